"""Train a model: python train.py --config=configs/X.py --workdir=DIR [--config.section.field=value ...]"""

from __future__ import annotations

import logging
import os
import sys

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")


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

    cfg, values, spec = parse_command_line(["train.py", *argv], DEFAULT_CONFIG, _define)
    workdir = values.workdir
    if workdir is None:
        workdir = os.path.join("runs", os.path.splitext(os.path.basename(spec.partition(":")[0]))[0])
    if not flags.FLAGS.is_parsed():  # the libraries' own absl flags (grain's) take their defaults
        flags.FLAGS(["train.py"])
    return cfg, workdir, values.print_sharding


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU found" is not news
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file operation at INFO
    from jaxtron.config.loader import HelpRequested
    from jaxtron.config.schema import ConfigError

    try:
        cfg, workdir, print_sharding = parse_args(sys.argv[1:] if argv is None else argv)
        from jaxtron.parallel import launch
        launch.initialize(cfg.distributed)  # before anything asks jax about devices
        import jax
        if jax.process_index() != 0:
            logging.getLogger().setLevel(logging.WARNING)
        from jaxtron.training.loop import run
        from jaxtron.training.preemption import PREEMPTED_EXIT_CODE
        from jaxtron.training.step_flags import NONFINITE_EXIT_CODE, NonFiniteError
        try:
            summary = run(cfg, workdir, print_sharding=print_sharding)
        except NonFiniteError as e:
            print(f"error: {e}", file=sys.stderr)
            return NONFINITE_EXIT_CODE
        finally:
            launch.finish()  # all processes leave together
        if summary.get("preempted"):
            return PREEMPTED_EXIT_CODE
    except HelpRequested as e:
        print(f"usage: python train.py --config=configs/X.py --workdir=DIR [--config.<section>.<field>=VALUE ...]"
              f"\n\n{e}")
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
