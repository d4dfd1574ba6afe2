"""The configuration as a user meets it: a mistake names its key before any work, overrides merge
with the file, a run length in steps, samples or epochs, `python train.py --help` lists every key
and says which ones a resumed run may change; the run plan resolves it once for a world."""

from __future__ import annotations

import dataclasses
import runpy
import subprocess
import sys

import pytest
import torch

from clipscale.checks import check_world, load_checked_config, plan_run
from clipscale.config import FREE, REDEAL, RUN_KEY, Config, ConfigError, load_config, on_resume
from clipscale.distributed import World

from tests.helpers.tiny_runs import DIGITS_YAML, REPO, TRAIN, run_train


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stepz=3", "unknown key train.stepz; allowed keys in train: batch_size, chunk_size"),
        ("trian.steps=3", "unknown key trian; allowed keys in the config: run, model, data"),
        ("train.steps=many", "train.steps: got 'many', expected int"),
        ("train.precision=fp8", "train.precision: got 'fp8', expected one of 'fp32', 'bf16', 'fp16'"),
        ("loss.name=magic", "loss.name: got 'magic', expected one of"),
        ("train.batch_size=0", "train.batch_size: must be positive"),
        ("data.worker_decode_share=1.5", "data.worker_decode_share: must be between 0 and 1, got 1.5"),
        ("model.name=ViT-B-16", "set exactly one of model.name"),
        ("model.pretrained=/nonexistent.pt", "model.pretrained: no file at"),
        ("train.steps", "must look like section.key=value"),
        ("steps=10", "override 'steps=10': keys are section.key; the nearest key is train.steps: train.steps=10"),
        ("batchsize=8", "keys are section.key; the nearest key is train.batch_size: train.batch_size=8"),
        ("colour=red", "keys are section.key (sections: run, model, data, loss, optim, train, eval, wandb, tensorboard)"),
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
    assert cfg.model.custom["vision_cfg"]["patch_size"] == 4  # untouched keys keep the file's values


def test_the_files_upsampling_factors_follow_its_sources():
    """The example's factors weigh its two sources: one source of the user's on the command line
    leaves them out; two sources keep them; factors given beside the sources are the ones used."""
    example = str(REPO / "configs" / "webdataset_example.yaml")
    assert load_config(example, ["data.train_shards=data/mine/{00000..00009}.tar"]).data.upsampling_factors is None
    assert load_config(example, ["data.train_shards=a/{0..1}.tar::b/{0..1}.tar"]).data.upsampling_factors == [1.0, 4.0]
    with pytest.raises(ConfigError, match="2 factors for 1 sources"):
        load_config(example, ["data.train_shards=a/{0..1}.tar", "data.upsampling_factors=[1, 2]"])


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


def importing_train_py(args: list[str]) -> subprocess.CompletedProcess:
    """`python -X importtime train.py ARGS`: stderr lists every module imported, then its output."""
    return subprocess.run([sys.executable, "-X", "importtime", TRAIN, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--config", DIGITS_YAML, "loss.name=clip"],
     "error: loss.name: got 'clip', expected one of disco, infcl, local, ntxent, siglip, vanilla"),
    (["--config", DIGITS_YAML, "model.custom=null", "model.name=ViT-B-322"],
     "error: model.name: unknown open_clip architecture 'ViT-B-322' (the nearest is ViT-B-32); see open_clip.list_models()"),
    (["train.steps=1", "--config", DIGITS_YAML, "loss.name=clip"],  # overrides on both sides of --config
     "error: loss.name: got 'clip', expected one of disco, infcl, local, ntxent, siglip, vanilla"),
])
def test_train_py_names_a_wrong_loss_or_architecture_in_one_line_before_importing_torch(args, message):
    """Importing torch and open_clip takes seconds: a name that is wrong is said before them."""
    done = importing_train_py(args)
    output = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert (done.returncode, output) == (2, [message]), done.stderr[-3000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "open_clip"} & imported, sorted(imported)


def test_train_py_takes_overrides_before_and_after_the_config_file():
    parse_args = runpy.run_path(TRAIN)["parse_args"]
    args = parse_args(["train.steps=7", "--config", DIGITS_YAML, "run.name=x", "optim.lr=0.5"])
    cfg = load_config(args.config, args.overrides)
    assert (cfg.train.steps, cfg.run.name, cfg.optim.lr) == (7, "x", 0.5)


def test_the_names_known_before_torch_are_the_components_own(monkeypatch):
    """The built-in losses listed in config are clipscale.losses'; open_clip's architectures read from
    its folder are open_clip's list; a loss registered by user code (which imported clipscale.losses) is known."""
    import open_clip

    from clipscale import losses
    from clipscale.config import BUILTIN_LOSSES, known_losses, open_clip_architectures

    assert sorted(BUILTIN_LOSSES) == sorted(losses._LOSS_MODULES)
    monkeypatch.delitem(sys.modules, "open_clip")
    # Less the configs this process registered itself (models.py's custom towers: clipscale-custom-*),
    # which earlier tests in the same worker may have added to open_clip's list.
    registered_here = [name for name in open_clip.list_models() if name.startswith("clipscale-custom")]
    assert open_clip_architectures() == sorted(set(open_clip.list_models()) - set(registered_here))
    monkeypatch.setitem(losses._REGISTRY, "mine", None)
    assert "mine" in known_losses()


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


def test_train_py_help_lists_every_section_and_key_with_its_default():
    shown = subprocess.run([sys.executable, TRAIN, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    for section in dataclasses.fields(Config):
        assert f"\n  {section.name}:" in shown, section.name
        for key in dataclasses.fields(section.default_factory):
            assert f"\n    {key.name}: " in shown, f"{section.name}.{key.name}"
    assert "\n    batch_size: 256  (int)\n" in shown
    assert "\n    workers: 2  (int)  [may change on resume: the epoch goes on, dealt anew]\n" in shown


def test_keys_that_only_change_speed_may_change_on_resume_and_the_others_may_not():
    assert [on_resume(key) for key in ("data.workers", "data.decoder", "model.compile", "train.log_every",
                                       "train.checkpoint_every", "eval.workers", "run.name")] == [
        REDEAL, FREE, FREE, FREE, FREE, FREE, RUN_KEY]
    assert [on_resume(key) for key in ("run.seed", "train.steps", "data.shuffle_buffer", "model.custom.embed_dim",
                                       "loss.options.tile_size", "no.such")] == [None] * 6


def test_the_run_plan_resolves_the_configuration_once_for_its_world():
    cfg = load_config(DIGITS_YAML, ["train.batch_size=96", "train.chunk_size=64", "train.precision=bf16",
                                    "model.force_image_size=48", "data.keep_on_device_gib=0.5"])
    plan = plan_run(cfg, World(world_size=3))
    assert (plan.per_rank_batch, plan.chunk, plan.image_size, plan.autocast_dtype, plan.keep_on_device_bytes) == (
        32, 32, 48, torch.bfloat16, 2**29)  # the chunk: at most the per-rank batch
    assert plan_run(load_config(DIGITS_YAML, ["train.chunk_size=auto"]), World()).chunk == "auto"
    with pytest.raises(ConfigError, match="must split evenly over 5 processes"):
        plan_run(cfg, World(world_size=5))
