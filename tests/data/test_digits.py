"""The embedded digits (clipscale/data/digits.py): train and held-out shards that do not overlap,
captions in templates the zero-shot prompts do not use, and jobs that write them at once on one data
root all get them whole."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import webdataset as wds

from clipscale.data.digits import CAPTION_TEMPLATES, ZEROSHOT_TEMPLATES

from tests.helpers.tiny_runs import REPO


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


@pytest.mark.slow
def test_jobs_that_start_together_on_one_data_root_all_get_the_digits_shards(tmp_path):
    """Two jobs sharing `data.root` do not race on one half-written folder (a FileNotFoundError)."""
    write = "import sys; from clipscale.data.digits import write_digits_shards; write_digits_shards(sys.argv[1], 32)"
    jobs = [subprocess.Popen([sys.executable, "-c", write, str(tmp_path)], cwd=REPO, stderr=subprocess.PIPE, text=True)
            for _ in range(3)]
    errors = [job.communicate(timeout=120)[1] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0, 0], errors
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    shards = manifest["train_shards"] + manifest["val_shards"]
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == sorted(shards)
    assert not list(tmp_path.glob(".partial-*"))
    assert sum(1 for name in manifest["val_shards"] for _ in wds.WebDataset(str(tmp_path / name), shardshuffle=False)) \
        == manifest["num_val"]
