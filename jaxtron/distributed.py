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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Mapping

from jaxtron.config import ConfigError, DistributedConfig

log = logging.getLogger(__name__)

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


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
    return launch
