"""The training loop: `train` decides what the run does with runs/<name> (run_dir.py), `Run.assemble`
builds its parts once, and `Run.fit`, read top to bottom, is the loop: the next batch, the step,
then metrics, evaluation and the checkpoint. The loop does not know how the loss is computed
(`build_loss`), how a batch is chunked (`TrainStep`), nor how it reaches the device (`TrainingBatches`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from clipscale.caption_length import text_lengths_for_run
from clipscale.checkpoint import CHECKPOINTS
from clipscale.checkpoint_manager import CheckpointManager, GlobalGenerators, ModelAndOptimizer
from clipscale.checks import RunPlan, plan_run
from clipscale.compile import CompilePolicy, compile_enabled, save_portable_cache
from clipscale.config import Config
from clipscale.console import Console, figures, library_noise_kept_off, weights_line
from clipscale.data.pipeline import TrainingBatches
from clipscale.distributed import World, barrier, init_distributed, shutdown_distributed
from clipscale.eval.during_training import Evaluator
from clipscale.losses import build_loss
from clipscale.memory import chunk_size
from clipscale.metrics import DataProblems, MetricsLogger, RecordWindow, StepReport
from clipscale.models import build_model, train_mode, write_open_clip_folder
from clipscale.optim import build_optimizer, learning_rate
from clipscale.parallel import ParallelModel, gathered, parallelize
from clipscale.profiling import profiled_step
from clipscale.run_dir import RunFolder, open_run_folder
from clipscale.signals import StopRequest
from clipscale.step import StepResult, TrainStep
from clipscale.utilization import train_flops_by_text_length
from clipscale.worker_server import start_worker_server


def train(cfg: Config, *, loss_fn: torch.nn.Module | None = None) -> dict:
    """Run (or resume) the configured job. Returns the last evaluation's results, or
    {"preempted_by": signal number} when a signal stopped it after a checkpoint.
    `loss_fn`: a loss built by the caller, in place of cfg.loss's."""
    with library_noise_kept_off():  # open_clip's "initialized randomly": the run says what it loads (weights_line)
        start_worker_server()  # while this process is one thread: before CUDA and the process group
        world = init_distributed(cfg.run.device, group_of_one=cfg.train.parallel == "fsdp")
        console = Console(world.is_main)
        preemption = StopRequest()
        run = None
        try:
            plan = plan_run(cfg, world)
            folder = open_run_folder(cfg)
            checkpoint = folder.newest_checkpoint(world, console)
            if folder.has_ended(checkpoint):
                console.say(f"{folder.run_dir} has already trained its {checkpoint['step']} steps; to train on, raise "
                            "train.steps with run.extend_steps=true, or choose a new run.name")
                return {}
            run = Run.assemble(cfg, plan, world, console, folder, checkpoint, loss_fn)
            return run.fit(preemption)
        finally:
            if run is not None:
                run.close()
            preemption.restore()
            shutdown_distributed()


def claim_run_dir(folder: RunFolder, world: World, console: Console) -> None:
    """Create (or move aside and create) runs/<name> and record the configuration, once every
    rank has read the folder (open_run_folder) and everything that can fail before training has passed."""
    barrier()
    if world.is_main:
        for line in folder.apply():
            console.say(line)
    barrier()


@dataclass
class Run:
    """Everything a training run is made of, assembled once."""

    cfg: Config
    world: World
    console: Console
    folder: RunFolder
    model: ParallelModel  # DDP-wrapped or sharded by FSDP under several processes
    step: TrainStep
    start_step: int
    batches: TrainingBatches
    evaluator: Evaluator
    window: RecordWindow
    logger: MetricsLogger
    checkpoints: CheckpointManager
    compile_cache: Path | None  # where the compiled towers' code is cached; None: not compiled
    step_report: StepReport
    progress: tqdm | None = None
    data_problems: DataProblems | None = None

    @classmethod
    def assemble(cls, cfg: Config, plan: RunPlan, world: World, console: Console, folder: RunFolder,
                 checkpoint: dict | None, loss_fn: torch.nn.Module | None = None) -> "Run":
        """`checkpoint`: the one the run resumes from, or None. Nothing is written to the run
        folder before every part is built: a mistake found here leaves it as it was."""
        torch.manual_seed(cfg.run.seed)  # the model's initial weights: the same on every rank
        towers = build_model(cfg.model, compiled=compile_enabled(cfg.model.compile, world.device),
                             gpu=world.device.type == "cuda")
        train = cfg.train
        text_order, text_notes = text_lengths_for_run(towers.model, cfg.model.cut_text_padding,
                                                      cfg.model.causal_text_attention)
        model = parallelize(towers.model, world, parallel=train.parallel, precision=train.precision,
                            reduce=train.fsdp_reduce, offload=train.fsdp_offload)
        with gathered(model.module):
            flops = train_flops_by_text_length(model.module, plan.image_size, text_order, world.device)
        loss_fn = loss_fn if loss_fn is not None else build_loss(cfg.loss.name, **cfg.loss.options)
        optimizer = build_optimizer(model.module, cfg.optim, fused=world.device.type == "cuda" and not train.fsdp_offload)
        chunk = chunk_size(plan, model, loss_fn, world, console)
        compile_policy = CompilePolicy.of(cfg.model, world.device, train.parallel, chunks=-(-plan.per_rank_batch // chunk))
        step = TrainStep(model, loss_fn, optimizer, chunk_size=chunk, precision=train.precision,
                         grad_clip=cfg.optim.grad_clip, max_nonfinite_steps=train.max_nonfinite_steps,
                         text_order=text_order, cuda_graphs=compile_policy.cuda_graphs)
        batches = TrainingBatches(cfg, plan, world, towers.train_transform, towers.tokenizer, chunk, min(flops.values()))
        try:
            window = RecordWindow(cfg.train.batch_size, world.device, world.world_size, flops)
            parts = {"model": ModelAndOptimizer(model.module, optimizer, world, sharded=train.parallel == "fsdp"),
                     "step": step, "data": batches, "metrics": window, "rng": GlobalGenerators(world.device)}
            checkpoints = CheckpointManager(folder.run_dir / CHECKPOINTS, cfg, world, console, parts)
            torch.manual_seed(cfg.run.seed + world.rank)  # dropout masks differ between ranks; a checkpoint's replace them
            start_step = checkpoints.load(checkpoint)
            console.say(weights_line(cfg.model.pretrained, f"the checkpoint of step {start_step}" if checkpoint else None,
                                     cfg.run.seed))
            evaluator = Evaluator(cfg, towers, world, plan.autocast_dtype)
            claim_run_dir(folder, world, console)
            for line in [*batches.path.notes, *text_notes]:
                console.say(line)
            default_cache = folder.run_dir / "compile_cache"  # in the run folder: compiled once the folder is claimed
            compile_cache = compile_policy.cache_dir(default_cache) if compile_policy.compiled else None
            for line in compile_policy.apply(model.module, default_cache):
                console.say(line)
            if world.is_main:
                write_open_clip_folder(folder.run_dir, towers)  # with the final weights, open_clip's `local-dir:` loads the run
            logger = MetricsLogger(folder.run_dir, cfg, enabled=world.is_main, resume_step=start_step)
        except BaseException:
            batches.close()
            raise
        step_report = StepReport(cfg, batches.path, compile_cache is not None, gpu=world.device.type == "cuda")
        return cls(cfg, world, console, folder, model, step, start_step, batches, evaluator, window, logger,
                   checkpoints, compile_cache, step_report)

    def fit(self, preemption: StopRequest) -> dict:
        cfg = self.cfg
        self.enter_train_mode()
        self.progress = self.console.progress_bar(cfg.train.steps, self.start_step, cfg.run.name)
        totals = self.batches.error_totals()
        self.window.open(totals)
        self.data_problems = DataProblems(totals=tuple(totals), steps=cfg.train.steps - self.start_step, batch_size=cfg.train.batch_size)
        for step_number in range(self.start_step, cfg.train.steps):
            lr = learning_rate(step_number, cfg.optim, cfg.train.steps)
            with self.batches.next() as batch:  # its pieces still arriving; used once the step returns
                if step_number + 1 == cfg.train.profile_step:
                    result = self.profiled(step_number + 1, lambda: self.step(batch.images, batch.texts, lr))
                else:
                    result = self.step(batch.images, batch.texts, lr)
            self.report(batch.data_wait_s)
            if step_number == self.start_step and self.compile_cache is not None and self.world.is_main:
                save_portable_cache(self.compile_cache)  # what the first step compiled, for a start elsewhere
            done = step_number + 1
            self.log_metrics(done, result, lr, batch.data_wait_s)
            self.evaluate_on_schedule(done)
            signum = preemption.requested(self.world.device)
            self.checkpoints.save(done, stopping=bool(signum))
            if signum:
                return self.stop(signum, done)
        self.progress.close()
        results = self.final_evaluation()
        self.folder.end(self.model.module, self.world)  # last: the weights and the end marker say that the run has ended
        return results

    def log_metrics(self, step_number: int, result: StepResult, lr: float, data_wait_s: float) -> None:
        self.progress.update(1)
        self.window.step_done(data_wait_s, result.text_chunks)
        if step_number % self.cfg.train.log_every and step_number != self.cfg.train.steps:
            return
        record = self.window.record(result, lr, logit_scale=result.logit_scale.item(), nonfinite_steps=self.step.nonfinite_total,
                                    data_errors=self.batches.error_totals())
        self.logger.log(step_number, record)
        self.progress.set_postfix(self.window.progress_figures(record, self.model.module.context_length))

    def profiled(self, step_number: int, run_step: Callable[[], StepResult]) -> StepResult:
        """The step under torch.profiler (train.profile_step); rank 0 writes its account and trace."""
        folder = self.folder.run_dir / "profile"
        results = []

        def step_to_its_end() -> None:
            results.append(run_step())
            float(results[0].loss)  # its GPU work ends inside the profile

        if self.world.is_main:
            folder.mkdir(exist_ok=True)
        account = profiled_step(step_to_its_end, self.world.device,
                                trace=folder / f"step_{step_number}.trace.json.gz" if self.world.is_main else None)
        if self.world.is_main:
            path = folder / f"step_{step_number}.json"
            path.write_text(json.dumps({"step": step_number, **account}, indent=1) + "\n")
            self.console.say(f"step {step_number} profiled: the GPU busy {account['gpu_busy_share']:.0%} of "
                             f"{account['step_s']:.2f} s; {path} and its trace beside it")
        return results[0]

    def report(self, data_wait_s: float) -> None:
        """Console lines from every step: the compile time, steps waiting for data, data problems.
        The data problems' totals over ranks (a blocking collective) are gathered only at the steps
        that log, the same on every rank; between them the shards and samples met are kept."""
        done = self.start_step + self.data_problems.steps_done + 1
        logs = done % self.cfg.train.log_every == 0 or done == self.cfg.train.steps
        problems = self.data_problems.after_step(self.batches.error_totals() if logs else None,
                                                 self.batches.take_problem_shards(), self.batches.stream.take_skips())
        for line in [*self.step_report.after_step(data_wait_s), *problems]:
            self.console.say(line)

    def stop(self, signum: int, step_number: int) -> dict:
        # No rank leaves before rank 0 has written the checkpoint: srun --kill-on-bad-exit
        # would end the step at the first rank's exit status 128+signal.
        barrier()
        self.progress.close()
        self.console.say(f"stopped by signal {signum} after step {step_number}; the same command resumes from the checkpoint")
        return {"preempted_by": signum}

    def enter_train_mode(self) -> None:
        train_mode(self.model.module, self.cfg.model)

    def evaluate_on_schedule(self, step_number: int) -> None:
        every = self.cfg.eval.every_n_steps
        if every and step_number % every == 0 and step_number < self.cfg.train.steps:  # the last step's: final_evaluation
            self.evaluate(step_number)

    def evaluate(self, step_number: int) -> dict:
        with gathered(self.model.module):
            results = self.evaluator(self.model.module)
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
        return self.folder.run_dir / "eval" / f"step_{step_number:08d}.json"

    def close(self) -> None:
        self.batches.close()
        self.logger.close()

