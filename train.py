"""Train a CLIP model: `python train.py --config configs/digits.yaml [section.key=value ...]`.

Also `torchrun --nproc_per_node N train.py --config ...` (gloo on CPU, NCCL on GPUs). Overrides
may come before or after --config.
"""

import argparse

from clipscale.config import check_names, load_config, schema_help
from clipscale.errors import run_main
from clipscale.optional_libraries import leave_out_unused_libraries


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, epilog=schema_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/digits.yaml", help="YAML run configuration")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 loss.name=infcl")
    return parser.parse_intermixed_args(argv)  # overrides on both sides of --config


def main() -> int:
    args = parse_args()
    cfg = load_config(args.config, args.overrides)
    # torch and open_clip take seconds to import: a mistake in the YAML, a key or a name is reported before them.
    check_names(cfg)
    leave_out_unused_libraries(cfg.model)
    from clipscale.checks import check_config
    from clipscale.trainer import train

    check_config(cfg)
    results = train(cfg)
    return 128 + results["preempted_by"] if "preempted_by" in results else 0  # the shell's "killed by signal N"


if __name__ == "__main__":
    run_main(main)
