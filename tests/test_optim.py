"""open_clip_train's knobs under our config's names: the lr schedules, locking the text tower,
the force_* overrides of a named model, TensorBoard beside metrics.jsonl, a run length in samples
or epochs, and CoCa refused. Expected values are open_clip's formulas written out here, not ours
called back."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from clipscale.checks import load_checked_config
from clipscale.config import ConfigError, ModelConfig, OptimConfig, load_config
from clipscale.gradcache import GradCache, trainable_towers
from clipscale.losses import build_loss
from clipscale.metrics import TENSORBOARD, read_metrics
from clipscale.models import build_model
from clipscale.optim import build_optimizer, learning_rate

from tiny_runs import DIGITS_YAML, run_train, tiny_run

pytestmark = pytest.mark.timeout(240)
os.environ["HF_HUB_OFFLINE"] = "1"

VIT = {  # a small open_clip ViT on both sides
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2.0},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}

# --- lr schedules (open_clip_train/scheduler.py) -------------------------------------------

BASE, WARMUP, TOTAL = 1e-3, 10, 100


def open_clip_warmup(step):
    return BASE * (step + 1) / WARMUP


@pytest.mark.parametrize("step", [0, 4, 9, 10, 37, 55, 99])
def test_cosine_schedule(step):
    expected = open_clip_warmup(step) if step < WARMUP else \
        0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (TOTAL - WARMUP))) * BASE
    cfg = OptimConfig(lr=BASE, warmup_steps=WARMUP)
    assert learning_rate(step, cfg, TOTAL) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("step", [0, 9, 10, 50, 99])
def test_const_schedule(step):
    expected = open_clip_warmup(step) if step < WARMUP else BASE
    cfg = OptimConfig(lr=BASE, warmup_steps=WARMUP, lr_scheduler="const")
    assert learning_rate(step, cfg, TOTAL) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("power, end", [(1.0, 0.0), (2.0, 1e-5), (0.5, 2e-4)])
@pytest.mark.parametrize("step", [0, 9, 10, 69, 70, 71, 85, 99])
def test_const_cooldown_schedule(step, power, end):
    cooldown = 30
    start = TOTAL - cooldown  # 70: the first step of the cooldown
    if step < WARMUP:
        expected = open_clip_warmup(step)
    elif step < start:
        expected = BASE
    else:
        expected = (1 - (step - start) / cooldown) ** power * (BASE - end) + end
    cfg = OptimConfig(lr=BASE, warmup_steps=WARMUP, lr_scheduler="const-cooldown", lr_cooldown_steps=cooldown,
                      lr_cooldown_power=power, lr_cooldown_end=end)
    assert learning_rate(step, cfg, TOTAL) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr_scheduler=const-cooldown"], "optim.lr_cooldown_steps: required with optim.lr_scheduler=const-cooldown"),
    (["optim.lr_scheduler=const-cooldown", "optim.lr_cooldown_steps=201"], "optim.lr_cooldown_steps: must be in 1..200"),
    (["optim.lr_cooldown_steps=10"], "optim.lr_cooldown_steps: only for optim.lr_scheduler=const-cooldown, not cosine"),
    (["optim.lr_scheduler=linear"], "optim.lr_scheduler: got 'linear', expected one of 'cosine', 'const', 'const-cooldown'"),
    (["optim.lr_scheduler=const-cooldown", "optim.lr_cooldown_steps=10", "optim.lr_cooldown_end=1"],
     "optim.lr_cooldown_end: must be in [0, optim.lr=0.002]"),
])
def test_schedule_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(".", r"\.")):
        load_config(DIGITS_YAML, overrides)


# --- run length in samples or epochs ---------------------------------------------------------

def test_run_length_in_samples_and_epochs():
    assert load_config(DIGITS_YAML, ["train.steps=null", "train.samples=1000"]).train.steps == 4  # ceil(1000 / 256)
    epochs = ["train.batch_size=300", "train.epochs=3", "train.num_samples_per_epoch=1000"]
    cfg = load_config(DIGITS_YAML, ["train.steps=null", *epochs])
    assert cfg.train.steps == 12  # open_clip_train's: 3 epochs of ceil(1000 / 300) batches, not ceil(3000 / 300)
    # The configuration written into the run folder (steps resolved) loads again as the same run.
    again = load_config(DIGITS_YAML, ["train.steps=12", *epochs])
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("overrides, message", [
    (["train.samples=1000"], "train.steps=200 and train.samples=1000 (4 steps of train.batch_size=256) give two run lengths"),
    (["train.steps=null", "train.epochs=2"], "train.epochs and train.num_samples_per_epoch go together"),
    (["train.steps=null", "train.samples=10", "train.epochs=2", "train.num_samples_per_epoch=5"],
     "train.samples and train.epochs both give the run length"),
    (["train.steps=null"], "train.steps: null needs the run length as train.samples or train.epochs"),
    (["train.steps=null", "train.samples=0"], "train.samples: must be positive"),
])
def test_run_length_errors(overrides, message):
    with pytest.raises(ConfigError) as raised:
        load_config(DIGITS_YAML, overrides)
    assert message in str(raised.value)


# --- locking the text tower (open_clip's lock_text_tower) ----------------------------------

def text_encodings(model) -> list[int]:
    """Counts the text tower's forward calls (open_clip's CLIP keeps its text transformer as `transformer`)."""
    calls = []
    model.transformer.register_forward_hook(lambda *_: calls.append(1))
    return calls


def training_steps(towers, steps=3, chunk_size=3):
    model = towers.model.train()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    step = GradCache(model, build_loss("vanilla"), chunk_size=chunk_size)
    images = torch.randn(8, 3, 32, 32)
    texts = torch.randint(1, 49407, (8, 16))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step(images, texts)
        optimizer.step()
    return optimizer


def test_locked_text_tower_has_no_gradients_no_optimizer_state_and_is_not_reencoded():
    towers = build_model(ModelConfig(custom=VIT, lock_text=True))
    model = towers.model
    text_names = {name for name, _ in model.named_parameters() if not name.startswith(("visual.", "logit_"))}
    assert {name for name, p in model.named_parameters() if not p.requires_grad} == text_names
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert trainable_towers(model) == (True, False)
    calls = text_encodings(model)
    optimizer = training_steps(towers, steps=3, chunk_size=3)
    # Gradient Cache: 3 chunks of 8 samples encoded once each per step, none again in its second pass.
    assert len(calls) == 3 * 3
    stateful = {id(p) for p in optimizer.state}
    for name, p in model.named_parameters():
        locked = name in text_names
        assert (p.grad is None) == locked, name
        assert (id(p) in stateful) != locked, name
        assert torch.equal(p, before[name]) == locked, name


def test_unlocked_text_tower_is_reencoded():
    """The counter above can fail: the same steps with the tower trainable encode it twice."""
    towers = build_model(ModelConfig(custom=VIT))
    calls = text_encodings(towers.model)
    training_steps(towers, steps=1, chunk_size=3)
    assert len(calls) == 3 + 2  # pass 2 re-encodes all but the last chunk, whose pass-1 graph it keeps


def test_lock_text_unlocked_layers():
    towers = build_model(ModelConfig(custom=VIT, lock_text=True, lock_text_unlocked_layers=2))
    trainable = {name for name, p in towers.model.named_parameters() if p.requires_grad and not name.startswith(("visual.", "logit_"))}
    # open_clip's text groups: [embeddings], block 0, [last block, ln_final], [text_projection]
    assert trainable == {"text_projection", "ln_final.weight", "ln_final.bias"} | {
        name for name, _ in towers.model.named_parameters() if name.startswith("transformer.resblocks.1.")
    }


def test_lock_text_config_errors():
    with pytest.raises(ConfigError, match="need model.lock_text: true"):
        load_config(DIGITS_YAML, ["model.lock_text_unlocked_layers=1"])
    with pytest.raises(ConfigError, match="model.lock_text_freeze_layer_norm: false needs a Hugging Face text tower"):
        load_checked_config(DIGITS_YAML, ["model.lock_text=true", "model.lock_text_freeze_layer_norm=false"])


# --- force_* on a named model ---------------------------------------------------------------

def test_patch_dropout_on_a_named_model():
    towers = build_model(ModelConfig(name="ViT-S-32", force_patch_dropout=0.5))
    visual = towers.model.visual
    tokens = []
    visual.transformer.register_forward_hook(lambda module, args, out: tokens.append(args[0].shape[1]))
    images = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        visual.train()(images)
        visual.eval()(images)
    # 49 patches and the class token; in training half the patches are dropped, the class token kept
    assert tokens == [1 + 24, 1 + 49]
    # The configuration written into the run folder is the one the model was built from.
    assert towers.open_clip_config["model_cfg"]["vision_cfg"]["patch_dropout"] == 0.5


def test_other_force_overrides_on_a_named_model():
    towers = build_model(ModelConfig(name="ViT-S-32", force_quick_gelu=True, force_image_size=64, force_context_length=20))
    model_cfg = towers.open_clip_config["model_cfg"]
    assert model_cfg["quick_gelu"] and model_cfg["vision_cfg"]["image_size"] == 64
    assert type(towers.model.visual.transformer.resblocks[0].mlp.gelu).__name__ == "QuickGELU"
    assert towers.model.visual(torch.randn(1, 3, 64, 64)).shape == (1, 384)
    assert towers.tokenizer(["a photo"]).shape == (1, 20)
    assert towers.model.positional_embedding.shape[0] == 20


def test_forced_image_size_reaches_a_timm_trunk():
    timm_vit = {**VIT, "vision_cfg": {"timm_model_name": "vit_tiny_patch16_224", "timm_pool": "token", "timm_proj": "linear"}}
    towers = build_model(ModelConfig(custom=timm_vit, force_image_size=64))
    assert towers.model.visual.trunk.patch_embed.img_size == (64, 64)
    assert towers.model.visual(torch.randn(1, 3, 64, 64)).shape == (1, 16)


def test_patch_dropout_on_timm_towers():
    """timm's ViTs take it (as patch_drop_rate); a timm convnet is refused before it is built."""
    timm_vit = {**VIT, "vision_cfg": {"timm_model_name": "vit_tiny_patch16_224", "image_size": 32}}
    load_checked_config(DIGITS_YAML, [f"model.custom={json.dumps(timm_vit)}", "model.force_patch_dropout=0.5"])
    timm_resnet = {**VIT, "vision_cfg": {"timm_model_name": "resnet18", "image_size": 32}}
    with pytest.raises(ConfigError, match="model.force_patch_dropout: the timm image tower resnet18 has no patch dropout"):
        load_checked_config(DIGITS_YAML, [f"model.custom={json.dumps(timm_resnet)}", "model.force_patch_dropout=0.5"])


# --- CoCa and unknown keys of model.custom ---------------------------------------------------

def test_coca_is_refused():
    with pytest.raises(ConfigError, match="model.name=coca_ViT-B-32: a CoCa model .* captioning loss is not supported"):
        load_checked_config(DIGITS_YAML, ["model.custom=null", "model.name=coca_ViT-B-32"])


@pytest.mark.parametrize("key, where", [
    ("vision_cfg.patch_sise", "model.custom.vision_cfg"),
    ("text_cfg.widht", "model.custom.text_cfg"),
    ("embed_dimension", "model.custom"),
])
def test_unknown_custom_key_named(key, where):
    with pytest.raises(ConfigError) as raised:
        load_checked_config(DIGITS_YAML, [f"model.custom.{key}=3"])
    name = key.split(".")[-1]
    assert str(raised.value).startswith(f"unknown key {where}.{name}; allowed keys in {where}: ")
    assert "embed_dim" in str(raised.value) if where == "model.custom" else "width" in str(raised.value)


# --- one real run: const-cooldown, a run length in samples, TensorBoard ----------------------

@pytest.fixture(scope="module")
def knob_run(digits_root, module_tmp):
    output = module_tmp("knobs")
    result = run_train(tiny_run(digits_root, output, "train.steps=null", "train.samples=384", "train.checkpoint_every=100",
                                "optim.lr_scheduler=const-cooldown", "optim.lr_cooldown_steps=3",
                                "optim.lr_cooldown_end=1e-4", "tensorboard.enabled=true", "eval.zeroshot=false"))
    assert result.returncode == 0, result.stderr[-3000:]
    return output / "tiny"


@pytest.mark.slow
def test_run_follows_the_schedule_for_its_samples(knob_run):
    records = [r for r in read_metrics(knob_run / "metrics.jsonl") if "lr" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # 384 samples at 64 a step
    # warmup 5 steps to 2e-3, then the cooldown over the last 3 steps (3, 4, 5, 0-based) down to 1e-4
    expected = [2e-3 * 1 / 5, 2e-3 * 2 / 5, 2e-3 * 3 / 5, 2e-3 * 4 / 5, 2e-3 * 5 / 5,
                (1 - 2 / 3) * (2e-3 - 1e-4) + 1e-4]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_tensorboard_event_files_hold_the_logged_scalars(knob_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(knob_run / TENSORBOARD))
    events.Reload()
    records = [r for r in read_metrics(knob_run / "metrics.jsonl") if "loss" in r]
    for key in ("loss", "lr", "grad_norm", "logit_scale"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [r["step"] for r in records], key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in records], rel=1e-6), key


def test_tensorboard_resume_drops_the_events_past_the_checkpoint(tmp_path):
    """As metrics.jsonl: a run resumed from step 3 rewrites steps 4 and 5, and TensorBoard shows one curve."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from clipscale.metrics import MetricsLogger

    cfg = load_config(DIGITS_YAML, ["tensorboard.enabled=true"])
    first = MetricsLogger(tmp_path, cfg, enabled=True)
    for step in range(1, 6):
        first.log(step, {"loss": float(step), "note": "not a number"})
    first.close()
    resumed = MetricsLogger(tmp_path, cfg, enabled=True, resume_step=3)
    for step in (4, 5):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / TENSORBOARD))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert events.Tags()["scalars"] == ["loss"]
