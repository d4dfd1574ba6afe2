"""FSDP's sharded checkpoints under NCCL on two GPUs, through real train.py runs (`-m gpu`).

The CPU suite holds the same promises in gloo worlds (test_fsdp_checkpoint.py); here the
collectives are NCCL's, the shards live on the GPUs and DCP writes them from there:
- a run under FSDP on two GPUs, SIGKILLed just after its step-4 checkpoint (step file renamed,
  its DCP folder written), resumes on the uninterrupted FSDP run's curve;
- a DDP run killed the same way resumes under FSDP, and an FSDP run under DDP, both on the
  uninterrupted curve;
- an FSDP run killed the same way on two GPUs resumes on one (DCP reshards its two shards), on the
  curve of the run never interrupted on two.
The towers are eager (model.compile=false: eight tiny runs, each compile would take longer than
the training) and the loss is Inf-CL's reference (deterministic; the Triton kernels have their
own two-GPU tests in tests/losses/infcl/test_gpu_kernels.py).
"""

from __future__ import annotations

import pytest
import torch

from clipscale.models import OPEN_CLIP_WEIGHTS
from tests.helpers.trainer_harness import checked, launch, load, max_difference, shard_run, step_checkpoints, training_records, write_shards
from tests.helpers.trainer_plugins import KILL_AT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
STEPS, BATCH = 6, 48


def _overrides(shards, root, name, parallel, *extra):
    return shard_run(shards, root, name, f"train.steps={STEPS}", f"train.batch_size={BATCH}", "train.chunk_size=8",
                     "train.checkpoint_every=2", "train.log_every=1", "data.shuffle_buffer=1", "run.device=cuda",
                     "model.compile=false", f"train.parallel={parallel}", "loss.name=infcl",
                     "loss.options={backend: reference}", *extra)


def _losses(run_dir):
    """step -> loss; a resumed run's records of the steps it repeats replace the first ones."""
    return {m["step"]: m["loss"] for m in training_records(run_dir)}


@pytest.fixture(scope="module")
def runs(module_tmp):
    root = module_tmp("gpu_fsdp")
    shards = write_shards(root / "shards", shards=2, per_shard=BATCH, uniform=True)
    for parallel in ("fsdp", "ddp"):
        checked(launch(_overrides(shards, root, parallel, parallel), nproc=2))
    for first, then in (("fsdp", "fsdp"), ("ddp", "fsdp"), ("fsdp", "ddp")):
        name = f"{first}_then_{then}"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(KILL_AT, "after_rename:step_00000004.pt")
            died = launch(_overrides(shards, root, name, first), nproc=2)
        assert died.returncode != 0 and max(step_checkpoints(root / name)) == 4, died.stderr[-3000:]
        checked(launch(_overrides(shards, root, name, then), nproc=2))
    return root


def test_a_killed_fsdp_run_resumes_from_its_shards_on_the_uninterrupted_curve(runs):
    checkpoint = load(step_checkpoints(runs / "fsdp_then_fsdp")[4])
    assert checkpoint["sharded"] == "step_00000004.dcp"
    assert sorted(p.name for p in (runs / "fsdp_then_fsdp" / "checkpoints" / "step_00000004.dcp").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert _losses(runs / "fsdp_then_fsdp") == pytest.approx(_losses(runs / "fsdp"), rel=1e-5)
    final = torch.load(runs / "fsdp_then_fsdp" / OPEN_CLIP_WEIGHTS, map_location="cpu", weights_only=True)
    uninterrupted = torch.load(runs / "fsdp" / OPEN_CLIP_WEIGHTS, map_location="cpu", weights_only=True)
    assert max_difference(final, uninterrupted) < 1e-5


@pytest.mark.parametrize("name", ["ddp_then_fsdp", "fsdp_then_ddp"])
def test_a_checkpoint_of_one_kind_resumes_under_the_other_on_the_same_curve(runs, name):
    """FSDP and DDP reduce in other orders (reduce-scatter against all-reduce), so the curves
    agree to float32 rounding, not bit for bit."""
    assert _losses(runs / name) == pytest.approx(_losses(runs / "ddp"), rel=1e-4), name
    final = torch.load(runs / name / OPEN_CLIP_WEIGHTS, map_location="cpu", weights_only=True)
    uninterrupted = torch.load(runs / "ddp" / OPEN_CLIP_WEIGHTS, map_location="cpu", weights_only=True)
    assert max_difference(final, uninterrupted) < 1e-4, name


def test_an_fsdp_run_killed_on_two_gpus_resumes_on_one_on_the_same_curve(runs):
    """The same global batch on another number of GPUs: the epochs' order and the batches do not
    depend on the shape, so only the reductions' order differs (float32 rounding)."""
    shards = write_shards(runs / "shards", shards=2, per_shard=BATCH, uniform=True)  # the same files again: their pattern
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KILL_AT, "after_rename:step_00000004.pt")
        died = launch(_overrides(shards, runs, "two_then_one", "fsdp"), nproc=2)
    assert died.returncode != 0 and max(step_checkpoints(runs / "two_then_one")) == 4, died.stderr[-3000:]
    checked(launch(_overrides(shards, runs, "two_then_one", "fsdp"), nproc=1))
    assert _losses(runs / "two_then_one") == pytest.approx(_losses(runs / "fsdp"), rel=1e-4)
    final = torch.load(runs / "two_then_one" / OPEN_CLIP_WEIGHTS, map_location="cpu", weights_only=True)
    uninterrupted = torch.load(runs / "fsdp" / OPEN_CLIP_WEIGHTS, map_location="cpu", weights_only=True)
    assert max_difference(final, uninterrupted) < 1e-4
