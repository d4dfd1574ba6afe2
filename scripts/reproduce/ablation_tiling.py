"""Table 4 of the Inf-CL paper: what each level of tiling saves in loss memory, with LiT.

At one global batch, three ways to compute the same contrastive loss:

  no tiling         `vanilla`: every GPU builds the whole b x b similarity matrix;
  cross-GPU only    the Inf-CL ring with one tile per block: `infcl`, reference backend,
                    tile_size = the per-GPU batch, so each step of the ring materialises a
                    (b/n) x (b/n) block but never the whole matrix;
  cross + in-GPU    `infcl` with the Triton kernels: the ring, and small tiles inside each GPU.

For each: the loss memory (the loss alone, forward and backward, on this rank's bf16
features) and the peak memory of a full LiT training step (image tower locked, text tower
trained with Gradient Cache at `--chunk`, data offloaded, fused AdamW).

    python scripts/reproduce/ablation_tiling.py --out docs/results/ablation_tiling_1xh100.json
    torchrun --nproc_per_node 2 scripts/reproduce/ablation_tiling.py --out docs/results/ablation_tiling_2xh200.json
    python scripts/reproduce/ablation_tiling.py --smoke --out /tmp/ablation.json     # tiny, CPU

Writes the JSON and a bar chart next to it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from clipscale.checks import check_loss_choices
from clipscale.provenance import provenance
from common import RESULTS, publish, pyplot, save_figure
from training_step import (
    load_workload,
    loss_memory_gib,
    smoke_model_name,
    start,
    training_step,
)


def variants(local_batch: int, on_gpu: bool) -> dict[str, tuple[str, dict]]:
    """label -> (loss name, options). On a CPU the Triton kernels are not used, so the last
    variant runs the reference backend with its default tiles instead (still in-GPU-style tiling)."""
    return {
        "no tiling (vanilla)": ("vanilla", {}),
        "cross-GPU tiling only": ("infcl", {"backend": "reference", "tile_size": local_batch}),
        "cross- and in-GPU tiling": ("infcl", {"backend": "triton"} if on_gpu else {"backend": "reference"}),
    }


def plot(record: dict, path: Path) -> None:
    plt = pyplot()
    rows = record["rows"]
    labels = [r["variant"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, key, name in ((-0.2, "loss_gib", "loss only"), (0.2, "peak_gib", "full LiT step, peak")):
        values = [r[key] if isinstance(r[key], float) else 0.0 for r in rows]
        bars = ax.bar([i + offset for i in range(len(rows))], values, width=0.4, label=name)
        for bar, row in zip(bars, rows):
            text = f"{row[key]:.2f}" if isinstance(row[key], float) else str(row[key] or "n/a (CPU)")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=9)
    ax.set_ylabel("GPU memory per GPU (GiB)")
    ax.set_title(f"{record['device']}: {record['model']} LiT, global batch {record['global_batch']:,}", fontsize=10)
    ax.legend()
    save_figure(fig, path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--batch", type=int, default=65536, help="global batch")
    parser.add_argument("--chunk", type=int, default=1024, help="Gradient Cache samples per GPU per text-tower pass")
    parser.add_argument("--no-step", action="store_true", help="loss memory only, no full training step")
    parser.add_argument("--smoke", action="store_true", help="tiny model and batch on the CPU: checks the script")
    parser.add_argument("--out", default=str(RESULTS / "ablation_tiling.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.batch, args.chunk = smoke_model_name(), 64, 16

    check_loss_choices(list(variants(args.batch, torch.cuda.is_available()).values()), [args.model])
    world = start()
    on_gpu = world.device.type == "cuda"
    local_batch = args.batch // world.world_size
    work = load_workload(args.model, world, lock_image=True)
    record = {"what": "loss memory and full LiT step peak memory at one global batch, per level of tiling",
              "model": args.model, "global_batch": args.batch, "chunk": args.chunk, "world_size": world.world_size,
              **provenance(argv), "rows": []}
    for label, (loss, options) in variants(local_batch, on_gpu).items():
        row = {"variant": label, "loss": loss, "options": options,
               "loss_gib": loss_memory_gib(loss, world, args.batch, work.feature_dim, options)}
        step = {} if args.no_step else training_step(work, world, loss, args.batch, args.chunk, offload=True, loss_options=options)
        row |= {"peak_gib": step.get("peak_gib", step.get("error")), "step_s": step.get("step_s")}
        record["rows"].append(row)
        if world.is_main:
            print(row, flush=True)
    if world.is_main:
        publish(record, Path(args.out), plot)
    return record


if __name__ == "__main__":
    main()
