"""train.parallel=fsdp trains what DDP trains: in real gloo worlds of 2 and 3 processes, several
training steps (Gradient Cache over uneven chunks, dropout and patch dropout on, gradient
clipping, AdamW) give the same losses, gradient norms and weights under FSDP2 as under DDP,
for the `local` loss and the Inf-CL ring, with the gradients reduce-scattered after every chunk
or once a step. SigLIP's logit_bias (a second replicated scalar), a LiT-locked image tower,
train.fsdp_offload's path, activation checkpointing and compiled blocks are covered too.

Each world trains under FSDP, under DDP and with a reference that has neither Gradient Cache nor
a wrapper (one graph over a rank's chunks, gradients averaged by hand), from the same initial
weights, the same per-rank batches and the same per-rank random seeds, so dropout draws the
same masks in all three.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from clipscale.compile import compile_towers
from clipscale.config import ConfigError, ModelConfig, OptimConfig, load_config
from clipscale.distributed import World
from clipscale.losses import build_loss
from clipscale.metrics import read_metrics
from clipscale.models import build_model
from clipscale.optim import build_optimizer
from clipscale.parallel import ParallelError, gathered, parallelize, tower_blocks
from clipscale.gradcache import GradCache, encode
from clipscale.step import MAX_LOGIT_SCALE, StepResult, TrainStep
from tests.helpers.gloo_world import run_in_gloo_world
from tests.helpers.gradients import VOCAB, make_batch, tiny_clip
from tests.helpers.tiny_runs import DIGITS_YAML, run_train, tiny_run
from tests.helpers.towers import timm_hf_config

STEPS, PER_RANK, CHUNK = 3, 6, 4  # chunks of 4 and 2 samples a rank
LOSS_OPTIONS = {"local": {}, "infcl": {"backend": "reference", "tile_size": 4}, "siglip": {}}


def siglip_clip():
    """tiny_clip with SigLIP's learnable bias (open_clip's init_logit_bias)."""
    model = tiny_clip()
    model.logit_bias = torch.nn.Parameter(torch.ones([]) * -10)
    return model


class OneGraphStep:
    """The reference: each rank encodes its chunks with one graph (each tower called alone per
    chunk, as Gradient Cache calls them, so dropout draws the same masks), the loss and one
    backward, then the gradients averaged over ranks by hand, clipped, AdamW and the clamp: no
    Gradient Cache, no DDP, no FSDP."""

    def __init__(self, model, loss_fn, optimizer):
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer

    def __call__(self, images, texts) -> StepResult:
        chunks = [(encode(self.model, images[s:s + CHUNK], None), encode(self.model, None, texts[s:s + CHUNK]))
                  for s in range(0, len(images), CHUNK)]
        loss = self.loss_fn(torch.cat([i.image for i, _ in chunks]), torch.cat([t.text for _, t in chunks]),
                            *chunks[-1][1].scalars)
        loss.backward()
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, MAX_LOGIT_SCALE)
        return StepResult(loss.detach(), norm, True, self.model.logit_scale.detach().exp(), [])


def train(rank: int, world: int, parallel: str, loss_name: str, reduce: str = "chunk", offload: bool = False,
          lock_image: bool = False, grad_checkpointing: bool = False, compiled: bool = False,
          model_factory=tiny_clip) -> dict:
    """STEPS training steps on this rank's batches; the losses, grad norms and whole weights.
    parallel: ddp | fsdp (TrainStep, Gradient Cache), or one_graph (OneGraphStep)."""
    model = model_factory()
    if lock_image:
        model.lock_image_tower()
    model.set_grad_checkpointing(grad_checkpointing)
    loss_fn = build_loss(loss_name, **LOSS_OPTIONS[loss_name])
    placed = parallelize(model, World(rank, world), parallel="ddp" if parallel == "one_graph" else parallel, reduce=reduce,
                         offload=offload)
    if compiled:  # as the trainer does: each block of both towers, under DDP or FSDP
        compile_towers(placed.module, Path(tempfile.mkdtemp()), backend="aot_eager")
    optimizer = build_optimizer(placed.module, OptimConfig(lr=1e-3, weight_decay=0.1))
    if parallel == "one_graph":
        step = OneGraphStep(placed.module, loss_fn, optimizer)
    else:
        step = TrainStep(placed, loss_fn, optimizer, chunk_size=CHUNK, grad_clip=1.0)
    torch.manual_seed(100 + rank)  # dropout: a different mask on every rank, the same in every training
    losses, norms = [], []
    for k in range(STEPS):
        result = step(*make_batch(PER_RANK, seed=world * k + rank))
        losses.append(float(result.loss))
        norms.append(float(result.grad_norm))
    weights = get_model_state_dict(placed.module, options=StateDictOptions(full_state_dict=True))
    return {"losses": losses, "norms": norms, "weights": weights}


def difference(want: dict, got: dict) -> dict:
    return {
        "loss": max(abs(a - b) for a, b in zip(want["losses"], got["losses"])),
        "norm": max(abs(a - b) / a for a, b in zip(want["norms"], got["norms"])),  # relative: norms of tens
        "weights": max(float((want["weights"][k] - got["weights"][k]).abs().max()) for k in want["weights"]),
        "keys": sorted(want["weights"]) == sorted(got["weights"]),
    }


def ddp_against_fsdp(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """For each case, how far FSDP's training is from DDP's and from the one-graph reference."""
    found = []
    for case in cases:
        fsdp = train(rank, world, "fsdp", **case)
        unreduced = {k: v for k, v in case.items() if k not in ("reduce", "offload")}
        ddp, one_graph = train(rank, world, "ddp", **unreduced), train(rank, world, "one_graph", **unreduced)
        found.append({
            "case": case, "ddp": difference(ddp, fsdp), "one_graph": difference(one_graph, fsdp),
            "moved": max(float((ddp["weights"][k] - v).abs().max()) for k, v in tiny_clip().state_dict().items()),
            "clipped": max(ddp["norms"]) > 1.0,
        })
    return found


def check(results: list[list[dict]]) -> None:
    for rank_results in results:
        for found in rank_results:
            assert found["moved"] > 1e-3, found  # the steps changed the weights: there is something to compare
            for reference in ("ddp", "one_graph"):
                differs = found[reference]
                assert differs["keys"], found["case"]
                assert differs["loss"] < 1e-5 and differs["norm"] < 1e-5 and differs["weights"] < 1e-5, (reference, found)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_trains_the_weights_of_ddp(world):
    cases = [{"loss_name": "local"}, {"loss_name": "infcl"}, {"loss_name": "infcl", "reduce": "step"}]
    results = run_in_gloo_world(ddp_against_fsdp, world, args=(cases,), timeout=300)
    check(results)
    assert any(found["clipped"] for found in results[0]), "the gradient clipping path is exercised"


@pytest.mark.slow
def test_fsdp_composes_as_ddp_does():
    """SigLIP's bias, a locked tower, offload, activation checkpointing and compiled blocks (aot_eager:
    the same random ops as eager). Offload on a CPU only runs the CPUOffloadPolicy path (the host is
    the device here): what it saves of a GPU's memory is for the GPU to measure (docs/fsdp.md)."""
    cases = [{"loss_name": "siglip", "model_factory": siglip_clip}, {"loss_name": "local", "lock_image": True},
             {"loss_name": "infcl", "offload": True}, {"loss_name": "local", "grad_checkpointing": True},
             {"loss_name": "local", "compiled": True, "grad_checkpointing": True}]
    check(run_in_gloo_world(ddp_against_fsdp, 2, args=(cases,), timeout=300))


def count_reduce_scatters(rank: int, world: int) -> dict:
    """Reduce-scatters in one step of 3 chunks a rank, for each train.fsdp_reduce (FSDP2 issues
    them through torch.distributed.reduce_scatter_single, counted here)."""
    counts = {}
    for reduce in ("chunk", "step"):
        placed = parallelize(tiny_clip(), World(rank, world), parallel="fsdp", reduce=reduce)
        optimizer = build_optimizer(placed.module, OptimConfig(lr=1e-3))
        step = TrainStep(placed, build_loss("local"), optimizer, chunk_size=2)
        calls, reduce_scatter = [], dist.reduce_scatter_single
        dist.reduce_scatter_single = lambda *args, **kwargs: calls.append(1) or reduce_scatter(*args, **kwargs)
        try:
            step(*make_batch(6, seed=rank))
        finally:
            dist.reduce_scatter_single = reduce_scatter
        counts[reduce] = len(calls)
    return counts


def wide_clip() -> "open_clip.CLIP":
    """One block a tower, each of 3.1 MB of weights: past the 1 MiB at which DDP closes its first
    gradient bucket, as ViT-B/32's 28 MB blocks are past its 25 MiB buckets."""
    import open_clip

    torch.manual_seed(0)
    return open_clip.CLIP(embed_dim=32, vision_cfg=dict(image_size=32, patch_size=16, width=256, layers=1, head_width=64),
                          text_cfg=dict(context_length=8, vocab_size=VOCAB, width=256, heads=4, layers=1)).train()


def graphs_compiled_for_a_step(rank: int, world: int) -> dict:
    """How many graphs the compiler was handed for one Gradient Cache step of two chunks, with
    each block compiled as the trainer compiles it: alone, and under DDP."""
    counts = {}
    for distributed in (False, True):
        torch._dynamo.reset()
        graphs = []

        def backend(graph, example_inputs):
            graphs.append(graph)
            return graph.forward

        placed = parallelize(wide_clip(), World(rank, world) if distributed else World(0, 1))
        compile_towers(placed.module, Path(tempfile.mkdtemp()), backend=backend)
        generator = torch.Generator().manual_seed(rank)
        images, texts = torch.randn(4, 3, 32, 32, generator=generator), torch.randint(1, VOCAB, (4, 8), generator=generator)
        GradCache(placed, build_loss("local"), chunk_size=2)(images, texts)
        counts["ddp" if distributed else "alone"] = len(graphs)
    return counts


def test_a_block_compiles_into_one_graph_under_ddp():
    """Dynamo's DDPOptimizer splits a graph compiled inside DDP's forward at DDP's gradient
    buckets (so that each bucket's all-reduce overlaps the rest of the backward): each block of
    ViT-B/32 into two graphs, the GELU's output between them. Gradient Cache reduces once a step,
    in its last chunk's backward, so there is nothing to overlap; the towers' blocks must compile
    as they do alone."""
    for counts in run_in_gloo_world(graphs_compiled_for_a_step, 2, timeout=120):
        assert counts["ddp"] == counts["alone"], counts


@pytest.mark.slow
def test_gradients_are_reduce_scattered_after_every_chunk_or_once_a_step():
    groups = 2 + 2 + 1  # the blocks of both towers and the root
    for counts in run_in_gloo_world(count_reduce_scatters, 2, timeout=120):
        assert counts == {"chunk": 3 * groups, "step": groups}


def evaluate_unevenly(rank: int, world: int) -> dict:
    """Rank r encodes r + 1 batches under `gathered` (as an evaluation's per-rank shares may differ),
    then trains a step: the features are the unsharded model's, and the parameters sharded again."""
    reference = tiny_clip().eval()
    placed = parallelize(tiny_clip(), World(rank, world), parallel="fsdp")
    placed.module.eval()
    errors = []
    with gathered(placed.module), torch.no_grad():
        for k in range(rank + 1):
            images, texts = make_batch(4, seed=k)
            errors.append(float((placed.module.encode_image(images) - reference.encode_image(images)).abs().max()))
            errors.append(float((placed.module.encode_text(texts) - reference.encode_text(texts)).abs().max()))
    placed.module.train()
    sharded_after = all(isinstance(p, DTensor) for n, p in placed.module.named_parameters() if not n.startswith("logit_"))
    optimizer = build_optimizer(placed.module, OptimConfig(lr=1e-3))
    TrainStep(placed, build_loss("local"), optimizer, chunk_size=2)(*make_batch(4, seed=rank))
    return {"error": max(errors), "sharded_after": sharded_after}


@pytest.mark.slow
def test_an_evaluation_may_run_a_different_number_of_batches_on_each_rank():
    """Without `gathered` every forward all-gathers each block, and rank 0, done after one batch,
    would leave rank 1's second forward waiting for it: the world times out."""
    for found in run_in_gloo_world(evaluate_unevenly, 2, timeout=60):
        assert found["error"] < 1e-5 and found["sharded_after"], found


@pytest.mark.slow
def test_train_py_under_fsdp_trains_and_evaluates_as_under_ddp(digits_root, tmp_path):
    """Two processes, the digits with their zero-shot evaluation during and after training, under DDP
    and FSDP. The held-out digits are two shards, of 180 and 179 samples, one a rank: in batches of
    179, rank 0 runs two and rank 1 one."""
    records = {}
    for parallel in ("ddp", "fsdp"):
        overrides = tiny_run(digits_root, tmp_path, f"run.name={parallel}", f"train.parallel={parallel}", "train.steps=4",
                             "train.chunk_size=16", "eval.every_n_steps=2", "eval.batch_size=179", "data.workers=1")
        result = run_train(overrides, nproc=2, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        records[parallel] = read_metrics(tmp_path / parallel / "metrics.jsonl")
    losses = {parallel: [m["loss"] for m in found if "loss" in m] for parallel, found in records.items()}
    accuracies = {parallel: [m["zeroshot_acc1"] for m in found if "zeroshot_acc1" in m] for parallel, found in records.items()}
    assert len(losses["fsdp"]) == 4 and losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-5)
    assert len(accuracies["fsdp"]) == 2 and accuracies["fsdp"] == accuracies["ddp"]


def test_every_tower_of_open_clip_has_its_blocks_found():
    model = tiny_clip()
    found = dict(tower_blocks(model))
    assert found["image"] is model.visual.transformer.resblocks and found["text"] is model.transformer.resblocks


def test_timm_and_hugging_face_towers_have_their_blocks_found(hf_folder):
    custom = {**timm_hf_config(hf_folder), "vision_cfg": {"image_size": 32, "timm_model_name": "vit_tiny_patch16_224",
                                                          "timm_pool": "token", "timm_proj": "linear"}}
    model = build_model(ModelConfig(custom=custom)).model
    found = dict(tower_blocks(model))
    assert found["image"] is model.visual.trunk.blocks and found["text"] is model.text.transformer.encoder.layer


def test_a_tower_without_blocks_is_refused_naming_the_key(hf_folder):
    model = build_model(ModelConfig(custom=timm_hf_config(hf_folder))).model  # timm's test_resnet: stages of one block
    with pytest.raises(ParallelError, match=r"train.parallel=fsdp: the image tower \(TimmModel\) .*train.parallel=ddp"):
        tower_blocks(model)


@pytest.mark.parametrize("overrides, key", [
    (["train.parallel=fsdp", "train.precision=fp16"], "train.precision=fp16 with train.parallel=fsdp"),
    (["train.parallel=fsdp", "train.chunk_size=auto"], "train.chunk_size: 'auto'"),
    (["train.fsdp_offload=true"], "train.fsdp_offload: only with train.parallel=fsdp"),
    (["train.fsdp_reduce=step"], "train.fsdp_reduce: only with train.parallel=fsdp"),
    (["train.parallel=zero3"], "train.parallel"),
])
def test_what_fsdp_cannot_do_is_refused_before_any_work(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(DIGITS_YAML, overrides)


def test_fsdp_and_its_knobs_are_accepted():
    cfg = load_config(DIGITS_YAML, ["train.parallel=fsdp", "train.fsdp_offload=true"])
    assert (cfg.train.parallel, cfg.train.fsdp_reduce, cfg.train.fsdp_offload) == ("fsdp", "chunk", True)


def test_a_tower_of_one_block_is_a_list_of_blocks_to_shard():
    """configs/digits.yaml's text tower has one layer: FSDP shards that one block, as it shards several."""
    from tests.helpers.tiny_runs import DIGITS_YAML

    cfg = load_config(DIGITS_YAML, [])
    model = build_model(cfg.model).model
    blocks = dict(tower_blocks(model))
    assert len(blocks["text"]) == cfg.model.custom["text_cfg"]["layers"] == 1
    assert blocks["text"] is model.transformer.resblocks and blocks["image"] is model.visual.transformer.resblocks


def test_a_process_on_a_gpu_runs_its_host_ops_in_one_thread_unless_omp_num_threads_says(monkeypatch):
    """On a GPU the training process's own CPU ops are small and the loader's workers hold the cores:
    one intra-op thread (as torchrun gives its processes), unless the user set OMP_NUM_THREADS; on a
    CPU device the model computes there, so torch keeps its threads."""
    from clipscale.distributed import host_threads_for

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        host_threads_for(torch.device("cpu"))
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        host_threads_for(torch.device("cuda"))
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        host_threads_for(torch.device("cuda"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
