"""Deciding how a process joins a run: config, JAX_* variables, srun steps, partial Slurm environments."""

import pytest

from jaxtron.config.schema import ConfigError, DistributedConfig
from jaxtron.parallel.launch import PEER_LOST_EXIT_CODE, PeerMonitor, _slurm_port, detect, expand_hostlist

# what srun -n 2 sets on the local test cluster (a subset), and what an salloc shell or a batch script has
SRUN = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "gpu[007-008]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
SALLOC = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1"}
BATCH = {**SALLOC, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}


@pytest.mark.parametrize("text,hosts", [
    ("vm", ["vm"]),
    ("node001,login2", ["node001", "login2"]),
    ("gpu[007-009]", ["gpu007", "gpu008", "gpu009"]),
    ("gpu[1,3-4],cpu[09-10]-ib", ["gpu1", "gpu3", "gpu4", "cpu09-ib", "cpu10-ib"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
])
def test_slurm_host_lists_expand(text, hosts):
    assert expand_hostlist(text) == hosts


def test_no_launcher_is_one_process():
    launch = detect(DistributedConfig(), {})
    assert (launch.source, launch.num_processes, launch.multi_process) == ("single", 1, False)


def test_the_config_and_the_environment_name_the_coordinator():
    cfg = DistributedConfig(coordinator_address="h:1234", num_processes=4, process_id=3)
    assert detect(cfg, SRUN).source == "config"  # the config wins over everything
    env = {"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", **SRUN}
    launch = detect(DistributedConfig(), env)
    assert (launch.source, launch.coordinator_address, launch.num_processes, launch.process_id) == \
        ("environment", "h:9", 2, 1)


@pytest.mark.parametrize("env,message", [
    ({"JAX_COORDINATOR_ADDRESS": "h:9"}, "JAX_COORDINATOR_ADDRESS set but JAX_NUM_PROCESSES, JAX_PROCESS_ID not; "),
    ({"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "environment variable JAX_NUM_PROCESSES is 'two', not an integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     r"process index 2 is not in \[0, 2\) \(JAX_PROCESS_ID\)"),
    ({**SRUN, "SLURM_PROCID": "5"}, r"process index 5 is not in \[0, 2\) \(SLURM_PROCID\)"),
    ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_NODELIST"}, "srun step of 2 tasks without SLURM_STEP_NODELIST"),
])
def test_bad_launch_environments_are_one_sentence_errors(env, message):
    with pytest.raises(ConfigError, match=message):
        detect(DistributedConfig(), env)


def test_an_srun_step_is_detected():
    launch = detect(DistributedConfig(), SRUN)
    assert (launch.source, launch.num_processes, launch.process_id) == ("slurm", 2, 1)
    assert launch.coordinator_address == f"gpu007:{_slurm_port(SRUN, 0)}"  # the step's first node
    assert detect(DistributedConfig(port=6000), SRUN).coordinator_address == "gpu007:6000"
    assert launch.local_device_ids is None  # one task per node: it uses all of the node's devices
    second_step = detect(DistributedConfig(), {**SRUN, "SLURM_STEP_ID": "1"})
    assert second_step.coordinator_address != launch.coordinator_address


def test_one_process_per_gpu_takes_its_local_gpu():
    env = {**SRUN, "SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "11", "SLURM_LOCALID": "3",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
    assert detect(DistributedConfig(), env).local_device_ids == (3,)
    bound = {**env, "CUDA_VISIBLE_DEVICES": "3"}  # srun --gpus-per-task=1 already gave it one GPU
    assert detect(DistributedConfig(), bound).local_device_ids is None


@pytest.mark.parametrize("env", [SALLOC, BATCH, {**SRUN, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}],
                         ids=["salloc_shell", "batch_script", "srun_one_task"])
def test_a_partial_slurm_environment_runs_alone_and_says_why(env):
    launch = detect(DistributedConfig(), env)
    assert not launch.multi_process and launch.source == "single"
    assert launch.note.startswith("Slurm job 4")
    if env is not SRUN:
        assert "not started by srun" in launch.note or "has one task" in launch.note


def test_open_mpi_is_left_to_jax():
    launch = detect(DistributedConfig(), {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"})
    assert (launch.source, launch.num_processes, launch.process_id) == ("openmpi", 4, 2)


@pytest.mark.parametrize("fields,message", [
    (dict(coordinator_address="h:1"), "is set with only some of distributed.num_processes"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"distributed.process_id' \(2\) is not below"),
    (dict(port=70000), "distributed.port' is 70000"),
    (dict(peer_check_s=-1), "distributed.peer_check_s' must be >= 0"),
])
def test_bad_distributed_configs(fields, message):
    with pytest.raises(ConfigError, match=message):
        DistributedConfig(**fields)


class FakeClient:
    """The two calls of jax's coordination-service client the peer monitor makes."""

    def __init__(self, live, barrier_error=None):
        self.live, self.barrier_error, self.asked = live, barrier_error, 0

    def get_live_nodes(self, ids):
        self.asked += 1
        live = self.live(self.asked) if callable(self.live) else self.live
        if isinstance(live, Exception):
            raise live
        return {i: 1000 + i for i in ids if i in live}

    def wait_at_barrier(self, name, timeout_ms):
        if self.barrier_error:
            raise self.barrier_error


def _monitor(client, process_id=0, n=4):
    exits = []
    monitor = PeerMonitor(client, process_id, n, 0.01, finish_timeout_s=5, exit=exits.append, thread=False)
    return monitor, exits


def test_the_peer_monitor_is_quiet_while_every_process_is_alive(capsys):
    monitor, exits = _monitor(FakeClient({0, 1, 2, 3}))
    assert monitor.check() and monitor.check()
    assert exits == [] and capsys.readouterr().err == ""


def test_a_dead_peer_ends_the_process_with_one_sentence(capsys):
    monitor, exits = _monitor(FakeClient({0, 2}), process_id=2)
    monitor.last_step = 57
    assert not monitor.check()
    assert exits == [PEER_LOST_EXIT_CODE]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: processes 1, 3 of 4 stopped sending heartbeats")
    assert "process 2 stops after step 57 with exit code 76" in err


def test_a_lost_coordinator_is_named(capsys):
    monitor, exits = _monitor(FakeClient(RuntimeError("UNAVAILABLE: Failed to send RPC\nmore detail")), 1)
    assert not monitor.check() and exits == [PEER_LOST_EXIT_CODE]
    err = capsys.readouterr().err
    assert "coordination service on process 0 is unreachable (UNAVAILABLE: Failed to send RPC)" in err
    assert "before its first step" in err and "more detail" not in err


def test_leaving_processes_are_not_reported(capsys):
    # at the end, the processes leave one by one; process 0 waits until the others are gone
    client = FakeClient(lambda asked: {0, 1, 2, 3} if asked < 3 else {0})
    monitor, exits = _monitor(client)
    monitor.finish()
    assert client.asked == 3 and exits == []
    assert not monitor.check() and exits == [] and capsys.readouterr().err == ""


def test_a_process_that_never_reaches_the_end_does_not_hold_the_others(caplog):
    client = FakeClient({0, 1, 2, 3}, barrier_error=RuntimeError("DEADLINE_EXCEEDED: barrier timed out"))
    monitor, exits = _monitor(client)
    monitor.finish()  # process 0 leaves without waiting for the others to disconnect
    assert client.asked == 0 and exits == []
    assert "did not all finish within 5 s (DEADLINE_EXCEEDED: barrier timed out)" in caplog.text


def test_the_private_coordination_client_has_what_jaxtron_calls():
    """jaxtron/parallel/coordination.py is the one module reaching into jax's private coordination client; an
    upgrade of jax that moves what it calls fails here, not in a multi-node run."""
    import inspect

    from jax._src import distributed

    from jaxtron.parallel import coordination

    assert hasattr(distributed.global_state, "client")
    cls = coordination.client_type()
    for name in coordination.CLIENT_METHODS:
        assert callable(getattr(cls, name, None)), name
    signature = cls.blocking_key_value_get.__doc__.splitlines()[0]
    assert signature.startswith("blocking_key_value_get(self, key: str, timeout_in_ms: int)"), signature
    assert "key_value_set(self, key: str, value: str" in cls.key_value_set.__doc__, cls.key_value_set.__doc__
    assert inspect.getsource(coordination).count("jax._src") == 3  # the docstring's name and its two imports


def test_no_other_module_reaches_into_jax_private_modules():
    """jax's private modules are reached from one module each (its fence, with signature tests): cuDNN attention
    (ops/cudnn.py), the coordination client (parallel/coordination.py), Pallas' Triton lowering
    (ops/triton_lowering.py)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "jaxtron"
    reaching = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
            if any(n.startswith("jax._src") for n in names):
                reaching.add(path.relative_to(root).as_posix())
    assert reaching == {"ops/cudnn.py", "parallel/coordination.py", "ops/triton_lowering.py"}
