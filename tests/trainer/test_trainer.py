"""The end-to-end trainer: config errors, digits shards, exact resumption, torchrun."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from clipscale.checkpoint import latest_checkpoint
from clipscale.checks import check_world, load_checked_config
from clipscale.config import ConfigError, load_config
from clipscale.data.digits import CAPTION_TEMPLATES, ZEROSHOT_TEMPLATES
from clipscale.data.shards import ShardStream, StreamState
from clipscale.metrics import read_metrics

from tiny_runs import DIGITS_YAML, REPO, run_train, tiny_run


# --- configuration -----------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stepz=3", "unknown key train.stepz; allowed keys in train: batch_size, chunk_size"),
        ("trian.steps=3", "unknown key trian; allowed keys in the config: run, model, data"),
        ("train.steps=many", "train.steps: got 'many', expected int"),
        ("train.precision=fp8", "train.precision: got 'fp8', expected one of 'fp32', 'bf16', 'fp16'"),
        ("loss.name=magic", "loss.name: got 'magic', expected one of"),
        ("train.batch_size=0", "train.batch_size: must be positive"),
        ("model.name=ViT-B-16", "set exactly one of model.name"),
        ("model.pretrained=/nonexistent.pt", "model.pretrained: no file at"),
        ("train.steps", "must look like section.key=value"),
    ],
)
def test_config_errors_name_the_key(override, expected):
    with pytest.raises(ConfigError, match=None) as err:
        load_checked_config(DIGITS_YAML, [override])
    assert expected in str(err.value)


def test_config_overrides_merge_with_the_file():
    cfg = load_config(DIGITS_YAML, ["train.steps=7", "loss.options.chunk_size=128", "optim.lr=1"])
    assert cfg.train.steps == 7
    assert cfg.loss.options == {"chunk_size": 128}
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.model.custom["vision_cfg"]["patch_size"] == 8  # untouched keys keep the file's values


def test_global_batch_must_split_over_the_world():
    cfg = load_config(DIGITS_YAML, ["train.batch_size=256"])
    check_world(cfg, 4)
    with pytest.raises(ConfigError, match="must split evenly over 3 processes"):
        check_world(cfg, 3)


def test_train_py_stops_before_any_work_on_a_bad_key(tmp_path):
    result = run_train([f"run.output_dir={tmp_path}", "optim.learning_rate=1"], timeout=120)
    assert result.returncode != 0
    assert "unknown key optim.learning_rate" in result.stderr
    assert not any(tmp_path.iterdir())


# --- data --------------------------------------------------------------------


def test_digits_shards_split_and_captions(digits_root):
    manifest = json.loads((digits_root / "manifest.json").read_text())
    assert manifest["num_train"] + manifest["num_val"] == 1797
    import webdataset as wds

    train = list(wds.WebDataset([str(digits_root / s) for s in manifest["train_shards"]], shardshuffle=False, empty_check=False))
    val = list(wds.WebDataset([str(digits_root / s) for s in manifest["val_shards"]], shardshuffle=False, empty_check=False))
    assert len(train) == manifest["num_train"] and len(val) == manifest["num_val"]
    assert not {s["__key__"] for s in train} & {s["__key__"] for s in val}, "validation images leaked into training"
    assert all("txt" not in s for s in val)
    captions = {s["txt"].decode() for s in train}
    assert len(captions) > 50  # varied templates, every class
    phrasing = {t.split("{")[0] for t in CAPTION_TEMPLATES}
    assert not any(t.split("{")[0] in phrasing for t in ZEROSHOT_TEMPLATES if t.split("{")[0])


def _stream(digits_root, workers, state=None):
    manifest = json.loads((digits_root / "manifest.json").read_text())
    import torchvision.transforms as T

    return ShardStream(
        [str(digits_root / s) for s in manifest["train_shards"]],
        piece_size=50, rank=0, world_size=1, num_workers=workers, seed=3,
        image_transform=T.Compose([T.RandomResizedCrop(32, scale=(0.5, 1.0)), T.ToTensor()]),
        tokenizer=lambda captions: captions, shuffle_buffer=100, state=state,
    )


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_resumes_exactly(digits_root, workers):
    """Batches after a resume equal the uninterrupted stream's, crops and worker order included."""

    def batches(state, count):
        loader = torch.utils.data.DataLoader(_stream(digits_root, workers, state), batch_size=None, num_workers=workers)
        out = []
        for batch in loader:
            out.append(batch)
            if len(out) == count:
                return out

    uninterrupted = batches(StreamState(), 40)  # 40 x 50 samples: crosses an epoch boundary
    state = StreamState()
    for batch in uninterrupted[:23]:  # odd: the resumed loader must rotate its workers
        state.update(batch)
    resumed = batches(state, 17)
    for a, b in zip(uninterrupted[23:], resumed):
        assert a["cursor"] == b["cursor"]
        assert a["texts"] == b["texts"]
        assert torch.equal(a["images"], b["images"])


# --- training ----------------------------------------------------------------


@pytest.mark.slow
def test_training_improves_and_resumes_on_the_same_curve(digits_root, tmp_path):
    """Stop a run with SIGTERM mid-way, rerun the same command: every later step's
    loss equals that of a run that was never interrupted."""
    steps = "train.steps=20"
    reference = run_train(tiny_run(digits_root, tmp_path / "a", steps, "train.checkpoint_every=100"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    curve = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "a" / "tiny" / "metrics.jsonl") if "loss" in m}
    assert len(curve) == 20
    assert curve[20] < curve[1] - 0.3, curve

    overrides = tiny_run(digits_root, tmp_path / "b", steps, "train.checkpoint_every=100")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", DIGITS_YAML, *overrides], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "b" / "tiny" / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be interrupted"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    stopped_at = max(m["step"] for m in read_metrics(metrics))
    assert stopped_at < 20

    resumed = run_train(overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_curve = {m["step"]: m["loss"] for m in read_metrics(metrics) if "loss" in m}
    assert sorted(resumed_curve) == list(range(1, 21))
    for step in range(stopped_at + 1, 21):
        assert resumed_curve[step] == pytest.approx(curve[step], rel=1e-6, abs=1e-6), step
    evaluation = json.loads((tmp_path / "b" / "tiny" / "eval" / "step_00000020.json").read_text())
    assert 0.0 <= evaluation["zeroshot_acc1"] <= 1.0

    # The standalone script on the final checkpoint agrees with the in-training hook.
    manifest = json.loads((digits_root / "manifest.json").read_text())
    script = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "eval_zeroshot.py"),
         "--checkpoint", str(tmp_path / "b" / "tiny" / "checkpoints" / "latest.pt"), "--task", "wds",
         "--data", str(digits_root / f"val-{{0000..{len(manifest['val_shards']) - 1:04d}}}.tar"),
         "--classnames", str(digits_root / "classnames.txt"), "--templates", str(digits_root / "templates.txt"),
         "--device", "cpu", "--workers", "0", "--no-progress", "--output", str(tmp_path / "script.json")],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert script.returncode == 0, script.stderr[-3000:]
    script_metrics = json.loads((tmp_path / "script.json").read_text())["metrics"]
    assert script_metrics["acc1"] == pytest.approx(evaluation["zeroshot_acc1"], abs=1e-9)
    assert script_metrics["acc5"] == pytest.approx(evaluation["zeroshot_acc5"], abs=1e-9)


@pytest.mark.slow
def test_torchrun_two_processes(digits_root, tmp_path):
    result = run_train(tiny_run(digits_root, tmp_path, "train.steps=12", "data.workers=1"), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "tiny"
    losses = [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 12 and losses[-1] < losses[0]
    ckpt = torch.load(latest_checkpoint(run_dir / "checkpoints"), weights_only=True)
    assert ckpt["step"] == 12 and len(ckpt["data"]) == 2  # both ranks' data cursors
    assert (run_dir / "eval" / "step_00000012.json").exists()


# --- non-finite steps --------------------------------------------------------

from clipscale.losses import build_loss, register_loss  # noqa: E402

NAN_LOSSES: list = []  # every NanOnCalls the trainer built, to read what it saw


@register_loss("nan_on_calls")
class NanOnCalls(torch.nn.Module):
    """vanilla, except that the listed calls get NaN features; records the scale it saw."""

    def __init__(self, calls=()):
        super().__init__()
        self.calls, self.count, self.scales = set(calls), 0, []
        self.inner = build_loss("vanilla")
        NAN_LOSSES.append(self)

    def forward(self, image, text, logit_scale):
        self.count += 1
        self.scales.append(float(logit_scale.detach()))
        if self.count in self.calls:
            image = image * math.nan
        return self.inner(image, text, logit_scale)


def _train_in_process(digits_root, tmp_path, *extra):
    from clipscale.trainer import train

    overrides = tiny_run(digits_root, tmp_path, "data.workers=0", "eval.zeroshot=false", "loss.name=nan_on_calls", *extra)
    return train(load_config(DIGITS_YAML, overrides))


def test_nonfinite_steps_are_skipped_without_touching_weights(digits_root, tmp_path):
    _train_in_process(digits_root, tmp_path, "loss.options={calls: [3, 4]}", "train.steps=6")
    scales = NAN_LOSSES[-1].scales
    assert scales[2] == scales[3] == scales[4], scales  # steps 3 and 4 skipped: the weights did not move
    assert scales[1] != scales[2] and scales[4] != scales[5]  # the others stepped
    metrics = read_metrics(tmp_path / "tiny" / "metrics.jsonl")
    assert [m["nonfinite_steps"] for m in metrics] == [0, 0, 1, 2, 2, 2]
    assert metrics[2]["loss"] is None and "loss" in metrics[2]["nonfinite"]  # strict JSON: null and a flag
    assert math.isfinite(metrics[5]["loss"])


def test_a_run_that_keeps_failing_stops_with_a_clear_message(digits_root, tmp_path):
    with pytest.raises(RuntimeError, match="3 steps in a row had a non-finite loss"):
        _train_in_process(digits_root, tmp_path, f"loss.options={{calls: {list(range(1, 7))}}}", "train.steps=6",
                          "train.max_nonfinite_steps=2")


def test_wandb_logs_offline_without_a_key(digits_root, tmp_path, monkeypatch):
    from clipscale.trainer import train

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from a `wandb login`
    overrides = tiny_run(digits_root, tmp_path, "data.workers=0", "eval.zeroshot=false", "train.steps=2", "wandb.enabled=true")
    train(load_config(DIGITS_YAML, overrides))
    runs = list((tmp_path / "tiny" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


@pytest.mark.slow
def test_gradient_cache_and_offload_follow_the_plain_curve(digits_root, tmp_path, monkeypatch):
    """train.chunk_size splits each step into Gradient Cache chunks; the training is the same.
    With train.offload the batch keeps PNG bytes, decoded again in processes for the second
    pass; with a transform that cannot be split, the pieces hold the whole transform's floats."""
    from clipscale.data.transforms import SplitTransform
    from clipscale.trainer import train

    offload = ["train.chunk_size=24", "train.offload=true"]
    runs = {"plain": [], "chunked": ["train.chunk_size=24"], "offload": offload,
            "offload_worker": [*offload, "data.workers=1"], "float_pieces": ["train.chunk_size=24"]}
    curves = {}
    for name, extra in runs.items():
        if name == "float_pieces":
            monkeypatch.setattr(SplitTransform, "split", classmethod(lambda cls, transform: None))
        overrides = tiny_run(digits_root, tmp_path, f"run.name={name}", "data.workers=0", "eval.zeroshot=false", "train.steps=5", *extra)
        train(load_config(DIGITS_YAML, overrides))
        curves[name] = [m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl")]
    for name in runs:
        assert curves[name] == pytest.approx(curves["plain"], rel=1e-5, abs=1e-5), name


def test_lit_keeps_the_locked_tower_in_eval_mode(digits_root, tmp_path, monkeypatch):
    """A fully locked image tower is a fixed feature extractor: eval mode at every step,
    also after an evaluation put the model back to training."""
    import clipscale.trainer as trainer

    from clipscale.step import TrainStep

    modes = []
    real_call = TrainStep.__call__

    def recording_call(step, images, texts, lr=None):
        modes.append((step.model.module.visual.training, step.model.module.transformer.training))
        return real_call(step, images, texts, lr)

    monkeypatch.setattr(TrainStep, "__call__", recording_call)
    overrides = tiny_run(digits_root, tmp_path, "data.workers=0", "train.steps=4", "eval.every_n_steps=2", "model.lock_image=true")
    trainer.train(load_config(DIGITS_YAML, overrides))
    assert modes == [(False, True)] * 4


def test_trains_on_webdataset_shards_from_the_synthetic_writer(tmp_path):
    """data.kind=webdataset with a brace pattern, on shards written by scripts/make_synthetic_shards.py."""
    from clipscale.trainer import train

    sys.path.insert(0, str(REPO / "scripts"))
    import make_synthetic_shards

    make_synthetic_shards.main(["--out", str(tmp_path / "shards"), "--shards", "2", "--per-shard", "24", "--size", "32"])
    overrides = tiny_run(tmp_path, tmp_path, "data.kind=webdataset", f"data.train_shards={tmp_path}/shards/synthetic-{{0000..0001}}.tar",
                         "data.workers=0", "eval.zeroshot=false", "train.batch_size=16", "train.steps=4")
    train(load_config(DIGITS_YAML, overrides))
    metrics = read_metrics(tmp_path / "tiny" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all(math.isfinite(m["loss"]) for m in metrics)
