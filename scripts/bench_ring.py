"""Does the Inf-CL ring hide its communication? Time per GPU of the ring against its local compute.

    torchrun --nproc_per_node 2 scripts/bench_ring.py --out results/bench_ring.json

For each global batch b (d = 512, bf16), every rank times forward+backward of
  ring:   infcl_loss over the whole group (text blocks travel between GPUs), and
  local:  the same tile work with no communication: this rank's b/n images against
          all b texts, in a group of this rank alone (the texts are gathered first,
          outside the timing),
and, for reference, open_clip's local loss (`local`, gathered features with their gradients),
DisCo (`disco`) and `vanilla` where they fit. Every case records its loss: on the same features
all of them compute the same global loss.
The ring hides its communication when ring / local is close to 1. JSON: per-rank
median ms and peak extra memory, device, versions, command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from clipscale.losses import build_loss
from clipscale.losses.infcl import infcl_loss
from clipscale.provenance import provenance


def timed(fn, repeats: int, device) -> tuple[float, float, float]:
    """(median ms, peak GiB above what was allocated before, the loss) of fn() incl. backward."""
    for _ in range(2):
        fn()
    dist.barrier()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    else:
        import time

        for _ in range(repeats):
            t = time.perf_counter()
            loss = fn()
            times.append(1000 * (time.perf_counter() - t))
        peak = float("nan")
    return statistics.median(times), peak, float(loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[65536, 131072, 262144])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peers", nargs="*", default=["local", "disco", "vanilla"], help="other losses to time where they fit")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank must create every group
    rows = []
    for b in args.batches:
        per_rank = b // world
        gen = torch.Generator(device=device).manual_seed(rank)
        image = torch.nn.functional.normalize(torch.randn(per_rank, args.dim, device=device, generator=gen), dim=1)
        text = torch.nn.functional.normalize(torch.randn(per_rank, args.dim, device=device, generator=gen), dim=1)
        image, text = image.to(dtype).requires_grad_(), text.to(dtype).requires_grad_()
        scale = torch.tensor(50.0, device=device, requires_grad=True)
        gathered = [torch.empty_like(text) for _ in range(world)]
        dist.all_gather(gathered, text.detach())
        all_text = torch.cat(gathered).requires_grad_()

        def backward(loss):
            loss.backward()
            return loss.detach()

        def ring():
            return backward(infcl_loss(image, text, scale))

        def local():
            return backward(infcl_loss(image, all_text, scale, group=alone))

        row = {"global_batch": b, "per_rank": per_rank}
        cases = {"ring": ring, "local_compute": local}
        for name in args.peers:
            loss_fn = build_loss(name)
            cases[name] = lambda loss_fn=loss_fn: backward(loss_fn(image, text, scale))
        for name, fn in cases.items():
            try:
                ms, gib, loss = timed(fn, args.repeats, device)
                row[name] = {"ms": ms, "extra_gib": gib, "loss": loss}
            except torch.OutOfMemoryError:
                row[name] = "oom"
                torch.cuda.empty_cache()
            dist.barrier()
        if isinstance(row["ring"], dict) and isinstance(row["local_compute"], dict):
            row["ring_over_local"] = row["ring"]["ms"] / row["local_compute"]["ms"]
        per_rank_rows = [None] * world
        dist.all_gather_object(per_rank_rows, row)
        if rank == 0:
            rows.append(per_rank_rows)
            print(json.dumps(per_rank_rows), flush=True)
        del image, text, all_text, gathered
        if cuda:
            torch.cuda.empty_cache()

    if rank == 0:
        result = {
            "what": "Inf-CL ring vs its local compute, forward+backward, per rank",
            "dim": args.dim,
            "dtype": str(dtype),
            "world_size": world,
            **provenance(),
            "rows": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
