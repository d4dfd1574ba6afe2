"""Host memory of the training data path grows with the batch as two batches of uint8, no more.

The trainer's own data path (`TrainingBatches`: loader workers decoding pieces, gathered one
batch ahead) runs in a child process at two batch sizes, measured from outside: the memory each
process allocated (its anonymous and shared memory's PSS; see ALLOCATED), and the whole tree's
PSS as scripts/bench_e2e.py measures it on the GPU. Per added sample:

  * the trainer process, which holds this batch and the next, grows by at most 2.5 times one
    sample's uint8 pixels (two batches, their tokens, slack);
  * the loader workers, which hold pieces and never a batch, grow by less than one sample's
    pixels (their allocator's high-water mark drifts by tens of MB from run to run, whatever
    the batch: measured together with the trainer it once made the tree look like 2.67x);
  * no moment of the run holds half a batch more than the steady state (a transient copy).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading

import pytest

from clipscale.data.epoch import MIN_SLOTS
from tests.helpers.tiny_runs import DIGITS_YAML, REPO

pytestmark = pytest.mark.slow

SIZE = 160  # the model's input: 3 * 160 * 160 = 76,800 uint8 bytes a sample: a batch of 2,048 is 157 MB,
# far above the tens of MB the workers' allocator drifts by from run to run
CHILD = """
import sys
from clipscale.checks import plan_run
from clipscale.config import load_config
from clipscale.distributed import World
from clipscale.models import build_model
from clipscale.data.pipeline import TrainingBatches

cfg = load_config(sys.argv[1], sys.argv[2:])
towers = build_model(cfg.model)
batches = TrainingBatches(cfg, plan_run(cfg, World()), World(), towers.train_transform, towers.tokenizer, cfg.train.chunk_size)
for step in range(cfg.train.steps):  # each gathered while the one before is held: both slots full
    with batches.next() as batch:  # used at once: leaving it waits for every piece
        if step == cfg.train.steps - 1:  # measured while the last batch is in use, as a step holds it
            batch.arrivals.wait_for(len(batch))
            print("HELD", flush=True)
            sys.stdin.readline()
batches.close()
"""


def _bench_e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", REPO / "scripts" / "bench_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def jpeg_shards(module_tmp) -> str:
    """2,048 JPEGs in MIN_SLOTS (64) shards: an epoch is at least MIN_SLOTS slots, and a shard cut into k
    of them is read (its tar headers parsed) k times an epoch: 2 shards of 1,024 read 32 times an epoch
    were three quarters of this test's time."""
    root = module_tmp("jpeg176")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_synthetic_shards.py"), "--out", str(root), "--shards", str(MIN_SLOTS),
                    "--per-shard", str(2048 // MIN_SLOTS), "--size", "176"], check=True, capture_output=True, timeout=120)
    return str(root / f"synthetic-{{0000..{MIN_SLOTS - 1:04d}}}.tar")


# What the data path allocates: anonymous memory and shared memory (the pieces). Not file-backed pages:
# a library's PSS is split over every process mapping it, so it moves whenever another test's processes
# start or end beside this one (under xdist the loader workers once "grew" by 1.34 samples' pixels a sample).
ALLOCATED = ("Pss_Anon:", "Pss_Shmem:")


def _allocated(pid: int) -> int:
    try:
        lines = open(f"/proc/{pid}/smaps_rollup").read().splitlines()
    except (FileNotFoundError, ProcessLookupError):  # a helper process that ended meanwhile
        return 0
    found = [int(line.split()[1]) * 1024 for line in lines if line.startswith(ALLOCATED)]
    if len(found) != len(ALLOCATED):
        raise AssertionError(f"no {ALLOCATED} in /proc/{pid}/smaps_rollup")
    return sum(found)


def _measure(shards: str, batch_size: int, tmp_path) -> dict[str, int]:
    """Memory allocated (ALLOCATED) by the trainer process and by its loader workers while it holds
    both batches; the process tree's PSS then and its peak through the run."""
    model = ("model.custom={embed_dim: 32, vision_cfg: {image_size: %d, patch_size: 32, width: 64, layers: 1, "
             "head_width: 32}, text_cfg: {context_length: 16, vocab_size: 49408, width: 64, heads: 2, layers: 1}}" % SIZE)
    overrides = [model, "data.kind=webdataset", f"data.train_shards={shards}",
                 f"train.batch_size={batch_size}", "train.chunk_size=256", f"train.steps={SAMPLES // batch_size}",
                 f"run.output_dir={tmp_path}"]
    child = subprocess.Popen([sys.executable, "-c", CHILD, DIGITS_YAML, *overrides], cwd=REPO, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    bench_e2e = _bench_e2e()
    sampler, watchdog = bench_e2e.Sampler(child.pid), threading.Timer(240, child.kill)
    sampler.start(), watchdog.start()
    # Measured while the child holds both batches, and sampled through the run: a sampler alone
    # can miss the moment under a loaded CPU (it once saw 0.76 of a batch).
    output, held = [], {}
    for line in child.stdout:
        output.append(line)
        if line.strip() == "HELD":
            trainer = _allocated(child.pid)
            workers = sum(_allocated(pid) for pid in bench_e2e.process_tree(child.pid) if pid != child.pid)
            held = {"trainer": trainer, "workers": workers, "tree": bench_e2e.tree_pss_bytes(child.pid)}
            child.stdin.write("\n")
            child.stdin.flush()
    child.wait()
    watchdog.cancel()
    sampler.done.set()
    sampler.join()
    assert child.returncode == 0 and held, "".join(output)[-3000:]
    return {**held, "peak": max(sampler.host, held["tree"])}


SMALL, LARGE = 256, 2048
# Both sizes read the same samples (two large batches, or sixteen small ones): what the loader workers'
# allocator keeps grows with the samples decoded (measured: 0.83 of a sample's pixels a sample, batch
# 512 then 8,192), and that must not pass for a batch held in a worker.
SAMPLES = 2 * LARGE


def test_host_memory_grows_by_at_most_two_and_a_half_uint8_batches(jpeg_shards, tmp_path):
    """With the default loader workers: batch 256 against 2,048, the same samples read."""
    small, large = _measure(jpeg_shards, SMALL, tmp_path), _measure(jpeg_shards, LARGE, tmp_path)
    uint8_sample = 3 * SIZE * SIZE
    growth = {part: (large[part] - small[part]) / (LARGE - SMALL) / uint8_sample for part in ("trainer", "workers")}
    print(f"per added sample, in uint8 samples: {growth}; {small=}, {large=}")
    assert 1.0 <= growth["trainer"] <= 2.5, f"the trainer process: {growth['trainer']:.2f}x a sample's pixels"
    assert growth["workers"] < 1.0, f"the loader workers: {growth['workers']:.2f}x a sample's pixels (a batch in a worker?)"
    transient = (large["peak"] - large["tree"]) / (LARGE * uint8_sample)
    assert transient <= 0.5, f"a moment of the run held {transient:.2f} of a batch more than both batches held"
