"""What slows a training step while the next batch is prepared: the towers' step (its ceiling) alone,
then beside each part of the data path running in the same process, one part at a time.

The step is the trainer's own `TrainStep` (compiled towers, Gradient Cache, the loss, fused AdamW)
on one chunk of random pixels handed out for every image chunk and the shards' own captions, given
as the trainer gives them (`text_order`: length-sorted chunks from the host's tokens) or already
on the device. Beside it, as `train.py` runs them:

  data path   the run's own `TrainingBatches` (loader workers, the gathering thread, the GPU
              decoder's process) built from the same configuration, each batch's image chunks
              asked for by a thread and dropped: the next batch being prepared, all the time;
  decoder     the run's decoder alone, decoding a batch of the shards' JPEGs again and again;
  decoder_alone  the same with no step beside it (12 s): the decoder's own rate (run it before
              data_path: its first chunks compile the crop's programs);
  python      a thread running pure Python (a reference for what any GIL holder costs; not in the
              default cases: on an H100 its steps did not end within minutes, each of the step's
              calls waiting for the interpreter lock the loop holds);
  workers_elsewhere  the same loader workers (data.worker_decode_share as set) feeding another
              process (scripts/bench_loader.py, nothing decoded on the GPU): their load on the
              host's cores, caches and memory without a thread in this process, so that
              data_path's cost splits into what the workers' load costs and what the trainer's own
              data threads cost.

Each case reports the step's median seconds and its ratio to the step alone, how many images a
second the load delivered beside it (`data_path_images_per_s`: whole batches) and the decoder's
threads' time per image (`decoded`: in all, and inside the JPEG decode call alone); with --pyspy, py-spy
samples which threads hold the GIL during the data-path case (collapsed stacks, one file a case).

    python scripts/bench_contention.py --shards '/tmp/shards-web/synthetic-{0000..0127}.tar' \\
        --model ViT-B-32 --batch 16384 --steps 4 --workers 14 --pyspy --out /tmp/contention.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import open_clip
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_e2e import CONFIG, RepeatedChunk, config_overrides, shard_captions  # noqa: E402

from clipscale.caption_length import text_lengths_for_run  # noqa: E402
from clipscale.checks import plan_run  # noqa: E402
from clipscale.compile import CompilePolicy, compile_enabled  # noqa: E402
from clipscale.config import load_config  # noqa: E402
from clipscale.data.chunks import chunk_bounds  # noqa: E402
from clipscale.data.pipeline import TrainingBatches  # noqa: E402
from clipscale.distributed import World, host_threads_for  # noqa: E402
from clipscale.losses import build_loss  # noqa: E402
from clipscale.models import build_model  # noqa: E402
from clipscale.optim import build_optimizer  # noqa: E402
from clipscale.provenance import provenance  # noqa: E402
from clipscale.step import TrainStep  # noqa: E402
from clipscale.utilization import train_flops_by_text_length  # noqa: E402


class Background:
    """A load run in a daemon thread until `stop`."""

    def __init__(self, name: str, work):
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(work,), name=f"bench-{name}", daemon=True)
        self.rounds = 0

    def _loop(self, work) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        while not self.stopping.is_set():
            work(self.stopping)
            self.rounds += 1

    def start(self) -> "Background":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=60)


def prepare_batches(batches: TrainingBatches, chunk: int, device: torch.device):
    """One batch of the data path, its image chunks asked for (decoded) and dropped."""

    def work(stopping: threading.Event) -> None:
        with batches.next() as batch:
            bounds = chunk_bounds(len(batch), chunk)
            for _ in batch.images.chunks(bounds, device, 1):
                if stopping.is_set():
                    break
            batch.texts.whole()
            synchronize(device)

    return work


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_only(batches: TrainingBatches, chunk: int, device: torch.device):
    """One batch of the data path, held (its bytes stay with the run's decoder), its chunks decoded
    again and again."""
    batch = batches.next()  # never left: the benchmark ends with it
    size = len(batch)
    batch.arrivals.wait_for(size)
    rows = batch.images.rows

    def work(stopping: threading.Event) -> None:
        pending = [rows.prepare(s, min(s + chunk, size), 2) for s in range(0, size, chunk)]
        for chunk_on_its_way in pending:
            chunk_on_its_way.on_device(device, None)
        synchronize(device)

    return work


class JpegCallTimer:
    """The time the decoder's threads spend inside the JPEG decode call itself (nvJPEG, the GIL
    released), apart from the rest of a chunk's decoding (the crop's launches, waits for the GIL)."""

    def __init__(self):
        from clipscale.data import decoders

        self.seconds, self.images, self.lock, self.inner = 0.0, 0, threading.Lock(), decoders.decode_jpegs

        def timed(blobs, device):
            started = time.perf_counter()
            decoded = self.inner(blobs, device)
            with self.lock:
                self.seconds += time.perf_counter() - started
                self.images += len(blobs)
            return decoded

        decoders.decode_jpegs = timed

    def totals(self) -> tuple[float, int]:
        with self.lock:
            return self.seconds, self.images


class LoaderElsewhere:
    """scripts/bench_loader.py in a process of its own, its workers reading and decoding the shards
    flat out until `stop` (its batches dropped), started a while before the timed steps."""

    def __init__(self, shards: str, workers: int, batch: int, worker_share):
        case = f"decoder=device,batch={batch},batches=1000000,worker_share={worker_share}"
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("bench_loader.py")), "--shards", shards,
                                         "--workers", str(workers), "--case", case, "--out", os.devnull],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.rounds = None

    def start(self) -> "LoaderElsewhere":
        time.sleep(20)  # its workers started and reading (the 2 s every load gets follow)
        if self.process.poll() is not None:
            raise SystemExit(f"bench_loader.py ended early (exit status {self.process.returncode})")
        return self

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)  # its workers with it
        self.process.wait()


def pure_python(stopping: threading.Event) -> None:
    total = 0
    for k in range(200_000):
        total += k * k


def gil_profile(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    """py-spy sampling the threads that hold the GIL, for `seconds`, into `out` (collapsed stacks)."""
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy not found: no GIL profile", flush=True)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--gil", "--threads", "--rate", "200", "--nonblocking",
                             "--duration", str(int(seconds)), "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def gil_shares(path: Path) -> dict[str, float]:
    """Share of the GIL samples each thread held, from py-spy's collapsed stacks ("thread (0x..);frames count")."""
    counts: dict[str, int] = {}
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread = stack.split(";", 1)[0]
        counts[thread] = counts.get(thread, 0) + int(count)
    total = sum(counts.values()) or 1
    return {thread: round(n / total, 4) for thread, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True)
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="steps a case; the first of each is dropped")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--cases", default="alone,tokens_on_device,workers_elsewhere,data_path,decoder,data_path_switch")
    parser.add_argument("--pyspy", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    work_dir = Path(tempfile.mkdtemp(prefix="bench_contention_"))
    case = {"model": args.model, "batch": args.batch, "chunk": args.chunk, "steps": 1000}
    cfg = load_config(str(CONFIG), config_overrides(case, args.shards, args.workers, work_dir, args.set))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = World(device=device)
    host_threads_for(device)  # the training process's host threads, as train.py sets them
    plan = plan_run(cfg, world)

    towers = build_model(cfg.model, compiled=compile_enabled(cfg.model.compile, device), gpu=device.type == "cuda")
    text_order, notes = text_lengths_for_run(towers.model, cfg.model.cut_text_padding, cfg.model.causal_text_attention)
    model = towers.model.to(device).train()
    # The towers' FLOPs a sample, as train.py hands them to the data path: its worker_decode_share=auto reads them.
    flops_per_sample = min(train_flops_by_text_length(model, plan.image_size, text_order, device).values())
    policy = CompilePolicy.of(cfg.model, device, cfg.train.parallel, chunks=-(-args.batch // args.chunk))  # as train.py's
    policy.apply(model, work_dir / "compile_cache")
    step = TrainStep(model, build_loss(cfg.loss.name, **cfg.loss.options), build_optimizer(model, cfg.optim, fused=device.type == "cuda"),
                     chunk_size=args.chunk, precision=cfg.train.precision, grad_clip=cfg.optim.grad_clip, text_order=text_order,
                     cuda_graphs=policy.cuda_graphs)
    captions = shard_captions(args.shards, set(cfg.data.caption_key.split(";")), args.batch)
    tokens = towers.tokenizer(captions).repeat(-(-args.batch // len(captions)), 1)[: args.batch]
    host_tokens = tokens.pin_memory() if device.type == "cuda" else tokens
    size = open_clip.get_model_preprocess_cfg(model)["size"]
    size = (size, size) if isinstance(size, int) else tuple(size)
    images = RepeatedChunk(torch.randn(args.chunk, 3, *size, device=device), args.batch)
    batches = TrainingBatches(cfg, plan, world, towers.train_transform, towers.tokenizer, args.chunk, flops_per_sample)
    jpeg_calls = JpegCallTimer()

    def run_steps(texts) -> list[float]:
        times = []
        for _ in range(args.steps):
            synchronize(device)
            started = time.perf_counter()
            float(step(images, texts, cfg.optim.lr).loss)
            times.append(time.perf_counter() - started)
        return times

    record = {**provenance(argv), "cuda_graphs": policy.cuda_graphs, "model": args.model, "batch": args.batch, "chunk": args.chunk, "workers": args.workers,
              "decoder": batches.path.describe(), "notes": notes, "cases": []}
    print("warming up (compiling)", flush=True)
    started = time.perf_counter()
    run_steps(host_tokens)
    record["first_steps_s"] = time.perf_counter() - started
    baseline = None
    held_batch_decoded = functools.cache(lambda: decode_only(batches, args.chunk, device))  # one batch held for both cases
    for name in args.cases.split(","):
        texts = tokens.to(device) if name == "tokens_on_device" else host_tokens
        background = {"data_path": lambda: prepare_batches(batches, args.chunk, device),
                      "data_path_switch": lambda: prepare_batches(batches, args.chunk, device),
                      "decoder": held_batch_decoded,
                      "decoder_alone": held_batch_decoded,
                      "python": lambda: pure_python}.get(name)
        switch = sys.getswitchinterval()
        if name.endswith("_switch"):
            sys.setswitchinterval(0.0002)
        if name == "workers_elsewhere":
            load = LoaderElsewhere(args.shards, args.workers, args.batch, cfg.data.worker_decode_share).start()
        else:
            load = Background(name, background()).start() if background else None
        decoder = batches.decoder
        decoded_before = (decoder.images_decoded, decoder.decode_s, *jpeg_calls.totals()) if decoder is not None else None
        if load is not None:
            time.sleep(2)  # the load running before the first timed step
        spy = None
        if args.pyspy and load is not None:
            spy = gil_profile(os.getpid(), 10, out.with_name(f"{out.stem}_gil_{name}.txt"))
        times = run_steps(texts) if name != "decoder_alone" else [time.sleep(5) or 5.0 for _ in range(2)]
        if spy is not None:
            spy.wait(timeout=60)
        rounds = load.rounds if load else None  # rounds done while the steps ran (stopping ends one early)
        if load is not None:
            load.stop()
        sys.setswitchinterval(switch)
        if decoded_before is not None:  # what the decoder's threads did meanwhile, the 2 s before the steps included
            count, seconds = decoder.images_decoded - decoded_before[0], decoder.decode_s - decoded_before[1]
            call_s, call_images = (now - before for now, before in zip(jpeg_calls.totals(), decoded_before[2:]))
            decoded = {"images": count, "thread_s": seconds, "ms_per_image_in_a_thread": 1e3 * seconds / count if count else None,
                       "ms_per_image_in_the_jpeg_call": 1e3 * call_s / call_images if call_images else None}
        median = statistics.median(times[1:])
        baseline = baseline or median
        result = {"case": name, "step_s": times, "median_step_s": median, "over_alone": median / baseline,
                  "samples_per_s": args.batch / median, "background_rounds": rounds,
                  "data_path_images_per_s": rounds * args.batch / (2 + sum(times)) if rounds is not None else None,
                  "decoded": decoded if decoded_before is not None else None}
        if spy is not None:
            result["gil_shares"] = gil_shares(out.with_name(f"{out.stem}_gil_{name}.txt"))
        record["cases"].append(result)
        print(json.dumps(result), flush=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
    batches.close()


if __name__ == "__main__":
    main()
