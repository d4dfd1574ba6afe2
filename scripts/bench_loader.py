"""How fast the trainer's data path delivers a batch with no model behind it: the loader workers
read the shards, decode (`data.decoder: loader`) or only parse each JPEG's header
(`device`), tokenize, and `BatchStream` gathers the pieces, exactly as train.py builds them
(`clipscale.data.pipeline.TrainingBatches`). Nothing is decoded on the device: this is the rate the workers
can feed a step at, and so the bound on a first step, whose batch cannot be gathered ahead.

A component benchmark on real shards: it explains what `scripts/bench_e2e.py` measures
through train.py; it does not replace it.

    python scripts/bench_loader.py --shards '/tmp/shards/synthetic-{0000..0129}.tar' --workers 14 \\
        --case decoder=device,batch=65536 --case decoder=loader,batch=65536 --out results/bench_loader.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]
from clipscale.checks import plan_run  # noqa: E402
from clipscale.config import load_config  # noqa: E402
from clipscale.distributed import World  # noqa: E402
from clipscale.models import build_model  # noqa: E402
from clipscale.data.pipeline import TrainingBatches  # noqa: E402
from clipscale.provenance import provenance  # noqa: E402


def run_case(case: dict, shards: str, workers: int) -> dict:
    batch, chunk, batches = int(case["batch"]), int(case.get("chunk", 512)), int(case.get("batches", 3))
    cfg = load_config(REPO / "configs" / "vit_b16_infcl.yaml", [
        f"model.name={case.get('model', 'ViT-B-32')}", "data.kind=webdataset", f"data.train_shards={shards}",
        f"data.workers={workers}", f"data.decoder={case['decoder']}", f"train.batch_size={batch}",
        f"train.chunk_size={chunk}", f"train.steps={batches}", "eval.zeroshot=false", "run.output_dir=/tmp/bench_loader"])
    world = World()
    started = time.perf_counter()
    towers = build_model(cfg.model)
    stream = TrainingBatches(cfg, plan_run(cfg, world), world, towers.train_transform, towers.tokenizer, chunk)
    arrived = []  # seconds since the start when each batch's last piece was in
    try:
        for _ in range(batches):
            with stream.next():  # used at once (it waits for every piece): the next batch is gathered flat out
                pass
            arrived.append(time.perf_counter() - started)
    finally:
        stream.close()
    later = [b - a for a, b in zip(arrived, arrived[1:])]
    return {"case": case, "first_batch_s": arrived[0], "later_batch_s": later,
            "samples_per_s": batch * len(later) / sum(later) if later else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="brace pattern of webdataset shards")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--case", action="append", required=True,
                        help="decoder=loader|device,batch=N[,chunk=512][,batches=3][,model=ViT-B-32]")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    record = {**provenance(argv), "shards": args.shards, "workers": args.workers, "cases": []}
    for spec in args.case:
        result = run_case(dict(item.split("=", 1) for item in spec.split(",")), args.shards, args.workers)
        record["cases"].append(result)
        print(spec, {k: v for k, v in result.items() if k != "case"}, flush=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")  # after each case: a kill keeps what ran


if __name__ == "__main__":
    main()
