"""The training loop. Read top to bottom, it is the algorithm:

    decide what the run does with runs/<name> before any work: new, resume (from the
        newest checkpoint that loads), or stop on another configuration   (run_dir.py)
    assemble the run once: world, data, towers, loss, optimizer, the training step,
        the state a checkpoint holds, the streamed batches   (each its own module)
    for each step: the next batch (its pieces still arriving) -> lr schedule
                   -> the training step (forward, loss, backward, clip, optimizer)
                   -> log / evaluate / checkpoint / stop on a signal
    final evaluation, then the weights (the sign that the run has ended)

The loop does not know how the loss is computed (`build_loss`), how the batch is split
into encoder chunks (`TrainStep`, Gradient Cache), nor how the batch reaches the host
(`BatchStream`).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from clipscale import console
from clipscale.checkpoint import CHECKPOINTS, load_checkpoint, load_latest, save_atomic, save_checkpoint
from clipscale.config import Config, ConfigError, check_world
from clipscale.compile import compile_enabled, compile_towers, seconds_compiling
from clipscale.data import PreparedData, prepare_data
from clipscale.data.pipeline import TrainingBatches, kept_bytes
from clipscale.data.shards import StreamState
from clipscale.distributed import World, all_reduce_max, all_reduce_sum_list, barrier, init_distributed, shutdown_distributed
from clipscale.eval.during_training import Evaluator
from clipscale.gradcache import autocast_factory, trainable_towers
from clipscale.losses import build_loss
from clipscale.memory import largest_chunk
from clipscale.metrics import MetricsLogger
from clipscale.models import OPEN_CLIP_WEIGHTS, Towers, build_model, write_open_clip_folder
from clipscale.optim import build_optimizer, learning_rate
from clipscale.run_dir import plan_run
from clipscale.run_state import RunState
from clipscale.signals import StopRequest
from clipscale.step import AUTOCAST_DTYPES, TrainStep
from clipscale.utilization import peak_bf16_flops, train_flops_per_sample


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def train(cfg: Config) -> dict:
    """Run (or resume) the configured job. Returns the last evaluation's results,
    or {"preempted_by": signal number} when a signal stopped it after a checkpoint."""
    world = init_distributed(cfg.run.device)
    preemption = StopRequest()
    run = None
    try:
        check_world(cfg, world.world_size)
        run_dir, checkpoint = open_run_dir(cfg, world)
        if checkpoint is not None and checkpoint["step"] >= cfg.train.steps:
            if final_weights_written(run_dir, checkpoint):
                say(world, console.run_already_complete(run_dir, checkpoint["step"]))
                return {}
            say(world, console.run_finishing(run_dir, checkpoint["step"]))  # Run.fit trains no step, then ends the run
        run = Run.assemble(cfg, world, run_dir, checkpoint)
        return run.fit(preemption)
    finally:
        if run is not None:
            run.close()
        preemption.restore()
        shutdown_distributed()


def say(world: World, line: str) -> None:
    """One console line, from rank 0, above the progress bar (not through it)."""
    if world.is_main:
        tqdm.write(line)
        sys.stdout.flush()  # a Slurm log or a pipe shows it now, not when the buffer fills


def open_run_dir(cfg: Config, world: World) -> tuple[Path, dict | None]:
    """runs/<name> for this configuration (run_dir.plan_run: a UserError before any data or model
    work when it holds another run or cannot be written), and the newest checkpoint in it that
    loads when the run resumes."""
    plan = plan_run(cfg)
    barrier()  # every rank has read the folder before rank 0 moves it aside or records the config
    if world.is_main:
        for line in plan.apply():
            say(world, line)
    barrier()  # and none looks for checkpoints in it before that
    if plan.action != "resume":
        return plan.run_dir, None
    found = load_latest(plan.run_dir / CHECKPOINTS, report=lambda line: say(world, line))
    checkpoint = found[1] if found else None
    step = checkpoint["step"] if checkpoint else 0
    if step < cfg.train.steps:
        say(world, console.run_resumed(plan.run_dir, step))
    return plan.run_dir, checkpoint


def final_weights_written(run_dir: Path, checkpoint: dict) -> bool:
    """Whether the run has ended: the open_clip weights, written last (after the final evaluation),
    are those of its final checkpoint. A run killed between the two is ended on its next start."""
    path = run_dir / OPEN_CLIP_WEIGHTS
    if not path.is_file():
        return False
    try:
        weights = load_checkpoint(path)
    except Exception:  # a damaged file raises anything from EOFError to a zip or unpickling error
        return False
    final = checkpoint["state_dict"]
    return weights.keys() == final.keys() and all(torch.equal(weights[key], final[key]) for key in final)


def chunk_size(cfg: Config, towers: Towers, loss_fn, world: World) -> int:
    """train.chunk_size as the step uses it: this rank's whole batch when null, the probe's
    choice for "auto" (logged), else the configured chunk."""
    per_rank = cfg.train.batch_size // world.world_size
    if cfg.train.chunk_size != "auto":
        return min(cfg.train.chunk_size or per_rank, per_rank)
    visual = towers.model.visual
    image_size = visual.image_size[0] if isinstance(visual.image_size, tuple) else visual.image_size
    chunk, figures = largest_chunk(towers.model, loss_fn, batch_size=per_rank,
                                   precision_dtype=AUTOCAST_DTYPES[cfg.train.precision], image_size=image_size,
                                   context_length=towers.model.context_length, vocab_size=towers.model.vocab_size,
                                   reserved=kept_bytes(cfg, world.device))
    chunk = int(min(all_reduce_max(-chunk, world.device) * -1, per_rank))  # the smallest over ranks
    shown = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
    say(world, f"train.chunk_size=auto: {chunk} samples per encoder pass ({shown})")
    return chunk


@dataclass
class Run:
    """Everything a training run is made of, assembled once."""

    cfg: Config
    world: World
    run_dir: Path
    data: PreparedData
    towers: Towers
    model: torch.nn.Module  # DDP-wrapped under several processes
    step: TrainStep
    stream_state: StreamState
    state: RunState
    start_step: int
    batches: TrainingBatches
    evaluator: Evaluator
    logger: MetricsLogger
    flops_per_sample: int  # model FLOPs of a training sample (clipscale.utilization)
    compiled: bool

    @classmethod
    def assemble(cls, cfg: Config, world: World, run_dir: Path, checkpoint: dict | None) -> "Run":
        """`checkpoint`: the one the run resumes from (open_run_dir), or None for a new run."""
        torch.manual_seed(cfg.run.seed)
        data = prepare_data(cfg.data, world)
        towers = build_model(cfg.model)
        module = towers.model.to(world.device)
        visual = module.visual
        image_size = visual.image_size[0] if isinstance(visual.image_size, tuple) else visual.image_size
        flops = train_flops_per_sample(module, image_size, module.context_length, world.device, *trainable_towers(module))
        compiled = compile_enabled(cfg.model.compile, world.device)
        if compiled:
            compile_towers(module, Path(cfg.model.compile_cache or run_dir / "compile_cache"))
        loss_fn = build_loss(cfg.loss.name, **cfg.loss.options)
        optimizer = build_optimizer(module, cfg.optim, fused=world.device.type == "cuda")
        chunk = chunk_size(cfg, towers, loss_fn, world)
        model = module
        if world.distributed:
            model = DistributedDataParallel(module, device_ids=[world.device.index] if world.device.type == "cuda" else None)
        step = TrainStep(model, loss_fn, optimizer, chunk_size=chunk, precision=cfg.train.precision,
                         grad_clip=cfg.optim.grad_clip, max_nonfinite_steps=cfg.train.max_nonfinite_steps)

        stream_state = StreamState()
        state = RunState(cfg, module, step, stream_state, world, data.num_train)
        start_step = state.restore(checkpoint) if checkpoint is not None else 0
        if world.is_main:
            write_open_clip_folder(run_dir, towers)  # with OPEN_CLIP_WEIGHTS, open_clip's `local-dir:` loads the run
        logger = MetricsLogger(run_dir, cfg, enabled=world.is_main, resume_step=start_step)
        batches = TrainingBatches.build(cfg, data, towers.train_transform, towers.tokenizer, world, stream_state, chunk,
                                        cfg.train.steps - start_step)
        for line in batches.path.notes:
            say(world, line)
        state.restore_rng()
        autocast = autocast_factory(AUTOCAST_DTYPES[cfg.train.precision], world.device)
        evaluator = Evaluator(cfg, data, towers, world, autocast)
        return cls(cfg, world, run_dir, data, towers, model, step, stream_state, state, start_step, batches,
                   evaluator, logger, flops, compiled)

    def fit(self, preemption: StopRequest) -> dict:
        cfg, world = self.cfg, self.world
        self.enter_train_mode()
        progress = tqdm(total=cfg.train.steps, initial=self.start_step, disable=not world.is_main, desc=cfg.run.name,
                        dynamic_ncols=True)
        data_errors_logged = self.state.logged_data_errors or self.data_errors()
        window_start, window_steps, data_wait = time.perf_counter(), 0, 0.0
        peak = peak_bf16_flops(world.device)
        for step_number in range(self.start_step, cfg.train.steps):
            batch = self.batches.next()
            lr = learning_rate(step_number, cfg.optim, cfg.train.steps)
            result = self.step(batch.images, batch.texts, lr)
            batch.consumed(self.stream_state)
            self.batches.release(batch)
            data_wait += batch.data_wait_s
            if step_number == self.start_step and self.compiled:
                say(world, f"compiling the towers took {seconds_compiling():.0f} s of the first step "
                           f"({self.batches.path.describe()})")

            done = step_number + 1
            window_steps += 1
            progress.update(1)
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                elapsed = time.perf_counter() - window_start
                # Data errors over all ranks: since the previous record, and since the run began.
                data_errors = self.data_errors()
                record = {
                    "loss": result.loss.item(),
                    "lr": lr,
                    "logit_scale": self.step.module.logit_scale.exp().item(),
                    "grad_norm": result.grad_norm.item(),
                    "samples_per_s": window_steps * cfg.train.batch_size / elapsed,
                    "step_s": elapsed / window_steps,
                    "data_wait_s": data_wait / window_steps,  # per step, on this rank
                    "peak_memory_gib": peak_memory_gib(world.device),
                    "skipped_samples": data_errors[0] - data_errors_logged[0],
                    "skipped_samples_total": data_errors[0],
                    "shard_errors": data_errors[1] - data_errors_logged[1],
                    "shard_errors_total": data_errors[1],
                    "nonfinite_steps": self.step.nonfinite_total,
                    "time": time.time(),
                }
                if peak is not None:
                    record["mfu"] = self.flops_per_sample * record["samples_per_s"] / world.world_size / peak
                self.logger.log(done, record)
                progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}")
                if step_number > self.start_step:  # the first step's wait is the loader starting up
                    self.warn_if_waiting(data_wait, elapsed)
                window_start, window_steps, data_wait, data_errors_logged = time.perf_counter(), 0, 0.0, data_errors
                self.state.logged_data_errors = data_errors
            if cfg.eval.every_n_steps and done % cfg.eval.every_n_steps == 0 and done < cfg.train.steps:
                self.evaluate(done)
            signum = preemption.requested(world.device)
            if signum or done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
                self.checkpoint(done)
            if signum:
                # No rank leaves before rank 0 has written the checkpoint: srun --kill-on-bad-exit
                # would end the step at the first rank's exit status 128+signal.
                barrier()
                progress.close()
                say(world, console.stopped_by_signal(signum, done))
                return {"preempted_by": signum}
        progress.close()
        results = self.final_evaluation()
        if world.is_main:  # last: these weights, equal to the final checkpoint's, say that the run has ended
            save_atomic(self.step.module.state_dict(), self.run_dir / OPEN_CLIP_WEIGHTS)
        return results

    def warn_if_waiting(self, data_wait: float, elapsed: float) -> None:
        """One console line, once a run, when the steps waited for their data over 10% of the time."""
        if data_wait <= 0.1 * elapsed or getattr(self, "warned_about_data", False):
            return
        self.warned_about_data = True
        path = self.batches.path
        knob = (f"data.workers (now {self.cfg.data.workers}) reads, checks and tokenizes for the GPU's decoder"
                if path.decoder == "device" else
                f"more data.workers (now {self.cfg.data.workers}), or data.decoder=device to decode on the GPU")
        say(self.world, f"the steps waited for their data {100 * data_wait / elapsed:.0f}% of the time "
                        f"({path.describe()}): {knob}")

    def data_errors(self) -> list[int]:
        return all_reduce_sum_list([self.stream_state.skipped_samples, self.stream_state.shard_errors], self.world.device)

    def enter_train_mode(self) -> None:
        self.model.train()
        if self.cfg.model.lock_image and self.cfg.model.lock_image_unlocked_groups == 0:
            self.step.module.visual.eval()  # LiT: a frozen tower is a fixed feature extractor, no dropout

    def evaluate(self, step_number: int) -> dict:
        results = self.evaluator(self.model)
        self.enter_train_mode()  # evaluation leaves the whole model in train mode
        if results:
            self.logger.log(step_number, results)
            self.logger.write_json(self.evaluation_path(step_number), {"step": step_number, **results})
            say(self.world, console.evaluation_ended(step_number, results))
        return results

    def final_evaluation(self) -> dict:
        """The evaluation at the last step; when a run that was killed after it (while its weights
        were written) is ended again, the results it wrote, not a second evaluation and record."""
        steps = self.cfg.train.steps
        written = self.evaluation_path(steps)
        if self.start_step == steps and written.is_file():
            say(self.world, console.evaluation_reused(written))
            return {key: value for key, value in json.loads(written.read_text()).items() if key != "step"}
        return self.evaluate(steps)

    def evaluation_path(self, step_number: int) -> Path:
        return self.run_dir / "eval" / f"step_{step_number:08d}.json"

    def checkpoint(self, step_number: int) -> None:
        checkpoint = self.state.capture(step_number)
        if checkpoint is not None:
            path = save_checkpoint(self.run_dir / CHECKPOINTS, step_number, checkpoint, keep=self.cfg.train.keep_checkpoints,
                                   keep_every=self.cfg.train.keep_every)
            say(self.world, console.checkpoint_saved(path, step_number))

    def close(self) -> None:
        self.batches.close()
        self.logger.close()

