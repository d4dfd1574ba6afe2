"""scripts/from_open_clip.py: an open_clip_train command line becomes a clipscale YAML that loads,
with open_clip's meaning (per-GPU batch, epochs, defaults); flags clipscale cannot honour are named.
docs/from_open_clip.md lists every flag of open_clip_train's parser."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import open_clip_train.params
import pytest
import yaml

from clipscale.checks import load_checked_config
from clipscale.config import load_config

from tests.helpers.tiny_runs import REPO

SCRIPT = str(REPO / "scripts" / "from_open_clip.py")
sys.path.insert(0, str(REPO / "scripts"))
import from_open_clip  # noqa: E402

COMMAND = (
    "torchrun --nproc_per_node 4 --nnodes 2 -m open_clip_train.main --model ViT-B-32 "
    "--train-data '/data/laion/{00000..01023}.tar' --dataset-type webdataset --train-num-samples 10000000 "
    "--batch-size 256 --accum-freq 2 --precision amp_bf16 --workers 6 --epochs 10 --lr 5e-4 --wd 0.1 --warmup 2000 "
    "--lr-scheduler const-cooldown --epochs-cooldown 1 --lr-cooldown-end 1e-5 --lr-cooldown-power 2 "
    "--report-to tensorboard,wandb --wandb-project-name laion --grad-checkpointing --lock-text --lock-text-unlocked-layers 2 "
    "--lock-text-freeze-layer-norm --force-patch-dropout 0.5 --save-frequency 2 --zeroshot-frequency 1 "
    "--imagenet-val /data/imagenet/val --local-loss --gather-with-grad --log-every-n-steps 50 --seed 1 "
    "--name laion-b32 --delete-previous-checkpoint --grad-clip-norm 1.0 --resume latest"
)


def convert(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *arguments], capture_output=True, text=True, timeout=60)


def test_a_realistic_command_line_becomes_a_config_that_loads(tmp_path):
    result = convert(COMMAND)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "note: dropped --local-loss: every loss is the exact loss over the global batch (what --local-loss --gather-with-grad compute)",
        "note: dropped --gather-with-grad: every loss is the exact loss over the global batch (what --local-loss --gather-with-grad compute)",
    ]
    path = tmp_path / "run.yaml"
    path.write_text(result.stdout)
    cfg = load_checked_config(str(path), [f"run.output_dir={tmp_path}"])
    global_batch = 256 * 8 * 2  # per GPU x 4 GPUs x 2 nodes x --accum-freq
    steps_per_epoch = -(-10_000_000 // global_batch)
    assert cfg.train.batch_size == global_batch and cfg.train.chunk_size == 256
    assert cfg.train.steps == 10 * steps_per_epoch
    assert (cfg.optim.lr_scheduler, cfg.optim.lr_cooldown_steps, cfg.optim.lr_cooldown_end, cfg.optim.lr_cooldown_power) == \
        ("const-cooldown", steps_per_epoch, 1e-5, 2.0)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.warmup_steps, cfg.optim.grad_clip) == (5e-4, 0.1, 2000, 1.0)
    assert (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps) == (0.9, 0.98, 1e-6)  # open_clip's defaults for a ViT
    assert cfg.train.precision == "bf16" and cfg.train.keep_checkpoints == 1
    assert cfg.train.checkpoint_every == 2 * steps_per_epoch and cfg.eval.every_n_steps == steps_per_epoch
    assert cfg.model.name == "ViT-B-32" and cfg.model.grad_checkpointing and cfg.model.force_patch_dropout == 0.5
    assert cfg.model.lock_text and cfg.model.lock_text_unlocked_layers == 2 and cfg.model.lock_text_freeze_layer_norm
    assert cfg.data.kind == "webdataset" and cfg.data.train_shards == "/data/laion/{00000..01023}.tar" and cfg.data.workers == 6
    assert cfg.eval.sets == [{"task": "imagenet", "data": "/data/imagenet/val"}]
    assert cfg.tensorboard.enabled and cfg.wandb.enabled and cfg.wandb.project == "laion"
    assert (cfg.run.name, cfg.run.seed, cfg.run.resume) == ("laion-b32", 1, True)


def test_open_clip_defaults_where_ours_differ():
    config, notes = from_open_clip.to_config(["--model", "RN50", "--train-data", "a.tar", "--train-num-samples", "1000"])
    assert config["optim"] == {"lr": 5e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.2,
                               "warmup_steps": 10000, "grad_clip": None, "lr_scheduler": "cosine"}
    assert config["train"]["batch_size"] == 64 and config["train"]["epochs"] == 32
    assert config["train"]["precision"] == "fp16"  # --precision amp, open_clip_train's default
    assert config["train"]["keep_checkpoints"] is None  # open_clip_train keeps every epoch's checkpoint
    assert notes == [  # no launcher: one GPU, said; the default warmup is longer than this run (32 epochs of 16 steps)
        "no torchrun or srun in the command: one GPU (train.batch_size is --batch-size x --accum-freq); give --gpus N "
        "before the command for a run on N GPUs",
        "optim.warmup_steps 10000 (--warmup, open_clip_train's default 10000 where not given) is more than the run's 512 "
        "steps: the lr never reaches --lr 0.0005; give a shorter --warmup"]


OPEN_CLIP_ARGS = "--model ViT-B-32 --train-data /data/{00000..00003}.tar --train-num-samples 4000 --batch-size 100 --warmup 10"


@pytest.mark.parametrize("command, gpus", [
    (f"srun --cpu_bind=v --accel-bind=gn python -u src/open_clip_train/main.py {OPEN_CLIP_ARGS}", None),  # open_clip's Slurm example
    (f"srun --ntasks-per-node 4 --nodes 2 python -u src/open_clip_train/main.py {OPEN_CLIP_ARGS}", 8),
    (f"srun -n 4 python -m open_clip_train.main {OPEN_CLIP_ARGS}", 4),
    (f"python -u src/open_clip_train/main.py {OPEN_CLIP_ARGS}", None),
    (f"python -m training.main {OPEN_CLIP_ARGS}", None),
    (f"torchrun --nproc_per_node 4 src/open_clip_train/main.py {OPEN_CLIP_ARGS}", 4),
    (f"torchrun --nproc_per_node 4 -m training.main {OPEN_CLIP_ARGS}", 4),
])
def test_open_clips_usual_command_forms_convert(command, gpus):
    """The forms of open_clip's README and Slurm example; where the launcher does not say how many
    processes it starts, one GPU, with a note that says how to give them."""
    config, notes = from_open_clip.to_config(command.split())
    assert config["train"]["batch_size"] == 100 * (gpus or 1) and config["model"]["name"] == "ViT-B-32"
    if gpus is None:
        assert len(notes) == 1 and "give --gpus N before the command" in notes[0], notes
    else:
        assert notes == []
    assert from_open_clip.to_config(command.split(), gpus=8)[0]["train"]["batch_size"] == 800


def test_the_samples_in_an_epoch_come_from_the_shards_sizes_json_as_open_clip_train_reads_them(tmp_path):
    (tmp_path / "sizes.json").write_text('{"00000.tar": 1000, "00001.tar": 1200, "00002.tar": 7}')
    shards = str(tmp_path / "{00000..00001}.tar")
    config, notes = from_open_clip.to_config(["--model", "ViT-B-32", "--train-data", shards, "--warmup", "10"], gpus=1)
    assert config["train"]["num_samples_per_epoch"] == 2200
    assert notes == ["train.num_samples_per_epoch 2200: the sizes the shards' folder lists (sizes.json or __len__), as "
                     "open_clip_train reads them without --train-num-samples"]
    (tmp_path / "sizes.json").unlink()
    (tmp_path / "__len__").write_text("5000\n")
    assert from_open_clip.to_config(["--train-data", shards], gpus=1)[0]["train"]["num_samples_per_epoch"] == 5000


def test_open_clip_trains_evaluation_frequencies_are_carried_with_its_defaults():
    base = ["--model", "ViT-B-32", "--train-num-samples", "6400", "--batch-size", "64", "--warmup", "10"]  # 100 steps an epoch
    evaluation = lambda *more: from_open_clip.to_config([*base, *more], gpus=1)[0]["eval"]  # noqa: E731
    assert evaluation("--val-data", "/data/val.tar")["every_n_steps"] == 100  # --val-frequency 1
    assert evaluation("--imagenet-val", "/data/in/val")["every_n_steps"] == 200  # --zeroshot-frequency 2
    assert evaluation("--imagenet-val", "/data/in/val", "--zeroshot-frequency", "3")["every_n_steps"] == 300
    assert "every_n_steps" not in evaluation()  # nothing to evaluate: only the end's evaluation


def test_data_source_flags_map_to_the_data_keys(tmp_path):
    config, _ = from_open_clip.to_config([
        "--train-data", "/data/a.csv::/data/b.csv", "--train-num-samples", "100", "--csv-img-key", "path",
        "--csv-caption-key", "caption", "--csv-separator", ",", "--dataset-resampled",
        "--train-data-upsampling-factors", "1::3", "--val-data", "/data/val.csv", "--image-key", "png",
        "--text-key", "caption", "--max-image-pixels", "1000000"])
    assert config["data"] == {"kind": "csv", "train_shards": "/data/a.csv::/data/b.csv", "csv_image_key": "path",
                              "csv_caption_key": "caption", "csv_separator": ",", "image_key": "png", "caption_key": "caption",
                              "upsampling_factors": "1::3", "max_image_pixels": 1000000, "resampled": True, "workers": 4}
    assert config["eval"]["val_data"] == "/data/val.csv"
    path = tmp_path / "csv.yaml"
    path.write_text(yaml.safe_dump(config))
    cfg = load_config(str(path))
    assert cfg.data.upsampling_factors == [1.0, 3.0] and cfg.data.csv_separator == "," and cfg.eval.val_data == "/data/val.csv"


def test_unsupported_flags_are_listed_with_why():
    result = convert("--", "--model", "coca_ViT-B-32", "--coca-caption-loss-weight", "2", "--distill-model", "ViT-L-14",
                     "--distill-pretrained", "openai", "--pretrained", "laion2b_s34b_b79k", "--precision", "pure_bf16",
                     "--use-naflex", "--train-num-samples", "10")
    assert result.returncode == 2 and result.stdout == ""
    message = result.stderr.strip()
    assert message.startswith("error: open_clip_train flags that clipscale does not support: ") and "\n" not in message
    for flag in ("--coca-caption-loss-weight: CoCa", "--distill-model: distillation", "--distill-pretrained: distillation",
                 "--model coca_ViT-B-32: CoCa", "--pretrained laion2b_s34b_b79k: a pretrained tag is a download",
                 "--precision pure_bf16: pure low-precision", "--use-naflex: NaFlex"):
        assert flag in message, flag


@pytest.mark.parametrize("arguments, message", [
    (["--model", "ViT-B-32", "--train-data", "a.tar"], "--train-num-samples is needed"),
    (["--model", "ViT-B-32", "--lr-scheduler", "const-cooldown", "--train-num-samples", "10"], "needs --epochs-cooldown"),
    (["--model", "ViT-B-32", "--modle", "x"], "not open_clip_train flags: --modle"),
])
def test_a_command_line_that_says_too_little_or_is_wrong(arguments, message):
    with pytest.raises(from_open_clip.ConversionError, match=message):
        from_open_clip.to_config(arguments)


def installed_parser_flags() -> set[str]:
    """The flags of the installed open_clip_train (its parser is built inside parse_args)."""
    return set(re.findall(r"[\"'](--[\w-]+)[\"']", inspect.getsource(open_clip_train.params)))


def test_every_open_clip_train_flag_is_in_the_table_and_the_doc():
    assert installed_parser_flags() <= set(from_open_clip.FLAGS)
    doc = (REPO / "docs" / "from_open_clip.md").read_text()
    assert from_open_clip.markdown_table() in doc  # the doc's table is the script's (--markdown)


def test_lock_text_without_frozen_norms_is_what_open_clip_asks():
    """open_clip_train's --lock-text leaves --lock-text-freeze-layer-norm false, which its own text
    tower refuses (an AssertionError there, one error line here)."""
    config, _ = from_open_clip.to_config(["--model", "ViT-B-32", "--train-num-samples", "10", "--lock-text"])
    assert config["model"]["lock_text_freeze_layer_norm"] is False
    assert yaml.safe_load(yaml.safe_dump(config)) == config


def test_a_csv_command_needs_no_train_num_samples_its_epoch_is_the_tables_rows(tmp_path):
    table = tmp_path / "train.csv"
    table.write_text("filepath\ttitle\n" + "".join(f"images/{i}.jpg\tcaption {i}\n" for i in range(1500)))
    config, notes = from_open_clip.to_config(["--model", "ViT-B-32", "--train-data", str(table), "--batch-size", "64",
                                              "--epochs", "2", "--save-frequency", "1", "--warmup", "10"], gpus=1)
    assert config["train"]["num_samples_per_epoch"] == 1500 and notes == []
    assert config["train"]["checkpoint_every"] == 24  # ceil(1500 / 64) steps an epoch
    path = tmp_path / "csv.yaml"
    path.write_text(yaml.safe_dump(config))
    assert load_config(str(path)).train.steps == 48

    # open_clip_train ignores --train-num-samples for a CSV: said, and the rows used
    config, notes = from_open_clip.to_config(["--model", "ViT-B-32", "--train-data", str(table), "--train-num-samples", "10",
                                              "--warmup", "10"], gpus=1)
    assert config["train"]["num_samples_per_epoch"] == 1500
    assert notes == ["dropped --train-num-samples 10: an epoch of a CSV is its 1500 rows (open_clip_train ignores the "
                     "flag for a CSV)"]
    # a table that is not here: its count from --train-num-samples, else an error naming it
    config, _ = from_open_clip.to_config(["--model", "ViT-B-32", "--train-data", "/elsewhere/t.csv", "--train-num-samples", "10"])
    assert config["train"]["num_samples_per_epoch"] == 10
    with pytest.raises(from_open_clip.ConversionError, match="--train-data: no CSV file at '/elsewhere/t.csv'"):
        from_open_clip.to_config(["--model", "ViT-B-32", "--train-data", "/elsewhere/t.csv"])


def test_fsdp_is_train_parallel_fsdp():
    config, notes = from_open_clip.to_config(["--model", "ViT-B-32", "--train-num-samples", "10", "--fsdp",
                                              "--fsdp-offload-cpu", "--fsdp-checkpoint", "sharded", "--precision", "amp_bf16",
                                              "--warmup", "1"], gpus=1)
    assert config["train"]["parallel"] == "fsdp" and config["train"]["fsdp_offload"] is True
    assert notes == [f"dropped --fsdp-checkpoint: {from_open_clip.FLAGS['--fsdp-checkpoint'].text}"]
    with pytest.raises(from_open_clip.ConversionError, match="--fsdp with --precision amp: .* use amp_bf16"):
        from_open_clip.to_config(["--model", "ViT-B-32", "--train-num-samples", "10", "--fsdp", "--precision", "amp"])


# Each mapped flag's values, and the flags open_clip_train needs beside it for it to act.
MAPPED_EXAMPLES = {
    "--train-data": ("/data/{0..9}.tar",), "--val-data": ("/data/val.tar",), "--train-num-samples": ("1000",),
    "--train-data-upsampling-factors": ("1::2", "|", "--train-data", "a.tar::b.tar", "--dataset-resampled"),
    "--dataset-type": ("webdataset", "|", "--train-data", "a.csv"), "--dataset-resampled": (),
    "--csv-separator": (",",), "--csv-img-key": ("path",), "--csv-caption-key": ("text",), "--image-key": ("png",),
    "--max-image-pixels": ("1000",), "--text-key": ("caption",), "--imagenet-val": ("/data/imagenet/val",),
    "--imagenet-v2": ("/data/v2",), "--logs": ("/tmp/logs",), "--name": ("x",), "--workers": ("3",),
    "--batch-size": ("32",), "--epochs": ("3",), "--epochs-cooldown": ("2", "|", "--lr-scheduler", "const-cooldown"),
    "--lr": ("0.1",), "--beta1": ("0.8",), "--beta2": ("0.9",), "--eps": ("1e-7",), "--wd": ("0.3",), "--warmup": ("7",),
    "--opt": ("adamw",), "--skip-scheduler": (), "--lr-scheduler": ("const",),
    "--lr-cooldown-end": ("1e-6", "|", "--lr-scheduler", "const-cooldown", "--epochs-cooldown", "1"),
    "--lr-cooldown-power": ("2", "|", "--lr-scheduler", "const-cooldown", "--epochs-cooldown", "1"),
    "--save-frequency": ("2",), "--zeroshot-frequency": ("3", "|", "--imagenet-val", "/data/imagenet/val"),
    "--val-frequency": ("2", "|", "--val-data", "/data/val.tar"), "--resume": ("latest",),
    "--precision": ("fp32",), "--model": ("ViT-B-16",), "--pretrained": ("{tmp}/b32.pt",), "--lock-image": (),
    "--lock-image-unlocked-groups": ("1", "|", "--lock-image"), "--lock-image-freeze-bn-stats": ("|", "--lock-image"),
    "--image-mean": ("0.5", "0.5", "0.5"), "--image-std": ("0.2", "0.2", "0.2"), "--image-interpolation": ("bilinear",),
    "--image-resize-mode": ("squash",), "--grad-checkpointing": (), "--force-context-length": ("32",),
    "--force-image-size": ("160",), "--force-quick-gelu": (), "--force-patch-dropout": ("0.5",), "--torchcompile": (),
    "--accum-freq": ("2",), "--device": ("cpu",), "--report-to": ("wandb,tensorboard",),
    "--wandb-project-name": ("p", "|", "--report-to", "wandb"), "--fsdp": ("|", "--precision", "amp_bf16"),
    "--fsdp-offload-cpu": ("|", "--fsdp", "--precision", "amp_bf16"),
    "--seed": ("5",), "--grad-clip-norm": ("2.0",), "--lock-text": ("|", "--lock-text-freeze-layer-norm"),
    "--lock-text-unlocked-layers": ("1", "|", "--lock-text", "--lock-text-freeze-layer-norm"),
    "--lock-text-freeze-layer-norm": ("|", "--lock-text"), "--log-every-n-steps": ("5",), "--delete-previous-checkpoint": (),
    "--siglip": ("|", "--model", "ViT-B-16-SigLIP"),
}


def _flat(tree: dict, prefix: str = "") -> dict:
    return {k: v for key, value in tree.items()
            for k, v in (_flat(value, f"{prefix}{key}.").items() if isinstance(value, dict) else [(prefix + key, value)])}


@pytest.mark.parametrize("flag", [flag for flag, entry in from_open_clip.FLAGS.items() if entry.kind == "mapped"])
def test_every_mapped_row_of_the_doc_sets_the_keys_it_names(tmp_path, flag):
    """Each row that names clipscale keys: a command line with the flag writes those keys, differently
    from the same command without it, and the configuration loads."""
    base = {"--model": ["--train-num-samples", "1000"], "--train-num-samples": ["--model", "ViT-B-32"]}.get(
        flag, ["--model", "ViT-B-32", "--train-num-samples", "1000"])
    example = " ".join(MAPPED_EXAMPLES[flag]).replace("{tmp}", str(tmp_path)).split("|")
    value, context = example[0].split(), (example[1].split() if len(example) > 1 else [])
    (tmp_path / "b32.pt").write_bytes(b"")
    with_flag, _ = from_open_clip.to_config([*base, *context, flag, *value])
    # the keys the row names outside its parentheses (those say more), each in the configuration
    keys = re.findall(r"`([a-z_]+\.[a-z_0-9.]+)", re.sub(r"\([^)]*\)", "", from_open_clip.FLAGS[flag].text))
    flat = _flat(with_flag)
    for key in keys:
        assert any(k == key or k.startswith(key + ".") for k in flat), (flag, key, flat)
    try:
        without, _ = from_open_clip.to_config([*base, *context])
    except from_open_clip.ConversionError:  # the command needs the flag
        without = None
    if flag != "--opt":  # adamw, the one optimizer, is also the default
        assert with_flag != without, flag
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(with_flag))
    load_checked_config(str(path), [f"run.output_dir={tmp_path}"])
