"""Fault injection: a training run killed (SIGKILL) at random moments and resumed after each kill ends with the
losses and parameters of a run never killed, bit for bit, and the run's readers work after every kill.

Each kill lands at a random moment of the process's life: half of them anywhere (start-up, restore, compile,
steps, saves), half while it trains (after it logged a step of its own), where asynchronous saves are written.
After each kill `jaxtron report` and `jaxtron verify` run on the workdir: each exits 0, or 2 with one sentence
(no traceback), and verify finds no damaged checkpoint. The run is then restarted, until one finishes.

    python tests/fault_injection.py --kills 30 --steps 150   # .ci/run's longer version; the test runs a few
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config.data.source=synthetic", "--config.model.num_layers=1", "--config.model.embed_dim=64",
        "--config.model.attention.num_heads=4", "--config.model.attention.num_kv_heads=4",
        "--config.model.mlp_dim=128", "--config.data.seq_len=32", "--config.train.global_batch_size=8",
        "--config.train.log_every=1", "--config.train.eval_batches=0",
        "--config.checkpoint.every=2", "--config.checkpoint.keep=3", "--config.checkpoint.async_save=true"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=env.get("XLA_FLAGS", ""))
    return env


def _train(workdir: str, steps: int, run_log: str) -> subprocess.Popen:
    """train.py in the background, its console (logging: one line a step) into ``run_log``."""
    with open(run_log, "w") as out:
        return subprocess.Popen([sys.executable, "train.py", *ARGS, f"--config.train.steps={steps}",
                                 f"--workdir={workdir}"], cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT)


def losses(workdir: str) -> dict[int, float]:
    """{step: loss} of every complete line of metrics.jsonl; a step logged twice is an error."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                record = json.loads(line)
                assert record["step"] not in out, f"step {record['step']} logged twice"
                out[record["step"]] = record["loss"]
    return out


def final_parameters(workdir: str, steps: int) -> list:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", str(steps), "state"))
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def check_readers(workdir: str, in_process: bool = False) -> list[str]:
    """What is wrong with `jaxtron report` and `jaxtron verify` on ``workdir`` now (nothing: []): each run as a user
    runs it, or with ``in_process`` through ``jaxtron.cli.main`` in this process (a raised exception is its
    traceback), which spares the quick test a process start per check."""
    problems = []
    for command in ("report", "verify"):
        code, out, err = _in_process(command, workdir) if in_process else _as_command(command, workdir)
        if code not in (0, 2) or "Traceback" in err:
            problems.append(f"{command} exited {code}: {err[-600:]}")
        elif code == 2 and (len(err.splitlines()) != 1 or not err.startswith("error: ")):
            problems.append(f"{command} exited 2 without one 'error:' sentence: {err[-600:]}")
        elif command == "verify" and "damaged" in out + err:
            problems.append(f"verify found damage: {out + err}")
    return problems


def _as_command(command: str, workdir: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "jaxtron", command, workdir], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, done.stdout, done.stderr.strip()


def _in_process(command: str, workdir: str) -> tuple[int, str, str]:
    import contextlib
    import io
    import traceback

    from jaxtron import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([command, workdir])
        except BaseException:  # noqa: BLE001 - reported as the traceback a user would see
            traceback.print_exc()
            code = 1
    return code, out.getvalue(), err.getvalue().strip()


def _cut(workdir: str, rng: random.Random) -> str:
    """Leaves a state that a kill at an unlucky byte leaves, when this kill did not: the next step's line of
    metrics.jsonl begun and cut midway, or the newest checkpoint committed without its checksums. Returns what
    it did ('' for nothing)."""
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if rng.random() < 0.5 and lines:
        record = json.loads(lines[-1])
        line = json.dumps({**record, "step": record["step"] + 1})
        with open(path, "a", encoding="utf-8") as f:
            f.write(line[:rng.randrange(1, len(line) - 1)])
        return "the next line of metrics.jsonl cut midway"
    checkpoints = os.path.join(workdir, "checkpoints")
    steps = sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit()) if os.path.isdir(checkpoints) else []
    manifest = os.path.join(checkpoints, str(steps[-1]), "integrity.process_0.json") if steps else ""
    if manifest and os.path.exists(manifest):
        os.remove(manifest)
        return f"checkpoint {steps[-1]} without its checksums"
    return ""


def inject(kills: int, seed: int, root: str, steps: int = 60, log=print, in_process: bool = False) -> dict:
    """Runs the uninterrupted reference and the killed run under ``root``; returns the figures. ``in_process``:
    the readers are checked in this process (``check_readers``)."""
    rng = random.Random(seed)
    reference = os.path.join(root, "reference")
    started = time.perf_counter()
    proc = _train(reference, steps, os.path.join(root, "reference.log"))
    first_step = _wait_for_a_step(proc, os.path.join(root, "reference.log")) - started
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"the reference run failed: {_tail(os.path.join(root, 'reference.log'))}")
    per_step = (time.perf_counter() - started - first_step) / steps
    log(f"reference run: first step logged after {first_step:.1f} s, then {per_step * 1e3:.0f} ms a step")

    workdir = os.path.join(root, "killed")
    figures = {"kills": 0, "kills_while_training": 0, "saves_cut": 0, "cut_by_hand": [], "resumes": 0,
               "reader_checks": 0, "problems": [], "kill_moments_s": []}
    stride = max(steps // (kills + 1), 4)  # a run's steps before its kill: up to twice this (a few saves' worth)
    for i in range(kills + 1):
        run_log = os.path.join(root, f"run{i}.log")
        cut_before = _cut_saves(workdir)
        proc, started = _train(workdir, steps, run_log), time.perf_counter()
        if i == kills:  # the last run goes to the end
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"the last run failed: {_tail(run_log)}")
            break
        # steps this run may take before its kill: on average `stride`, never all that are left
        span = per_step * min(2 * stride, max(steps - _resumes_from(workdir) - 2, 0))
        if i % 2:  # while training: after this process logged a step
            _wait_for_a_step(proc, run_log)
            time.sleep(rng.uniform(0, span))
        else:  # anywhere in its life: start-up, restore, compile, steps, saves
            time.sleep(rng.uniform(0, 0.9 * first_step + span))
        if proc.poll() is not None:
            if proc.returncode != 0:
                raise RuntimeError(f"run {i} failed before its kill (exit {proc.returncode}): {_tail(run_log)}")
            log(f"run {i} reached the last step before its kill")
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        moment = time.perf_counter() - started
        figures["kills"] += 1
        figures["kill_moments_s"].append(round(moment, 2))
        trained = _logged(run_log)
        figures["kills_while_training"] += bool(trained)
        cut = bool(_cut_saves(workdir) - cut_before)
        figures["saves_cut"] += cut
        by_hand = _cut(workdir, rng) if i % 3 == 2 and os.path.exists(os.path.join(workdir, "metrics.jsonl")) else ""
        if by_hand:
            figures["cut_by_hand"].append(by_hand)
        problems = check_readers(workdir, in_process)
        figures["reader_checks"] += 2
        figures["problems"] += [f"after kill {figures['kills']} at {moment:.2f} s: {p}" for p in problems]
        log(f"kill {figures['kills']} at {moment:.2f} s, {trained} step(s) trained{', a save cut' if cut else ''}"
            f"{', then ' + by_hand if by_hand else ''}{'; ' + '; '.join(problems) if problems else ''}")
        figures["resumes"] += 1
    import numpy as np

    figures["steps"] = steps
    figures["losses_identical"] = losses(workdir) == losses(reference) and len(losses(reference)) == steps
    figures["parameters_identical"] = all(np.array_equal(a, b) for a, b in
                                          zip(final_parameters(workdir, steps), final_parameters(reference, steps),
                                              strict=True))
    figures["problems"] += check_readers(workdir, in_process)
    figures["reader_checks"] += 2
    return figures


def _resumes_from(workdir: str) -> int:
    """The step a restart resumes from: its newest committed checkpoint's (0 if none)."""
    checkpoints = os.path.join(workdir, "checkpoints")
    return max((int(n) for n in os.listdir(checkpoints) if n.isdigit()), default=0) if os.path.isdir(checkpoints) \
        else 0


def _cut_saves(workdir: str) -> set[str]:
    checkpoints = os.path.join(workdir, "checkpoints")
    return {n for n in os.listdir(checkpoints) if "tmp" in n} if os.path.isdir(checkpoints) else set()


def _logged(run_log: str) -> int:
    """Steps a run logged on its console (its log file)."""
    try:
        with open(run_log, encoding="utf-8", errors="replace") as f:
            return sum(" INFO step " in line for line in f)
    except FileNotFoundError:
        return 0


def _wait_for_a_step(proc: subprocess.Popen, run_log: str) -> float:
    while not _logged(run_log) and proc.poll() is None:
        time.sleep(0.005)
    return time.perf_counter()


def _tail(run_log: str) -> str:
    with open(run_log, encoding="utf-8", errors="replace") as f:
        return f.read()[-3000:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process reads the final checkpoints
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        figures = inject(args.kills, args.seed, root, args.steps)
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python tests/fault_injection.py " + " ".join(argv or sys.argv[1:]), **figures},
                      f, indent=1)
    ok = figures["losses_identical"] and figures["parameters_identical"] and not figures["problems"]
    for problem in figures["problems"]:  # again, last: a CI log shows its tail
        print(problem)
    print("identical to the run never killed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
