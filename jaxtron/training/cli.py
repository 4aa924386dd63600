"""`jaxtron train`'s command line: a config file, its overrides and the workdir (``parse_args``), which
``jaxtron.cli.train`` hands to ``jaxtron.train``.

    jaxtron train --config=configs/X.py --workdir=DIR [--config.<section>.<field>=VALUE ...] [--print_sharding]
"""

from __future__ import annotations

import os

from jaxtron.common.files import user_path

DEFAULT_CONFIG = "default"  # configs/default.py, shipped with the package (jaxtron.config.loader.config_file)
USAGE = "usage: jaxtron train --config=NAME|configs/X.py --workdir=DIR [--config.<section>.<field>=VALUE ...]"


def _define(values) -> None:
    from absl import flags
    flags.DEFINE_string("workdir", None, "directory for metrics, TensorBoard events and checkpoints (default: "
                        "runs/<config file name>)", flag_values=values)
    flags.DEFINE_bool("print_sharding", False, "print the logical-axis rules and every parameter's sharding, then "
                      "exit", flag_values=values)


def parse_args(argv: list[str]):
    """(Config, workdir, print_sharding) of the command line ``argv`` (without the program name)."""
    from absl import flags

    from jaxtron.config.loader import parse_command_line
    from jaxtron.config.schema import replace

    cfg, values, spec = parse_command_line(["jaxtron train", *argv], DEFAULT_CONFIG, _define)
    workdir = values.workdir
    if workdir is None:
        workdir = os.path.join("runs", os.path.splitext(os.path.basename(spec.partition(":")[0]))[0])
    workdir = user_path(workdir)  # '~', relative, a trailing slash: one directory, wherever the run is read from
    if cfg.train.init_from:  # saved absolute, so that a LoRA run's base is found from any directory
        cfg = replace(cfg, train=replace(cfg.train, init_from=user_path(cfg.train.init_from)))
    if not flags.FLAGS.is_parsed():  # the libraries' own absl flags (grain's) take their defaults
        flags.FLAGS(["jaxtron"])
    return cfg, workdir, values.print_sharding
