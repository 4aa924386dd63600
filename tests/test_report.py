"""Observability: the profiler window, per-step facts in metrics.jsonl, the run report and its plots."""

import gzip
import json
import os
import struct
from pathlib import Path

import jax
import matplotlib.image
import pytest
from helpers import metrics_lines, tiny_config

from jaxtron import cli
from jaxtron.config.schema import ConfigError, ProfileConfig
from jaxtron.metrics import bubble
from jaxtron.metrics import summary as summary_lib
from jaxtron.metrics.plots import write_plots
from jaxtron.training import profiling
from jaxtron.training.loop import run


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def profiled_run(tmp_path_factory):
    """Six fsdp=8 steps, logged every step, with the profiler on steps 3 and 4."""
    workdir = str(tmp_path_factory.mktemp("profiled"))
    cfg = tiny_config(dict(fsdp=8), train=dict(steps=6), profile=dict(start_step=2, end_step=4))
    run(cfg, workdir, use_tqdm=False)
    return workdir


def _trace_events(workdir):
    window = json.loads(Path(workdir, "profile", "window.json").read_text())
    with gzip.open(os.path.join(workdir, "profile", window["trace"]), "rt") as f:
        return window, json.load(f)["traceEvents"]


@pytest.mark.slow
def test_the_profiler_traces_exactly_the_window(profiled_run):
    window, events = _trace_events(profiled_run)
    assert (window["start_step"], window["end_step"], window["complete"], window["devices"]) == (2, 4, True, 8)
    traced = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    assert traced == [3, 4]
    assert len(profiling.trace_files(os.path.join(profiled_run, "profile"))) == 1


@pytest.mark.slow
def test_metrics_lines_carry_data_wait_memory_and_compile_time(profiled_run):
    lines = metrics_lines(profiled_run)
    train = [line for line in lines if "step_time_s" in line]
    assert [line["step"] for line in train] == [1, 2, 3, 4, 5, 6]
    assert "compile_time_s" in train[0] and all("compile_time_s" not in line for line in train[1:])
    for line in train:
        assert line["interval_steps"] == 1
        assert 0 <= line["data_wait_s"] <= line["step_time_s"] and 0 <= line["data_wait_share"] <= 1
        assert "memory_peak_gib" not in line  # the CPU backend reports no memory; nothing is made up


def test_device_memory_takes_the_fullest_device(monkeypatch):
    class Device:
        def __init__(self, used, peak):
            self.stats = {"bytes_in_use": used, "peak_bytes_in_use": peak}

        def memory_stats(self):
            return self.stats

    assert profiling.device_memory() == {}  # CPU: not reported
    monkeypatch.setattr(jax, "local_devices", lambda: [Device(2**30, 3 * 2**30), Device(2 * 2**30, 2**30)])
    assert profiling.device_memory() == {"memory_in_use_gib": 2.0, "memory_peak_gib": 3.0}


def test_the_report_reads_the_run_and_its_communication_share(profiled_run, capsys):
    s = summary_lib.summarize(profiled_run)
    assert s["steps_done"] == 6 and s["checkpoints"] == [6] and s["nonfinite_steps"] == 0
    # 6 intervals of one step: step 1 carries the compile time, steps 3-4 were traced; 10% of 6 steps is 1
    assert (s["intervals"], s["steady_intervals"]) == (6, 3)
    lines = metrics_lines(profiled_run)
    counted = [line["tokens_per_sec"] for line in lines if line["step"] in (2, 5, 6) and "tokens_per_sec" in line]
    assert s["tokens_per_sec"] == sorted(counted)[1]
    comm = s["communication"]
    assert comm["steps"] == [3, 4] and comm["devices"] == 8
    assert comm["share"]["all-gather"] > 0 and 0 < sum(comm["share"].values()) < comm["device_busy_share"] <= 1
    assert s["collectives"]["all-gather"]["count"] > 0  # fsdp gathers in the compiled step
    assert cli.run("report", [profiled_run, "--no_plots"]) == 0
    out = capsys.readouterr().out
    assert "communication share over the profiler window (steps 3-4, 8 device(s)" in out and "all-gather" in out


def _write_run(workdir, lines, steps=100, window=None):
    os.makedirs(os.path.join(workdir, "checkpoints", "50"))
    os.makedirs(os.path.join(workdir, "checkpoints", "100"))
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    Path(workdir, "config.json").write_text(json.dumps({"train": {"steps": steps}, "profile": {"dir": ""}}))
    if window:
        os.makedirs(os.path.join(workdir, "profile"))
        window = {"start_step": window[0], "end_step": window[1], "wall_s": 1.0, "trace": None}
        Path(workdir, "profile", "window.json").write_text(json.dumps(window))


def _line(step, time, **extra):
    return {"step": step, "interval_steps": 10, "loss": 5.0 - step / 100, "loss_avg": 5.0 - step / 100,
            "step_time_s": time, "tokens_per_sec": 1000 / time, "tflops_per_device": 2 / time, "mfu": 0.1 / time,
            "hfu": 0.12 / time, "data_wait_s": time / 10, "data_wait_share": 0.1, "nonfinite_steps": step // 50,
            **extra}


def test_sustained_values_follow_the_stated_rule(tmp_path):
    # log every 10 of 100 steps; a restart at step 50 (its first line carries the compile time again);
    # steps 31-40 traced. Counted: intervals ending at 20, 30, 50, 70, 80, 90, 100.
    lines = [_line(s, s / 100, **({"compile_time_s": 9.0} if s in (10, 60) else {})) for s in range(10, 101, 10)]
    lines.insert(5, {"step": 50, "eval/loss": 4.2})
    lines.append({"step": 100, "eval/loss": 4.0})
    lines[3]["memory_peak_gib"], lines[7]["memory_peak_gib"] = 30.5, 31.25
    _write_run(str(tmp_path), lines, window=(30, 40))
    s = summary_lib.summarize(str(tmp_path))
    counted = [0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0]
    assert (s["intervals"], s["steady_intervals"]) == (10, 7)
    assert s["step_time_s"] == 0.7  # the median of the counted step times
    assert s["tokens_per_sec"] == sorted(1000 / t for t in counted)[3]
    assert s["mfu"] == sorted(0.1 / t for t in counted)[3]
    assert s["data_wait_share"] == 0.1
    assert s["memory_peak_gib"] == 31.25 and s["nonfinite_steps"] == 2 and s["compile_time_s"] == 9.0
    assert s["final_loss"] == 4.0 and s["final_validation_loss"] == 4.0 and s["checkpoints"] == [50, 100]
    assert s["communication"] is None  # a window without a trace


def test_plots_are_valid_png_files(tmp_path):
    lines = [_line(s, s / 100) for s in range(10, 101, 10)] + [{"step": 100, "eval/loss": 4.0}]
    paths = write_plots(lines, str(tmp_path), "test")
    assert [os.path.basename(p) for p in paths] == ["loss.png", "throughput.png"]
    for path in paths:
        data = Path(path).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        assert struct.unpack(">II", data[16:24]) == (700, 400)
        assert matplotlib.image.imread(path).shape[:2] == (400, 700)


def test_report_compares_two_runs_and_refuses_bad_input(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write_run(a, [_line(s, 1.0) for s in range(10, 101, 10)])
    _write_run(b, [_line(s, 0.5) for s in range(10, 101, 10)])
    assert cli.run("report", [a, "--vs", b, "--json", str(tmp_path / "both.json")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("tokens/s"))
    assert row.split()[-1] == "2.000"  # B runs twice as many tokens per second
    assert os.path.isfile(os.path.join(b, "throughput.png"))
    assert [r["workdir"] for r in json.loads(Path(tmp_path / "both.json").read_text())] == [a, b]
    assert cli.run("report", [str(tmp_path / "missing")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    with open(os.path.join(a, "metrics.jsonl"), "a") as f:
        f.write("{not json\n")
    assert cli.run("report", [a]) == 2
    err = capsys.readouterr().err
    assert "line 11 is not JSON" in err and err.count("\n") == 1


def test_profile_config_errors():
    with pytest.raises(ConfigError, match="profile.end_step"):
        ProfileConfig(start_step=5, end_step=5)
    with pytest.raises(ConfigError, match="profile.processes"):
        ProfileConfig(end_step=3, processes="zero")
    with pytest.raises(ConfigError, match="beyond train.steps"):
        tiny_config(profile=dict(start_step=1, end_step=10))
    assert ProfileConfig(end_step=3, processes="0,2").traces(2) and not ProfileConfig(end_step=3).traces(1)
    assert not ProfileConfig().traces(0)


def test_report_flags_skipped_steps(tmp_path, capsys):
    # nonfinite_steps is cumulative: none until step 30, then one, then three
    counts = {10: 0, 20: 0, 30: 1, 40: 1, 50: 3}
    lines = [{**_line(step, 0.5), "nonfinite_steps": n} for step, n in counts.items()]
    _write_run(str(tmp_path / "bad"), lines, steps=50)
    assert cli.run("report", [str(tmp_path / "bad"), "--no_plots", "--json", str(tmp_path / "bad.json")]) == 0
    out = capsys.readouterr().out
    warning = "WARNING: 3 step(s) were skipped as non-finite (first logged at step 30)"
    assert warning in out and out.splitlines()[1].startswith(warning)  # right under the run's first line
    written = json.loads(Path(tmp_path / "bad.json").read_text())
    assert written["nonfinite_steps"] == 3 and written["nonfinite_first_step"] == 30
    assert written["warnings"] and written["warnings"][0].startswith("3 step(s) were skipped as non-finite")
    clean = [{**_line(step, 0.5), "nonfinite_steps": 0} for step in counts]
    _write_run(str(tmp_path / "good"), clean, steps=50)
    assert cli.run("report", [str(tmp_path / "good"), "--no_plots"]) == 0
    assert "WARNING" not in capsys.readouterr().out
    assert summary_lib.summarize(str(tmp_path / "good"))["warnings"] == []


def test_report_states_the_flop_weighted_peak_of_fp8_runs(tmp_path, capsys):
    import dataclasses

    from jaxtron.config.schema import ExecutionConfig, ModelConfig

    h, q, k, f, s, layers, vocab = 64, 64, 32, 128, 32, 4, 256
    model = ModelConfig(vocab_size=vocab, embed_dim=h, num_layers=layers, attention=dict(num_heads=4, num_kv_heads=2),
                        mlp_dim=f, max_seq_len=s)
    execution = ExecutionConfig(dtype="bfloat16", fp8=True, fp8_skip_layers=1)
    workdir = str(tmp_path)
    _write_run(workdir, [_line(step, 0.5) for step in range(10, 101, 10)])  # 2 / t TFLOP/s at mfu 0.1 / t
    config = {"train": {"steps": 100}, "profile": {"dir": ""}, "model": dataclasses.asdict(model),
              "execution": dataclasses.asdict(execution), "data": {"seq_len": s}}
    Path(workdir, "config.json").write_text(json.dumps(config))
    # the two middle blocks run their projections and MLP in FP8; scores and logits stay 16-bit
    fp8 = 2 * 6 * (h * (q + 2 * k) + q * h + 3 * h * f)
    total = layers * 6 * (h * (q + 2 * k) + q * s + q * h + 3 * h * f) + 6 * h * vocab
    assert cli.run("report", [workdir, "--no_plots", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "MFU against the" in x)
    assert f"FLOP-weighted dense peak: FP8 matmuls are {fp8 / total:.1%} of the model FLOPs" in line
    assert "the rest at the bfloat16 peak (20 TFLOP/s per device)" in line
    basis = json.loads(Path(tmp_path / "s.json").read_text())["mfu_basis"]
    assert basis["fp8_flops_share"] == pytest.approx(fp8 / total, rel=1e-12)
    assert basis["peak_tflops"] == pytest.approx(20)
    # without FP8 the basis is the plain dense peak of the compute dtype
    config = json.loads(Path(workdir, "config.json").read_text())
    config["execution"]["fp8"] = False
    Path(workdir, "config.json").write_text(json.dumps(config))
    text = summary_lib.summarize(workdir)["mfu_basis"]["text"]
    assert text == "dense bfloat16 datasheet peak (20 TFLOP/s per device)"


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_the_idle_share_of_each_stage_is_that_of_its_fill_and_drain_iterations(steps):
    # 2 stages x 2 microbatches: 3 iterations a loop; forward ones last 1, 2, 4 s, backward ones 8, 16, 32 s.
    # Stage 0 idles in iteration 2 (drain), stage 1 in iteration 0 (fill); the backward loop runs 2, 1, 0. Each
    # iteration runs as ``steps`` steps of the loop (one per period of a stage; a layout without ``loop_steps``
    # has one)
    layout = {"stages": 2, "microbatches": 2, "virtual_stages": 1, "stage_of_device": {"0": 0, "1": 1},
              "loops": {"forward": ["param.1", "fwd_a", "fwd_b"], "backward": ["bwd_a", "bwd_b"]}}
    if steps > 1:
        layout["loop_steps"] = 3 * steps
    events, t = [], 0.0
    for direction, durations in (("fwd", (1, 2, 4)), ("bwd", (8, 16, 32))):
        for d in durations:
            for _ in range(steps):
                for device in ("0", "1"):  # each step: its first op, then one that runs to its end
                    events += [{"ph": "X", "ts": t * 1e6, "dur": 0.1e6, "args": {"hlo_op": f"{direction}_a",
                                                                                 "device_ordinal": device}},
                               {"ph": "X", "ts": (t + 0.1) * 1e6, "dur": (d / steps - 0.1) * 1e6,
                                "args": {"hlo_op": f"{direction}_b", "device_ordinal": device}}]
                t += d / steps
    events.append({"ph": "X", "ts": 0, "dur": 1e6, "args": {"hlo_op": "fwd_a", "device_ordinal": "5"}})  # not traced
    idle = bubble.idle_shares(events, layout, wall_s=126.0)
    assert idle["measured_stages"] == [0, 1] and idle["formula"] == pytest.approx(1 / 3)
    assert idle["of_loops"] == pytest.approx([12 / 63, 33 / 63])
    assert idle["of_window"] == pytest.approx([12 / 126, 33 / 126])
    assert bubble.idle_shares(events, {**layout, "loops": {"forward": ["param.1"]}}, 126.0) is None


def test_the_idle_share_of_a_1f1b_stage_is_that_of_its_empty_phases():
    """2 stages x 2 microbatches under 1F1B: 4 iterations, forward phases in 0..2 (1, 2, 4 s), backward phases in 1..3
    (8, 16, 32 s; the fill's 0 s). Stage 0 runs forwards in iterations 0, 1 and backwards in 2, 3; stage 1 forwards
    in 1, 2 and backwards in 1, 2; the rest is idle."""
    layout = {"stages": 2, "microbatches": 2, "virtual_stages": 1, "stage_of_device": {"0": 0, "1": 1},
              "schedule": "1f1b", "loops": {"forward": ["fwd", "bwd"]},
              "phases": {"forward": ["fwd"], "backward": ["bwd"]}}
    forward, backward = (1, 2, 4, 0), (0, 8, 16, 32)
    events, t = [], 0.0
    for f, b in zip(forward, backward, strict=True):
        for device in ("0", "1"):
            events += [{"ph": "X", "ts": t * 1e6, "dur": f * 1e6, "args": {"hlo_op": "fwd", "device_ordinal": device}},
                       {"ph": "X", "ts": (t + f) * 1e6, "dur": b * 1e6,
                        "args": {"hlo_op": "bwd", "device_ordinal": device}}]
        t += f + b
    idle = bubble.idle_shares(events, layout, wall_s=126.0)
    assert idle["iterations"] == 4 and idle["formula"] == pytest.approx(1 / 3)
    # stage 0: forward of iteration 2 (4 s), backward of iteration 1 (8 s); stage 1: forward 0 (1 s), backward 3 (32 s)
    assert idle["of_loops"] == pytest.approx([12 / 63, 33 / 63])
    assert idle["of_window"] == pytest.approx([12 / 126, 33 / 126])


def test_the_idle_share_of_an_interleaved_stage_is_that_of_its_empty_phases():
    """2 stages x 2 microbatches x 2 virtual stages: 8 iterations (M V + V S + S - 2), forward phases of 1 s,
    backward phases of t + 1 s. Stage 0 runs forward units 0..3 in iterations 0..3 and backward units in 4..7;
    stage 1 forwards in 1..4 and backwards in 3..6; the rest is idle."""
    layout = {"stages": 2, "microbatches": 2, "virtual_stages": 2, "stage_of_device": {"0": 0, "1": 1},
              "schedule": "interleaved", "loops": {"forward": ["fwd", "bwd"]},
              "phases": {"forward": ["fwd"], "backward": ["bwd"]}}
    events, t = [], 0.0
    for k in range(8):
        for device in ("0", "1"):
            events += [{"ph": "X", "ts": t * 1e6, "dur": 1e6, "args": {"hlo_op": "fwd", "device_ordinal": device}},
                       {"ph": "X", "ts": (t + 1) * 1e6, "dur": (k + 1) * 1e6,
                        "args": {"hlo_op": "bwd", "device_ordinal": device}}]
        t += k + 2
    idle = bubble.idle_shares(events, layout, wall_s=88.0)
    assert idle["iterations"] == 8 and idle["formula"] == pytest.approx(1 / 5)
    # stage 0: forwards of 4..7 (4 s), backwards of 0..3 (10 s); stage 1: forwards of 0, 5..7 (4 s), backwards of
    # 0, 1, 2, 7 (14 s); 44 s of loop each
    assert idle["of_loops"] == pytest.approx([14 / 44, 18 / 44])


def test_a_1f1b_programs_phases_are_found_by_their_scopes():
    """The compiled 1F1B step's loop and its iterations' two phases, as the report needs them to time the phases."""
    from jaxtron.metrics.bubble import phase_ops, schedule_loops
    from jaxtron.planning.dry_run import _compile
    from jaxtron.training.pipeline.fill_drain import SCOPE
    from jaxtron.training.pipeline.one_f_one_b import BACKWARD_PHASE, FORWARD_PHASE

    cfg = tiny_config(dict(pipeline=2, fsdp=4), train=dict(global_batch_size=16),
                      pipeline=dict(microbatches=4, schedule="1f1b"))
    _, hlo = _compile(cfg, jax.devices(), "xla")
    loops = schedule_loops(hlo, SCOPE)
    assert list(loops) == ["forward"]  # one loop: no transposed one
    phases = phase_ops(hlo, loops["forward"], {"forward": FORWARD_PHASE, "backward": BACKWARD_PHASE})
    assert any(op.startswith("conditional") for op in phases["forward"])  # the forward phase's branch
    assert any(op.startswith("conditional") for op in phases["backward"])
    assert not set(phases["forward"]) & set(phases["backward"])


@pytest.mark.slow
def test_the_report_measures_each_pipeline_stages_idle_share(tmp_path, capsys):
    cfg = tiny_config(dict(pipeline=2, data=4, fsdp=1), model=dict(num_layers=4),
                      train=dict(steps=4, global_batch_size=16), pipeline=dict(microbatches=2),
                      profile=dict(start_step=1, end_step=3))
    run(cfg, str(tmp_path), use_tqdm=False)
    layout = json.loads(Path(tmp_path / "profile" / "pipeline.json").read_text())
    assert set(layout["loops"]) == {"forward", "backward"}
    assert layout["loop_steps"] == 3 * 2  # 3 iterations of the 2 periods a stage holds
    assert sorted(layout["stage_of_device"].values()) == [0] * 4 + [1] * 4
    idle = summary_lib.summarize(str(tmp_path))["pipeline_idle"]
    # every iteration runs the same program on each stage, so the idle share is near the schedule's 1 of 3
    assert idle["measured_stages"] == [0, 1] and idle["iterations"] == 3
    for share in idle["of_loops"]:
        assert 0.5 < share / idle["formula"] < 2, idle
    assert cli.run("report", [str(tmp_path), "--no_plots"]) == 0
    assert "pipeline idle share per stage over the profiler window" in capsys.readouterr().out
