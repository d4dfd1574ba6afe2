"""Do the tests catch the bugs they are named for? Put each plausible bug below into a copy of
the tree, run the tests said to catch it, and report whether at least one of them fails.

    python tests/mutations.py                 # every mutation (about 25 minutes on 2 cores)
    python tests/mutations.py no_ddp_wrap     # some, by name
    python tests/mutations.py --list

A mutation is a literal replacement that must match the source exactly once: when the code it
names moves or changes, or a test file it names is not there, this script stops and says so
instead of testing an unchanged tree.
Each mutation is caught (a listed test failed), survived (every listed test passed with the bug in
place) or hung (its tests ran past --timeout and were killed, with every process they started:
a hang is no catch, a test should fail with its own message instead). Exit status 1 when a
mutation survives or hangs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(REPO))  # run as a script: tests/ is sys.path[0]
import torch  # noqa: E402

from tests.helpers.tiny_runs import kill_tree  # noqa: E402


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids, any one failing catches the bug


MUTATIONS = [
    Mutation("timm_left_out_of_a_timm_tower", "a run whose image tower is timm's starts as if timm were not installed",
             "clipscale/optional_libraries.py", '    if "timm_model_name" in vision_cfg:', "    if False:",
             ("tests/test_optional_libraries.py",)),
    Mutation("optional_library_unloaded_after_import", "a library already imported is marked absent all the same",
             "clipscale/optional_libraries.py", " and name not in sys.modules]", "]",
             ("tests/test_optional_libraries.py::test_a_timm_tower_gets_timm_and_a_library_already_imported_stays",)),
    Mutation("auto_chunk_not_measured", "train.chunk_size=auto takes the line's chunk without measuring its pass",
             "clipscale/memory.py", "        if measured is not None and measured <= probe.room_for_a_chunk():",
             "        if True:", ("tests/test_memory.py",)),
    Mutation("pass_two_works_ahead_only_from_the_device",
             "pass 2 begins the next batch only when pass 1 kept every chunk on the device, not when some wait on the host",
             "clipscale/data/chunks.py", "all(bound in self.kept or bound in self.on_host for bound in bounds)",
             "all(bound in self.kept for bound in bounds)",
             ("tests/data/test_device_decode.py::test_a_batch_larger_than_the_arenas_streams_through_them_on_the_same_curve",)),
    Mutation("window_ignores_the_pixels_on_the_host", "the arenas' window takes host memory that pass 2's pixels on the host need",
             "clipscale/data/pipeline.py", "min(room, STEP_HOST_FRACTION * host_bytes - on_host)",
             "min(room, STEP_HOST_FRACTION * host_bytes)",
             ("tests/data/test_pipeline.py::test_a_batch_larger_than_its_arenas_takes_a_window_of_them_while_pass_twos_pixels_fit",)),
    Mutation("infcl_float32_under_autocast", "Inf-CL runs the trainer's float32 features in IEEE float32 under autocast (20x slower)",
             "clipscale/losses/infcl/loss.py",
             "    if exact or not isinstance(first, torch.Tensor) or not torch.is_autocast_enabled(first.device.type):",
             "    if True:", ("tests/losses/infcl/test_loss.py",)),
    Mutation("crop_tries_skipped_without_rounding", "the crop draw skips torchvision's tries where one fits only as its sides round down",
             "clipscale/data/transforms.py", "(width + 0.5) ** 2 / smallest", "width ** 2 / smallest",
             ("tests/data/test_transforms.py",)),
    Mutation("stream_drops_a_sample_on_resume", "a resumed stream seeks one raw sample too far",
             "clipscale/data/epoch.py", "self._seek(buffered, read=draws + len(buffered))",
             "self._seek(buffered, read=draws + len(buffered) + 1)",
             ("tests/data/test_shards.py::test_every_sample_is_seen_once_per_epoch_across_ranks_and_workers",)),
    Mutation("record_window_keeps_its_text_chunks",
             "the metrics window stops clearing its text chunks after a record: text positions and mfu become running averages",
             "clipscale/metrics.py", "        self.logged_data_errors = list(data_errors)\n        self._new_window()\n",
             "        self.logged_data_errors = list(data_errors)\n        self.start, self.steps = time.perf_counter(), 0\n",
             ("tests/test_metrics_window.py",)),
    Mutation("mfu_of_the_whole_world", "mfu counts the world's rate against one GPU's peak (not divided by the world size)",
             "clipscale/metrics.py", 'record["samples_per_s"] / self.world_size / self.peak_flops',
             'record["samples_per_s"] / self.peak_flops', ("tests/test_metrics_window.py",)),
    Mutation("reshaped_resume_restarts_the_epoch",
             "a resume on another world size or data.workers starts the epoch again: what was read before is read twice",
             "clipscale/data/shards.py", "        return cls.reshaped(saved, rank, workers)\n",
             '        return cls(workers=workers, batches=saved[0]["batches"])\n',
             ("tests/data/test_reshaped_resume.py",)),
    Mutation("reshaped_resume_drops_begun_slots", "a resume on another shape counts the slots begun as used up",
             "clipscale/data/epoch.py", "                partial[self.item(item)[0]] = tuple(position)\n",
             "                done.add(self.item(item)[0])\n",
             ("tests/data/test_reshaped_resume.py",)),
    Mutation("pass_two_without_replay", "Gradient Cache's pass 2 re-encodes without pass 1's RNG states",
             "clipscale/gradcache.py", "grads.backward(self.reencode(image, text, *states[k]), start, stop",
             "grads.backward(self.reencode(image, text, None, None), start, stop",
             ("tests/test_compile.py::test_the_compiled_gradient_cache_step_equals_the_eager_one",
              "tests/test_gradcache.py")),
    Mutation("text_features_left_in_length_order", "Gradient Cache's loss sees the texts in their encoding order",
             "clipscale/gradcache.py", "first.text_features = first.text_features[torch.argsort(text_rows.to(self.device))]",
             "first.text_features = first.text_features",
             ("tests/test_caption_length.py",)),
    Mutation("text_gradients_of_the_wrong_rows", "pass 2 backpropagates the texts' gradients in the pairs' order",
             "clipscale/gradcache.py", "grads.text_rows = None if text_rows is None else text_rows.to(self.device)",
             "grads.text_rows = None",
             ("tests/test_caption_length.py",)),
    Mutation("caption_cut_before_its_end", "a caption's length leaves out its end-of-text token",
             "clipscale/caption_length.py", "    return pooled[:, 0] + 1", "    return pooled[:, 0]",
             ("tests/test_caption_length.py",)),
    Mutation("positional_embedding_from_the_end", "cut tokens get the positional embedding's last rows",
             "clipscale/caption_length.py", "self.positional_embedding[: text.shape[1]]",
             "self.positional_embedding[-text.shape[1]:]",
             ("tests/test_caption_length.py",)),
    Mutation("pooled_at_the_last_position", "the cut tower pools its last position, not the end-of-text token",
             "clipscale/caption_length.py", "text_global_pool(x, text, self.text_pool_type,",
             'text_global_pool(x, text, "last",',
             ("tests/test_caption_length.py",)),
    Mutation("chunk_cut_to_its_shortest_caption", "a text chunk is cut to its shortest caption, not its longest",
             "clipscale/caption_length.py", "int(self.lengths[start:stop].max())", "int(self.lengths[start:stop].min())",
             ("tests/test_caption_length.py::test_sorted_and_cut_step_equals_the_unsorted_full_length_step",)),
    Mutation("causal_hint_on_any_mask", "the causal kernel is used for a bidirectional text tower",
             "clipscale/caption_length.py", "    if tower.attn_mask is None or not _is_causal(tower.attn_mask):\n        return \"the text attention",
             "    if False:\n        return \"the text attention",
             ("tests/test_caption_length.py",)),
    Mutation("pass_one_keeps_nothing", "pass 1's chunks are never kept on the device: pass 2 decodes them again",
             "clipscale/data/chunks.py", "if bound in keep and (charged or self.budget.take(nbytes(chunk))):",
             "if False and (charged or self.budget.take(nbytes(chunk))):",
             ("tests/data/test_device_decode.py",)),
    Mutation("no_rng_restore", "the trainer does not restore the RNG on resume",
             "clipscale/checkpoint_manager.py", '        torch.set_rng_state(state["cpu"])\n', "",
             ("tests/trainer/test_resume.py::test_a_resumed_run_with_dropout_draws_the_uninterrupted_runs_masks",)),
    Mutation("error_counts_restart_after_resume", "the 'since previous record' counters restart at a resume",
             "clipscale/metrics.py", "        if self.logged_data_errors is None:\n            self.logged_data_errors = data_errors",
             "        self.logged_data_errors = data_errors",
             ("tests/trainer/test_resume.py::test_data_error_counts_since_the_previous_record_survive_a_resume",
              "tests/trainer/test_resume.py::test_data_error_counts_since_the_previous_record_survive_a_resume_between_records")),
    Mutation("same_seed_on_every_rank", "every rank draws dropout from the same seed",
             "clipscale/trainer.py", "torch.manual_seed(cfg.run.seed + world.rank)",
             "torch.manual_seed(cfg.run.seed)",
             ("tests/trainer/test_rank_seeds.py::test_two_ranks_draw_different_dropout_masks",)),
    Mutation("metrics_rewritten_in_place", "a resume rewrites metrics.jsonl in place (a kill leaves it cut short)",
             "clipscale/metrics.py", 'write_text_atomic(self.path, "".join(line + "\\n" for line in kept))',
             'self.path.write_text("".join(line + "\\n" for line in kept))',
             ("tests/trainer/test_checkpoint_kills.py",)),
    Mutation("ended_without_its_marker", "a run counts as ended once its weights exist, without the end marker",
             "clipscale/run_dir.py",
             ' and marker.is_file()\n                and marker.read_text().strip() == str(checkpoint["step"]))', ")",
             ("tests/trainer/test_checkpoint_kills.py",)),
    Mutation("injected_loss_ignored", "train() builds the configured loss even when a loss is handed to it",
             "clipscale/trainer.py", "loss_fn = loss_fn if loss_fn is not None else build_loss(",
             "loss_fn = build_loss(",
             ("tests/trainer/test_run_components.py",)),
    Mutation("optimizer_steps_on_nonfinite", "optimizer.step() runs on non-finite steps",
             "clipscale/step.py", "        elif applied:\n            self.optimizer.step()",
             "        else:\n            self.optimizer.step()",
             ("tests/test_step.py",)),
    Mutation("nonfinite_grad_norm_ignored", "a non-finite gradient norm is ignored",
             "clipscale/step.py", "applied = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))",
             "applied = bool(torch.isfinite(loss))",
             ("tests/test_step.py::test_infinite_gradients_with_a_finite_loss_do_not_step_the_optimizer",
              "tests/test_step.py::test_finite_steps_do_step_and_nonfinite_ones_are_counted")),
    Mutation("in_a_row_never_resets", "the 'in a row' non-finite counter never resets",
             "clipscale/step.py", "            self.nonfinite_in_a_row = 0\n            return", "            return",
             ("tests/test_step.py::test_the_in_a_row_count_restarts_after_a_finite_step",)),
    Mutation("checkpoint_in_place", "checkpoints written in place (no temporary file, no rename)",
             "clipscale/checkpoint.py",
             "tmp = temporary_name(path)",
             "tmp = path",
             ("tests/test_checkpoint.py",)),
    Mutation("no_fsync", "a checkpoint renamed into place before it reaches the disk (no fsync)",
             "clipscale/checkpoint.py", "                f.flush()\n                os.fsync(f.fileno())\n            os.replace(tmp, path)",
             "                f.flush()\n            os.replace(tmp, path)",
             ("tests/test_checkpoint.py::test_a_process_killed_while_saving_leaves_every_checkpoint_loadable",
              "tests/test_checkpoint.py::test_a_checkpoint_reaches_the_disk_before_it_takes_the_final_name")),
    Mutation("no_ddp_wrap", "the model is never wrapped in DDP",
             "clipscale/parallel.py", "    if not world.distributed:\n        return ParallelModel(module, GradientSync()",
             "    if True:\n        return ParallelModel(module, GradientSync()",
             ("tests/trainer/test_distributed.py",)),
    Mutation("no_warmup", "no learning-rate warmup",
             "clipscale/optim.py", "    if step < cfg.warmup_steps:", "    if False:",
             ("tests/test_optim.py::test_lr_warms_up_linearly_then_follows_a_half_cosine",)),
    Mutation("weight_decay_everywhere", "weight decay on every parameter",
             "clipscale/optim.py", '    return not (param.ndim < 2 or "bn" in name', '    return True or not (param.ndim < 2 or "bn" in name',
             ("tests/test_optim.py::test_weight_decay_applies_to_weights_not_to_gains_biases_norms_or_logit_scale",)),
    Mutation("no_logit_scale_clamp", "the logit scale is not clamped at 100",
             "clipscale/step.py", "            logit_scale.clamp_(0, MAX_LOGIT_SCALE)\n", "            pass\n",
             ("tests/test_optim.py::test_the_logit_scale_is_clamped_at_100",)),
    Mutation("scaler_state_not_restored", "the GradScaler's state is not restored on resume",
             "clipscale/step.py", '            self.scaler.load_state_dict(state["scaler"])', "            pass",
             ("tests/test_step.py::test_an_fp16_overflow_skips_the_step_halves_the_scale_and_the_scale_survives_a_resume",)),
    Mutation("autocast_ignored", "train.precision=bf16/fp16 runs the encoders in float32 (no autocast)",
             "clipscale/step.py", "autocast=AUTOCAST_DTYPES[precision]", "autocast=None",
             ("tests/test_step.py::test_bf16_and_fp16_runs_follow_the_fp32_curve",)),
    Mutation("sigusr1_not_handled", "SIGUSR1 is not one of the trainer's stop signals",
             "clipscale/signals.py", "STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)",
             "STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)",
             ("tests/trainer/test_resume.py::test_sigusr1_finishes_the_step_writes_a_checkpoint_and_exits_138",)),
    Mutation("stop_signal_not_reduced", "ranks decide alone whether to stop (the signal is not reduced over ranks)",
             "clipscale/signals.py", "        return int(all_reduce_max(self.signum, device))", "        return self.signum",
             ("tests/trainer/test_distributed.py::test_ranks_stop_at_the_same_step_when_only_one_is_signalled",)),
    Mutation("lit_optimizer_over_all_parameters", "LiT: the optimizer holds the locked tower's parameters too",
             "clipscale/optim.py", "named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]",
             "named = list(model.named_parameters())",
             ("tests/test_optim.py::test_lit_keeps_no_optimizer_state_for_the_locked_tower",)),
    Mutation("siglip_bias_without_gradient", "SigLIP's logit_bias gets no gradient through Gradient Cache",
             "clipscale/gradcache.py", "for scalar, grad in zip(out.scalars, self.scalars):",
             "for scalar, grad in zip(out.scalars[:1], self.scalars[:1]):",  # the logit scale only
             ("tests/trainer/test_trainer.py::test_siglip_trains_its_logit_bias_through_gradient_cache_as_in_one_pass",)),
    Mutation("eval_set_prefix_dropped", "eval.sets metrics logged without their <set>_ prefix",
             "clipscale/eval/during_training.py", 'results.update({f"{task.name}_{k}": v', "results.update({k: v",
             ("tests/eval/test_during_training.py::test_eval_sets_run_inside_training_and_log_set_metric_keys",)),
    Mutation("eval_script_ignores_precision", "the eval script ignores --precision",
             "scripts/eval_zeroshot.py", 'bf16 = args.precision == "bf16" or (', "bf16 = (",
             ("tests/eval/test_during_training.py::test_the_eval_scripts_precision_is_the_towers_compute_dtype",)),
    Mutation("batch_keeps_its_pieces", "each batch keeps the loader pieces it was gathered from (a third batch in memory)",
             "clipscale/data/pipeline.py",
             '                              if key in piece})',
             '                              if key in piece} | {"piece": piece})',
             ("tests/data/test_host_memory.py",)),
    Mutation("arena_pieces_given_back_early", "a batch's pixels in the workers' arenas given back as they arrive, before pass 2 reads them",
             "clipscale/data/decoders.py",
             "        self.pieces.append((first_row, encoded.clone(pinned=torch.cuda.is_available())))\n",
             "        self.pieces.append((first_row, encoded.clone(pinned=torch.cuda.is_available())))\n"
             "        self.release()\n",
             ("tests/data/test_device_decode.py::test_workers_decoding_every_image_write_into_arenas_and_train_on_the_threads_curve",)),
    Mutation("arena_skipped_tail_held", "the tail a wrapped piece skipped counts as held until the next piece is given back",
             "clipscale/data/chunks.py", "            if stop - (held[0][0] if held else start) <= self.arena_bytes:",
             "            if stop - released[worker] <= self.arena_bytes:",
             ("tests/data/test_device_decode.py::test_an_arena_wraps_round_and_a_worker_waits_for_room_until_given_back",)),
    Mutation("arena_pieces_held_through_pass_two", "the batch in use keeps its arena pieces while pass 2 receives the next batch's",
             "clipscale/data/chunks.py",
             "            self.rows.release()  # pass 2 reads only what pass 1 kept: the rows' host pixels can go now\n",
             "            pass\n",
             ("tests/data/test_device_decode.py::test_the_training_thread_decodes_the_next_batch_between_pass_twos_chunks_on_the_same_curve",)),
    Mutation("pieces_received_ahead_counted_as_wait", "pieces received during the previous step's pass 2 counted in data_wait_s",
             "clipscale/data/pipeline.py",
             "                - self.received_ahead_s + self.receiving_next_s)",
             "                + self.receiving_next_s)",
             ("tests/data/test_device_decode.py::test_the_training_thread_decodes_the_next_batch_between_pass_twos_chunks_on_the_same_curve",)),
    Mutation("receiving_the_next_batch_not_a_wait", "the time the training thread spends receiving the next batch's pieces between pass 2's chunks left out of data_wait_s",
             "clipscale/data/pipeline.py",
             "                - self.received_ahead_s + self.receiving_next_s)",
             "                - self.received_ahead_s)",
             ("tests/data/test_device_decode.py::test_the_training_thread_decodes_the_next_batch_between_pass_twos_chunks_on_the_same_curve",)),
    Mutation("arena_pieces_given_back_with_the_first_chunk_ahead", "a batch's arena pieces all given back once its first chunk is decoded ahead",
             "clipscale/data/chunks.py", "            self.rows.on_device_before(stop)\n", "            self.rows.on_device_before(len(self))\n",
             ("tests/data/test_device_decode.py::test_pieces_of_a_chunk_decoded_ahead_go_back_to_their_arena_before_the_batch_trains",)),
    Mutation("workers_read_the_same_shards", "two loader workers of a rank read the same shards",
             "clipscale/data/shards.py", "        consumer = self.rank * self.num_workers + worker",
             "        consumer = self.rank * self.num_workers",
             ("tests/data/test_shards.py::test_every_sample_is_seen_once_per_epoch_across_ranks_and_workers",)),
    Mutation("loss_options_ignored_on_resume", "loss.options left out of the run-identity check",
             "clipscale/config.py", "    options: dict = field(default_factory=dict)",
             "    options: dict = may_change(default_factory=dict)",
             ("tests/test_run_dir.py::test_a_resume_with_another_loss_option_is_refused_naming_the_key",)),
    Mutation("every_rank_reads_the_checkpoint", "every rank reads the whole checkpoint file, not rank 0 alone",
             "clipscale/run_dir.py", "        if world.is_main:\n            try:", "        if True:\n            try:",
             ("tests/trainer/test_fsdp_checkpoint.py::test_a_whole_checkpoint_resumed_under_fsdp_is_read_by_rank_0_alone",)),
    Mutation("other_workers_keep_the_data_cursors", "a resume on another data.workers restores the saved cursors",
             "clipscale/data/shards.py", '        if len(saved) == world_size and saved[0]["workers"] == workers:',
             "        if len(saved) == world_size:",
             ("tests/data/test_reshaped_resume.py",)),
    Mutation("older_checkpoint_cursors_misread", "a checkpoint's cursors written before `Cursor` lose their epoch field wrongly",
             "clipscale/data/shards.py", "        item, _, *position = saved\n", "        item, *position = saved\n",
             ("tests/data/test_shards.py",)),
    Mutation("other_workers_said_to_go_on_from_the_checkpoint",
             "a resume on another data.workers says the data order goes on from the checkpoint, not dealt anew",
             "clipscale/config.py", "    workers: int = may_change(2, on_resume=REDEAL)", "    workers: int = may_change(2)",
             ("tests/test_checkpoint_manager.py",)),
    Mutation("data_error_totals_of_rank_0", "skipped_samples_total / shard_errors_total are rank 0's own",
             "clipscale/data/pipeline.py",
             "return all_reduce_sum_list([self.state.skipped_samples, self.state.shard_errors, self.state.captions_cut,\n"
             "                                    self.state.images_trained_black], self.world.device)",
             "return [self.state.skipped_samples, self.state.shard_errors, self.state.captions_cut, self.state.images_trained_black]",
             ("tests/data/test_error_totals.py",)),
    Mutation("evaluation_in_train_mode", "evaluation runs the model in train mode (dropout, patch dropout on)",
             "clipscale/eval/inference.py", "    inner.eval()\n", "",
             ("tests/eval/test_inference.py",)),
    Mutation("auto_chunk_twice_what_fits", "train.chunk_size=auto picks twice the chunk the probe says fits",
             "clipscale/memory.py", "fits = min(batch_size, int(room // per_sample))",
             "fits = min(batch_size, int(2 * room // per_sample))",
             ("tests/test_memory.py",)),
    Mutation("infcl_does_not_build", "the infcl loss cannot be built (its Gradient Cache tests must fail, not vanish)",
             "clipscale/losses/infcl/loss.py", "        select_backend(backend, \"cpu\", tile_size)  # fail at build time on a bad option",
             "        raise RuntimeError(\"broken\")",
             ("tests/test_gradcache.py::test_matches_plain_step_with_dropout",)),
    Mutation("refused_features_count_as_a_finite_step", "a step whose loss refused non-finite features counts as applied",
             "clipscale/step.py", "loss, scaled = torch.tensor(math.nan), False", "loss, scaled = torch.tensor(0.0), False",
             ("tests/test_step.py::test_a_step_with_nonfinite_features_leaves_weights_and_optimizer_untouched",)),
    Mutation("interpreter_fixed_once", "the Inf-CL kernels keep the first mode they ran in (TRITON_INTERPRET not read per call)",
             "clipscale/losses/infcl/kernels.py", "    return _programs_of_mode(interpreting())",
             "    return _programs_of_mode(True)",
             ("tests/losses/infcl/test_kernels.py::test_the_interpreter_is_chosen_at_each_call_not_at_import",)),
    Mutation("cublas_flags_left_set", "the backward's cuBLAS and TF32 flags are not restored after it",
             "clipscale/losses/infcl/kernels.py", "        for key, value in saved.items():\n            setattr(matmul, key, value)",
             "        pass",
             ("tests/losses/infcl/test_kernels.py::test_the_cublas_settings_hold_inside_the_backward_only",)),
    Mutation("extension_always_cosine", "extending a run names the cosine schedule whatever optim.lr_scheduler is",
             "clipscale/run_dir.py", 'return (f"the {optim.lr_scheduler} learning-rate schedule',
             'return (f"the cosine learning-rate schedule',
             ("tests/test_run_dir.py::test_an_extension_states_the_configured_schedule",)),
    Mutation("kernel_state_in_a_module_global", "the kernels count launches in a module-level Counter",
             "clipscale/losses/infcl/kernels.py", "TUNE_ROWS = 131_072 + 1_024\n",
             "TUNE_ROWS = 131_072 + 1_024\nlaunch_counts = collections.Counter()\n",
             ("tests/test_module_boundaries.py::test_the_loss_kernels_and_the_data_path_keep_no_module_state",)),
    Mutation("private_name_imported", "a module imports another's private name",
             "clipscale/data/crop_resize.py", "from clipscale.triton_modes import interpreting, programs",
             "from clipscale.triton_modes import interpreting, programs\nfrom clipscale.losses.infcl.kernels import _split  # noqa: F401",
             ("tests/test_module_boundaries.py::test_no_module_imports_a_private_name_of_another",)),
    Mutation("fsdp_scalars_not_averaged", "FSDP: the replicated logit scale's gradient is not averaged over ranks",
             "clipscale/parallel.py", "                dist.all_reduce(scalar.grad)\n                scalar.grad /= dist.get_world_size()",
             "                pass",
             ("tests/test_parallel.py::test_fsdp_trains_the_weights_of_ddp",)),
    Mutation("fsdp_step_reduce_never_syncs", "FSDP with fsdp_reduce=step: the last chunk does not reduce-scatter either",
             "clipscale/parallel.py", "        finally:\n            self.module.set_requires_gradient_sync(True)",
             "        finally:\n            pass",
             ("tests/test_parallel.py::test_fsdp_trains_the_weights_of_ddp",
              "tests/test_parallel.py::test_gradients_are_reduce_scattered_after_every_chunk_or_once_a_step")),
    Mutation("fsdp_evaluation_not_gathered", "FSDP: evaluation runs without gathering every block first (ranks' batch counts differ)",
             "clipscale/parallel.py", "    if not isinstance(model, FSDPModule):\n        yield\n        return\n    modules",
             "    if True:\n        yield\n        return\n    modules",
             ("tests/test_parallel.py::test_an_evaluation_may_run_a_different_number_of_batches_on_each_rank",)),
    Mutation("data_wait_is_the_steps_time", "data_wait_s measured as the whole step's time",
             "clipscale/metrics.py", '"data_wait_s": self.data_wait_s / self.steps,',
             '"data_wait_s": (time.perf_counter() - self.start) / self.steps,',
             ("tests/test_console.py::test_data_wait_is_the_time_the_step_waited_for_its_batch_not_the_steps_time",)),
    Mutation("validation_in_train_mode", "the validation loss (eval.val_data) computed with the model in train mode",
             "clipscale/eval/validation.py", "with evaluating(model) as inner:\n            for batch in self._batches():",
             "with evaluating(model) as inner:\n            inner.train()\n            for batch in self._batches():",
             ("tests/eval/test_inference.py::test_the_validation_loss_is_computed_in_eval_mode",)),
    Mutation("csv_upsampling_factors_ignored", "upsampling factors ignored for CSV sources",
             "clipscale/data/__init__.py", "return CsvTable(tables, factors=factors, **sampling)",
             "return CsvTable(tables, **sampling)",
             ("tests/data/test_own_data.py::test_csv_sources_are_drawn_by_their_upsampling_factors",)),
    Mutation("patch_rows_and_columns_swapped", "model.patch_embed=matmul unfolds each patch's columns before its rows",
             "clipscale/models.py", ".permute(0, 2, 4, 1, 3, 5)", ".permute(0, 2, 4, 1, 5, 3)",
             ("tests/test_patch_embed.py::test_the_patches_order_inside_the_product",)),
    Mutation("patch_grid_transposed", "model.patch_embed=matmul gives the grid's columns as its rows",
             "clipscale/models.py", ".unflatten(2, (gh, gw))", ".unflatten(2, (gw, gh))",
             ("tests/test_patch_embed.py::test_the_patches_order_inside_the_product",)),
    Mutation("short_attention_causal_mask_dropped", "model.attention=short lets a caption's tokens attend to later ones",
             "clipscale/attention_programs.py", "        keep = keep & (cols[None, :] <= rows[:, None])", "        keep = keep",
             ("tests/test_attention.py::test_output_and_gradient_equal_sdpa_in_float64",)),
    Mutation("short_attention_padding_keys_attended", "model.attention=short attends to the tile's rows past the sequence",
             "clipscale/attention_programs.py", "    keep = cols[None, :] < seq_len", "    keep = cols[None, :] < BLOCK",
             ("tests/test_attention.py::test_output_and_gradient_equal_sdpa_in_float64",)),
    Mutation("short_attention_softmax_gradient_without_delta", "model.attention=short's backward leaves out the softmax's row term",
             "clipscale/attention_programs.py",
             "    p = tl.exp2(_scores(q, k, rows, rows, seq_len, scale_log2, CAUSAL, PREC) - lse[:, None])\n"
             "    dv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)\n"
             "    ds = (p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])).to(q.dtype)",
             "    p = tl.exp2(_scores(q, k, rows, rows, seq_len, scale_log2, CAUSAL, PREC) - lse[:, None])\n"
             "    dv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)\n"
             "    ds = (p * tl.dot(do, tl.trans(v), input_precision=PREC)).to(q.dtype)",
             ("tests/test_attention.py::test_output_and_gradient_equal_sdpa_in_float64",)),
    Mutation("short_attention_strides_assumed_contiguous", "model.attention=short reads the projection as if its samples were packed",
             "clipscale/attention_programs.py",
             "    qkv_at = sample * stride_qkv_b\n    q = _tile(QKV, qkv_at, stride_qkv_s, rows, head * head_dim, dims, seq_len, head_dim)\n    k =",
             "    qkv_at = sample * (3 * width * seq_len)\n    q = _tile(QKV, qkv_at, stride_qkv_s, rows, head * head_dim, dims, seq_len, head_dim)\n    k =",
             ("tests/test_attention.py::test_a_strided_projection_is_read_in_place",)),
    Mutation("key_loop_strides_assumed_contiguous", "the attention's key loop reads the projection as if its samples were packed",
             "clipscale/attention_programs.py",
             "    qkv_at = sample * stride_qkv_b\n    q = _tile(QKV, qkv_at, stride_qkv_s, rows, head * head_dim, dims, seq_len, head_dim)\n    row_max",
             "    qkv_at = sample * (3 * width * seq_len)\n    q = _tile(QKV, qkv_at, stride_qkv_s, rows, head * head_dim, dims, seq_len, head_dim)\n    row_max",
             ("tests/test_attention.py::test_a_strided_projection_is_read_in_place",)),
    Mutation("key_loop_output_not_rescaled", "the attention's key loop keeps an output summed under an older row maximum",
             "clipscale/attention_programs.py", "        out = out * rescale[:, None] + tl.dot(", "        out = out + tl.dot(",
             ("tests/test_attention.py::test_output_and_gradient_equal_sdpa_in_float64",)),
    Mutation("key_loop_lse_rows_overlap", "the attention's key loop saves each block's log-sum-exp over the first block's rows",
             "clipscale/attention_programs.py", "    tl.store(LSE + program * tl.num_programs(1) * BLOCK + rows,",
             "    tl.store(LSE + program * tl.num_programs(1) * BLOCK + rows % BLOCK,",
             ("tests/test_attention.py::test_output_and_gradient_equal_sdpa_in_float64",)),
    Mutation("key_loop_dkdv_skips_earlier_queries", "the attention's backward leaves out the queries before a key block without a causal mask",
             "clipscale/attention_programs.py", "range(block * BLOCK if CAUSAL else 0, seq_len, BLOCK)", "range(block * BLOCK, seq_len, BLOCK)",
             ("tests/test_attention.py::test_output_and_gradient_equal_sdpa_in_float64",)),
    Mutation("key_loop_dq_stops_at_the_diagonal", "the attention's backward stops dQ's key loop at the diagonal without a causal mask",
             "clipscale/attention_programs.py",
             "    end = tl.minimum(seq_len, (block + 1) * BLOCK) if CAUSAL else seq_len\n    for start in range(0, end, BLOCK):  # the key blocks",
             "    end = tl.minimum(seq_len, (block + 1) * BLOCK)\n    for start in range(0, end, BLOCK):  # the key blocks",
             ("tests/test_attention.py::test_output_and_gradient_equal_sdpa_in_float64",)),
    Mutation("short_attention_ignores_the_mask", "model.attention=short computes a block given a mask that is not the causal hint's",
             "clipscale/attention.py", "and not need_weights and (attn_mask is None or is_causal)", "and not need_weights",
             ("tests/test_attention.py::test_the_kernels_run_for_what_they_cover",)),
    Mutation("short_attention_auto_on_the_cpu", "model.attention=auto chooses the Triton kernels for towers that run on the CPU",
             "clipscale/models.py", 'cfg.attention == "auto" and compiled and gpu)', 'cfg.attention == "auto" and compiled)',
             ("tests/test_attention.py::test_the_config_key_and_auto_build_it_and_a_model_without_blocks_is_refused",)),
    Mutation("ceiling_without_the_runs_attention", "bench_e2e's ceiling beside a run computes the attention another way than the run",
             "scripts/bench_e2e.py", ' "patch_embed",\n                                              "attention") if key in case}',
             ' "patch_embed") if key in case}',
             ("tests/scripts/test_bench_e2e.py::test_the_ceiling_follows_the_runs_towers_text_positions_chunk_and_per_process_batch",)),
    Mutation("sibling_ceiling_of_other_towers", "a README row takes the ceiling of a case whose towers computed the attention another way",
             "scripts/results_table.py", '    same = ("model", "batch", "chunk", "nproc", "patch_embed", "attention")',
             '    same = ("model", "batch", "chunk", "nproc")',
             ("tests/test_readme.py::test_a_case_shows_its_text_positions_and_a_ceiling_measured_beside_its_twin",)),
    Mutation("offload_second_decode_raises", "train.offload's pass 2 cannot decode the kept bytes again",
             "clipscale/data/decoders.py", "        return DecodedInPool([future",
             "        raise RuntimeError('no second decode')\n        return DecodedInPool([future",
             ("tests/data/test_offload.py::test_an_offloaded_run_follows_the_streamed_runs_curve",
              "tests/trainer/test_trainer.py::test_gradient_cache_and_offload_follow_the_plain_curve")),
    Mutation("device_second_decode_raises", "the device decoder's pass 2 cannot decode a chunk again",
             "clipscale/data/decoders.py", "        return self.decoder.submit(self.encoded, self.arrivals, start, stop, counted=self if pass_number == 1 else None)",
             "        assert pass_number == 1, 'no second decode'\n        return self.decoder.submit(self.encoded, self.arrivals, start, stop, counted=self if pass_number == 1 else None)",
             ("tests/data/test_device_decode.py::test_the_trainer_decodes_on_the_device_on_the_loaders_curve",)),
    Mutation("black_images_counted_at_every_decode", "an image trained black is counted again when pass 2 decodes it again",
             "clipscale/data/decoders.py", "counted=self if pass_number == 1 else None)", "counted=self)",
             ("tests/data/test_device_decode.py::test_images_no_decoder_takes_are_trained_black_and_counted_once",)),
    Mutation("black_images_not_counted", "the images trained black are not added to the stream's counts",
             "clipscale/data/pipeline.py", "            self.state.images_trained_black += getattr(", "            0 and getattr(",
             ("tests/data/test_device_decode.py::test_images_no_decoder_takes_are_trained_black_and_counted_once",)),
    Mutation("worker_share_by_place_in_the_piece",
             "data.worker_decode_share picks the first rows of each piece instead of by each sample's seed: another shape decodes other samples there",
             "clipscale/data/shards.py", "decode = self.decode or seed < self.decoded_here_below",
             "decode = self.decode or len(samples) < self.piece_size * self.decoded_here_below / SAMPLE_SEEDS",
             ("tests/data/test_device_decode.py::test_the_workers_decode_their_share_of_the_gpus_jpegs_the_same_way_on_every_shape",)),
    Mutation("worker_share_not_passed_to_the_loader", "the run's data.worker_decode_share never reaches the loader workers",
             "clipscale/data/pipeline.py", "            worker_decode_share=self.path.worker_decode_share,\n",
             "            worker_decode_share=0.0,\n",
             ("tests/data/test_device_decode.py::test_the_trainer_decodes_on_the_device_on_the_loaders_curve",)),
    Mutation("worker_region_box_off_by_one", "the device resizes a worker-decoded region from one pixel in, not the whole region the worker cut",
             "clipscale/data/decoders.py", "self.boxes = torch.cat([torch.zeros_like(self.sizes), self.sizes], 1)",
             "self.boxes = torch.cat([torch.ones_like(self.sizes), self.sizes - 1], 1)",
             ("tests/data/test_device_decode.py::test_the_device_path_skips_the_same_samples_and_draws_the_same_crops",
              "tests/data/test_device_decode.py::test_every_kind_of_image_arrives_as_promised_through_the_device_path",
              "tests/data/test_crop_resize.py::test_the_device_decoder_resizes_a_chunk_in_one_pass_and_keeps_its_other_images_in_place")),
    Mutation("worker_regions_misplaced_in_the_table", "the batched resize reads every worker region at the first one's address",
             "clipscale/data/decoders.py", "return torch.cat([(self.pixels.data_ptr() + self.starts)[:, None],",
             "return torch.cat([(self.pixels.data_ptr() + 0 * self.starts)[:, None],",
             ("tests/data/test_crop_resize.py::test_the_device_decoder_resizes_a_chunk_in_one_pass_and_keeps_its_other_images_in_place",
              "tests/data/test_device_decode.py::test_the_workers_decode_their_share_of_the_gpus_jpegs_the_same_way_on_every_shape")),
    Mutation("local_tar_keeps_suffix_case", "the local tar reader names a member by its suffix as written (JPG, not jpg)",
             "clipscale/data/sources.py", "        suffix = suffix.lower()\n", "",
             ("tests/data/test_tar_reading.py",)),
    Mutation("local_tar_cut_short_unreported", "a local shard cut short is read to its cut without a word",
             "clipscale/data/sources.py", "    if error is not None:\n        handler(error)\n", "",
             ("tests/data/test_tar_reading.py",)),
    Mutation("worker_regions_read_as_planes", "the batched resize reads a worker's [h, w, 3] rows as [3, h, w] planes",
             "clipscale/data/decoders.py", "torch.full_like(width, 3)], 1)", "torch.full_like(width, 1)], 1)",
             ("tests/data/test_crop_resize.py::test_the_device_decoder_resizes_a_chunk_in_one_pass_and_keeps_its_other_images_in_place",
              "tests/data/test_device_decode.py::test_every_kind_of_image_arrives_as_promised_through_the_device_path")),
    Mutation("auto_worker_share_ignores_the_host", "data.worker_decode_share=auto takes 0.4 at any batch: a million samples' pixels fill the host",
             "clipscale/data/pipeline.py", "    if held > AUTO_SHARE_HOST_FRACTION * host_bytes:", "    if False:",
             ("tests/data/test_pipeline.py::test_the_auto_share_follows_the_workers_and_stays_off_where_the_pixels_would_fill_the_host",)),
    Mutation("auto_share_towers_at_vit_b16_mfu", "data.worker_decode_share=auto estimates the towers at ViT-B/16's mfu: ViT-B/32 falls to 0.4 at its defaults",
             "clipscale/data/pipeline.py", "WORKER_IMAGES_PER_S, TOWERS_MFU, KEEP_UP_MARGIN = 780, 0.22, 1.2",
             "WORKER_IMAGES_PER_S, TOWERS_MFU, KEEP_UP_MARGIN = 780, 0.27, 1.2",
             ("tests/data/test_pipeline.py::test_vit_b32_on_an_h200_host_with_14_workers_takes_share_one_at_the_shipped_defaults",)),
    Mutation("auto_share_one_counts_three_batches_of_pixels", "auto's share 1 is held to three batches of pixels, not to its arenas: 0.4 at 65,536",
             "clipscale/data/pipeline.py", "    if keeps_up and arenas_fit:",
             "    if keeps_up and BATCHES_HELD * per_rank_batch * image_bytes <= AUTO_SHARE_HOST_FRACTION * host_bytes:",
             ("tests/data/test_pipeline.py::test_vit_b32_on_an_h200_host_with_14_workers_takes_share_one_at_the_shipped_defaults",)),
    Mutation("window_arenas_kept_until_the_step_ends", "pass 1 keeps a window arena's pieces until the step's end: the workers wait for room forever",
             "clipscale/data/chunks.py", "                self.rows.on_device_before(bound[1])\n            if isinstance(prepared, OnHost)",
             "                pass\n            if isinstance(prepared, OnHost)",
             ("tests/data/test_device_decode.py::test_a_batch_larger_than_the_arenas_streams_through_them_on_the_same_curve",)),
    Mutation("window_chunks_not_kept_on_the_host", "pass 2 reads again the window arenas' pieces that pass 1 handed back",
             "clipscale/data/chunks.py",
             "                    self.on_host[bound] = prepared if isinstance(prepared, OnHost) else self.waiting_room.hold(chunk, copy_stream)",
             "                    pass",
             ("tests/data/test_device_decode.py::test_a_batch_larger_than_the_arenas_streams_through_them_on_the_same_curve",)),
    Mutation("waiting_room_never_reused", "a slot of the room pass 2 has read is never free again: the room grows each step",
             "clipscale/data/chunks.py", "        self.room.free.append((self.slot, copy_stream.record_event() if copy_stream is not None else None))\n",
             "        pass\n",
             ("tests/data/test_device_decode.py::test_a_batch_larger_than_the_arenas_streams_through_them_on_the_same_curve",)),
    Mutation("waiting_room_chunks_share_rows", "a free slot of the room is handed to every chunk that asks",
             "clipscale/data/chunks.py", "        slot, writable = self.free.popleft()\n", "        slot, writable = self.free[0]\n",
             ("tests/data/test_device_decode.py::test_a_batch_larger_than_the_arenas_streams_through_them_on_the_same_curve",)),
    Mutation("room_slot_written_before_its_read", "a slot pass 2 has freed is written before pass 2's copy from it has run (GPU only)",
             "clipscale/data/chunks.py", "        if copy_stream is not None and writable is not None:\n            copy_stream.wait_event(writable)\n", "",
             ("tests/data/test_gpu_spill.py::test_a_slot_of_the_host_room_is_written_again_only_after_its_read_has_run",)),
    Mutation("nothing_ahead_into_the_room", "pass 2 prepares the next batch's chunks only within the device's budget, none into the room",
             "clipscale/data/chunks.py", "            elif self.waiting_room is not None and self.waiting_room.free:\n",
             "            elif False:\n",
             ("tests/data/test_device_decode.py::test_a_batch_larger_than_the_arenas_streams_through_them_on_the_same_curve",)),
    Mutation("chunk_ahead_in_the_room_copied_again", "pass 1 copies a chunk prepared ahead into the room into another slot",
             "clipscale/data/chunks.py",
             "                    self.on_host[bound] = prepared if isinstance(prepared, OnHost) else self.waiting_room.hold(chunk, copy_stream)\n",
             "                    self.on_host[bound] = self.waiting_room.hold(chunk, copy_stream)\n",
             ("tests/data/test_device_decode.py::test_a_batch_larger_than_the_arenas_streams_through_them_on_the_same_curve",)),
    Mutation("arenas_populated_by_writing", "the arenas' pages are brought in by writing zeros, over the workers' pieces",
             "clipscale/data/chunks.py",
             "        return LIBC.madvise(ctypes.c_void_p(bounds[0]), ctypes.c_size_t(bounds[1] - bounds[0]), MADV_POPULATE_WRITE) == 0\n",
             "        ctypes.memset(bounds[0], 0, bounds[1] - bounds[0])\n        return True\n",
             ("tests/data/test_device_decode.py::test_populating_an_arena_brings_its_pages_in_and_leaves_what_workers_wrote",)),
    Mutation("arenas_not_populated", "the arenas' pages are left for CUDA's registration to fault in",
             "clipscale/data/chunks.py", "    with ThreadPoolExecutor(len(slices), thread_name_prefix=\"clipscale-pages\") as pool:\n        return all(pool.map(advise, slices))\n",
             "    return True\n",
             ("tests/data/test_device_decode.py::test_populating_an_arena_brings_its_pages_in_and_leaves_what_workers_wrote",)),
    Mutation("waiting_room_made_in_pass_one", "the room's first segments are made in pass 1's thread as it reaches them, none ahead",
             "clipscale/data/chunks.py",
             "            self.ahead.extend(maker.submit(make, (size,), torch.uint8) for _ in range(-(-make_ahead // size)))\n",
             "",
             ("tests/data/test_device_decode.py::test_the_waiting_rooms_first_segments_are_made_ahead_in_a_thread_of_their_own",)),
    Mutation("spill_chunks_share_a_place", "every chunk spilled to disk for pass 2 is written at the same offset",
             "clipscale/data/chunks.py", "        self.offset += length\n        return held\n", "        return held\n",
             ("tests/data/test_device_decode.py::test_pass_twos_chunks_beyond_the_rooms_limit_wait_on_disk_and_come_back_bit_for_bit",
              "tests/data/test_device_decode.py::test_a_batch_beyond_the_host_spills_to_disk_through_the_arenas_window_on_the_same_curve")),
    Mutation("spill_write_error_lost", "a failed write to the spill file is not what its chunk's read reports",
             "clipscale/data/chunks.py", "        written.result()  # ran before (one thread, in order): its error is this chunk's\n", "",
             ("tests/data/test_device_decode.py::test_pass_twos_chunks_beyond_the_rooms_limit_wait_on_disk_and_come_back_bit_for_bit",)),
    Mutation("spill_buffer_reused_while_written", "a staging buffer is filled again before its last write or read ended",
             "clipscale/data/chunks.py", "        if self.last_io[k] is not None:\n            wait([self.last_io[k]])\n", "",
             ("tests/data/test_device_decode.py::test_pass_twos_chunks_beyond_the_rooms_limit_wait_on_disk_and_come_back_bit_for_bit",)),
    Mutation("pinned_pages_forked", "memory made to be page-locked is mapped in forked loader workers (Linux copies it into each)",
             "clipscale/data/chunks.py", "    memory.madvise(mmap.MADV_DONTFORK)\n", "",
             ("tests/data/test_device_decode.py::test_host_memory_made_to_be_page_locked_is_left_out_of_forked_loader_workers",)),
    Mutation("spill_after_the_room_is_full", "chunks go to disk only once the room is full: the writes stall pass 1's end",
             "clipscale/data/chunks.py",
             "        if self.spill is not None and (not self._fits() or\n",
             "        if self.spill is not None and (not self._fits() or False and\n",
             ("tests/data/test_device_decode.py::test_pass_twos_chunks_beyond_the_rooms_limit_wait_on_disk_and_come_back_bit_for_bit",)),
    Mutation("room_unbounded_with_a_spill", "the host's room grows past its limit, the disk never used",
             "clipscale/data/chunks.py", " or self.limit is None or self.bytes < self.limit\n", " or True\n",
             ("tests/data/test_device_decode.py::test_pass_twos_chunks_beyond_the_rooms_limit_wait_on_disk_and_come_back_bit_for_bit",)),
    Mutation("no_spill_window", "a batch beyond the host finds no window even with a disk (as before the spill)",
             "clipscale/data/pipeline.py", "    if workers * window.arena_bytes > room or on_host - in_room > spill_bytes:\n",
             "    if True:\n",
             ("tests/data/test_pipeline.py::test_a_million_on_an_80_gb_gpu_takes_the_least_window_and_spills_what_the_host_cannot_hold",
              "tests/data/test_device_decode.py::test_a_batch_beyond_the_host_spills_to_disk_through_the_arenas_window_on_the_same_curve")),
    Mutation("spill_beyond_the_disk", "the window spills more than the disk's room",
             "clipscale/data/pipeline.py", " or on_host - in_room > spill_bytes:\n", ":\n",
             ("tests/data/test_pipeline.py::test_a_million_on_an_80_gb_gpu_takes_the_least_window_and_spills_what_the_host_cannot_hold",)),
    Mutation("bench_dies_of_sigterm", "a machine's time limit kills the benchmark before it writes what it measured",
             "scripts/bench_e2e.py", "    signal.signal(signal.SIGTERM, on_sigterm)\n    try:\n", "    try:\n",
             ("tests/scripts/test_bench_e2e.py::test_sigterm_stops_the_running_case_and_writes_what_it_ran",)),
    Mutation("bench_loses_its_case_to_a_second_sigterm", "a second SIGTERM, while the benchmark stops its case, loses what it measured",
             "scripts/bench_e2e.py", "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    raise Terminated\n", "    raise Terminated\n",
             ("tests/scripts/test_bench_e2e.py::test_sigterm_stops_the_running_case_and_writes_what_it_ran",)),
    Mutation("window_drops_a_stopped_runs_last_step", "a run stopped by its budget loses its last finished step, a middle step, from the window",
             "scripts/bench_e2e.py", "    return steps[1:] if len(steps) < int(case[\"steps\"]) else steps[1:-1]\n",
             "    return steps[1:-1]\n",
             ("tests/scripts/test_bench_e2e.py::test_the_window_keeps_the_last_finished_step_only_of_a_run_stopped_before_its_end",)),
    Mutation("window_page_locked_after_the_first_pass", "a window of the arenas waits for the first pass 2 to be page-locked: every first-pass chunk is staged",
             "clipscale/data/pipeline.py", "            self._page_lock_arenas()  # a window of them: at once (see there)\n",
             "            pass\n",
             ("tests/data/test_device_decode.py::test_a_window_of_the_arenas_is_page_locked_before_the_first_batchs_first_pass",)),
    Mutation("ddp_splits_compiled_blocks", "Dynamo's DDPOptimizer splits each compiled block at DDP's gradient buckets",
             "clipscale/compile.py", "    torch._dynamo.config.optimize_ddp = False\n", "",
             ("tests/test_parallel.py::test_a_block_compiles_into_one_graph_under_ddp",)),
    Mutation("piece_straddles_a_segment", "a worker's piece crosses a segment's end (CUDA refuses a copy across two registrations)",
             "clipscale/data/chunks.py", "            end = min(self.arena_bytes, (offset // self.segment_bytes + 1) * self.segment_bytes)\n",
             "            end = self.arena_bytes\n",
             ("tests/data/test_device_decode.py::test_a_piece_never_straddles_a_segment_of_its_arena",)),
    Mutation("arenas_allocated_at_once", "the arenas' pages are all allocated before a worker starts (4 s at 65,536)",
             "clipscale/data/chunks.py", "            os.ftruncate(fd, nbytes)\n", "            os.ftruncate(fd, nbytes)\n            os.posix_fallocate(fd, 0, nbytes)\n",
             ("tests/data/test_device_decode.py::test_the_arenas_pages_come_into_being_as_written_and_are_locked_in_writing_order",)),
    Mutation("arenas_pickled_as_tensors", "the arenas reach a fork server's workers as a tensor, copied (their writes lost)",
             "clipscale/data/chunks.py", "    def __reduce__(self):\n        return _shared_pages_from, (self.nbytes, reduction.DupFd(self.fd))\n",
             "",
             ("tests/data/test_device_decode.py::test_a_worker_started_by_a_fork_server_writes_into_the_trainers_arenas",)),
    Mutation("lazy_backward_not_counted", "the first step's compile line leaves out backward graphs compiled when they first run",
             "clipscale/compile.py", 'COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")',
             'COMPILE_TIMERS = ("_compile.compile_inner",)',
             ("tests/test_compile.py::test_the_time_compiling_counts_the_backward_compiled_when_it_first_runs",)),
    Mutation("arenas_locked_as_the_first_batch_comes_in", "the arenas are page-locked as the first batch's last piece comes in, during its pass 1",
             "clipscale/data/pipeline.py", "        batch.arrivals.add(self.piece_size)\n",
             "        batch.arrivals.add(self.piece_size)\n        if batch.arrivals.rows == self.batch_size:\n            self._page_lock_arenas()\n",
             ("tests/data/test_device_decode.py::test_the_arenas_are_page_locked_once_the_first_batchs_first_pass_is_over",)),
    Mutation("attention_switch_ignored", "CLIPSCALE_ATTENTION is not applied before the towers are traced",
             "clipscale/compile.py", '    allow_attention_backends(os.environ.get("CLIPSCALE_ATTENTION"))', '    pass',
             ("tests/test_compile.py::test_the_attention_kernels_named_in_the_environment_are_the_only_ones_the_towers_may_use",)),
    Mutation("backward_tuning_not_kept", "the backward's autotuner times every tile config again in each process",
             "clipscale/losses/infcl/triton_programs.py",
             '@triton.autotune(configs=_configs_mma(), key=["d", "B_BUCKET"],\n                 prune_configs_by={"early_config_prune": _prune}, **KEEP_TUNING)\n@triton.heuristics(_HEURISTICS)\n@triton.jit\ndef weights_kernel',
             '@triton.autotune(configs=_configs_mma(), key=["d", "B_BUCKET"],\n                 prune_configs_by={"early_config_prune": _prune})\n@triton.heuristics(_HEURISTICS)\n@triton.jit\ndef weights_kernel',
             ("tests/losses/infcl/test_kernels.py::test_the_tuning_of_both_tuned_programs_is_kept_for_the_next_process",)),
    Mutation("bench_loader_cases_share_a_process", "bench_loader measures every case in the one process, one after another",
             "scripts/bench_loader.py", "        result = case_in_its_own_process(spec, args.shards, args.workers)\n",
             '        result = run_case(parse_case(spec), args.shards, args.workers)\n',
             ("tests/scripts/test_bench_loader.py::test_each_case_runs_in_its_own_process_and_a_failing_one_is_recorded",)),
    Mutation("sigusr2_ends_the_trainer", "the trainer does not print its stacks on SIGUSR2 (the signal ends it)",
             "clipscale/signals.py", "        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}\n        print_stacks_on_signal()\n",
             "        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}\n",
             ("tests/scripts/test_bench_e2e.py::test_a_case_stopped_by_the_budget_says_where_each_thread_of_its_run_was",)),
    Mutation("peer_loss_is_a_traceback", "a rank whose peer was killed under a collective prints its traceback",
             "clipscale/distributed.py", 'PEER_ENDED = ("Connection reset by peer", "Connection closed by peer", "remote process exited")',
             'PEER_ENDED = ("no such error",)',
             ("tests/trainer/test_rank_killed.py::test_a_rank_killed_mid_step_ends_the_job_in_one_line_and_the_same_command_resumes_on_the_curve[cpu]",)),
    Mutation("launcher_names_the_lowest_failed_rank", "clipscale.torchrun names the lowest failed rank, not the one that failed first",
             "clipscale/torchrun.py", "rank, failure = min(err.failures.items(), key=lambda item: item[1].timestamp)",
             "rank, failure = min(err.failures.items())",
             ("tests/trainer/test_rank_killed.py::test_a_rank_killed_mid_step_ends_the_job_in_one_line_and_the_same_command_resumes_on_the_curve[cpu]",)),
]


def copy_tree(destination: Path) -> None:
    """The files git knows about (tracked and untracked, not ignored), as they are in the working tree."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, listed):
        source = REPO / name.decode()
        if source.is_file():
            target = destination / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def mutated_source(mutation: Mutation, tree: Path) -> str:
    text = (tree / mutation.path).read_text()
    found = text.count(mutation.old)
    if found != 1:
        raise SystemExit(f"{mutation.name}: {mutation.path} holds {found} copies of the text to mutate (1 expected); "
                         f"update tests/mutations.py:\n{mutation.old}")
    return text.replace(mutation.old, mutation.new)


def run_tests(mutation: Mutation, tree: Path, timeout: float) -> tuple[str, str]:
    """('caught' | 'survived' | 'hung', pytest's summary lines). PYTHONPATH puts the mutated package ahead
    of the editable install of the real one, in pytest and in every process a test starts."""
    env = {**os.environ, "PYTHONPATH": str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *mutation.tests],
                            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, _ = proc.communicate()
        running = [line for line in stdout.splitlines() if line.strip()][-1:]
        return "hung", f"no result within {timeout:.0f} s: killed" + (f" (last output: {running[0]})" if running else "")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    summary = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    tail = result.stdout.strip().splitlines()[-1:] if result.stdout.strip() else [result.stderr.strip()[-500:]]
    if result.returncode == 0:
        return "survived", "\n".join(tail)
    if result.returncode not in (1,):  # 2: interrupted, 3: internal error, 4: usage, 5: no tests collected
        raise SystemExit(f"{mutation.name}: pytest exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return "caught", "\n".join(summary + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and the tests said to catch them")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per mutation's tests")
    args = parser.parse_args()
    by_name = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; known: {sorted(by_name)}")
    chosen = [by_name[n] for n in args.names] or MUTATIONS
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.bug}\n  {m.path}\n  " + "\n  ".join(m.tests))
        return 0
    for mutation in chosen:  # every one still applies and names test files that exist, before any runs
        mutated_source(mutation, REPO)
        missing = [test for test in mutation.tests if not (REPO / test.split("::")[0]).is_file()]
        if missing:
            raise SystemExit(f"{mutation.name}: no such test file for {missing}; update tests/mutations.py")
    if not torch.cuda.is_available():  # their tests skip: every such mutation would survive
        on_gpu = [m for m in chosen if all(Path(test.split("::")[0]).name.startswith("test_gpu_") for test in m.tests)]
        if on_gpu:
            print(f"not run without a GPU: {[m.name for m in on_gpu]}", flush=True)
        chosen = [m for m in chosen if m not in on_gpu]
    survivors, hangs = [], []
    for mutation in chosen:
        with tempfile.TemporaryDirectory(prefix=f"mutant-{mutation.name}-") as folder:
            tree = Path(folder)
            copy_tree(tree)
            (tree / mutation.path).write_text(mutated_source(mutation, tree))
            start = time.perf_counter()
            verdict, detail = run_tests(mutation, tree, args.timeout)
        print(f"{verdict:8s} {mutation.name} ({time.perf_counter() - start:.0f} s): {mutation.bug}\n  "
              + detail.replace("\n", "\n  "), flush=True)
        {"survived": survivors, "hung": hangs}.get(verdict, []).append(mutation.name)
    caught = len(chosen) - len(survivors) - len(hangs)
    print(f"{caught} of {len(chosen)} caught" + (f"; hung: {hangs}" if hangs else "")
          + (f"; survived: {survivors}" if survivors else ""))
    return 1 if survivors or hangs else 0


if __name__ == "__main__":
    sys.exit(main())
