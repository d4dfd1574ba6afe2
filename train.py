"""Train a CLIP model: `python train.py --config configs/digits.yaml [section.key=value ...]`.

Also `torchrun --nproc_per_node N train.py --config ...` (gloo on CPU, NCCL on GPUs).
"""

import argparse
import sys

from clipscale.checks import load_checked_config
from clipscale.config import ConfigError
from clipscale.trainer import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/digits.yaml", help="YAML run configuration")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 loss.name=infcl")
    args = parser.parse_args()
    try:
        cfg = load_checked_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"config error: {err}")
    results = train(cfg)
    if "preempted_by" in results:
        sys.exit(128 + results["preempted_by"])  # the shell convention for "killed by signal N"


if __name__ == "__main__":
    main()
