"""The `jaxtron` command: every tool of the package as one subcommand.

    jaxtron --help                   # the commands, one line each
    jaxtron <command> --help         # a command's own options
    jaxtron train --config=default --workdir=runs/default --config.train.steps=100

``python -m jaxtron <command>`` and, for training, ``python train.py`` (at the top of the repository) are the same.
A command's module is imported only when that command runs, so that ``jaxtron --help`` answers at once (without
jax).

Every command ends the same way: an exception of ``ERRORS`` (bad input, a diverged run) becomes one line
``error: <sentence>`` on stderr and that exit code, without a traceback; any other exception is a bug and keeps its
traceback. The other exit codes a job script can act on are the outcomes a command returns itself: a preempted
training run, after its checkpoint (``jaxtron.training.preemption.PREEMPTED_EXIT_CODE``: requeue it), and a process
that lost a peer of its run (``jaxtron.parallel.launch.PEER_LOST_EXIT_CODE``: restart from the last checkpoint).
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Collection, Sequence
from typing import NamedTuple


class Command(NamedTuple):
    target: str  # "module:function"; the function takes the argument list and returns the exit code
    help: str  # one line for `jaxtron --help`


COMMANDS: dict[str, Command] = {
    "train": Command("jaxtron.cli:train", "train a model from a config file (any field overridable)"),
    "plan": Command("jaxtron.planning.cli:main", "rank the meshes of a model on N GPUs by estimated memory and step "
                    "time; --compile checks one with XLA"),
    "report": Command("jaxtron.metrics.report:main", "summarise a run (throughput, MFU, loss) and plot it, or "
                      "compare two runs"),
    "prepare": Command("jaxtron.data.prepare:main", "tokenize text files into a token store"),
    "verify-data": Command("jaxtron.data.store:main", "hash every shard of token stores against their manifests"),
    "verify": Command("jaxtron.checkpoint.verify:main", "check a run's checkpoints against their checksums"),
    "convert": Command("jaxtron.interop.convert:main", "convert Hugging Face models to jaxtron checkpoints and back"),
    "score": Command("jaxtron.interop.score:main", "write a model's logits on given token ids"),
    "generate": Command("jaxtron.inference.generate:main", "continue prompts with a trained or converted model (KV "
                        "cache; greedy, temperature, top-k, top-p)"),
    "lm-eval": Command("jaxtron.inference.harness:main", "evaluate a run with lm-evaluation-harness tasks "
                       "(lm_eval's options, --model jaxtron)"),
    "gpu-preset": Command("jaxtron.gpu.preset:main", "print the GPU environment and XLA flags to export, or --check "
                          "them against the installed jaxlib"),
}

# Exceptions that end a command with "error: <message>" and no traceback, and their exit codes; the first class the
# exception is an instance of decides. A class is looked up only once its module is loaded (an exception of a module
# never imported cannot have been raised), so that the table imports nothing at startup.
ERRORS: tuple[tuple[str, str, int], ...] = (
    # bad input, one sentence naming it and the fix: a config field, data (DataError), a checkpoint
    # (CheckpointError), a Hugging Face file (FormatError), ...; a rerun would fail the same way
    ("jaxtron.config.checks", "ConfigError", 2),
    # training stopped: too many non-finite steps in a row, or a non-finite state about to be saved
    ("jaxtron.training.step_flags", "NonFiniteError", 3),
)
USAGE_EXIT_CODE = 2  # no command, or an unknown one (argparse exits with 2 for a command's bad options too)
INTERRUPTED_EXIT_CODE = 130  # Ctrl-C, as a shell reports a process ended by SIGINT (128 + 2)


def exit_code(error: BaseException) -> int | None:
    """The exit code of an exception that ends a command in one line (``ERRORS``), or None for any other."""
    for module, name, code in ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(error, cls):
            return code
    return None


def _error(message: str, code: int) -> int:
    """Prints ``error: <message>`` on stderr, the one form every command's errors take; returns ``code``."""
    print(f"error: {message}", file=sys.stderr)
    return code


def run(name: str, argv: Sequence[str] | None = None) -> int:
    """Runs command ``name`` with the arguments ``argv`` (default: the process's) and returns its exit code, with
    the exceptions of ``ERRORS`` printed as one line and turned into theirs."""
    args = list(sys.argv[1:] if argv is None else argv)
    module, _, function = COMMANDS[name].target.partition(":")
    try:
        return getattr(importlib.import_module(module), function)(args) or 0
    except SystemExit as e:  # argparse's --help and usage errors: an exit code for callers of main(argv) too
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        raise
    except KeyboardInterrupt:  # Ctrl-C outside a training step (a run checkpoints on it: preemption.py)
        return _error("interrupted (Ctrl-C); nothing more was done.", INTERRUPTED_EXIT_CODE)
    except Exception as e:
        code = exit_code(e)
        if code is None:
            raise
        return _error(str(e), code)


def train(argv: list[str]) -> int:
    """`jaxtron train`: its command line (``jaxtron.training.cli.parse_args``) handed to ``jaxtron.train``.
    Exits 0 when the run reached ``train.steps``, and with ``PREEMPTED_EXIT_CODE`` when a signal stopped it
    after a checkpoint."""
    from jaxtron.common.console import console_logging
    from jaxtron.config.loader import HelpRequested
    from jaxtron.training.cli import USAGE, parse_args

    console_logging()
    try:
        cfg, workdir, print_sharding = parse_args(argv)
    except HelpRequested as e:
        print(f"{USAGE}\n\n{e}")
        return 0
    if print_sharding:
        return _print_sharding(cfg)
    from jaxtron import api
    from jaxtron.training.preemption import PREEMPTED_EXIT_CODE

    return PREEMPTED_EXIT_CODE if api.train(cfg, workdir)["preempted"] else 0


def _print_sharding(cfg) -> int:
    """`jaxtron train --print_sharding`: the rules table and every parameter's sharding, then exit."""
    from jaxtron.parallel import launch
    from jaxtron.training.placement import sharding_report

    launch.initialize(cfg.distributed)
    try:
        print(sharding_report(cfg))
    finally:
        launch.finish()
    return 0


def help_text(names: Collection[str] = COMMANDS) -> str:
    """What ``jaxtron --help`` prints: the usage and the commands ``names``, one line each."""
    width = max(map(len, names)) + 2
    rows = "\n".join(f"  {name:<{width}}{COMMANDS[name].help}" for name in names)
    return (f"usage: jaxtron <command> [options]\n\nJAX/XLA SPMD training of large language models.\n\ncommands:\n"
            f"{rows}\n\n`jaxtron <command> --help` shows the options of a command.")


def _unknown(name: str, names: Collection[str]) -> str:
    """One sentence for a command that does not exist, naming the closest one."""
    close = difflib.get_close_matches(name, names, n=1)
    names = list(names)
    hint = f"use '{(close or names)[0]}'" if close or len(names) == 1 else f"use one of {', '.join(names)}"
    return f"'{name}' is not a jaxtron command; {hint} (jaxtron --help lists them)."


def main(argv: Sequence[str] | None = None) -> int:
    """The `jaxtron` command: ``argv`` (default: the process's arguments) is a command name and its arguments;
    returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else USAGE_EXIT_CODE
    if argv[0] not in COMMANDS:
        return _error(_unknown(argv[0], COMMANDS), USAGE_EXIT_CODE)
    return run(argv[0], argv[1:])
