"""Untrusted shards and checkpoints run no code and take no run down.

A hostile shard carries, beside each sample's image, caption and label, `.pyd`, `.pickle`,
`.pth` and `.npy` (object array) members whose loading would create a marker file: webdataset's
default decoders unpickle the first three and `np.load` the last. Every reader gives the same
result on it as on the same shard without those members, and no marker appears. Image bombs
(a header claiming 30,000 x 30,000 pixels) are skipped and counted, and checkpoints holding
pickled objects are refused by name on every path that loads one.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import webdataset as wds
from open_clip.transform import image_transform
from PIL import Image, UnidentifiedImageError

from clipscale.checkpoint import CheckpointError, PickledObjectError, load_latest, save_checkpoint
from clipscale.config import ConfigError, ModelConfig, load_config
from clipscale.data.sources import ImageTooLarge, open_image
from clipscale.data.shards import ShardStream, load_sample
from clipscale.data.transforms import SplitTransform
from clipscale.errors import UserError
from clipscale.eval.datasets import LabelledFolder, Skipped, shard_classification
from clipscale.eval.tasks import resolve_task, run_task
from clipscale.models import build_model, load_clip_checkpoint, load_timm_trunk

from tests.helpers.rigged import EXPECTED_RETRIEVAL, RETRIEVAL_CAPTIONS, caption_model, evaluate, png_bytes
from tests.helpers.towers import TINY_CLIP
from tests.helpers.tiny_runs import DIGITS_YAML, REPO, run_train, tiny_run

HOSTILE_MEMBERS = ("pyd", "pickle", "pth", "npy")
TRAIN = image_transform(32, is_train=True, aug_cfg={"scale": (0.5, 1.0)})
SPLIT = SplitTransform.split(TRAIN)
BOMB_SIDE = 30_000


class WritesMarker:
    """Unpickling this creates `path`: what a hostile member would do with os.system."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def hostile_members(markers: Path) -> dict:
    """One member of each kind webdataset's default decoders would load, each creating its own marker."""
    npy, pth = io.BytesIO(), io.BytesIO()
    np.save(npy, np.array([WritesMarker(markers / "npy")], dtype=object), allow_pickle=True)
    torch.save({"weights": WritesMarker(markers / "pth")}, pth)
    return {"pyd": pickle.dumps(WritesMarker(markers / "pyd")), "pickle": pickle.dumps(WritesMarker(markers / "pickle")),
            "pth": pth.getvalue(), "npy": npy.getvalue()}


def write_shards(folder: Path, samples: list[dict]) -> tuple[str, str, Path]:
    """The samples as a clean shard and as a hostile one (each sample with hostile members too);
    (clean, hostile, markers folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    markers = folder / "markers"
    markers.mkdir()
    clean, hostile = str(folder / "clean.tar"), str(folder / "hostile.tar")
    with wds.TarWriter(clean) as plain, wds.TarWriter(hostile) as evil:
        for sample in samples:
            plain.write(sample)
            evil.write({**sample, **hostile_members(markers)})
    return clean, hostile, markers


def assert_nothing_ran(markers: Path) -> None:
    assert sorted(p.name for p in markers.iterdir()) == [], "a shard member or checkpoint ran code"


def noise_jpeg(seed: int, size: int = 32) -> bytes:
    torch.manual_seed(seed)
    pixels = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


def test_the_hostile_members_run_code_when_loaded_the_usual_way(tmp_path):
    """The fixture is real: webdataset's default decoders (what `.decode("pil")` runs on every member)
    create the pickle and torch markers, and np.load with pickles allowed the numpy one."""
    members = hostile_members(tmp_path)
    for kind in ("pyd", "pickle", "pth"):
        wds.autodecode.basichandlers(kind, members[kind])
    with pytest.raises(ValueError, match="allow_pickle"):  # webdataset's npy decoder refuses object arrays ...
        wds.autodecode.basichandlers("npy", members["npy"])  # ... so `.decode` stops the whole read instead
    np.load(io.BytesIO(members["npy"]), allow_pickle=True)
    assert {p.name for p in tmp_path.iterdir()} == set(HOSTILE_MEMBERS)


# --- every path that reads shards ----------------------------------------------------------


@pytest.mark.parametrize("decode", [True, False], ids=["loader-decodes", "device-decodes"])
def test_training_stream_reads_only_image_and_caption(tmp_path, decode):
    samples = [{"__key__": f"{i:03d}", "jpg": noise_jpeg(i), "txt": f"caption {i}"} for i in range(12)]
    clean, hostile, markers = write_shards(tmp_path, samples)

    def pieces(url):
        stream = ShardStream([url], piece_size=4, rank=0, world_size=1, num_workers=1, seed=3, image_transform=TRAIN,
                             tokenizer=list, shuffle_buffer=5, split=SPLIT, keep_encoded=True, decode=decode)
        return [next(it) for it in [iter(stream)] for _ in range(3)]

    for ours, theirs in zip(pieces(clean), pieces(hostile), strict=True):
        assert ours["texts"] == theirs["texts"] and theirs["skipped_samples"] == 0
        assert torch.equal(ours["encoded"].data, theirs["encoded"].data)
        assert torch.equal(ours["encoded"].params, theirs["encoded"].params)
        if decode:
            assert torch.equal(ours["images"], theirs["images"])
    assert_nothing_ran(markers)


def test_shard_classification_decodes_only_image_and_label(tmp_path, colour_model, templates):
    # Labels: red 2, green 1, blue 0 (the class names below); purple scores red = blue, blue wins the tie.
    samples = [{"__key__": f"{i:03d}", "png": png_bytes(colour, tmp_path), "cls": label}
               for i, (colour, label) in enumerate([("red", 2), ("green", 1), ("blue", 0), ("purple", 2), ("red", 1)])]
    clean, hostile, markers = write_shards(tmp_path, samples)
    classnames = tmp_path / "classnames.txt"
    classnames.write_text("blue\ngreen\nred\n")

    def metrics(url):
        return evaluate(resolve_task("wds", data=url, classnames=str(classnames), templates=templates), colour_model)

    expected = metrics(clean)
    assert expected["acc1"] == 3 / 5 and expected["num_samples"] == 5
    assert json.dumps(metrics(hostile)) == json.dumps(expected)  # acc5 is NaN (three classes), and NaN != NaN
    assert_nothing_ran(markers)


def test_shard_retrieval_decodes_only_image_and_captions(tmp_path):
    colours = ["red", "green", "blue", "red"]
    samples = [{"__key__": f"{i:03d}", "png": png_bytes(colour, tmp_path), "txt": "\n".join(captions)}
               for i, (colour, captions) in enumerate(zip(colours, RETRIEVAL_CAPTIONS))]
    clean, hostile, markers = write_shards(tmp_path, samples)
    for url in (clean, hostile):
        assert evaluate(resolve_task("wds-retrieval", data=url), caption_model()) == EXPECTED_RETRIEVAL
    assert_nothing_ran(markers)


def eval_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "eval_zeroshot.py"), *args, "--device", "cpu",
                           "--batch-size", "3", "--workers", "1", "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_eval_script_on_a_hostile_shard_runs_nothing_and_gives_the_clean_metrics(tmp_path):
    """The script on the hostile shard against the same evaluation in-process on the clean one
    (scripts/test_eval_zeroshot.py holds the script to the in-process evaluation)."""
    samples = [{"__key__": f"{i:03d}", "jpg": noise_jpeg(i), "cls": i % 5, "txt": f"caption {i}\nanother {i}"}
               for i in range(10)]
    clean, hostile, markers = write_shards(tmp_path / "shards", samples)
    torch.manual_seed(0)
    towers = build_model(ModelConfig(custom=TINY_CLIP))
    torch.save(towers.model.state_dict(), tmp_path / "tiny.pt")
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_CLIP))
    classnames = tmp_path / "classnames.txt"
    classnames.write_text("zero\none\ntwo\nthree\nfour\n")
    for task in ("wds", "wds-retrieval"):
        expected = run_task(resolve_task(task, data=clean, classnames=str(classnames)), towers.model, towers.tokenizer,
                            towers.val_transform, "cpu", batch_size=3, workers=0, progress=False)
        output = tmp_path / f"{task}.json"
        done = eval_script("--checkpoint", str(tmp_path / "tiny.pt"), "--model", str(tmp_path / "tiny.json"), "--task", task,
                           "--data", hostile, "--classnames", str(classnames), "--output", str(output))
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(output.read_text())["metrics"] == expected, task
    assert "image_retrieval_recall@1" in expected  # the last task was retrieval
    assert_nothing_ran(markers)


@pytest.mark.slow
def test_eval_sets_inside_training_on_a_hostile_shard(tmp_path, digits_root):
    samples = [{"__key__": f"{i:03d}", "png": png_bytes(["red", "green", "blue"][i % 3], tmp_path), "cls": i % 3,
                "txt": f"a picture number {i}"} for i in range(9)]
    clean, hostile, markers = write_shards(tmp_path / "shards", samples)
    classnames = tmp_path / "classnames.txt"
    classnames.write_text("red\ngreen\nblue\n")
    sets = ", ".join(f"{{task: {task}, name: {name}-{task}, data: '{url}', classnames: '{classnames}'}}"
                     for task in ("wds", "wds-retrieval") for name, url in (("clean", clean), ("hostile", hostile)))
    result = run_train(tiny_run(digits_root, tmp_path / "runs", "train.steps=2", "eval.workers=1", f"eval.sets=[{sets}]"))
    assert result.returncode == 0, result.stderr[-3000:]
    final = json.loads((tmp_path / "runs" / "tiny" / "eval" / "step_00000002.json").read_text())
    for task in ("wds", "wds-retrieval"):
        ours = {k.removeprefix(f"clean-{task}_"): v for k, v in final.items() if k.startswith(f"clean-{task}_")}
        theirs = {k.removeprefix(f"hostile-{task}_"): v for k, v in final.items() if k.startswith(f"hostile-{task}_")}
        assert ours and ours == theirs, task
    assert "zeroshot_acc1" in final  # the digits held-out set, a wds task like the others
    assert_nothing_ran(markers)


# --- image bombs ---------------------------------------------------------------------------


def jpeg_claiming(width: int, height: int) -> bytes:
    """A whole 16 x 16 JPEG whose frame header (SOF0) claims width x height pixels."""
    data = bytearray(noise_jpeg(0, size=16))
    sof = data.index(b"\xff\xc0")
    data[sof + 5: sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def png_claiming(width: int, height: int) -> bytes:
    """A 16 x 16 PNG whose IHDR chunk claims width x height pixels (its checksum redone, so PIL reads it)."""
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(out, "PNG")
    data = bytearray(out.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_the_bombs_claim_what_they_should():
    for bomb in (jpeg_claiming(BOMB_SIDE, BOMB_SIDE), png_claiming(BOMB_SIDE, BOMB_SIDE)):
        with pytest.raises(Image.DecompressionBombError):  # PIL's own check: over twice its bound
            Image.open(io.BytesIO(bomb))
    for bomb in (jpeg_claiming(5000, 4000), png_claiming(5000, 4000)):
        with Image.open(io.BytesIO(bomb)) as image:  # under PIL's bound: PIL would decode it
            assert image.size == (5000, 4000)


@pytest.mark.parametrize("decode", [True, False], ids=["loader-decodes", "device-header-parse"])
def test_image_bombs_are_skipped_and_counted_and_the_stream_goes_on(tmp_path, decode):
    bombs = {"005": ("jpg", jpeg_claiming(BOMB_SIDE, BOMB_SIDE)), "011": ("png", png_claiming(BOMB_SIDE, BOMB_SIDE))}
    with wds.TarWriter(str(tmp_path / "bombs.tar")) as sink:
        for i in range(18):
            key = f"{i:03d}"
            kind, image = bombs.get(key, ("jpg", noise_jpeg(i)))
            sink.write({"__key__": key, kind: image, "txt": f"caption {key}"})
    stream = ShardStream([str(tmp_path / "bombs.tar")], piece_size=4, rank=0, world_size=1, num_workers=1, seed=3,
                         image_transform=TRAIN, tokenizer=list, shuffle_buffer=1, split=SPLIT, keep_encoded=True,
                         decode=decode, keep_keys=True)
    pieces = iter(stream)
    first_epoch = [next(pieces) for _ in range(4)]  # 16 usable samples of 18
    assert sum(p["skipped_samples"] for p in first_epoch) == 2
    texts = [t for p in first_epoch for t in p["texts"]]
    assert sorted(texts) == [f"caption {i:03d}" for i in range(18) if f"{i:03d}" not in bombs]
    assert {epoch for epoch, _ in next(pieces)["sample_keys"]} == {1}  # and on into the next epoch


@pytest.mark.parametrize("decode", [True, False], ids=["loader-decodes", "device-header-parse"])
def test_data_max_image_pixels_bounds_images_from_the_header(decode):
    """A 5000 x 4000 header is under PIL's bound, so only our bound refuses it; on the device path
    nothing else would (the header is all the worker reads), and the GPU would allocate for it."""
    raw = {"__key__": "big", "jpg": jpeg_claiming(5000, 4000), "txt": b"a big picture"}
    assert load_sample(raw, TRAIN, SPLIT, True, decode, max_pixels=5000 * 4000 - 1) is None
    small = {"__key__": "small", "jpg": noise_jpeg(1), "txt": b"a small picture"}
    assert load_sample(small, TRAIN, SPLIT, True, decode, max_pixels=32 * 32) is not None
    assert load_sample(small, TRAIN, SPLIT, True, decode, max_pixels=32 * 32 - 1) is None
    with pytest.raises(ImageTooLarge, match="5000 x 4000"):
        open_image(raw["jpg"], max_pixels=10**6)


def test_a_bound_above_pils_lets_larger_images_through(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    header = jpeg_claiming(20_000, 10_000)  # 200 M pixels: over twice PIL's bound, which PIL refuses itself
    with pytest.raises(ImageTooLarge, match="more pixels than PIL allows"):
        open_image(header)
    with open_image(header, max_pixels=250_000_000) as image:
        assert image.size == (20_000, 10_000)


def test_data_max_image_pixels_key():
    assert load_config(DIGITS_YAML, []).data.max_image_pixels == Image.MAX_IMAGE_PIXELS
    assert load_config(DIGITS_YAML, ["data.max_image_pixels=1000"]).data.max_image_pixels == 1000
    with pytest.raises(ConfigError, match="data.max_image_pixels"):
        load_config(DIGITS_YAML, ["data.max_image_pixels=0"])


def test_a_bug_in_the_transform_is_not_counted_as_a_corrupt_sample():
    def broken_transform(image):
        raise KeyError("a bug of ours")

    raw = {"__key__": "0", "jpg": noise_jpeg(0), "txt": b"a caption"}
    with pytest.raises(KeyError, match="a bug of ours"):
        load_sample(raw, broken_transform, None, False)


def test_evaluation_skips_an_image_bomb_naming_it(tmp_path):
    with wds.TarWriter(str(tmp_path / "eval.tar")) as sink:
        for i in range(4):
            image = jpeg_claiming(BOMB_SIDE, BOMB_SIDE) if i == 2 else noise_jpeg(i)
            sink.write({"__key__": f"{i:03d}", "jpg": image, "cls": i})
    items = list(shard_classification(str(tmp_path / "eval.tar"), T.ToTensor()))
    skipped = [item for item in items if isinstance(item, Skipped)]
    assert [label for item in items if not isinstance(item, Skipped) for _, label in [item]] == [0, 1, 3]
    assert len(skipped) == 1 and skipped[0].where.endswith("eval.tar: sample 002.jpg")
    assert re.search(rf"{BOMB_SIDE ** 2} pixels", skipped[0].reason)


# --- checkpoints ---------------------------------------------------------------------------


def pickled_checkpoint(path: Path, state_dict: dict, marker: Path) -> Path:
    """A loadable-looking checkpoint that also holds an object whose unpickling creates `marker`."""
    torch.save({"state_dict": state_dict, "extra": WritesMarker(marker)}, path)
    return path


@pytest.fixture
def tiny_clip():
    torch.manual_seed(0)
    return build_model(ModelConfig(custom=TINY_CLIP)).model


def test_model_pretrained_with_a_pickled_object_is_refused_by_name(tmp_path, tiny_clip):
    marker = tmp_path / "ran"
    path = pickled_checkpoint(tmp_path / "evil.pt", tiny_clip.state_dict(), marker)
    with pytest.raises(PickledObjectError, match=rf"{path}.*pickled Python objects \(io.open\)"):
        load_clip_checkpoint(tiny_clip, str(path))
    array = tmp_path / "evil.npy"  # open_clip reads .npy/.npz (big_vision) weights with np.load
    np.save(array, np.array([WritesMarker(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(PickledObjectError, match=rf"{array}.*numpy object array"):
        load_clip_checkpoint(tiny_clip, str(array))
    assert not marker.exists()


def test_model_pretrained_image_with_a_pickled_object_is_refused_by_name(tmp_path):
    custom = {**TINY_CLIP, "vision_cfg": {"image_size": 32, "timm_model_name": "test_resnet", "timm_pool": "avg",
                                          "timm_proj": "linear"}}
    visual = build_model(ModelConfig(custom=custom)).model.visual
    marker = tmp_path / "ran"
    path = pickled_checkpoint(tmp_path / "evil-timm.pt", visual.trunk.state_dict(), marker)
    with pytest.raises(PickledObjectError, match=str(path)):
        load_timm_trunk(visual, str(path))
    assert not marker.exists()


@pytest.mark.slow
def test_train_py_refuses_a_pickled_model_pretrained_with_one_error_line(tmp_path, digits_root, tiny_clip):
    marker = tmp_path / "ran"
    path = pickled_checkpoint(tmp_path / "evil.pt", tiny_clip.state_dict(), marker)
    custom = "model.custom=" + json.dumps(TINY_CLIP)
    result = run_train(tiny_run(digits_root, tmp_path / "runs", "train.steps=1", custom, f"model.pretrained={path}"))
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(path) in errors[0] and "pickled" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_eval_script_refuses_a_pickled_checkpoint_with_one_error_line(tmp_path, tiny_clip):
    marker = tmp_path / "ran"
    path = pickled_checkpoint(tmp_path / "evil.pt", tiny_clip.state_dict(), marker)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_CLIP))
    (tmp_path / "val" / "a").mkdir(parents=True)
    for model in ([], ["--model", str(tmp_path / "tiny.json")]):  # config read from the checkpoint, or given
        done = eval_script("--checkpoint", str(path), *model, "--task", "imagefolder", "--data", str(tmp_path / "val"))
        assert done.returncode == 2, done.stderr[-3000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and str(path) in errors[0] and "pickled" in errors[0], done.stderr[-3000:]
        assert "Traceback" not in done.stderr
    assert not marker.exists()


def test_resume_names_and_skips_a_checkpoint_holding_a_pickled_object(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "runs" / "tiny" / "checkpoints"
    save_checkpoint(folder, 2, {"step": 2, "state_dict": {"w": torch.ones(2)}})
    pickled_checkpoint(folder / "step_00000004.pt", {"w": torch.ones(2)}, marker)
    lines = []
    path, checkpoint = load_latest(folder, report=lines.append)
    assert path.name == "step_00000002.pt" and checkpoint["step"] == 2
    assert "step_00000004.pt" in lines[0] and "pickled Python objects" in lines[0]
    (folder / "step_00000002.pt").unlink()
    with pytest.raises(CheckpointError, match="step_00000004.pt: PickledObjectError"):
        load_latest(folder, report=lines.append)
    assert not marker.exists()


# --- Hugging Face towers -------------------------------------------------------------------


def test_a_hugging_face_folder_with_code_of_its_own_is_refused(tmp_path):
    """transformers would offer to import modeling.py (it asks when no trust_remote_code is given)."""
    folder = tmp_path / "hf-with-code"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "modeling.py").write_text(f"open({str(marker)!r}, 'w')\n")
    (folder / "config.json").write_text(json.dumps({"model_type": "clipscale-test-remote", "hidden_size": 32,
                                                    "auto_map": {"AutoConfig": "modeling.Config", "AutoModel": "modeling.Model"}}))
    custom = {**TINY_CLIP, "text_cfg": {"context_length": 16, "hf_model_name": str(folder), "hf_tokenizer_name": str(folder),
                                        "hf_pooler_type": "mean_pooler", "hf_proj_type": "linear"}}
    with pytest.raises(UserError, match=rf"model.custom.text_cfg.hf_model_name: {folder}/config.json names Python code"):
        build_model(ModelConfig(custom=custom))
    assert not marker.exists()


def test_evaluation_skips_the_sample_whose_image_does_not_decode_naming_it(tmp_path):
    with wds.TarWriter(str(tmp_path / "eval.tar")) as sink:
        sink.write({"__key__": "000", "jpg": noise_jpeg(0), "cls": 0})
        sink.write({"__key__": "001", "jpg": noise_jpeg(1)[:200], "cls": 1})  # cut short
    items = list(shard_classification(str(tmp_path / "eval.tar"), T.ToTensor()))
    assert items[0][1] == 0 and items[1] == Skipped(f"{tmp_path / 'eval.tar'}: sample 001.jpg", items[1].reason)
    assert items[1].reason.startswith("OSError")


# --- evaluation folders --------------------------------------------------------------------

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n%%EndComments\nnewpath 0 0 moveto 16 16 lineto stroke\nshowpage\n"


def test_folder_images_never_open_as_a_format_that_runs_a_program(tmp_path):
    """PIL opens by content whatever the name: a PostScript file named .jpg is EPS to it, which it
    renders by running Ghostscript. Folder and COCO sets open only image formats."""
    (tmp_path / "val" / "a").mkdir(parents=True)
    (tmp_path / "val" / "a" / "0.jpg").write_bytes(EPS)
    with Image.open(tmp_path / "val" / "a" / "0.jpg") as image:
        assert image.format == "EPS"  # what PIL alone would do
    folder = LabelledFolder(str(tmp_path / "val"), T.ToTensor())  # a file it will not open is skipped, and why
    assert folder[0].reason.startswith(UnidentifiedImageError.__name__)
    (tmp_path / "val" / "a" / "0.jpg").write_bytes(png_claiming(BOMB_SIDE, BOMB_SIDE))
    assert re.match(rf"{ImageTooLarge.__name__}: .*0.jpg: .*more pixels than PIL allows", folder[0].reason)
