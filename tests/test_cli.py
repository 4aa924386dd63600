"""The `jaxtron` command (jaxtron/cli.py): its commands and their help, the one error wrapper, the console script,
`python -m jaxtron` and `python train.py`."""

import configparser
import importlib
import os
import subprocess
import sys

import pytest
from conftest import REPO

from jaxtron import cli
from jaxtron.checkpoint.train_state import CheckpointError
from jaxtron.config.schema import ConfigError
from jaxtron.data.errors import DataError
from jaxtron.interop.hf.safetensors import FormatError
from jaxtron.training.step_flags import NonFiniteError

# an option (or argument) each command's help must show: its own, not the command list or a dumped config
OWN_OPTIONS = {
    "train": ("--workdir", "--print_sharding", "--config.<section>.<field>=VALUE", "jaxtron/config/schema.py"),
    "plan": ("--gpus", "--compile", "--config.<section>.<field>=VALUE"),
    "report": ("--vs", "--no_plots"),
    "prepare": ("--input", "--tokenizer", "--output"),
    "verify-data": ("STORE_DIR",),
    "verify": ("WORKDIR",),
    "convert": ("from-hf", "to-hf"),
    "score": ("--checkpoint", "--tokens"),
    "generate": ("--run", "--prompt", "--top-p", "--stop", "--chat"),
    "lm-eval": ("--model", "--model_args", "--tasks", "--include_path"),
    "gpu-preset": ("--check",),
}


def _listed(help_text: str) -> list[str]:
    """The command names of `jaxtron --help`."""
    rows = help_text.split("commands:\n", 1)[1].split("\n\n", 1)[0]
    return [line.split()[0] for line in rows.splitlines()]


def test_every_listed_command_shows_its_own_options(capsys):
    assert cli.main(["--help"]) == 0
    listed = _listed(capsys.readouterr().out)
    assert listed == list(cli.COMMANDS) and set(listed) == set(OWN_OPTIONS)
    for name in listed:
        assert cli.main([name, "--help"]) == 0, name
        out = capsys.readouterr().out
        assert out.startswith(f"usage: jaxtron {name} "), out
        for option in OWN_OPTIONS[name]:
            assert option in out, (name, option, out)


def test_train_help_names_the_overrides_without_dumping_the_config(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "vocab_size" not in out and "num_heads" not in out and "global_batch_size" not in out
    assert len(out.splitlines()) < 20, out


def test_no_command_or_an_unknown_one_exits_2_in_one_sentence(capsys):
    assert cli.main([]) == 2
    assert "commands:" in capsys.readouterr().err
    assert cli.main(["trian", "--config=x.py"]) == 2
    err = capsys.readouterr().err
    assert err == "error: 'trian' is not a jaxtron command; use 'train' (jaxtron --help lists them).\n"
    assert cli.main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 'bogus' is not a jaxtron command; use one of train, plan,") and err.count("\n") == 1


def test_a_config_error_of_a_tool_is_one_line_and_exit_2(capsys, tmp_path):
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "has no metrics.jsonl" in captured.err and captured.out == ""
    assert cli.main(["report"]) == 2  # argparse's usage error: an exit code, not a SystemExit, for callers of main
    assert "required: workdir" in capsys.readouterr().err


def test_the_exit_code_of_each_error():
    for error in (ConfigError("x"), DataError("x"), CheckpointError("x"), FormatError("x")):
        assert cli.exit_code(error) == 2, type(error)
    assert cli.exit_code(NonFiniteError("x")) == 3
    assert cli.exit_code(ValueError("x")) is None and cli.exit_code(KeyboardInterrupt()) is None


def test_train_ends_a_diverged_run_with_3_and_a_preempted_one_with_75(monkeypatch, tmp_path, capsys):
    from jaxtron import api
    from jaxtron.training.preemption import PREEMPTED_EXIT_CODE

    def diverged(cfg, workdir, **_):
        raise NonFiniteError("the loss was not finite in 5 steps in a row; lower the learning rate.")

    monkeypatch.setattr(api, "train", diverged)
    assert cli.main(["train", f"--workdir={tmp_path}"]) == 3
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "error: the loss was not finite in 5 steps in a row; lower the learning rate.", err
    assert "Traceback" not in err
    monkeypatch.setattr(api, "train", lambda cfg, workdir, **_: {"preempted": "SIGTERM"})
    assert cli.main(["train", f"--workdir={tmp_path}"]) == PREEMPTED_EXIT_CODE == 75
    monkeypatch.setattr(api, "train", lambda cfg, workdir, **_: {"preempted": None})
    assert cli.main(["train", f"--workdir={tmp_path}"]) == 0


def test_any_other_exception_keeps_its_traceback(monkeypatch):
    # a command whose function fails with a TypeError (json.loads of a list): a bug, not a user's mistake
    monkeypatch.setitem(cli.COMMANDS, "broken", cli.Command("json:loads", "fails"))
    with pytest.raises(TypeError):
        cli.main(["broken"])


def test_the_console_script_is_the_dispatcher():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, "setup.cfg"))
    scripts = dict(line.split("=", 1) for line in setup["options.entry_points"]["console_scripts"].split("\n") if line)
    module, _, function = scripts["jaxtron "].strip().partition(":")
    assert getattr(importlib.import_module(module), function) is cli.main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def test_help_starts_without_jax():
    code = "import sys; from jaxtron.cli import main; main(['--help']); print([m for m in ('jax', 'absl') if m in " \
           "sys.modules])"
    proc = _run("-c", code)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "[]", proc.stdout + proc.stderr


def test_python_m_jaxtron_and_train_py_are_the_command(tmp_path):
    plan = _run("-m", "jaxtron", "plan", "--help")
    assert plan.returncode == 0 and "--gpus" in plan.stdout, plan.stderr
    train = _run("train.py", "--help")
    assert train.returncode == 0 and "--workdir" in train.stdout and "vocab_size" not in train.stdout, train.stderr
    error = _run("-m", "jaxtron", "report", str(tmp_path / "missing"))
    assert error.returncode == 2 and error.stderr.startswith("error: ") and error.stderr.count("\n") == 1, error.stderr


def test_flags_are_checked_before_a_model_loads(monkeypatch, tmp_path, capsys):
    from jaxtron.inference import generate

    monkeypatch.setattr(generate, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main(["generate", "--run", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "-1"]) == 2
    out = capsys.readouterr()
    assert out.err == "error: --max-new-tokens must be at least 1, not -1.\n" and out.out == ""


def test_commands_log_without_jaxs_backend_probing_and_the_bar_moves_every_step(tmp_path):
    import io
    import logging

    from jaxtron.common.console import console_logging
    from jaxtron.metrics.writers import MetricsWriter

    console_logging()
    assert logging.getLogger("jax._src.xla_bridge").getEffectiveLevel() >= logging.WARNING
    writer = MetricsWriter(str(tmp_path), 10, use_tqdm=True, tensorboard=False)
    writer._bar.fp = io.StringIO()
    for step in (1, 2, 3):
        writer.advance(step)
    assert writer._bar.n == 3 and not os.path.getsize(tmp_path / "metrics.jsonl")  # the bar alone moved
    writer.close()


def test_paths_are_taken_in_any_form(monkeypatch, tmp_path):
    from jaxtron.training.cli import parse_args

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    _, workdir, _ = parse_args(["--workdir=~/runs/a/"])
    assert workdir == str(tmp_path / "runs" / "a")
    cfg, workdir, _ = parse_args(["--workdir=runs/b", "--config.train.init_from=models/base/"])
    assert workdir == str(tmp_path / "runs" / "b") and cfg.train.init_from == str(tmp_path / "models" / "base")


@pytest.mark.integration
def test_an_install_ships_the_configs_and_one_front_door(tmp_path):
    """What a non-editable install copies (setuptools' build_py, the step that fills a wheel) holds every file of
    configs/ as jaxtron/configs/ (the names --config takes from any directory) and no module at the package top but
    `jaxtron/cli.py`, the Python API's `jaxtron/api.py` and `python -m jaxtron`'s."""
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=REPO,
                           capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-2000:]
    shipped = sorted(os.listdir(tmp_path / "jaxtron" / "configs"))
    assert shipped == sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".py"))
    assert sorted(f for f in os.listdir(tmp_path / "jaxtron") if f.endswith(".py")) == \
        ["__init__.py", "__main__.py", "api.py", "cli.py"]
    assert os.path.isfile(tmp_path / "jaxtron" / "gpu" / "specs" / "h100_sxm.txtpb")
