"""eval.val_data (open_clip's --val-data): val_loss and retrieval recalls during training and at
the end, checked against the figures computed here, apart from the trainer, from the run's
final open_clip weights and the validation shards read with webdataset."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import webdataset as wds
import open_clip

from clipscale.config import load_config
from clipscale.distributed import World
from clipscale.eval.validation import Validation
from clipscale.metrics import read_metrics
from clipscale.models import build_model

from tests.helpers.user_data import write_csv, write_img2dataset_shards
from tests.helpers.tiny_runs import DIGITS_YAML, TINY_MODEL, run_train

VAL_BATCH = 8  # 20 validation samples: batches of 8, 8 and 4


def expected_figures(run_dir, val_pattern) -> dict:
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{run_dir}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{run_dir}")
    model.eval()
    samples = list(wds.WebDataset(val_pattern, shardshuffle=False, empty_check=False).decode("pil"))
    with torch.no_grad():
        images = F.normalize(model.encode_image(torch.stack([preprocess(s["jpg"]) for s in samples])), dim=-1)
        texts = F.normalize(model.encode_text(tokenizer([s["txt"] for s in samples])), dim=-1)
        scale = model.logit_scale.exp()
        total = 0.0
        for start in range(0, len(samples), VAL_BATCH):
            logits = scale * images[start:start + VAL_BATCH] @ texts[start:start + VAL_BATCH].T
            labels = torch.arange(len(logits))
            total += float(F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2 * len(logits)
        similarity = texts @ images.T
    return {"val_loss": total / len(samples),
            "val_image_retrieval_recall@1": float((similarity.argmax(1) == torch.arange(len(samples))).double().mean()),
            "val_text_retrieval_recall@1": float((similarity.argmax(0) == torch.arange(len(samples))).double().mean())}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_validation_set_gives_loss_and_retrieval_at_each_evaluation_and_the_end(tmp_path, nproc):
    train = write_img2dataset_shards(tmp_path / "train", shards=4, per_shard=16)
    val = write_img2dataset_shards(tmp_path / "val", shards=2, per_shard=10, prefix="held out ")
    result = run_train([TINY_MODEL, "data.kind=webdataset", f"data.train_shards={train}", f"eval.val_data={val}",
                        f"run.output_dir={tmp_path / 'runs'}", "run.name=val", "train.batch_size=16", "train.steps=4",
                        "train.log_every=2", "eval.every_n_steps=2", "eval.zeroshot=false",
                        f"eval.batch_size={VAL_BATCH}", "data.workers=1"], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluations = {m["step"]: m for m in read_metrics(tmp_path / "runs" / "val" / "metrics.jsonl") if "val_loss" in m}
    assert sorted(evaluations) == [2, 4]
    for metrics in evaluations.values():
        for k in (1, 5, 10):
            assert 0 <= metrics[f"val_image_retrieval_recall@{k}"] <= metrics.get(f"val_image_retrieval_recall@{k + 5}", 1)
            assert f"val_text_retrieval_recall@{k}" in metrics
    expected = expected_figures(tmp_path / "runs" / "val", val)
    final = evaluations[4]
    assert final["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-4)
    assert final["val_image_retrieval_recall@1"] == expected["val_image_retrieval_recall@1"]
    assert final["val_text_retrieval_recall@1"] == expected["val_text_retrieval_recall@1"]
    assert "step 4: val_loss" in result.stdout + result.stderr


def test_a_csv_validation_set_gives_the_figures_of_the_same_pairs_in_shards(tmp_path):
    """The .csv table is read by the training reader, with data.csv_*'s columns, as shards are."""
    table = write_csv(tmp_path / "csv", rows=12, separator=",", image_column="path", caption_column="text",
                      missing={5})
    with wds.TarWriter(str(tmp_path / "val.tar")) as sink:
        for i in range(12):
            if i != 5:  # the missing image: skipped in both
                image = (tmp_path / "csv" / "images" / f"{i}.png").read_bytes()
                sink.write({"__key__": f"{i:03d}", "png": image, "txt": f"a csv caption {i}".encode()})
    csv_keys = ['data.csv_separator=","', "data.csv_image_key=path", "data.csv_caption_key=text"]
    figures = {}
    for name, val_data in {"csv": table, "shards": tmp_path / "val.tar"}.items():
        cfg = load_config(DIGITS_YAML, [TINY_MODEL, f"eval.val_data={val_data}", f"eval.batch_size={VAL_BATCH}", *csv_keys])
        torch.manual_seed(0)
        towers = build_model(cfg.model)
        figures[name] = Validation(cfg, towers, World(), None)(towers.model)
    assert figures["csv"].pop("val_num_skipped") == 1 and figures["shards"].pop("val_num_skipped") == 0  # the missing image
    assert figures["csv"] == figures["shards"]
    assert sorted(figures["csv"]) == sorted(["val_loss", "val_num_samples"] + [
        f"val_{way}_retrieval_recall@{k}" for way in ("image", "text") for k in (1, 5, 10)])
    assert figures["csv"]["val_num_samples"] == 11
