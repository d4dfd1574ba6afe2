"""The training loop. Read top to bottom, it is the algorithm:

    decide what the run does with runs/<name> (run_dir.py): new, resume, or stop on another
        configuration; when it resumes, the newest checkpoint that loads   (checkpoint_manager.py)
    assemble the run: world, data, towers, loss, optimizer, the training step; restore its
        parts from the checkpoint (or seed them); the streamed batches; only then, with
        everything that can fail before training checked, claim runs/<name>
    for each step: the next batch (its pieces still arriving) -> lr schedule
                   -> the training step (forward, loss, backward, clip, optimizer)
                   -> metrics record -> evaluation -> checkpoint (or stop on a signal)
    final evaluation, then the weights and the end marker

The loop does not know how the loss is computed (`build_loss`), how the batch is split
into encoder chunks (`TrainStep`, Gradient Cache), nor how the batch reaches the host
(`BatchStream`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from clipscale.checkpoint_manager import CheckpointManager, UnderKey
from clipscale.config import Config, ConfigError, check_world
from clipscale.console import Console, figures
from clipscale.data import PreparedData, prepare_data
from clipscale.data.batches import BatchStream, piece_size_for
from clipscale.data.device_decode import DeviceDecodedImages, DeviceDecoder
from clipscale.data.offload import DecodePool, OffloadedImages
from clipscale.data.shards import ShardStream, StreamState
from clipscale.data.transforms import SplitTransform
from clipscale.distributed import World, all_reduce_max, all_reduce_sum_list, barrier, init_distributed, shutdown_distributed
from clipscale.eval.during_training import Evaluator
from clipscale.gradcache import autocast_factory
from clipscale.losses import build_loss
from clipscale.memory import largest_chunk
from clipscale.metrics import MetricsLogger, RecordWindow
from clipscale.models import Towers, build_model, write_open_clip_folder
from clipscale.optim import build_optimizer, cosine_lr
from clipscale.run_dir import RunPlan, plan_run
from clipscale.signals import StopRequest, ignore_stop_signals
from clipscale.step import AUTOCAST_DTYPES, StepResult, TrainStep


def train(cfg: Config, *, loss_fn: torch.nn.Module | None = None) -> dict:
    """Run (or resume) the configured job. Returns the last evaluation's results, or
    {"preempted_by": signal number} when a signal stopped it after a checkpoint.
    `loss_fn`: a loss built by the caller, in place of cfg.loss's."""
    world = init_distributed(cfg.run.device)
    console = Console(world.is_main)
    preemption = StopRequest()
    run = None
    try:
        check_world(cfg, world.world_size)
        plan = plan_run(cfg)
        checkpoints = CheckpointManager(plan.run_dir, cfg, world, console)
        checkpoint = checkpoints.newest() if plan.action == "resume" else None
        if checkpoints.has_ended(checkpoint):
            console.say(f"{plan.run_dir} has already trained its {checkpoint['step']} steps; to train on, raise "
                        "train.steps with run.extend_steps=true, or choose a new run.name")
            return {}
        run = Run.assemble(cfg, world, console, plan, checkpoints, checkpoint, loss_fn)
        return run.fit(preemption)
    finally:
        if run is not None:
            run.close()
        preemption.restore()
        shutdown_distributed()


def claim_run_dir(plan: RunPlan, world: World, console: Console) -> None:
    """Create (or move aside and create) runs/<name> and record the configuration, once every
    rank has read the folder (plan_run) and everything that can fail before training has passed."""
    barrier()
    if world.is_main:
        for line in plan.apply():
            console.say(line)
    barrier()


def chunk_size(cfg: Config, towers: Towers, loss_fn, world: World, console: Console) -> int:
    """train.chunk_size as the step uses it: this rank's whole batch when null, the probe's
    choice for "auto" (logged), else the configured chunk."""
    per_rank = cfg.train.batch_size // world.world_size
    if cfg.train.chunk_size != "auto":
        return min(cfg.train.chunk_size or per_rank, per_rank)
    visual = towers.model.visual
    image_size = visual.image_size[0] if isinstance(visual.image_size, tuple) else visual.image_size
    chunk, probe = largest_chunk(towers.model, loss_fn, batch_size=per_rank,
                                 precision_dtype=AUTOCAST_DTYPES[cfg.train.precision], image_size=image_size,
                                 context_length=towers.model.context_length, vocab_size=towers.model.vocab_size)
    chunk = int(min(all_reduce_max(-chunk, world.device) * -1, per_rank))  # the smallest over ranks
    shown = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in probe.items())
    console.say(f"train.chunk_size=auto: {chunk} samples per encoder pass ({shown})")
    return chunk


@dataclass
class Run:
    """Everything a training run is made of, assembled once."""

    cfg: Config
    world: World
    console: Console
    run_dir: Path
    model: torch.nn.Module  # DDP-wrapped under several processes
    step: TrainStep
    stream_state: StreamState
    start_step: int
    batches: BatchStream
    decode_pool: DecodePool | DeviceDecoder | None  # whoever decodes images apart from the loader
    evaluator: Evaluator
    window: RecordWindow
    logger: MetricsLogger
    checkpoints: CheckpointManager
    progress: tqdm | None = None

    @classmethod
    def assemble(cls, cfg: Config, world: World, console: Console, plan: RunPlan, checkpoints: CheckpointManager,
                 checkpoint: dict | None, loss_fn: torch.nn.Module | None = None) -> "Run":
        """`checkpoint`: the one the run resumes from, or None. Nothing is written to the run
        folder before every part is built: a mistake found here leaves it as it was."""
        torch.manual_seed(cfg.run.seed)  # the model's initial weights: the same on every rank
        data = prepare_data(cfg.data, world)
        towers = build_model(cfg.model)
        module = towers.model.to(world.device)
        loss_fn = loss_fn if loss_fn is not None else build_loss(cfg.loss.name, **cfg.loss.options)
        optimizer = build_optimizer(module, cfg.optim, fused=world.device.type == "cuda")
        chunk = chunk_size(cfg, towers, loss_fn, world, console)
        model = module
        if world.distributed:
            model = DistributedDataParallel(module, device_ids=[world.device.index] if world.device.type == "cuda" else None)
        step = TrainStep(model, loss_fn, optimizer, chunk_size=chunk, precision=cfg.train.precision,
                         grad_clip=cfg.optim.grad_clip, max_nonfinite_steps=cfg.train.max_nonfinite_steps)
        stream_state, window = StreamState(), RecordWindow(cfg.train.batch_size, world.device)
        shared = [UnderKey("state_dict", module), UnderKey("optimizer", optimizer), step]
        start_step = checkpoints.start(checkpoint, shared=shared, per_rank={"data": stream_state, "metrics": window},
                                       samples_per_epoch=data.num_train)
        evaluator = Evaluator(cfg, data, towers, world, autocast_factory(AUTOCAST_DTYPES[cfg.train.precision], world.device))
        batches, decode_pool = stream_batches(cfg, data, towers, world, stream_state, chunk, cfg.train.steps - start_step)
        try:
            claim_run_dir(plan, world, console)
            if world.is_main:
                write_open_clip_folder(plan.run_dir, towers)  # with the final weights, open_clip's `local-dir:` loads the run
            logger = MetricsLogger(plan.run_dir, cfg, enabled=world.is_main, resume_step=start_step)
        except BaseException:
            batches.close()
            if decode_pool is not None:
                decode_pool.close()
            raise
        return cls(cfg, world, console, plan.run_dir, model, step, stream_state, start_step, batches, decode_pool,
                   evaluator, window, logger, checkpoints)

    def fit(self, preemption: StopRequest) -> dict:
        cfg = self.cfg
        self.enter_train_mode()
        self.progress = self.console.progress_bar(cfg.train.steps, self.start_step, cfg.run.name)
        self.window.open(self.data_errors())
        for step_number in range(self.start_step, cfg.train.steps):
            batch = self.batches.next()
            lr = cosine_lr(step_number, cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.steps)
            result = self.step(batch.images, batch.texts, lr)
            batch.consumed(self.stream_state)
            self.batches.release(batch)
            done = step_number + 1
            self.log_metrics(done, result, lr)
            self.evaluate_on_schedule(done)
            signum = preemption.requested(self.world.device)
            self.checkpoints.after_step(done, stopping=bool(signum))
            if signum:
                return self.stop(signum, done)
        self.progress.close()
        results = self.final_evaluation()
        self.checkpoints.end(self.step.module)  # last: the weights and the end marker say that the run has ended
        return results

    def log_metrics(self, step_number: int, result: StepResult, lr: float) -> None:
        self.progress.update(1)
        self.window.step_done()
        if step_number % self.cfg.train.log_every and step_number != self.cfg.train.steps:
            return
        record = self.window.record(result, lr, logit_scale=self.step.module.logit_scale.exp().item(),
                                    nonfinite_steps=self.step.nonfinite_total, data_errors=self.data_errors())
        self.logger.log(step_number, record)
        self.progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}")

    def data_errors(self) -> list[int]:
        """[skipped samples, shard errors] over all ranks since the run began."""
        return all_reduce_sum_list([self.stream_state.skipped_samples, self.stream_state.shard_errors], self.world.device)

    def stop(self, signum: int, step_number: int) -> dict:
        # No rank leaves before rank 0 has written the checkpoint: srun --kill-on-bad-exit
        # would end the step at the first rank's exit status 128+signal.
        barrier()
        self.progress.close()
        self.console.say(f"stopped by signal {signum} after step {step_number}; the same command resumes from the checkpoint")
        return {"preempted_by": signum}

    def enter_train_mode(self) -> None:
        self.model.train()
        if self.cfg.model.lock_image and self.cfg.model.lock_image_unlocked_groups == 0:
            self.step.module.visual.eval()  # LiT: a frozen tower is a fixed feature extractor, no dropout

    def evaluate_on_schedule(self, step_number: int) -> None:
        every = self.cfg.eval.every_n_steps
        if every and step_number % every == 0 and step_number < self.cfg.train.steps:  # the last step's: final_evaluation
            self.evaluate(step_number)

    def evaluate(self, step_number: int) -> dict:
        results = self.evaluator(self.model)
        self.enter_train_mode()  # evaluation leaves the whole model in train mode
        if results:
            self.logger.log(step_number, results)
            self.logger.write_json(self.evaluation_path(step_number), {"step": step_number, **results})
            self.console.say(f"step {step_number}: {figures(results)}")
        return results

    def final_evaluation(self) -> dict:
        """The evaluation at the last step; when a run that was killed after it (while its weights
        were written) is ended again, the results it wrote, not a second evaluation and record."""
        steps = self.cfg.train.steps
        written = self.evaluation_path(steps)
        if self.start_step == steps and written.is_file():
            self.console.say(f"the final evaluation had ended before the stop: its results are kept from {written}")
            return {key: value for key, value in json.loads(written.read_text()).items() if key != "step"}
        return self.evaluate(steps)

    def evaluation_path(self, step_number: int) -> Path:
        return self.run_dir / "eval" / f"step_{step_number:08d}.json"

    def close(self) -> None:
        self.batches.close()
        if self.decode_pool is not None:
            self.decode_pool.close()
        self.logger.close()


def stream_batches(cfg: Config, data: PreparedData, towers: Towers, world: World, stream_state: StreamState,
                   chunk: int, steps: int) -> tuple[BatchStream, DecodePool | DeviceDecoder | None]:
    """The loader (worker processes decoding pieces of the rank's shard stream) and the thread
    that gathers the pieces into each step's pinned host batch."""
    per_rank = cfg.train.batch_size // world.world_size
    piece = piece_size_for(per_rank, chunk)
    split = SplitTransform.split(towers.train_transform)
    if split is None and world.is_main:
        warnings.warn(f"the image transform {towers.train_transform} does not split into uint8 host steps and float "
                      "device steps: loader pieces and the host batch hold float32 images (4x the memory)")
    keep_encoded = cfg.train.offload or cfg.data.decoder == "device"
    if keep_encoded and split is None:
        setting = "data.decoder=device" if cfg.data.decoder == "device" else "train.offload"
        raise ConfigError(f"{setting} needs an image transform whose random crop can be kept with the image bytes "
                         f"(open_clip's RandomResizedCrop pipelines); got {towers.train_transform}")
    stream = ShardStream(
        data.train_shards,
        piece_size=piece,
        rank=world.rank,
        world_size=world.world_size,
        num_workers=cfg.data.workers,
        seed=cfg.run.seed,
        image_transform=towers.train_transform,
        tokenizer=towers.tokenizer,
        shuffle_buffer=cfg.data.shuffle_buffer,
        state=stream_state,
        split=split,
        keep_encoded=keep_encoded,
        decode=cfg.data.decoder == "loader",
    )
    # A generator of its own: the loader's seed draw leaves the global RNG (dropout's) as restored.
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=cfg.data.workers,
                                         persistent_workers=cfg.data.workers > 0, worker_init_fn=ignore_stop_signals,
                                         generator=torch.Generator().manual_seed(cfg.run.seed + world.rank))
    pool, image_column = None, None
    if cfg.data.decoder == "device":
        pool = DeviceDecoder(split, world.device)

        def image_column(batch_size, arrivals, to_float):
            return DeviceDecodedImages(batch_size, arrivals, to_float, pool)
    elif cfg.train.offload:
        pool = DecodePool(split.decode, cfg.data.decode_workers or max(1, cfg.data.workers))
        # Without workers the batch is gathered whole before the step (BatchStream's in_thread): no bound then.
        window = 2 * max(1, chunk // piece) if cfg.data.workers else 0

        def image_column(batch_size, arrivals, to_float):
            return OffloadedImages(batch_size, arrivals, to_float, pool, window)
    to_float = split.to_float if split is not None else None
    batches = BatchStream(loader, batch_size=per_rank, piece_size=piece, batches=steps, to_float=to_float,
                          image_column=image_column, in_thread=cfg.data.workers > 0)
    return batches, pool
