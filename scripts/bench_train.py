"""Peak GPU memory and samples/s of full CLIP training steps, with and without GradCache.

One step = `clipscale.step.TrainStep`, the object train.py runs: forward, loss, backward,
clip, AdamW, logit-scale clamp, of an open_clip model (random init, bf16 autocast) on
synthetic data already in memory (train.py on real shards, loader included, is
scripts/bench_e2e.py). "plain" is the step without GradCache (one chunk); the GradCache
cases keep the batch on the host as pinned uint8 images and int32 tokens and stream it to
the GPU a chunk at a time.

    python scripts/bench_train.py --out results/bench_train.json
    python scripts/bench_train.py --smoke --out /tmp/bench.json             # tiny, any device

Cases that would not finish before --budget seconds are skipped and recorded as such,
with the estimate that ruled them out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import open_clip
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

from clipscale.data.chunks import ChunkSource
from clipscale.losses import build_loss
from clipscale.provenance import provenance
from clipscale.step import TrainStep

IMAGE_SIZE, CONTEXT, VOCAB = 224, 77, 49408

# model -> (GradCache chunk for the large batches, plain batch = the comparison batch both
# steps can run, GradCache batches)
STANDARD = {
    "ViT-B-32": (512, 1024, [4096, 16384, 65536]),
    "ViT-B-16": (256, 512, [4096, 16384, 65536]),
}
SMOKE = {"ViT-B-32": (8, 16, [32])}


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.deadline = time.monotonic() + args.budget
        self.loss_name, self.loss_note = self.pick_loss()
        self.record = {
            **provenance(),
            "loss": self.loss_name,
            "loss_note": self.loss_note,
            "precision": "bf16 autocast, fp32 master weights, AdamW",
            "cases": [],
        }
        mean = torch.tensor(OPENAI_DATASET_MEAN, device=self.device).view(1, 3, 1, 1) * 255
        std = torch.tensor(OPENAI_DATASET_STD, device=self.device).view(1, 3, 1, 1) * 255
        self.normalise = lambda pixels: (pixels.float() - mean) / std

    def pick_loss(self) -> tuple[str, str]:
        """infcl when its kernels run here (checked on a small problem), else vanilla."""
        try:
            features = torch.nn.functional.normalize(torch.randn(2, 4096, 512, device=self.device), dim=-1)
            image, text = (f.requires_grad_() for f in features)
            build_loss("infcl")(image, text, torch.tensor(10.0, device=self.device)).backward()
            return "infcl", "Inf-CL loss (Triton kernels on CUDA)"
        except Exception as error:  # noqa: BLE001 - any failure means: use the baseline loss
            return "vanilla", f"infcl failed here ({type(error).__name__}: {error}); vanilla loss, O(b^2) memory"

    # --- data -------------------------------------------------------------------------------

    def device_batch(self, batch: int):
        images = torch.randint(0, 256, (batch, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8, device=self.device)
        return self.normalise(images), random_tokens(batch).to(self.device)

    def pinned_batch(self, batch: int):
        """uint8 images in pinned host memory (150 KB a sample), normalised on the GPU per chunk."""
        images = host_images(batch, IMAGE_SIZE, pin=self.device.type == "cuda")
        return ChunkSource.of_tensor(images, self.normalise), ChunkSource.of_tensor(random_tokens(batch))

    # --- running ----------------------------------------------------------------------------

    def run(self):
        self.standard()

    def standard(self):
        for model_name, (chunk, plain_batch, batches) in (SMOKE if self.args.smoke else STANDARD).items():
            model, optimizer = build_model(model_name, self.device)
            plain = self.case(model, optimizer, model_name, plain_batch, plain_batch, "device", repeats=3)
            # The same batch in 2 and in 4 chunks: pass 1 keeps its last chunk's graph, so the
            # extra forward costs (k-1)/k of one and the ratio depends on the chunk count k.
            for chunks in (2, 4):
                chunked = self.case(model, optimizer, model_name, plain_batch, plain_batch // chunks, "device", repeats=3)
                if "samples_per_s" in plain and "samples_per_s" in chunked:
                    self.record.setdefault("ratios", []).append({
                        "model": model_name, "batch": plain_batch, "chunks": chunks,
                        "gradcache_over_plain_samples_per_s": chunked["samples_per_s"] / plain["samples_per_s"],
                    })
            for batch in batches:
                self.case(model, optimizer, model_name, batch, chunk, "pinned", repeats=1)
            del model, optimizer

    def case(self, model, optimizer, model_name, batch, chunk, data, repeats, estimate=None) -> dict:
        row = {"model": model_name, "batch": batch, "chunk": min(chunk, batch), "data": data,
               "gradcache": chunk < batch, "offload": data != "device"}
        if estimate is None:
            estimate = self.estimate(model_name, batch, data)
        if time.monotonic() + estimate > self.deadline:
            return self.keep(row | {"skipped": f"estimated {estimate:.0f}s, {self.deadline - time.monotonic():.0f}s left"})
        print(f"{model_name} batch {batch} chunk {row['chunk']} {data} ...", flush=True)
        try:
            images, texts = getattr(self, f"{data}_batch")(batch)
            loss_fn = build_loss(self.loss_name)
            step = TrainStep(model, loss_fn, optimizer, chunk_size=min(chunk, batch),
                             precision="bf16" if self.device.type == "cuda" else "fp32", grad_clip=1.0)
            # A single timed step must not pay for the loss kernels' autotuning at a new size;
            # beyond 64k that warm-up would cost more than it saves.
            row["loss_s_warm"] = self.loss_seconds(batch) if repeats == 1 and batch <= 65536 else None
            times, peaks = [], []
            for _ in range(repeats + (1 if repeats > 1 else 0)):  # the first of several is warm-up
                seconds, peak, loss = self.timed_step(step, images, texts)
                times.append(seconds)
                peaks.append(peak)
            times = times[1:] if repeats > 1 else times
            row |= {"step_s": statistics.median(times), "samples_per_s": batch / statistics.median(times),
                    "peak_allocated_gib": max(p[0] for p in peaks), "peak_reserved_gib": max(p[1] for p in peaks),
                    "loss": loss, "host_batch_bytes": host_bytes(images) + host_bytes(texts)}
        except Exception as error:  # noqa: BLE001 - an out-of-memory (or a failing loss kernel) is a result too
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        finally:
            images = texts = step = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return self.keep(row)

    def timed_step(self, step, images, texts):
        self.synchronize()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = float(step(images, texts).loss)
        self.synchronize()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30) if self.device.type == "cuda" else (0.0, 0.0)
        return seconds, peak, loss

    def loss_seconds(self, batch: int) -> float:
        """One loss forward+backward at this batch (also warms any autotuning for this size)."""
        features = torch.nn.functional.normalize(torch.randn(2, batch, 512, device=self.device), dim=-1)
        image, text = (f.requires_grad_() for f in features)
        loss_fn = build_loss(self.loss_name)
        loss_fn(image, text, torch.tensor(10.0, device=self.device)).backward()
        self.synchronize()
        start = time.perf_counter()
        loss_fn(image, text, torch.tensor(10.0, device=self.device)).backward()
        self.synchronize()
        return time.perf_counter() - start

    def estimate(self, model_name: str, batch: int, data: str) -> float:
        """Seconds for this case from the last measured rate of the same model (0 if none yet)."""
        rates = [c["samples_per_s"] for c in self.record["cases"] if c["model"] == model_name and "samples_per_s" in c]
        return 1.3 * batch / rates[-1] if rates else 0.0

    def keep(self, row: dict) -> dict:
        self.record["cases"].append(row)
        print(json.dumps(row), flush=True)
        with open(self.args.out, "w") as f:
            json.dump(self.record, f, indent=1)
        return row

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def build_model(name: str, device: torch.device):
    model = open_clip.create_model(name, pretrained=None, output_dict=True).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.2, fused=device.type == "cuda")
    return model, optimizer


def random_tokens(batch: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, CONTEXT), dtype=torch.int32)


def host_images(batch: int, size: int, pin: bool) -> torch.Tensor:
    """uint8 [batch, 3, size, size] on the host: shifted copies of one random block, so that
    filling hundreds of GB runs at memcpy speed (fresh random numbers would take minutes)."""
    images = torch.empty((batch, 3, size, size), dtype=torch.uint8, pin_memory=pin)
    block = torch.randint(0, 256, (min(batch, 1024), 3, size, size), dtype=torch.uint8)
    for start in range(0, batch, len(block)):
        rows = images[start : start + len(block)]
        torch.add(block[: len(rows)], start // len(block), out=rows)
    return images


def host_bytes(column) -> int:
    """Bytes of a batch column on the host as if every sample were distinct."""
    tensor = column.rows.tensor if isinstance(column, ChunkSource) else column
    return tensor.numel() * tensor.element_size() if tensor.device.type == "cpu" else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file, rewritten after every case")
    parser.add_argument("--budget", type=float, default=540, help="seconds; later cases that would not fit are skipped")
    parser.add_argument("--smoke", action="store_true", help="tiny batches, to check the script anywhere")
    args = parser.parse_args()
    Bench(args).run()


if __name__ == "__main__":
    main()
