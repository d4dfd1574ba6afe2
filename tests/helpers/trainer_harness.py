"""What trainer tests share: shards written for the purpose, real train.py processes, and
reading a run's files (metrics.jsonl, checkpoints/step_*.pt) without the trainer's code."""

from __future__ import annotations

import io
import math
import subprocess
from pathlib import Path

import torch
import webdataset as wds
from PIL import Image

from clipscale.metrics import read_metrics

from tests.helpers.tiny_runs import DIGITS_YAML, TINY_MODEL, run_train, tiny_run
from tests.helpers.user_data import seeded_noise

PLUGIN_TRAIN = str(Path(__file__).resolve().parent / "train_with_plugins.py")
CORRUPT_JPEG = b"\xff\xd8\xff\xe0" + bytes(300)  # a JPEG header, then nothing decodable


def caption(index: int) -> str:
    return f"sample number {index}"


def write_shards(folder: Path, shards: int, per_shard: int, *, uniform: bool = False, corrupt_every: int = 0) -> str:
    """webdataset shards of 32x32 JPEGs, each with its own caption `caption(i)`; returns their
    brace pattern. uniform: each image one flat colour, so any random crop gives the same
    pixels (runs of different world sizes then see the same data). corrupt_every=k: every
    k-th sample's image is undecodable bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with wds.TarWriter(str(folder / f"part-{s:04d}.tar")) as sink:
            for j in range(per_shard):
                i = s * per_shard + j
                if uniform:
                    image = Image.new("RGB", (32, 32), ((37 * i) % 256, (91 * i + 40) % 256, (53 * i + 100) % 256))
                else:
                    image = seeded_noise((32, 32), 30 + i % 60, seed=i)
                buffer = io.BytesIO()
                image.save(buffer, "JPEG", quality=95)
                data = CORRUPT_JPEG if corrupt_every and i % corrupt_every == corrupt_every - 1 else buffer.getvalue()
                sink.write({"__key__": f"s{i:05d}", "jpg": data, "txt": caption(i).encode()})
    return str(folder / f"part-{{0000..{shards - 1:04d}}}.tar")


def shard_run(shards: str, output_dir: Path, name: str, *extra: str) -> list[str]:
    """Overrides for a tiny run on webdataset shards (no zero-shot evaluation: no labels)."""
    return [TINY_MODEL, "data.kind=webdataset", f"data.train_shards={shards}", f"run.output_dir={output_dir}",
            f"run.name={name}", "optim.lr=2e-3", "optim.warmup_steps=2", "eval.every_n_steps=0", "eval.zeroshot=false",
            *extra]


def launch(overrides: list[str], *, nproc: int = 1, timeout: float = 300,
           launcher: str = "torch.distributed.run") -> subprocess.CompletedProcess:
    """train.py with the test losses registered (train_with_plugins.py)."""
    return run_train(overrides, nproc=nproc, timeout=timeout, script=PLUGIN_TRAIN, launcher=launcher)


def checked(result: subprocess.CompletedProcess, returncode: int = 0) -> subprocess.CompletedProcess:
    assert result.returncode == returncode, f"exit status {result.returncode}, expected {returncode}:\n{result.stderr[-4000:]}"
    return result


def step_checkpoints(run_dir: Path) -> dict[int, Path]:
    """{step: path} of checkpoints/step_<n>.pt, by file name (not through latest.pt)."""
    return {int(p.stem.split("_")[1]): p for p in (run_dir / "checkpoints").glob("step_*.pt")}


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def newest_checkpoint(run_dir: Path) -> dict:
    checkpoints = step_checkpoints(run_dir)
    assert checkpoints, f"no step_*.pt in {run_dir / 'checkpoints'}"
    return load(checkpoints[max(checkpoints)])


def training_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's per-step records (those with a loss), in order; a value written as null
    with its key under "nonfinite" reads back as NaN."""
    return [{**m, **{key: math.nan for key in m.get("nonfinite", [])}}
            for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m]


def max_difference(a: dict, b: dict) -> float:
    """Largest absolute difference between two state_dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def train_in_process(digits_root: Path, output_dir: Path, name: str, *extra: str) -> tuple[object, Path]:
    """The tiny run on the digits in this process, every checkpoint kept (tests read the weights of
    each step); (what `train` returned, the run folder)."""
    from clipscale.config import load_config
    from clipscale.trainer import train

    overrides = tiny_run(digits_root, output_dir, f"run.name={name}", "eval.zeroshot=false", "data.workers=1",
                         "train.keep_checkpoints=null", *extra)
    return train(load_config(DIGITS_YAML, overrides)), output_dir / name


def checkpointed_run(digits_root: Path, output_dir: Path, name: str, *extra: str) -> dict[int, dict]:
    """train_in_process with a checkpoint after every step: {step: checkpoint}."""
    _, run_dir = train_in_process(digits_root, output_dir, name, "train.checkpoint_every=1", *extra)
    return {step: load(path) for step, path in step_checkpoints(run_dir).items()}
