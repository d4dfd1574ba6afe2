"""The end-to-end trainer: a run that learns and resumes on the same curve, torchrun, Gradient
Cache and offload on the plain curve (SigLIP's logit bias included), LiT's locked tower, and shards
from the synthetic writer."""

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
from clipscale.config import load_config
from clipscale.metrics import read_metrics

from tests.helpers.tiny_runs import DIGITS_YAML, REPO, TINY_MODEL, run_train, tiny_run
from tests.helpers.trainer_harness import checkpointed_run, max_difference, training_records


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


# --- Gradient Cache, offload and LiT through the trainer ---------------------------------------


@pytest.mark.slow
def test_gradient_cache_and_offload_follow_the_plain_curve(digits_root, tmp_path, monkeypatch):
    """train.chunk_size splits each step into Gradient Cache chunks; the training is the same.
    With train.offload the batch keeps PNG bytes, decoded again in processes for the second
    pass (nothing kept on the device, so every chunk is); with a transform that cannot be split,
    the pieces hold the whole transform's floats."""
    from clipscale.data.transforms import SplitTransform
    from clipscale.trainer import train

    offload = ["train.chunk_size=24", "train.offload=true", "data.keep_on_device_gib=0"]  # pass 2 decodes every chunk again
    runs = {"plain": [], "chunked": ["train.chunk_size=24", "data.keep_on_device_gib=0"], "offload": offload,
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


SIGLIP_MODEL = TINY_MODEL[:-1] + ", init_logit_bias: -10}"


def test_siglip_trains_its_logit_bias_through_gradient_cache_as_in_one_pass(digits_root, tmp_path):
    """Gradient Cache in chunks of 16 (4 per step) against a plain step: the same curve and the
    same logit_bias, which moves from its initial -10."""
    runs = {name: checkpointed_run(digits_root, tmp_path, name, SIGLIP_MODEL, "loss.name=siglip", "train.steps=4", *extra)
            for name, extra in {"plain": [], "chunked": ["train.chunk_size=16"]}.items()}
    curves = {name: [m["loss"] for m in training_records(tmp_path / name)] for name in runs}
    assert curves["chunked"] == pytest.approx(curves["plain"], rel=1e-5)
    bias = {name: float(checkpoints[4]["state_dict"]["logit_bias"]) for name, checkpoints in runs.items()}
    assert bias["chunked"] == pytest.approx(bias["plain"], abs=1e-5)
    assert abs(bias["plain"] + 10) > 1e-4  # Adam moved it by about the learning rate per step
    assert max_difference(runs["chunked"][4]["state_dict"], runs["plain"][4]["state_dict"]) < 1e-5


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
