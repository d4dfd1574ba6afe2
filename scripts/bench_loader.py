"""How fast the trainer's data path delivers a batch with no model behind it: the loader workers
read the shards, decode (`data.decoder: loader`) or only parse each JPEG's header
(`device`), tokenize, and `BatchStream` gathers the pieces, exactly as train.py builds them
(`clipscale.data.pipeline.TrainingBatches`). With `decode=1` (on a GPU) every chunk of each batch
is also decoded there, as a step's first pass asks for it: the whole path, shards to decoded GPU
tensors; without it nothing is decoded on the device: the rate the workers can feed a step at, and
so the bound on a first step, whose batch cannot be gathered ahead. Each case reports the cores
its processes kept busy (their CPU seconds over the window's, from /proc).

The case key `page_lock` says how the workers' arenas are page-locked (at share 1), to tell what
the first batch waits for: as train.py does, or never
(`PAGE_LOCKS` below); each case reports where its first batch's time went.

A component benchmark on real shards: it explains what `scripts/bench_e2e.py` measures
through train.py; it does not replace it.

    python scripts/bench_loader.py --shards '/tmp/shards/synthetic-{0000..0129}.tar' --workers 14 \\
        --case decoder=device,batch=65536 --case decoder=loader,batch=65536 --out results/bench_loader.json

Each case runs in a process of its own, as train.py starts its loader once: one case's end (its
workers stopping, its arenas' memory given back to the host, 41 GiB at 65,536) never overlaps the
next case's start. In one process, two cases of the same setting put the first batch 8.55 s and
12.53 s after the loader's start (results/bench_loader_h200_first_batch_65k_after_pass_1.json).

`--profile-worker PIECES` first runs what one loader worker runs (`ShardStream` with the device
decoder's settings: header, crop draw, the worker's own decode of what the device does not take, tokenizer) in this process, alone,
for that many pieces of 512 under cProfile: milliseconds a sample without the profiler and with
it, and where the profiled time goes (`worker_profile`). Its rate times the workers is what the
workers could deliver with a core each; the cases say what they deliver.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]
from clipscale.checks import plan_run  # noqa: E402
from clipscale.config import load_config  # noqa: E402
from clipscale.distributed import World, host_threads_for  # noqa: E402
from clipscale.models import build_model  # noqa: E402
from clipscale.data.chunks import chunk_bounds  # noqa: E402
from clipscale.data.pipeline import TrainingBatches  # noqa: E402
from clipscale.provenance import provenance  # noqa: E402
from bench_e2e import process_tree  # noqa: E402


def cpu_seconds() -> float:
    """CPU seconds of this process and its descendants (the loader workers) so far, from /proc."""
    total = 0
    for pid in process_tree(os.getpid()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
        total += int(fields[11]) + int(fields[12])  # utime and stime: stat's 14th and 15th fields
    return total / os.sysconf("SC_CLK_TCK")


# How the workers' arenas are page-locked (case key page_lock), to tell what the first batch waits for:
#   default  as train.py does: one thread registers the arenas' segments in the order the workers
#            write them, once the first batch's pass 1 is over: here, once it is used
#            (clipscale.data.pipeline.BatchStream._page_lock_arenas)
#   never    no page-locking: every copy staged through pinned memory of its own (what that costs the later batches)
PAGE_LOCKS = ("default", "never")


def run_case(case: dict, shards: str, workers: int) -> dict:
    """The case, in the process of its own that it runs in (`case_in_its_own_process`)."""
    variant = case.get("page_lock", "default")
    if variant not in PAGE_LOCKS:
        raise SystemExit(f"page_lock={variant}: one of {', '.join(PAGE_LOCKS)}")
    os.environ["CLIPSCALE_PAGE_LOCK_ARENAS"] = "0" if variant == "never" else "1"
    return measure_case(case, shards, workers)


def parse_case(spec: str) -> dict:
    """`key=value,...` as a dict."""
    return dict(item.split("=", 1) for item in spec.split(","))


def measure_case(case: dict, shards: str, workers: int) -> dict:
    import torch

    batch, chunk, batches = int(case["batch"]), int(case.get("chunk", 512)), int(case.get("batches", 3))
    on_gpu = bool(int(case.get("decode", 0)))
    cfg = load_config(REPO / "configs" / "vit_b16_infcl.yaml", [
        f"model.name={case.get('model', 'ViT-B-32')}", "data.kind=webdataset", f"data.train_shards={shards}",
        f"data.workers={workers}", f"data.decoder={case['decoder']}", f"train.batch_size={batch}",
        f"data.worker_decode_share={case.get('worker_share', 0)}",
        f"train.chunk_size={chunk}", f"train.steps={batches}", "eval.zeroshot=false", "run.output_dir=/tmp/bench_loader"])
    world = World(device=torch.device("cuda", 0)) if on_gpu else World()
    if on_gpu:
        torch.cuda.set_device(world.device)
    host_threads_for(world.device)  # the training process's host threads, as train.py sets them
    started = time.perf_counter()
    towers = build_model(cfg.model)
    model_built = time.perf_counter() - started  # train.py has built it before its loader starts
    stream = TrainingBatches(cfg, plan_run(cfg, world), world, towers.train_transform, towers.tokenizer, chunk)
    built = time.perf_counter() - started
    arrived, cpu = [], []  # seconds since the start when each batch was in (decoded, with decode=1); CPU seconds then
    first_piece = None
    try:
        for _ in range(batches):
            with stream.next() as got:  # used at once: the next batch is gathered flat out
                first_piece = first_piece or time.perf_counter() - started
                if on_gpu:
                    bounds = chunk_bounds(len(got), chunk)
                    for _ in got.images.chunks(bounds, world.device, 1):
                        pass
                    got.texts.whole()
                    torch.cuda.synchronize(world.device)
                else:
                    got.arrivals.wait_for(len(got))
            arrived.append(time.perf_counter() - started)
            cpu.append(cpu_seconds())
    finally:
        stream.close()
    later = [b - a for a, b in zip(arrived, arrived[1:])]
    locking = stream.arenas.page_locking if stream.arenas is not None else None
    # Where the first batch's time went (seconds from the case's start): the model built, then the
    # data path (the workers' arenas made; their pages come as written), its first piece received (the workers started); the arenas' page-locking,
    # which runs in a thread once the first batch is used (BackgroundPageLock), took page_lock_s.
    first = {"model_built_s": model_built, "built_s": built, "first_piece_s": first_piece,
             "from_the_loaders_start_s": arrived[0] - model_built,
             "arenas_gib": stream.arenas.memory.numel() / 2**30 if stream.arenas is not None else None,
             "page_locked": locking.wait() if locking else None, "page_lock_s": locking.seconds if locking else None}
    return {"case": case, "process": os.getpid(), "first_batch_s": arrived[0], "first_batch": first, "later_batch_s": later,
            "samples_per_s": batch * len(later) / sum(later) if later else None,
            "cores_busy": (cpu[-1] - cpu[0]) / (arrived[-1] - arrived[0]) if later else None}


# Where a worker's time goes, by the functions that own it (cumulative time of each, profiled).
WORKER_PARTS = {
    "tar reading (sources.tar_samples: local shards, webdataset's for others)": ("sources.py", "tar_samples"),
    "image header (PIL open)": ("sources.py", "open_image"),
    "crop draw (RandomResizedCrop.get_params)": ("transforms.py", "draw"),
    "JPEG header (the device check)": ("decoders.py", "jpeg_frame"),
    # The worker_decode_share of the JPEGs the device takes: libjpeg-turbo decodes them (simplejpeg),
    # the worker cuts the crop's region, which the device resizes.
    "worker's JPEG decode and region (SplitTransform.jpeg_region)": ("transforms.py", "jpeg_region"),
    # The images the device does not take: PIL decodes them (its convert to RGB forces the decode),
    # then the worker cuts the crop's region.
    "worker's own decode (PIL's Image.convert)": ("Image.py", "convert"),
    "worker's crop region (SplitTransform.crop_region)": ("transforms.py", "crop_region"),
    "worker's crop and resize (SplitTransform.apply: the loader decoder's)": ("transforms.py", "apply"),
    "per-sample RNG seeding (fork_rng)": ("random.py", "fork_rng"),
    "tokenizer (the piece's captions)": ("transforms.py", "__call__"),
    "captions cut (tokenized again)": ("caption_length.py", "captions_cut"),
    "the piece's bytes and tables into tensors (EncodedImages.parts_of_samples)": ("decoders.py", "parts_of_samples"),
    # At share 1 the piece goes into the worker's arena (as train.py's workers write it): each
    # decoded region copied once, straight there.
    "the piece written into the worker's arena (WorkerArenas.carry)": ("chunks.py", "carry"),
    # Elsewhere the regions are laid end to end in memory of their own, for the loader's queue.
    "the piece's regions laid end to end (EncodedImages.of_parts)": ("decoders.py", "of_parts"),
}


def profile_worker(shards: str, pieces: int, model: str = "ViT-B-32", piece_size: int = 512, worker_share: float = 0.0) -> dict:
    """What one loader worker does for the device decoder, in this process, alone (see the module
    doc); `worker_share`: data.worker_decode_share, the share of the device's JPEGs it decodes too."""
    import open_clip
    import torch
    import webdataset as wds

    from clipscale.data.chunks import WorkerArenas, aligned
    from clipscale.data.pipeline import arena_sample_bytes
    from clipscale.data.shards import ShardStream
    from clipscale.data.transforms import CaptionTokenizer, SplitTransform

    torch.set_num_threads(1)  # as in a DataLoader worker
    _, transform, _ = open_clip.create_model_and_transforms(model)
    tokenizer = CaptionTokenizer.of(open_clip.get_tokenizer(model))  # as train.py's workers tokenize
    split = SplitTransform.split(transform)
    arenas = None
    if worker_share >= 1:  # as train.py's workers at share 1: each piece written into the worker's arena
        sample_bytes = arena_sample_bytes(*split.only_random_resized_crop().size)
        arenas = WorkerArenas(1, aligned(2 * piece_size * sample_bytes), sample_bytes)
    stream = ShardStream(wds.shardlists.expand_urls(shards), piece_size=piece_size, rank=0, world_size=1, num_workers=1,
                         seed=0, image_transform=transform, tokenizer=tokenizer, split=split,
                         keep_encoded=True, decode=False, worker_decode_share=worker_share, arenas=arenas)
    pieces_of = iter(stream)

    def next_piece() -> None:
        piece = next(pieces_of)
        if "in_arena" in piece:  # the trainer's part: done with it at once
            arenas.release(0, piece["in_arena"].stop)

    next_piece()  # the shuffle buffer fills first

    def timed(profiler=None) -> float:
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        for _ in range(pieces):
            next_piece()
        if profiler:
            profiler.disable()
        return (time.perf_counter() - started) * 1e3 / (pieces * piece_size)

    plain = timed()
    profiler = cProfile.Profile()
    profiled = timed(profiler)
    stats = pstats.Stats(profiler, stream=io.StringIO()).stats
    total = sum(tottime for _, _, tottime, _, _ in stats.values())
    parts = {}
    for name, (filename, function) in WORKER_PARTS.items():
        cumulative = [cum for (file, _, func), (_, _, _, cum, _) in stats.items() if file.endswith(filename) and func == function]
        parts[name] = round(max(cumulative, default=0.0) / total, 3)
    return {"model": model, "piece_size": piece_size, "pieces": pieces, "worker_share": worker_share, "ms_per_sample": plain,
            "ms_per_sample_profiled": profiled, "share_of_profiled_time": parts,
            "one_worker_samples_per_s": 1e3 / plain}


CASE_RESULT = "bench_loader case: "  # the line a case's process gives its result on


def case_in_its_own_process(spec: str, shards: str, workers: int) -> dict:
    """Case `spec` measured by this script in a fresh process (`--measure-case`); its output passes
    through, and a process that fails is a case with its `error` (its last lines)."""
    command = [sys.executable, __file__, "--shards", shards, "--workers", str(workers), "--out", os.devnull,
               "--measure-case", spec]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    results = [line[len(CASE_RESULT):] for line in lines if line.startswith(CASE_RESULT)]
    print("\n".join(line for line in lines if not line.startswith(CASE_RESULT)), flush=True)
    sys.stderr.write(done.stderr)
    if done.returncode or not results:
        return {"case": parse_case(spec),
                "error": f"exit code {done.returncode}: " + " | ".join(done.stderr.strip().splitlines()[-3:])}
    return json.loads(results[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="brace pattern of webdataset shards")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--case", action="append", default=[],
                        help="decoder=loader|device,batch=N[,chunk=512][,batches=3][,model=ViT-B-32][,decode=0|1]"
                             "[,worker_share=S: data.worker_decode_share][,page_lock=default|never]")
    parser.add_argument("--profile-worker", type=int, default=0, metavar="PIECES",
                        help="first profile one worker's work in this process for PIECES pieces (see above)")
    parser.add_argument("--worker-share", type=float, action="append", default=[],
                        help="profile the worker at this data.worker_decode_share (repeatable; default 0)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--measure-case", metavar="CASE", help=argparse.SUPPRESS)  # a case's own process
    args = parser.parse_args(argv)
    if args.measure_case:
        result = run_case(parse_case(args.measure_case), args.shards, args.workers)
        print(CASE_RESULT + json.dumps(result), flush=True)
        return

    record = {**provenance(argv), "shards": args.shards, "workers": args.workers, "cases": []}
    if args.profile_worker:
        profiles = [profile_worker(args.shards, args.profile_worker, worker_share=share) for share in args.worker_share or [0.0]]
        record["worker_profile"] = profiles[0] if len(profiles) == 1 else profiles
        print("worker profile", record["worker_profile"], flush=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for spec in args.case:
        result = case_in_its_own_process(spec, args.shards, args.workers)
        record["cases"].append(result)
        print(spec, {k: v for k, v in result.items() if k != "case"}, flush=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")  # after each case: a kill keeps what ran


if __name__ == "__main__":
    main()
