"""The digits as JPEG shards with damaged samples mixed in, and tiny runs on them (the device
decoder's tests, on the CPU and on the GPU)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import webdataset as wds
from PIL import Image

from clipscale.config import load_config
from clipscale.metrics import read_metrics
from clipscale.step import TrainStep
from tests.helpers.tiny_runs import DIGITS_YAML, tiny_run

DAMAGED = {7: "truncated", 40: "png", 77: "garbage", 123: "trailing"}  # sample index -> what it holds


def jpeg(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=90)
    return out.getvalue()


def write_jpeg_shards(digits_root: Path, root: Path) -> list[str]:
    """The digits' training samples as 48-px JPEGs in 3 shards under `root`, with DAMAGED's samples mixed in."""
    manifest = json.loads((digits_root / "manifest.json").read_text())
    samples = [s for url in manifest["train_shards"] for s in wds.WebDataset(str(digits_root / url), shardshuffle=False)]
    urls = [str(root / f"train-{k}.tar") for k in range(3)]
    sinks = [wds.TarWriter(url) for url in urls]
    for i, sample in enumerate(samples[:600]):
        img = Image.open(io.BytesIO(sample["png"])).convert("RGB").resize((48, 48), Image.BICUBIC)
        data = jpeg(img)
        kind = DAMAGED.get(i)
        if kind == "truncated":
            data = data[: len(data) // 2]
        elif kind == "png":
            out = io.BytesIO()
            img.save(out, format="PNG")
            data = out.getvalue()
        elif kind == "garbage":
            data = b"\xff\xd8\xff" + bytes(range(256)) * 4 + b"\xff\xd9"  # the markers of a JPEG, nothing inside
        elif kind == "trailing":
            data += b"\x00" * 16  # decodable, but not whole by the end marker: the worker judges it
        elif kind == "huffman":  # a whole JPEG by its frame header and end marker, its first Huffman table bogus
            table = data.index(b"\xff\xc4") + 5  # the table's 16 code-length counts
            data = data[:table] + b"\xff" * 16 + data[table + 16 :]
        sinks[i % 3].write({"__key__": sample["__key__"], "jpg": data, "txt": sample["txt"]})
    for sink in sinks:
        sink.close()
    return urls


def train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, name, *extra, monkeypatch=None, record=None) -> list[dict]:
    """Six steps of the tiny model on the JPEG shards, in this process; metrics.jsonl's records.
    `record` (a list) receives the images column each step gets."""
    import clipscale.trainer as trainer

    if record is not None:
        real_call = TrainStep.__call__

        def recording_call(step, images, texts, lr=None):
            record.append(images)
            return real_call(step, images, texts, lr)

        monkeypatch.setattr(TrainStep, "__call__", recording_call)
    shards = jpeg_shards[0].replace("train-0", "train-{0..2}")
    # Seed 5: the six steps' 384 samples hold the truncated and the garbage JPEGs (skipped and counted).
    # Nothing kept on the device (data.keep_on_device_gib=0): Gradient Cache's pass 2 decodes every chunk again.
    overrides = tiny_run(digits_root, tmp_path, f"run.name={name}", "eval.zeroshot=false", "train.steps=6", "run.seed=5",
                         "train.chunk_size=24", "data.keep_on_device_gib=0", "data.kind=webdataset",
                         f"data.train_shards={shards}", *extra)
    trainer.train(load_config(DIGITS_YAML, overrides))
    return read_metrics(tmp_path / name / "metrics.jsonl")


def through_window_arenas(monkeypatch, batch: int, chunk: int, workers: int) -> tuple[list, list]:
    """Runs after this take share 1's arenas as a window of about half a worker's pieces of a batch
    (`arena_window`): ([what arena_window gave each run], [the rows of each chunk pass 2 took from
    the host, `OnHost`]). Each arena's room counts a sample at about its real size (2.3 outputs'
    pixels against these 48-px crops' 1.7 or so, its tokens and table rows), so that the window
    cannot hold a batch."""
    import clipscale.data.pipeline as pipeline
    from clipscale.data.chunks import OnHost

    monkeypatch.setattr(pipeline, "REGION_LIMIT", 2.3)
    monkeypatch.setattr(pipeline, "ARENA_TOKENS_BYTES", 77 * 8 + 64)
    whole = workers * pipeline.arena_window(workers, batch, chunk, chunk, 32, 32, 0, 2**40, 2**40)[0]
    monkeypatch.setattr(pipeline, "arenas_room", lambda: 0.55 * whole)
    windows, from_host = [], []
    real_window, real_on_device = pipeline.arena_window, OnHost.on_device
    monkeypatch.setattr(pipeline, "arena_window", lambda *args: windows.append(real_window(*args)) or windows[-1])
    monkeypatch.setattr(OnHost, "on_device", lambda chunk, *args: from_host.append(len(chunk.host)) or real_on_device(chunk, *args))
    return windows, from_host

