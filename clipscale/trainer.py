"""The training loop. Read top to bottom, it is the algorithm:

    set up the world, data, towers, loss, optimizer   (each its own module)
    resume from runs/<name>/checkpoints/latest.pt if it exists
    for each step: lr schedule -> step strategy (forward, loss, backward)
                   -> unscale, clip, skip if non-finite -> optimizer
                   -> clamp logit scale -> log / evaluate / checkpoint
    final evaluation and checkpoint

The loop does not know how the loss is computed (`build_loss`) nor how the
batch is split into encoder chunks (the step strategy: one plain forward and
backward, or Gradient Cache).
"""

from __future__ import annotations

import math
import resource
import signal
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import yaml
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from clipscale.checkpoint import latest_checkpoint, load_checkpoint, save_atomic, save_checkpoint
from clipscale.config import Config, check_world, eval_task
from clipscale.data import prepare_data
from clipscale.data.offload import EncodedSamples, HostTensor
from clipscale.data.shards import DeferredTransform, EncodedImages, ShardStream, StreamState
from clipscale.distributed import (
    World,
    all_gather_objects,
    all_reduce_max,
    all_reduce_sum_list,
    barrier,
    init_distributed,
    shutdown_distributed,
)
from clipscale.eval import evaluate_zeroshot, zeroshot_classifier
from clipscale.eval.inference import unwrap
from clipscale.eval.tasks import run_task
from clipscale.gradcache import GradCache, autocast_factory
from clipscale.losses import build_loss
from clipscale.losses.common import NonFiniteError
from clipscale.metrics import MetricsLogger
from clipscale.models import OPEN_CLIP_WEIGHTS, build_model, write_open_clip_folder
from clipscale.optim import build_optimizer, cosine_lr

MAX_LOGIT_SCALE = math.log(100)  # open_clip clamps the learnable temperature at 100
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_step(cfg: Config, model, loss_fn, autocast, scaler, world: World) -> GradCache:
    """The step strategy. A rank's batch that fits in one chunk is one plain forward and
    backward; a larger one is a Gradient Cache step over chunks of train.chunk_size."""
    per_rank = cfg.train.batch_size // world.world_size
    return GradCache(model, loss_fn, chunk_size=cfg.train.chunk_size or per_rank, offload=cfg.train.offload,
                     autocast=autocast, scaler=scaler, decode_workers=cfg.data.decode_workers)


def deferred_transform(cfg: Config, transform, world: World) -> DeferredTransform | None:
    """With offload, how the loader keeps images encoded and GradCache decodes them per chunk;
    None without offload, or for a transform that cannot be split (then the batch is held
    decoded, as float, which a large batch cannot afford: say so)."""
    if not cfg.train.offload:
        return None
    deferred = DeferredTransform.split(transform)
    if deferred is None and world.is_main:
        warnings.warn(f"train.offload: the image transform {transform} cannot be deferred to the Gradient Cache passes; "
                      "the offloaded batch is held decoded (float32) on the host")
    return deferred


def host_columns(batch: dict, deferred: DeferredTransform | None) -> tuple:
    """An offloaded batch as GradCache's host columns: images still encoded (decoded a chunk
    at a time in each pass, normalised on the device), tokens as one small tensor."""
    images = batch["images"]
    if isinstance(images, EncodedImages):
        images = EncodedSamples(images, deferred.decode, deferred.device_transform)
    else:
        images = HostTensor(images)
    return images, HostTensor(batch["texts"])


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class Preemption:
    """SIGTERM / SIGUSR1 (what SLURM and torchrun send before stopping a job) ask the
    loop to finish its current step, checkpoint and leave. Ranks agree on the step
    to stop at, so they all write the same checkpoint."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum = 0
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame):
        self.signum = signum

    def requested(self, device: torch.device) -> int:
        """The signal number any rank received (0 for none)."""
        return int(all_reduce_max(self.signum, device))

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Evaluator:
    """Every configured evaluation, run by all ranks together (each on its part of the data).

    Results are flat `<set>_<metric>` keys: `zeroshot_acc1` for the held-out
    digits, `imagenet_acc1`, `coco_image_retrieval_recall@1`, ... for eval.sets.
    """

    def __init__(self, cfg: Config, data, towers, world: World, autocast):
        self.cfg, self.data, self.towers, self.world, self.autocast = cfg, data, towers, world, autocast
        self.tasks = [eval_task(entry) for entry in cfg.eval.sets]

    def __call__(self, model) -> dict:
        unwrapped = unwrap(model)
        results = {}
        if self.cfg.eval.zeroshot and self.data.classnames:
            classifier = zeroshot_classifier(
                unwrapped, self.towers.tokenizer, self.data.classnames, self.data.templates, self.world.device,
                batch_size=self.cfg.eval.batch_size, autocast=self.autocast,
            )
            loader = self.data.val_loader(self.towers.val_transform, self.world, self.cfg.eval.batch_size)
            metrics = evaluate_zeroshot(unwrapped, classifier, loader, self.world.device, autocast=self.autocast, progress=False)
            results.update({f"zeroshot_{k}": v for k, v in metrics.items()})
        for task in self.tasks:
            metrics = run_task(
                task, unwrapped, self.towers.tokenizer, self.towers.val_transform, self.world.device,
                batch_size=self.cfg.eval.batch_size, workers=self.cfg.eval.workers, autocast=self.autocast,
                progress=self.world.is_main,
            )
            results.update({f"{task.name}_{k}": v for k, v in metrics.items()})
        return results


def train(cfg: Config) -> dict:
    """Run (or resume) the configured job. Returns the last evaluation's results,
    or {"preempted_by": signal number} when a signal stopped it after a checkpoint."""
    world = init_distributed(cfg.run.device)
    preemption = Preemption()
    try:
        return _train(cfg, world, preemption)
    finally:
        preemption.restore()
        shutdown_distributed()


def _train(cfg: Config, world: World, preemption: Preemption) -> dict:
    check_world(cfg, world.world_size)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    checkpoint_dir = run_dir / "checkpoints"
    torch.manual_seed(cfg.run.seed)
    data = prepare_data(cfg.data, world)
    towers = build_model(cfg.model)
    model = towers.model.to(world.device)
    loss_fn = build_loss(cfg.loss.name, **cfg.loss.options)
    optimizer = build_optimizer(model, cfg.optim, fused=world.device.type == "cuda")
    scaler = torch.amp.GradScaler(world.device.type) if cfg.train.precision == "fp16" else None
    autocast = autocast_factory(AUTOCAST_DTYPES[cfg.train.precision], world.device)

    start_step, stream_state, nonfinite_total = 0, StreamState(), 0
    resume_path = latest_checkpoint(checkpoint_dir) if cfg.run.resume else None
    if resume_path is not None:
        ckpt = load_checkpoint(resume_path)
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        start_step, nonfinite_total = ckpt["step"], ckpt.get("nonfinite_steps", 0)
        if len(ckpt["data"]) == world.world_size:
            stream_state = StreamState(**ckpt["data"][world.rank])
            set_rng_state(ckpt["rng"][world.rank], world.device)
        elif world.is_main:
            print(f"resuming on {world.world_size} processes from a run on {len(ckpt['data'])}: the data order restarts")

    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        write_open_clip_folder(run_dir, towers)  # with OPEN_CLIP_WEIGHTS, open_clip's `local-dir:` loads the run
    logger = MetricsLogger(run_dir, cfg, enabled=world.is_main, resume_step=start_step)

    if world.distributed:
        model = DistributedDataParallel(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    step_fn = build_step(cfg, model, loss_fn, autocast, scaler, world)
    evaluator = Evaluator(cfg, data, towers, world, autocast)
    unwrapped = unwrap(model)

    per_rank_batch = cfg.train.batch_size // world.world_size
    deferred = deferred_transform(cfg, towers.train_transform, world)
    stream = ShardStream(
        data.train_shards,
        batch_size=per_rank_batch,
        rank=world.rank,
        world_size=world.world_size,
        num_workers=cfg.data.workers,
        seed=cfg.run.seed,
        image_transform=towers.train_transform,
        tokenizer=towers.tokenizer,
        shuffle_buffer=cfg.data.shuffle_buffer,
        state=stream_state,
        deferred=deferred,
    )
    loader = torch.utils.data.DataLoader(
        stream,
        batch_size=None,
        num_workers=cfg.data.workers,
        persistent_workers=cfg.data.workers > 0,
        pin_memory=world.device.type == "cuda",
    )

    def checkpoint(step: int) -> None:
        states = all_gather_objects(asdict(stream_state))
        rngs = all_gather_objects(rng_state(world.device))
        if world.is_main:
            save_checkpoint(
                checkpoint_dir,
                step,
                {
                    "name": cfg.run.name,
                    "epoch": step * cfg.train.batch_size // max(1, data.num_train),
                    "step": step,
                    "state_dict": unwrapped.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "config": cfg.to_dict(),
                    "data": states,
                    "rng": [{k: v.cpu() for k, v in r.items()} for r in rngs],
                    "nonfinite_steps": nonfinite_total,
                },
            )

    def enter_train_mode() -> None:
        model.train()
        if cfg.model.lock_image and cfg.model.lock_image_unlocked_groups == 0:
            unwrapped.visual.eval()  # LiT: a frozen tower is a fixed feature extractor, no dropout

    def evaluate(step: int) -> dict:
        results = evaluator(model)
        enter_train_mode()  # evaluation leaves the whole model in train mode
        if not results:  # nothing configured to evaluate
            return results
        logger.log(step, results)
        logger.write_json(run_dir / "eval" / f"step_{step:08d}.json", {"step": step, **results})
        return results

    enter_train_mode()
    progress = tqdm(total=cfg.train.steps, initial=start_step, disable=not world.is_main, desc=cfg.run.name, dynamic_ncols=True)
    nonfinite_in_a_row = 0
    data_errors_logged = all_reduce_sum_list([stream_state.skipped_samples, stream_state.shard_errors], world.device)
    window_start, window_samples = time.perf_counter(), 0
    batches = iter(loader)
    results: dict = {}
    for step in range(start_step, cfg.train.steps):
        batch = next(batches)
        stream_state.update(batch)
        if cfg.train.offload:  # stays on the host; GradCache streams one chunk at a time to the device
            images, texts = host_columns(batch, deferred)
        else:
            images = batch["images"].to(world.device, non_blocking=True)
            texts = batch["texts"].to(world.device, non_blocking=True)
        lr = cosine_lr(step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr

        try:
            loss = step_fn(images, texts)
        except NonFiniteError:  # raised on every rank alike, before any backward
            loss = torch.tensor(math.nan)
        if scaler is not None:
            scaler.unscale_(optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(unwrapped.parameters(), max_norm)
        finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
        if finite and scaler is not None:
            scaler.step(optimizer)
        elif finite:
            optimizer.step()
        if scaler is not None:
            scaler.update()  # after an fp16 overflow this lowers the loss scale
        optimizer.zero_grad(set_to_none=True)
        if finite:
            nonfinite_in_a_row = 0
        else:  # the weights were not touched
            nonfinite_total += 1
            nonfinite_in_a_row += 1
            if nonfinite_in_a_row > cfg.train.max_nonfinite_steps:
                raise RuntimeError(
                    f"{nonfinite_in_a_row} steps in a row had a non-finite loss or gradient (last at step {step + 1}); "
                    "stopping. Lower optim.lr, check the data, or use train.precision=bf16/fp32."
                )
        with torch.no_grad():
            unwrapped.logit_scale.clamp_(0, MAX_LOGIT_SCALE)

        done = step + 1
        window_samples += cfg.train.batch_size
        progress.update(1)
        if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            elapsed = time.perf_counter() - window_start
            # Data errors over all ranks: since the previous record, and since the run began.
            data_errors = all_reduce_sum_list([stream_state.skipped_samples, stream_state.shard_errors], world.device)
            record = {
                "loss": loss.item(),
                "lr": lr,
                "logit_scale": unwrapped.logit_scale.exp().item(),
                "grad_norm": grad_norm.item(),
                "samples_per_s": window_samples / elapsed,
                "peak_memory_gib": peak_memory_gib(world.device),
                "skipped_samples": data_errors[0] - data_errors_logged[0],
                "skipped_samples_total": data_errors[0],
                "shard_errors": data_errors[1] - data_errors_logged[1],
                "shard_errors_total": data_errors[1],
                "nonfinite_steps": nonfinite_total,
            }
            logger.log(done, record)
            progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}")
            window_start, window_samples, data_errors_logged = time.perf_counter(), 0, data_errors
        if cfg.eval.every_n_steps and done % cfg.eval.every_n_steps == 0 and done < cfg.train.steps:
            results = evaluate(done)
        signum = preemption.requested(world.device)
        if signum or done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
            checkpoint(done)
        if signum:
            # No rank leaves before rank 0 has written the checkpoint: srun --kill-on-bad-exit
            # would end the step at the first rank's exit status 128+signal.
            barrier()
            progress.close()
            if world.is_main:
                print(f"stopped by signal {signum} after step {done}; the same command resumes from the checkpoint")
            logger.close()
            return {"preempted_by": signum}
    progress.close()
    if world.is_main:
        save_atomic(unwrapped.state_dict(), run_dir / OPEN_CLIP_WEIGHTS)

    results = evaluate(cfg.train.steps)
    if world.is_main and "zeroshot_acc1" in results:
        print(f"zero-shot top-1 on the held-out split: {100 * results['zeroshot_acc1']:.2f}%")
    logger.close()
    return results
