"""`jaxtron verify WORKDIR`: one line per checkpoint of a run (intact, unfinished, or damaged and why), checked
against the checksums recorded when it was saved (`jaxtron/checkpoint/integrity.py`)."""

from __future__ import annotations

import argparse
import os

from jaxtron.checkpoint.integrity import NO_MANIFEST, check, incomplete_saves, read_manifests, steps_in
from jaxtron.config.checks import ConfigError


def report(workdir: str) -> tuple[list[str], int]:
    """One line per checkpoint of a run (intact, unfinished, or damaged and why) and the number damaged; a
    ConfigError when ``workdir`` is no run directory or holds no checkpoint."""
    workdir = os.path.abspath(os.path.expanduser(workdir))
    if not os.path.isdir(workdir):
        what = "is a file" if os.path.exists(workdir) else "does not exist"
        raise ConfigError(f"'{workdir}' {what}; point verify at the --workdir of a run.")
    directory = os.path.join(workdir, "checkpoints")
    steps = steps_in(directory)
    if not steps:
        raise ConfigError(f"'{directory}' holds no checkpoint; point verify at the --workdir of a run that saved "
                          "one.")
    lines, damaged, unfinished = [], 0, 0
    for step in steps:
        step_dir = os.path.join(directory, str(step))
        reason = check(step_dir)
        if reason == NO_MANIFEST and step == steps[-1]:  # the newest: the run stopped between the two
            unfinished += 1
            lines.append(f"step {step}: unfinished: the run stopped before its checksums were recorded; never "
                         f"loaded (a resumed run starts from {'the step before' if len(steps) > 1 else 'step 0'})")
            continue
        damaged += reason is not None
        if reason:
            lines.append(f"step {step}: damaged: {reason}")
        else:
            files = read_manifests(step_dir)
            total = sum(f["size"] for f in files.values())
            lines.append(f"step {step}: intact ({len(files)} files, {total / 1e6:.1f} MB)")
    lines += [f"{n}: a save cut off while being written; never loaded" for n in incomplete_saves(directory)]
    finished = len(steps) - unfinished
    lines.append(f"{finished - damaged} of {finished} checkpoints intact in {directory}")
    return lines, damaged


def main(argv: list[str]) -> int:
    """`jaxtron verify WORKDIR`: one line per checkpoint of the run; exit 2 (after them, with one error line) if
    any is damaged, and for a WORKDIR with no checkpoint."""
    parser = argparse.ArgumentParser(prog="jaxtron verify", description="Check a run's checkpoints against the "
                                     "checksums recorded when they were saved.")
    parser.add_argument("workdir", metavar="WORKDIR", help="the --workdir of a run")
    lines, damaged = report(parser.parse_args(argv).workdir)
    print("\n".join(lines))
    if damaged:
        raise ConfigError(f"{damaged} checkpoint(s) damaged (listed above); a resumed run falls back to the newest "
                          "intact one and moves the newer damaged ones aside.")
    return 0
