"""Towers from config: open_clip, timm and Hugging Face towers, local weights, LiT, locking the
text tower, the force_* overrides of a named model, CoCa and unknown keys refused, and checkpoints
that open_clip loads (and open_clip checkpoints that we start from).

Everything is tiny and local: a timm test network, a two-layer BERT with its tokenizer
saved to a temporary folder, a small open_clip ViT. Nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import os

import open_clip
import pytest
import torch

from open_clip.tokenizer import HFTokenizer

from clipscale.checks import load_checked_config
from clipscale.checkpoint import latest_checkpoint
from clipscale.config import ConfigError, ModelConfig, OptimConfig, load_config
from clipscale.data.digits import CLASSNAMES
from clipscale.gradcache import GradCache, trainable_towers
from clipscale.losses import build_loss
from clipscale.models import OPEN_CLIP_WEIGHTS, WeightsError, build_model
from clipscale.optim import build_optimizer

from tests.helpers.tiny_runs import DIGITS_YAML, REPO, TINY_MODEL, tiny_run
from tests.helpers.towers import timm_hf_config

pytestmark = pytest.mark.timeout(180)
os.environ["HF_HUB_OFFLINE"] = "1"  # a hub lookup would fail the test rather than download

VIT = {  # a small open_clip ViT on both sides
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 3, "head_width": 16, "mlp_ratio": 2.0},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def features(model, images, texts):
    model.eval()
    with torch.no_grad():
        out = model(images, texts)
    return out["image_features"], out["text_features"]


def sample_inputs(towers, batch=4):
    torch.manual_seed(1)
    return torch.randn(batch, 3, 32, 32), towers.tokenizer([f"a photo of the digit {CLASSNAMES[i]}" for i in range(batch)])


# --- towers ----------------------------------------------------------------------------


def test_open_clip_vit_from_a_custom_dict():
    towers = build_model(ModelConfig(custom=VIT))
    assert type(towers.model) is open_clip.CLIP
    assert isinstance(towers.tokenizer, open_clip.SimpleTokenizer) and towers.tokenizer.context_length == 16
    image, text = features(towers.model, *sample_inputs(towers))
    assert image.shape == text.shape == (4, 16)
    assert towers.open_clip_config["model_cfg"] == VIT
    assert towers.open_clip_config["preprocess_cfg"]["size"] == (32, 32)


def test_timm_image_tower_and_hugging_face_text_tower(hf_folder):
    import transformers
    from open_clip.hf_model import HFTextEncoder
    from open_clip.timm_model import TimmModel

    towers = build_model(ModelConfig(custom=timm_hf_config(hf_folder), preprocess={"mean": [0.5] * 3, "std": [0.25] * 3}))
    model = towers.model
    assert isinstance(model.visual, TimmModel) and isinstance(model.text, HFTextEncoder)
    # The tokenizer is the text tower's own, read from its folder.
    assert isinstance(towers.tokenizer, HFTokenizer)
    reference = transformers.AutoTokenizer.from_pretrained(hf_folder)
    tokens = towers.tokenizer(["a photo of the digit three"])[0]
    assert tokens[:8].tolist() == reference("a photo of the digit three")["input_ids"]
    # The text tower's weights are the saved ones.
    saved = transformers.AutoModel.from_pretrained(hf_folder, add_pooling_layer=False)
    assert torch.equal(model.text.transformer.embeddings.word_embeddings.weight, saved.embeddings.word_embeddings.weight)
    assert list(towers.open_clip_config["preprocess_cfg"]["mean"]) == [0.5] * 3
    image, text = features(model, *sample_inputs(towers))
    assert image.shape == text.shape == (4, 16)


def test_timm_weights_load_into_the_trunk(hf_folder, tmp_path):
    """A timm checkpoint, with its ImageNet classifier and DDP's `module.` prefix: the trunk
    gets every weight, the classifier (replaced by the CLIP projection) is left out."""
    import timm

    trained = timm.create_model("test_resnet")
    torch.save({"state_dict": {f"module.{k}": v for k, v in trained.state_dict().items()}}, tmp_path / "resnet.pth")
    towers = build_model(ModelConfig(custom=timm_hf_config(hf_folder), pretrained_image=str(tmp_path / "resnet.pth")))
    trunk = towers.model.visual.trunk.state_dict()
    assert trunk.keys() == {k: v for k, v in trained.state_dict().items() if not k.startswith("fc.")}.keys()
    assert all(torch.equal(value, trained.state_dict()[key]) for key, value in trunk.items())


# --- errors ----------------------------------------------------------------------------


def test_weights_that_do_not_fit_name_the_keys(hf_folder, tmp_path):
    import timm

    wrong = timm.create_model("test_resnet").state_dict()
    wrong["conv1.0.weight"] = torch.zeros(3, 3, 3, 3)
    del wrong["bn1.weight"]
    torch.save(wrong, tmp_path / "wrong.pth")
    with pytest.raises(WeightsError) as error:
        build_model(ModelConfig(custom=timm_hf_config(hf_folder), pretrained_image=str(tmp_path / "wrong.pth")))
    message = str(error.value)
    assert "1 shape mismatch: conv1.0.weight (file (3, 3, 3, 3), model (" in message
    assert "1 missing from the file: bn1.weight" in message

    wider = build_model(ModelConfig(custom={**VIT, "embed_dim": 24})).model
    torch.save({"state_dict": wider.state_dict()}, tmp_path / "wider.pt")
    with pytest.raises(WeightsError, match=r"shape mismatch: .*text_projection \(file \(32, 24\), model \(32, 16\)\)"):
        build_model(ModelConfig(custom=VIT, pretrained=str(tmp_path / "wider.pt")))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.pretrained_image=/nonexistent.pth", "model.pretrained_image: no file at '/nonexistent.pth'"),
        ("model.custom.text_cfg.hf_model_name=/no/such/folder", "text_cfg.hf_model_name: no directory at '/no/such/folder'"),
        ("model.custom.vision_cfg.timm_model_pretrained=true", "weights are never downloaded"),
        ("model.preprocess={meen: [0.5]}", "model.preprocess: unknown keys meen"),
        ("model.lock_image_unlocked_groups=2", "need model.lock_image: true"),
    ],
)
def test_config_errors_before_any_work(hf_folder, override, expected):
    custom = timm_hf_config(hf_folder)
    with pytest.raises(ConfigError) as error:
        load_config(DIGITS_YAML, [f"model.custom={custom}", override])
    assert expected in str(error.value)


def test_pretrained_image_needs_a_timm_tower(tmp_path):
    (tmp_path / "w.pth").write_bytes(b"")
    with pytest.raises(ConfigError, match="only for a timm image tower"):
        load_config(DIGITS_YAML, [f"model.pretrained_image={tmp_path / 'w.pth'}"])


# --- LiT -------------------------------------------------------------------------------


def lit_step(towers, chunk_size):
    """One training step (forward, loss, backward) through GradCache, as the trainer takes it."""
    model = towers.model.train()
    images, texts = sample_inputs(towers, batch=8)
    GradCache(model, build_loss("vanilla"), chunk_size=chunk_size)(images, texts)
    return model


@pytest.mark.parametrize("chunk_size", [8, 3], ids=["plain", "gradcache"])
def test_lit_locks_the_whole_image_tower(chunk_size):
    towers = build_model(ModelConfig(custom=VIT, lock_image=True))
    frozen = {name for name, p in towers.model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in towers.model.named_parameters() if name.startswith("visual.")}
    out = towers.model(*sample_inputs(towers))
    assert out["image_features"].grad_fn is None  # no graph: the locked tower costs a forward only
    model = lit_step(towers, chunk_size)
    for name, p in model.named_parameters():
        assert (p.grad is None) == name.startswith("visual."), name


def test_lit_unlocks_the_last_groups():
    towers = build_model(ModelConfig(custom=VIT, lock_image=True, lock_image_unlocked_groups=2))
    trainable = {name for name, p in towers.model.visual.named_parameters() if p.requires_grad}
    # open_clip's ViT groups: [stem], block 0, block 1, [last block, ln_post], proj
    assert trainable == {"proj", "ln_post.weight", "ln_post.bias"} | {
        name for name, _ in towers.model.visual.named_parameters() if name.startswith("transformer.resblocks.2.")
    }
    model = lit_step(towers, chunk_size=3)
    for name, p in model.visual.named_parameters():
        assert (p.grad is not None) == (name in trainable), name


def test_lit_timm_tower_freezes_batchnorm_statistics(hf_folder):
    """timm's lock freezes the trunk; the new CLIP projection head stays trainable."""
    towers = build_model(ModelConfig(custom=timm_hf_config(hf_folder), lock_image=True, lock_image_freeze_bn_stats=True))
    trainable = {name for name, p in towers.model.visual.named_parameters() if p.requires_grad}
    assert trainable == {"head.proj.weight"}
    before = {k: v.clone() for k, v in towers.model.visual.trunk.state_dict().items()}
    model = lit_step(towers, chunk_size=8)
    after = model.visual.trunk.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running means and variances included
    assert all(p.grad is None for p in model.visual.trunk.parameters())


# --- checkpoints through open_clip -----------------------------------------------------


def train_tiny(digits_root, tmp_path, name, *extra):
    from clipscale.trainer import train

    cfg = load_config(DIGITS_YAML, tiny_run(digits_root, tmp_path, f"run.name={name}", "data.workers=0",
                                            "eval.zeroshot=false", "train.batch_size=16", "train.steps=2", *extra))
    train(cfg)
    return cfg, tmp_path / name


def test_our_run_loads_in_open_clip(digits_root, hf_folder, tmp_path):
    """A timm + HF run: open_clip's `local-dir:` loader rebuilds it with the same outputs and
    tokenizer, and open_clip's checkpoint loader reads our training checkpoints."""
    cfg, run_dir = train_tiny(digits_root, tmp_path, "timm-hf", f"model.custom={timm_hf_config(hf_folder)}")
    assert (run_dir / OPEN_CLIP_WEIGHTS).exists()

    ours = build_model(cfg.model)
    ours.model.load_state_dict(torch.load(latest_checkpoint(run_dir / "checkpoints"), weights_only=True)["state_dict"])
    theirs = open_clip.create_model(f"local-dir:{run_dir}", output_dict=True)
    tokenizer = open_clip.get_tokenizer(f"local-dir:{run_dir}")
    images, texts = sample_inputs(ours)
    assert torch.equal(tokenizer([f"a photo of the digit {CLASSNAMES[i]}" for i in range(4)]), texts)
    for a, b in zip(features(ours.model, images, texts), features(theirs, images, texts)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    step_1 = open_clip.create_model(f"local-dir:{run_dir}", output_dict=True)
    open_clip.load_checkpoint(step_1, str(run_dir / "checkpoints" / "step_00000002.pt"))
    assert all(torch.equal(a, b) for a, b in zip(step_1.state_dict().values(), theirs.state_dict().values()))


def test_training_starts_from_an_open_clip_checkpoint_with_lit(digits_root, tmp_path):
    """open_clip_train's checkpoint layout (`state_dict` with DDP's `module.` prefix) as
    model.pretrained, with the image tower locked: it stays exactly the file's."""
    cfg = load_config(DIGITS_YAML, [TINY_MODEL])
    torch.manual_seed(123)
    pretrained = build_model(cfg.model).model.state_dict()
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in pretrained.items()}}, tmp_path / "epoch_3.pt")

    _, run_dir = train_tiny(digits_root, tmp_path, "lit", f"model.pretrained={tmp_path / 'epoch_3.pt'}", "model.lock_image=true")
    trained = torch.load(latest_checkpoint(run_dir / "checkpoints"), weights_only=True)["state_dict"]
    for key, value in trained.items():
        if key.startswith("visual."):
            assert torch.equal(value, pretrained[key]), key
    assert not torch.equal(trained["text_projection"], pretrained["text_projection"])


@pytest.mark.parametrize("name", ["vit_b16_infcl", "lit_vit_b16", "timm_hf_example", "webdataset_example"])
def test_example_configs_are_valid(name, hf_folder, tmp_path):
    """The example configs pass every check (keys, values, loss against model) once their local files exist."""
    (tmp_path / "weights.pt").write_bytes(b"")
    local_files = {
        "lit_vit_b16": [f"model.pretrained={tmp_path / 'weights.pt'}"],
        "timm_hf_example": [f"model.pretrained_image={tmp_path / 'weights.pt'}",
                            f"model.custom.text_cfg.hf_model_name={hf_folder}",
                            f"model.custom.text_cfg.hf_tokenizer_name={hf_folder}"],
    }
    load_checked_config(str(REPO / "configs" / f"{name}.yaml"), local_files.get(name, []))


def test_no_random_init_warning_when_model_pretrained_loads_next(tmp_path, caplog):
    """open_clip logs "No pretrained weights loaded ... initialized randomly" for every model it
    builds without weights; with model.pretrained the weights load right after, so it is false."""
    caplog.set_level(logging.WARNING)
    torch.save(build_model(ModelConfig(custom=VIT)).model.state_dict(), tmp_path / "weights.pt")
    assert "initialized randomly" in caplog.text  # without weights it is said, and seen here
    caplog.clear()
    build_model(ModelConfig(custom=VIT, pretrained=str(tmp_path / "weights.pt")))
    assert "initialized randomly" not in caplog.text


# --- open_clip_train's knobs on the towers --------------------------------------------------

TWO_LAYER_VIT = {  # two layers in each tower (the text tower's lock groups need two blocks)
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2.0},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


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
    towers = build_model(ModelConfig(custom=TWO_LAYER_VIT, lock_text=True))
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
    towers = build_model(ModelConfig(custom=TWO_LAYER_VIT))
    calls = text_encodings(towers.model)
    training_steps(towers, steps=1, chunk_size=3)
    assert len(calls) == 3 + 2  # pass 2 re-encodes all but the last chunk, whose pass-1 graph it keeps


def test_lock_text_unlocked_layers():
    towers = build_model(ModelConfig(custom=TWO_LAYER_VIT, lock_text=True, lock_text_unlocked_layers=2))
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
    timm_vit = {**TWO_LAYER_VIT, "vision_cfg": {"timm_model_name": "vit_tiny_patch16_224", "timm_pool": "token", "timm_proj": "linear"}}
    towers = build_model(ModelConfig(custom=timm_vit, force_image_size=64))
    assert towers.model.visual.trunk.patch_embed.img_size == (64, 64)
    assert towers.model.visual(torch.randn(1, 3, 64, 64)).shape == (1, 16)


def test_patch_dropout_on_timm_towers():
    """timm's ViTs take it (as patch_drop_rate); a timm convnet is refused before it is built."""
    timm_vit = {**TWO_LAYER_VIT, "vision_cfg": {"timm_model_name": "vit_tiny_patch16_224", "image_size": 32}}
    load_checked_config(DIGITS_YAML, [f"model.custom={json.dumps(timm_vit)}", "model.force_patch_dropout=0.5"])
    timm_resnet = {**TWO_LAYER_VIT, "vision_cfg": {"timm_model_name": "resnet18", "image_size": 32}}
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
