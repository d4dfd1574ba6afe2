"""scripts/eval_zeroshot.py loads real (tiny) open_clip models from both checkpoint layouts
and reports what the in-process evaluation reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clipscale.config import ModelConfig
from clipscale.eval.tasks import resolve_task, run_task
from clipscale.models import build_model
from test_eval_data import picture, write_lines

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def run_script(*args) -> dict:
    subprocess.run([sys.executable, str(REPO / "scripts" / "eval_zeroshot.py"), *args], check=True, cwd=REPO, timeout=120)
    return json.loads(Path(args[args.index("--output") + 1]).read_text())


def test_script_matches_in_process_evaluation_for_both_checkpoint_layouts(tmp_path):
    for i, colour in enumerate(["red", "green", "blue", "purple", "yellow"] * 2):
        picture(tmp_path / "val" / f"{i % 5}_{colour}" / f"{i}.png", colour)  # five classes: acc5 is a number
    templates = write_lines(tmp_path / "templates.txt", ["a photo of {c}.", "a {c} thing."])

    torch.manual_seed(0)
    towers = build_model(ModelConfig(custom=TINY_CLIP))
    state = towers.model.state_dict()
    ours = tmp_path / "step_3.pt"  # clipscale layout: DDP-prefixed state_dict and the resolved config
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "step": 3, "epoch": 0,
                "config": {"model": {"name": None, "custom": TINY_CLIP, "pretrained": None, "grad_checkpointing": True}}},
               ours)  # fmt: skip
    plain = tmp_path / "open_clip.pt"  # a bare state dict, architecture given by --model
    torch.save(state, plain)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_CLIP))

    task = resolve_task("imagefolder", data=str(tmp_path / "val"), templates=templates)
    expected = run_task(task, towers.model, towers.tokenizer, towers.val_transform, "cpu", batch_size=3, workers=0, progress=False)

    common = ["--task", "imagefolder", "--data", str(tmp_path / "val"), "--templates", templates,
              "--device", "cpu", "--batch-size", "3", "--workers", "0", "--no-progress"]  # fmt: skip
    from_ours = run_script("--checkpoint", str(ours), "--output", str(tmp_path / "ours.json"), *common)
    from_plain = run_script("--checkpoint", str(plain), "--model", str(tmp_path / "tiny.json"), "--output", str(tmp_path / "plain.json"), *common)
    assert from_ours["metrics"] == expected == from_plain["metrics"]
    assert from_ours["task"] == "zeroshot_classification" and expected["num_samples"] == 10
