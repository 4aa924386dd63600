"""Train a model: python train.py --config=configs/X.py --workdir=DIR [--config.section.field=value ...]"""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")


def parse_args(argv: list[str]):
    from jaxtron.config.loader import load_config, split_overrides

    spec, overrides, rest = split_overrides(argv)
    parser = argparse.ArgumentParser(
        prog="train.py", description="Train a jaxtron model. Any config field can be overridden with "
        "--config.<section>.<field>=<value>.")
    parser.add_argument("--workdir", default=None, help="directory for metrics, TensorBoard events and checkpoints "
                        "(default: runs/<config file name>)")
    parser.add_argument("--print_sharding", action="store_true",
                        help="print the logical-axis rules and every parameter's sharding, then exit")
    args = parser.parse_args(rest)
    spec = spec or DEFAULT_CONFIG
    if args.workdir is None:
        args.workdir = os.path.join("runs", os.path.splitext(os.path.basename(spec.partition(":")[0]))[0])
    return load_config(spec, overrides), args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU found" is not news
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file operation at INFO
    from jaxtron.config.schema import ConfigError

    try:
        cfg, args = parse_args(sys.argv[1:] if argv is None else argv)
        from jaxtron.parallel import launch
        launch.initialize(cfg.distributed)  # before anything asks jax about devices
        import jax
        if jax.process_index() != 0:
            logging.getLogger().setLevel(logging.WARNING)
        from jaxtron.training.loop import run
        from jaxtron.training.step_flags import NONFINITE_EXIT_CODE, NonFiniteError
        from jaxtron.training.preemption import PREEMPTED_EXIT_CODE
        try:
            summary = run(cfg, args.workdir, print_sharding=args.print_sharding)
        except NonFiniteError as e:
            print(f"error: {e}", file=sys.stderr)
            return NONFINITE_EXIT_CODE
        finally:
            launch.finish()  # all processes leave together
        if summary.get("preempted"):
            return PREEMPTED_EXIT_CODE
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
