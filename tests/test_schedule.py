"""The latency-hiding scheduler's profile (jaxtron/metrics/schedule.py): which links a collective's group uses, what
each kernel and collective of a program costs in it, and the second compile that reads it."""

import os

import pytest

from jaxtron.metrics import budget, collectives, schedule

COSTS = schedule.Costs(budget.H100, nvlink_bandwidth=360e9, network_bandwidth=40e9, per_node=8)
MIB = 2**20

PROGRAM = """HloModule step


%fused_add (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %add.1 = bf16[1024,1024]{1,0} add(%p0, %p1)
}

ENTRY %main (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[8192,1024] {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %b = bf16[1024,1024]{1,0} parameter(1)
  %all-gather-start = (bf16[1024,1024]{1,0}, bf16[8192,1024]{1,0}) all-gather-start(%a), channel_id=1, GROUPS, \
dimensions={0}
  %loop_add_fusion = bf16[1024,1024]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_add
  ROOT %all-gather-done = bf16[8192,1024]{1,0} all-gather-done(%all-gather-start)
}
"""


def _costs(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        name = line.split('name: "')[1].split('"')[0]
        out[name] = float(line.split("cost_us: ")[1].split()[0])
    return out


@pytest.mark.parametrize("groups, want", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", [0, 1, 2, 3]),
    ("replica_groups={{0,8},{1,9}}", [0, 8]),
    ("replica_groups=[2,8]<=[16]", list(range(8))),
    ("replica_groups=[8,2]<=[2,8]T(1,0)", [0, 8]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_0'}", [0, 8]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_1'}", list(range(8))),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=2] {'axis_0','axis_2'}", [0, 1, 8, 9]),
])
def test_a_collectives_first_group_is_read_in_each_form_xla_writes(groups, want):
    line = f"%x = f32[8]{{0}} all-gather-start(%y), {groups}, dimensions={{0}}"
    assert collectives.group_devices(line) == want
    assert collectives.group_size(line) == len(want)


@pytest.mark.parametrize("kind, groups, want", [
    ("all-gather", "{{0,1,2,3,4,5,6,7}}", 360e9),  # one node: NVLink
    ("all-gather", "{{0,8}}", 40e9),  # a device a node: one NIC
    ("all-gather", "{{0,1,2,3,8,9,10,11}}", 160e9),  # 4 devices a node drive 4 NICs
    ("all-gather", "{{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}", 320e9),
    ("ragged-all-to-all", "{{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}", 40e9),  # rows leave through their own NIC
    ("ragged-all-to-all", "{{0,1,2,3,4,5,6,7}}", 360e9),
])
def test_a_collective_runs_at_the_bandwidth_of_the_links_its_group_shares(kind, groups, want):
    line = f"%x = f32[8]{{0}} {kind}-start(%y), replica_groups={groups}"
    assert schedule.link_bandwidth(line, COSTS) == pytest.approx(want)


@pytest.mark.parametrize("groups, bandwidth", [("replica_groups={{0,1,2,3,4,5,6,7}}", 360e9),
                                               ("replica_groups={{0,8}}", 40e9)])
def test_the_profile_prices_kernels_by_the_budget_and_collectives_by_their_links(groups, bandwidth):
    text = schedule.profile(PROGRAM.replace("GROUPS", groups), COSTS)
    got = _costs(text)
    assert set(got) == {"all-gather-start", "loop_add_fusion"}  # by name, without '%'; parameters and dones free
    # the gather's result, 16 MiB, over its links, plus the collective's own latency
    assert got["all-gather-start"] == pytest.approx(1e6 * (16 * MIB / bandwidth + schedule.COLLECTIVE_LATENCY_S),
                                                    abs=1e-3)
    # the fusion reads two 2 MiB operands and writes 2 MiB at the copy rate, plus a launch
    assert got["loop_add_fusion"] == pytest.approx(1e6 * (6 * MIB / budget.H100.copy_bytes + budget.H100.launch_s),
                                                   abs=1e-3)


def test_a_program_without_collectives_has_no_profile():
    program = PROGRAM.replace("  %all-gather-start", "  %unused").replace(
        "ROOT %all-gather-done = bf16[8192,1024]{1,0} all-gather-done(%all-gather-start)",
        "ROOT %r = bf16[1024,1024]{1,0} copy(%loop_add_fusion)")
    program = "\n".join(line for line in program.splitlines() if "%unused" not in line)
    assert schedule.profile(program, COSTS) == ""


# the same program with its fusion scheduled before the gather's start: nothing runs beside the gather
EXPOSED = PROGRAM.replace(
    "  %loop_add_fusion = bf16[1024,1024]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_add\n", "").replace(
    "  %all-gather-start =", "  %loop_add_fusion = bf16[1024,1024]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_add\n"
    "  %all-gather-start =")


class _Compiled:
    def __init__(self, text: str):
        self.text = text

    def as_text(self):
        return self.text


class _Lowered:
    """A lowered program's stand-in: each compile returns the next of ``texts`` and records its options and the
    profile file they point at, read while it exists."""

    def __init__(self, *texts: str):
        self.texts, self.calls = list(texts), []

    def compile(self, compiler_options):
        path = compiler_options.get(schedule.PROFILE_OPTION)
        read = None
        if path:
            with open(path) as f:
                read = f.read()
        self.calls.append((dict(compiler_options), read))
        return _Compiled(self.texts[len(self.calls) - 1])


def test_the_second_compile_reads_the_first_compiles_costs_and_the_better_program_is_kept():
    groups = "replica_groups={{0,8}}"
    exposed, hidden = EXPOSED.replace("GROUPS", groups), PROGRAM.replace("GROUPS", groups)
    assert schedule.exposed_seconds(exposed, COSTS) == pytest.approx(16 * MIB / 40e9)
    assert schedule.exposed_seconds(hidden, COSTS) == pytest.approx(16 * MIB / 40e9 - 6 * MIB / budget.H100.copy_bytes)
    lowered = _Lowered(exposed, hidden)
    assert schedule.compile_scheduled(lowered, {"xla_option": 1}, COSTS).text == hidden
    (first, none), (second, read) = lowered.calls
    assert first == {"xla_option": 1} and none is None
    assert second["xla_option"] == 1 and second[schedule.PROFILE_OPTION].endswith(".pbtxt")
    assert read == schedule.profile(exposed, COSTS)
    assert not os.path.exists(second[schedule.PROFILE_OPTION])  # the profile's folder is gone with the compile
    # a second program that waits longer than the first is not kept, nor one that waits as long
    assert schedule.compile_scheduled(_Lowered(hidden, exposed), {}, COSTS).text == hidden
    assert schedule.compile_scheduled(_Lowered(exposed, exposed + " "), {}, COSTS).text == exposed


def test_without_costs_or_collectives_the_program_compiles_once():
    lowered = _Lowered(PROGRAM.replace("GROUPS", "replica_groups={{0,8}}"))
    schedule.compile_scheduled(lowered, {}, None)
    assert len(lowered.calls) == 1


class _Device:
    def __init__(self, platform: str, kind: str, process: int):
        self.platform, self.device_kind, self.process_index = platform, kind, process


def test_the_devices_jax_runs_on_give_the_gpus_rates_and_their_nodes():
    two_nodes = [_Device("gpu", "NVIDIA H200", i // 4) for i in range(8)]
    assert schedule.for_devices(two_nodes) == schedule.Costs(budget.H200, 360e9, 40e9, per_node=4)
    assert schedule.for_devices([_Device("gpu", "NVIDIA H100 80GB HBM3", 0)]).ceilings == budget.H100
    assert schedule.for_devices([_Device("cpu", "cpu", 0)]) is None
    assert schedule.for_devices([_Device("gpu", "NVIDIA A100-SXM4-80GB", 0)]) is None  # no budget rates for it


def test_the_schedule_is_a_config_choice():
    from jaxtron.config.model import ExecutionConfig
    from jaxtron.config.schema import ConfigError

    with pytest.raises(ConfigError, match="execution.moe_schedule"):
        ExecutionConfig(moe_schedule="profile")
