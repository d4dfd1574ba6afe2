"""Checkpoints under train.parallel=fsdp, through real train.py runs: every rank writes its shards
into a folder of torch.distributed.checkpoint beside the step file; a run stopped on 2 processes
under FSDP resumes on 3 under FSDP and on 2 under DDP, and one stopped on 2 under DDP resumes
under FSDP on one process (a world of one: FSDP's device mesh of one) and on two, each on the
uninterrupted one-process curve; the run's final weights are one open_clip file. A whole (DDP)
checkpoint is read by rank 0 alone, which broadcasts the weights to the other ranks' shards.

As in test_distributed.py, one shard of `MIN_SLOTS` flat-colour images (a sample a slot of the
epochs' order), so every world size trains on the same global batches, before and after a resume
on another one.
"""

from __future__ import annotations

import shutil

import open_clip
import pytest
import torch

from clipscale.checkpoint import load_latest, remove_partial_saves, save_checkpoint, sharded_folder, temporary_name
from clipscale.data.epoch import MIN_SLOTS
from clipscale.models import OPEN_CLIP_WEIGHTS
from tests.helpers.trainer_harness import checked, launch, load, max_difference, newest_checkpoint, shard_run, step_checkpoints, training_records, write_shards
from tests.helpers.trainer_plugins import READS_TO

STEPS, BATCH = 6, 24


def _overrides(shards, root, name, parallel, **faults):
    options = "".join(f", {k}: {v}" for k, v in faults.items())
    return shard_run(shards, root, name, f"train.steps={STEPS}", f"train.batch_size={BATCH}", "train.chunk_size=8",
                     "train.checkpoint_every=2", "train.keep_checkpoints=2", "train.log_every=1", "data.workers=1", "data.shuffle_buffer=1",
                     f"train.parallel={parallel}", "loss.name=scripted_faults",
                     f"loss.options={{inner: infcl, inner_options: {{backend: reference, tile_size: 4}}{options}}}")


def _stopped_at_step_4(shards, root, name, parallel, nproc):
    """A run on `nproc` processes that rank 1's SIGUSR1 in step 4 stops after its checkpoint."""
    faults = dict(signal_calls=[4], signal_rank=1, signal_marker=root / f"{name}.signalled")
    stopped = launch(_overrides(shards, root, name, parallel, **faults), nproc=nproc, timeout=300)
    assert stopped.returncode != 0 and sorted(step_checkpoints(root / name)) == [2, 4], stopped.stderr[-3000:]
    return faults


@pytest.fixture(scope="module")
def runs(module_tmp):
    root = module_tmp("fsdp_checkpoints")
    shards = write_shards(root / "shards", shards=1, per_shard=MIN_SLOTS, uniform=True)
    checked(launch(_overrides(shards, root, "single", "ddp")))
    faults = _stopped_at_step_4(shards, root, "fsdp", "fsdp", nproc=2)
    shutil.copytree(root / "fsdp", root / "fsdp_then_ddp")
    checked(launch(_overrides(shards, root, "fsdp", "fsdp", **faults), nproc=3, timeout=300))
    checked(launch(_overrides(shards, root, "fsdp_then_ddp", "ddp", **faults), nproc=2, timeout=300))
    faults = _stopped_at_step_4(shards, root, "ddp_then_fsdp", "ddp", nproc=2)
    shutil.copytree(root / "ddp_then_fsdp", root / "ddp_then_fsdp_on_2")
    checked(launch(_overrides(shards, root, "ddp_then_fsdp", "fsdp", **faults), nproc=1, timeout=300))
    (root / "reads").mkdir()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(READS_TO, str(root / "reads"))
        checked(launch(_overrides(shards, root, "ddp_then_fsdp_on_2", "fsdp", **faults), nproc=2, timeout=300))
    return root


@pytest.mark.slow
def test_every_rank_writes_its_shards_and_the_step_file_names_them(runs):
    folder = runs / "fsdp" / "checkpoints"
    checkpoint = load(folder / "step_00000004.pt")
    assert "state_dict" not in checkpoint and checkpoint["sharded"] == "step_00000004.dcp"
    for step, ranks in ((4, 2), (6, 3)):  # written on 2 processes, then on 3
        written = sorted(p.name for p in (folder / f"step_{step:08d}.dcp").iterdir())
        assert written == [".metadata", *(f"__{rank}_0.distcp" for rank in range(ranks))], written
    assert not list(folder.glob(".*.tmp")), "no temporary folder is left"
    # train.keep_checkpoints=2: step 2's file was pruned, and its folder with it
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_00000004.dcp", "step_00000004.pt",
                                                        "step_00000006.dcp", "step_00000006.pt"]


@pytest.mark.slow
def test_resumed_runs_continue_the_uninterrupted_curve(runs):
    single_losses = [m["loss"] for m in training_records(runs / "single")]
    single = newest_checkpoint(runs / "single")["state_dict"]
    for name in ("fsdp", "fsdp_then_ddp", "ddp_then_fsdp", "ddp_then_fsdp_on_2"):
        assert [m["loss"] for m in training_records(runs / name)] == pytest.approx(single_losses, rel=1e-4), name
        final = torch.load(runs / name / OPEN_CLIP_WEIGHTS, map_location="cpu", weights_only=True)
        assert max_difference(final, single) < 4e-5, name


@pytest.mark.slow
def test_a_whole_checkpoint_resumed_under_fsdp_is_read_by_rank_0_alone(runs):
    """Rank 0 reads the step file and broadcasts the weights: no other process holds the whole
    file (for ViT-bigG some 30 GB of host memory a process)."""
    reads = {path.name: path.read_text().split() for path in (runs / "reads").iterdir()}
    assert reads == {"rank0": ["step_00000004.pt"]}, reads


@pytest.mark.slow
def test_the_final_weights_are_one_open_clip_file(runs):
    model = open_clip.create_model(f"local-dir:{runs / 'fsdp'}")
    weights = torch.load(runs / "fsdp" / OPEN_CLIP_WEIGHTS, map_location="cpu", weights_only=True)
    assert max_difference(model.state_dict(), weights) == 0.0


def test_a_step_file_whose_shards_are_missing_is_named_and_the_one_before_it_loads(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (2, 4):
        (folder / sharded_folder(step)).mkdir(parents=True)
        (folder / sharded_folder(step) / ".metadata").write_bytes(b"")
        save_checkpoint(folder, step, {"step": step, "sharded": sharded_folder(step)})
    (folder / sharded_folder(4) / ".metadata").unlink()  # a folder whose writing was cut short
    said = []
    path, checkpoint = load_latest(folder, report=said.append)
    assert checkpoint["step"] == 2 and "step_00000004.dcp are missing" in said[0], said


def test_a_killed_sharded_save_leaves_a_temporary_folder_that_the_next_start_removes(tmp_path):
    partial = temporary_name(tmp_path / "checkpoints" / sharded_folder(6))
    (partial / "__0_0.distcp").parent.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"part")
    assert remove_partial_saves(tmp_path) == [partial] and not partial.exists()


@pytest.mark.slow
def test_a_step_whose_shards_do_not_load_stops_with_one_line_naming_them(runs):
    """A shard file damaged after its save (not missing: that falls back, above) stops the resume
    with one error line naming the folder and the way on, not a traceback."""
    shutil.copytree(runs / "fsdp", runs / "damaged")
    shard = runs / "damaged" / "checkpoints" / "step_00000006.dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    shards = str(runs / "shards" / "part-{0000..0000}.tar")
    as_stopped = dict(signal_calls=[4], signal_rank=1, signal_marker=runs / "fsdp.signalled")  # the fixture's run, whose signal is spent
    resumed = launch([*_overrides(shards, runs, "damaged", "fsdp", **as_stopped), f"train.steps={STEPS + 2}", "run.extend_steps=true"])
    last = resumed.stderr.strip().splitlines()[-1]
    assert resumed.returncode != 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert last.startswith("error:") and "step_00000006.dcp do not load" in last and "step_00000006.pt aside" in last, last
