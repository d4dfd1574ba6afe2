"""Each rank's CUDA work stays on its own GPU, the data path's threads included (`-m gpu`, two GPUs).

A new thread starts on CUDA device 0 whatever the main thread chose, and a thread that
registers pinned memory or runs the JPEG decoder there creates a context on GPU 0: on two
GPUs, rank 1's data threads then put a context (and the decoder's buffers) beside rank 0's
training. Measured through NVML from inside a real two-process train.py run that decodes on
the GPU (`data.decoder=device`): after a step each process, and the JPEG decoding process it
started, holds a context on its own GPU only.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.trainer_harness import checked, launch, shard_run, write_shards

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def test_every_rank_and_its_data_threads_hold_a_context_on_their_own_gpu_only(tmp_path):
    shards = write_shards(tmp_path / "shards", shards=2, per_shard=64)
    checked(launch(shard_run(shards, tmp_path, "devices", "train.steps=3", "train.batch_size=64", "train.chunk_size=16",
                             "run.device=cuda", "data.decoder=device", "data.workers=2", "model.compile=false",
                             "loss.name=gpus_in_use", f"loss.options={{folder: {tmp_path}}}"), nproc=2))
    held = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    assert held == {0: [0], 1: [1]}, held
