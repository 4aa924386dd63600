"""Joining a multi-process run, before anything asks jax about devices.

Where the process count, this process's index and the coordinator (host:port of process 0) come from, in
order:

1. the config (``distributed.coordinator_address``, ``num_processes``, ``process_id``);
2. the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
3. an srun step of more than one task: SLURM_STEP_NUM_TASKS, SLURM_PROCID, and the first node of
   SLURM_STEP_NODELIST as coordinator;
4. Open MPI's mpirun (jax reads its environment);
5. otherwise one process.

A Slurm environment without an srun step (an salloc shell, the batch script itself) is not a launch: the
run is one process, and the log says what was found. Every decision is logged with what it was based on.

When a process of a running job dies, the others cannot finish their next collective and would wait for it
forever. jax's coordination service notices the silence after ``distributed.heartbeat_timeout_s``. With
``distributed.peer_check_s`` > 0 (the default) a ``PeerMonitor`` thread in every process asks the service
which processes are alive; when one is gone, the process writes one sentence naming it and exits with
``PEER_LOST_EXIT_CODE``, and the job can be restarted from the last checkpoint. (For that the service runs in
jax's "recoverable" mode, in which it does not end the survivors itself; the processes then leave together
through ``finish``, process 0, which hosts the service, last.) If process 0 itself dies, the service dies with
it and jax ends the others at once with its own message. With ``peer_check_s = 0``, jax ends every survivor
with its message ("...another task died...") and a stack dump.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping

from jaxtron.config.schema import ConfigError, DistributedConfig

log = logging.getLogger(__name__)

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
PEER_LOST_EXIT_CODE = 76  # another process of the run died; restart the job to resume from the last checkpoint


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process takes part: ``source`` names where the numbers came from."""

    source: str  # "single", "config", "environment", "slurm", "openmpi"
    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None
    local_device_ids: tuple[int, ...] | None = None
    note: str = ""

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact host list (``gpu[001-003,007],login1``) as host names."""
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for n in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{n:0{len(first)}d}{suffix}")
    return hosts


def _int(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name} is {text!r}, not an integer; set it to one.") from None


def _checked(launch: Launch, where: str) -> Launch:
    if launch.num_processes < 1 or not 0 <= launch.process_id < launch.num_processes:
        raise ConfigError(f"process index {launch.process_id} is not in [0, {launch.num_processes}) ({where}); "
                          "fix the launch.")
    return launch


def _slurm_port(env: Mapping[str, str], port: int) -> int:
    if port:
        return port
    # one port per job and step, so a second srun in the same allocation does not meet the first's coordinator
    return 20000 + (_int(env, "SLURM_JOB_ID") * 32 + _int(env, "SLURM_STEP_ID")) % 30000


def _local_device_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """Several tasks on a node that all see every GPU: task i takes GPU i (SLURM_LOCALID)."""
    per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if per_node and int(per_node.group()) > 1 and len(visible) != 1 and "SLURM_LOCALID" in env:
        return (_int(env, "SLURM_LOCALID"),)
    return None


def detect(cfg: DistributedConfig, env: Mapping[str, str]) -> Launch:
    """Decides how this process takes part, from the config and the environment (nothing is started)."""
    if cfg.coordinator_address:
        return _checked(Launch("config", cfg.num_processes, cfg.process_id, cfg.coordinator_address),
                        "distributed.process_id")
    given = [name for name in ENV if env.get(name)]
    if given:
        if len(given) != len(ENV):
            missing = ", ".join(name for name in ENV if name not in given)
            raise ConfigError(f"{', '.join(given)} set but {missing} not; set all of {', '.join(ENV)} or none.")
        return _checked(Launch("environment", _int(env, "JAX_NUM_PROCESSES"), _int(env, "JAX_PROCESS_ID"),
                               env["JAX_COORDINATOR_ADDRESS"]), "JAX_PROCESS_ID")
    if "SLURM_JOB_ID" in env:
        return _detect_slurm(cfg, env)
    if "OMPI_COMM_WORLD_SIZE" in env and _int(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return Launch("openmpi", _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_RANK"),
                      note="Open MPI launch; jax finds the coordinator from mpirun's environment")
    return Launch("single")


def _detect_slurm(cfg: DistributedConfig, env: Mapping[str, str]) -> Launch:
    job = env["SLURM_JOB_ID"]
    if "SLURM_STEP_ID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        tasks = env.get("SLURM_NTASKS", "?")
        return Launch("single", note=f"Slurm job {job} ({tasks} tasks) found, but this process was not started by "
                                     "srun (an salloc shell or the batch script itself), so it runs alone; "
                                     "start it with srun to use every task")
    tasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if tasks == 1:
        return Launch("single", note=f"Slurm job {job}, step {env['SLURM_STEP_ID']} has one task")
    missing = [n for n in ("SLURM_PROCID", "SLURM_STEP_NODELIST") if n not in env]
    if missing:
        raise ConfigError(f"srun step of {tasks} tasks without {', '.join(missing)} in the environment; launch with "
                          "srun, or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID.")
    host = expand_hostlist(env["SLURM_STEP_NODELIST"])[0]
    address = f"{host}:{_slurm_port(env, cfg.port)}"
    return _checked(Launch("slurm", tasks, _int(env, "SLURM_PROCID"), address, _local_device_ids(env),
                           note=f"Slurm job {job}, step {env['SLURM_STEP_ID']}"), "SLURM_PROCID")


def initialize(cfg: DistributedConfig | None = None, env: Mapping[str, str] | None = None) -> Launch:
    """Joins the run this process belongs to (if it is a multi-process one) and returns how it was decided."""
    cfg = cfg or DistributedConfig()
    launch = detect(cfg, os.environ if env is None else env)
    if launch.note and not launch.multi_process:
        log.warning("%s", launch.note)
    if not launch.multi_process:
        return launch
    import jax

    # CPU collectives across processes need gloo; the setting does not affect GPU backends
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # the service then leaves the survivors of a dead process running, for the PeerMonitor to end them
    jax.config.update("jax_enable_recoverability", cfg.peer_check_s > 0)
    options = dict(initialization_timeout=cfg.initialization_timeout_s,
                   heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    if launch.source == "openmpi":
        jax.distributed.initialize(cluster_detection_method="ompi", **options)
    else:
        jax.distributed.initialize(launch.coordinator_address, num_processes=launch.num_processes,
                                   process_id=launch.process_id,
                                   local_device_ids=list(launch.local_device_ids) if launch.local_device_ids else None,
                                   **options)
    log.info("process %d of %d joined the run at %s (%s%s)", launch.process_id, launch.num_processes,
             launch.coordinator_address or "the coordinator mpirun named", launch.source,
             f": {launch.note}" if launch.note else "")
    if cfg.peer_check_s > 0:
        global _monitor
        from jaxtron.parallel import coordination
        _monitor = PeerMonitor(coordination.client(), launch.process_id, launch.num_processes, cfg.peer_check_s,
                               finish_timeout_s=cfg.heartbeat_timeout_s)
    return launch


_monitor: PeerMonitor | None = None


def report_step(step: int) -> None:
    """Tells the peer monitor (if any) the last step this process finished, for its message."""
    if _monitor is not None:
        _monitor.last_step = step


def finish() -> None:
    """Leaves a multi-process run (with a peer monitor) in step with the others; nothing for one process."""
    global _monitor
    monitor, _monitor = _monitor, None
    if monitor is not None:
        monitor.finish()


class PeerMonitor:
    """Ends this process with one sentence when another process of the run is gone.

    A background thread asks the coordination service every ``poll_s`` seconds which processes are alive.
    The service answers once every live process has asked (the calls pair up across processes), and a process
    that stopped sending heartbeats for ``distributed.heartbeat_timeout_s`` is no longer alive.
    """

    def __init__(self, client, process_id: int, num_processes: int, poll_s: float, *,
                 finish_timeout_s: float = 60.0, exit: Callable[[int], None] = os._exit, thread: bool = True):
        self.client, self.process_id, self.num_processes = client, process_id, num_processes
        self.poll_s, self.finish_timeout_s, self.exit = poll_s, finish_timeout_s, exit
        self.last_step: int | None = None
        self._leaving = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxtron-peers", daemon=True) if thread else None
        if self._thread is not None:
            self._thread.start()

    def check(self) -> bool:
        """Asks once: True while every process is alive; False once this one is leaving; else reports, exits."""
        ids = list(range(self.num_processes))
        try:
            live = set(self.client.get_live_nodes(ids))
        except Exception as e:  # noqa: BLE001 - the service is unreachable: process 0 is gone
            if self._leaving.is_set():
                return False
            return self._lost(f"the coordination service on process 0 is unreachable ({str(e).splitlines()[0][:200]})")
        if self._leaving.is_set():
            return False
        gone = sorted(set(ids) - live)
        if not gone:
            return True
        names = ", ".join(map(str, gone))
        return self._lost(f"process{'es' if len(gone) > 1 else ''} {names} of {self.num_processes} "
                          f"stopped sending heartbeats (it died, was killed, or its host failed)")

    def _lost(self, what: str) -> bool:
        where = "before its first step" if self.last_step is None else f"after step {self.last_step}"
        sys.stderr.write(f"error: {what}; process {self.process_id} stops {where} with exit code "
                         f"{PEER_LOST_EXIT_CODE} so that the job can be restarted from the last checkpoint.\n")
        sys.stderr.flush()
        self.exit(PEER_LOST_EXIT_CODE)  # the main thread may be stuck in a collective: end the whole process
        return False

    def _watch(self) -> None:
        while not self._leaving.is_set() and self.check():
            self._leaving.wait(self.poll_s)

    def finish(self) -> None:
        """Leaves the run together: every process waits here for the others (for at most
        ``finish_timeout_s``), then disconnects; process 0, which hosts the coordination service, shuts it
        down only once the others have disconnected, since a process that loses the service is aborted."""
        import jax
        together = True
        try:
            self.client.wait_at_barrier("jaxtron_finished", int(self.finish_timeout_s * 1000))
        except Exception as e:  # noqa: BLE001
            together = False
            log.warning("process %d: the other processes did not all finish within %g s (%s); leaving without them",
                        self.process_id, self.finish_timeout_s, str(e).splitlines()[0][:200])
        self._leaving.set()
        if self.process_id != 0 and self._thread is not None:
            # a call of the monitor still in flight would race the client's shutdown below
            self._thread.join(self.finish_timeout_s)
        if self.process_id == 0 and together:
            waiter = threading.Thread(target=self._wait_for_others, daemon=True)
            waiter.start()
            waiter.join(self.finish_timeout_s)
        jax.distributed.shutdown()

    def _wait_for_others(self) -> None:
        if self._thread is not None:
            self._thread.join()  # its call in flight, if any, pairs with one of another process
        ids = list(range(self.num_processes))
        try:
            while len(self.client.get_live_nodes(ids)) > 1:  # returns once the others asked too or disconnected
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - the coordination service is gone: nothing left to wait for
            log.debug("stopped waiting for the other processes: %s", e)
