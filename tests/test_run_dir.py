"""A run is one run: the run folder's config decides between a new run, a resumed one and a
clear stop, before any work. A reused run name refuses a change to a loss option as it refuses a
change of loss: the options (Inf-CL's `exact` and `tile_size`, ...) change what is trained."""

from __future__ import annotations

import pytest
import yaml

from clipscale.config import ConfigError, load_config
from clipscale.run_dir import CONFIG_FILE, LAUNCHED_BY, open_run_folder

from tests.helpers.tiny_runs import DIGITS_YAML


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """A plain start, as if by `python` (these tests may themselves run inside a Slurm job)."""
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def _config(tmp_path, *overrides):
    return load_config(DIGITS_YAML, [f"run.output_dir={tmp_path}", "run.name=tiny", *overrides])


def _started(tmp_path, *overrides, steps_done: int = 100):
    """A run folder as a run leaves it: its config, a checkpoint (only its name is read here), a metrics file."""
    plan = open_run_folder(_config(tmp_path, *overrides))
    assert plan.action == "new" and plan.apply() == []
    (plan.run_dir / "checkpoints").mkdir()
    (plan.run_dir / "checkpoints" / f"step_{steps_done:08d}.pt").write_bytes(b"")
    (plan.run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.3}\n')
    return plan.run_dir


def test_a_new_run_creates_its_folder_and_remembers_its_config(tmp_path):
    plan = open_run_folder(_config(tmp_path, "loss.name=infcl"))
    assert plan.action == "new" and not plan.run_dir.exists()
    plan.apply()
    assert yaml.safe_load((plan.run_dir / CONFIG_FILE).read_text())["loss"]["name"] == "infcl"
    assert open_run_folder(_config(tmp_path / "empty")).action == "new"


def test_the_same_config_resumes_and_settings_that_do_not_change_the_run_may_differ(tmp_path):
    run_dir = _started(tmp_path)
    plan = open_run_folder(_config(tmp_path, "eval.every_n_steps=50", "data.decode_workers=2", "train.log_every=5",
                                   "train.chunk_size=64", "run.device=cpu", "data.workers=3", "model.compile=false"))
    assert plan.action == "resume" and plan.apply() == []
    assert yaml.safe_load((run_dir / CONFIG_FILE).read_text())["eval"]["every_n_steps"] == 50


def test_a_different_config_stops_with_the_keys_that_differ_and_the_ways_on(tmp_path):
    run_dir = _started(tmp_path)
    before = (run_dir / CONFIG_FILE).read_text()
    with pytest.raises(ConfigError) as raised:
        open_run_folder(_config(tmp_path, "loss.name=infcl", "optim.lr=5e-4", "model.custom.embed_dim=32"))
    message = str(raised.value)
    assert f"{run_dir} holds a run with another configuration (loss.name: 'vanilla' -> 'infcl'; "\
           "model.custom.embed_dim: 64 -> 32; optim.lr: 0.002 -> 0.0005)" in message
    assert "choose a new run.name" in message and "run.resume=false run.overwrite=true" in message
    assert "\n" not in message and (run_dir / CONFIG_FILE).read_text() == before


def test_resume_false_on_an_existing_run_needs_overwrite_which_moves_it_aside(tmp_path):
    run_dir = _started(tmp_path)
    with pytest.raises(ConfigError, match=r"run.resume=false, but .*tiny already holds a run \(at step 100\)"):
        open_run_folder(_config(tmp_path, "run.resume=false"))
    with pytest.raises(ConfigError, match="run.overwrite=true starts the run afresh: set run.resume=false with it"):
        _config(tmp_path, "run.overwrite=true")
    plan = open_run_folder(_config(tmp_path, "run.resume=false", "run.overwrite=true", "loss.name=infcl"))
    assert plan.action == "overwrite"
    [moved] = plan.apply()
    [aside] = tmp_path.glob("tiny.old-*")
    assert moved == f"moved the previous run {run_dir} aside to {aside}"
    assert (aside / "checkpoints" / "step_00000100.pt").exists() and (aside / "metrics.jsonl").exists()
    assert sorted(p.name for p in run_dir.iterdir()) == [CONFIG_FILE]


@pytest.mark.parametrize("job, other_job", [({"SLURM_JOB_ID": "4242"}, {"SLURM_JOB_ID": "4243"}),
                                            ({"TORCHELASTIC_RUN_ID": "3f2a"}, {"TORCHELASTIC_RUN_ID": "77c1"})],
                         ids=["Slurm requeue", "torchrun restart"])
def test_an_overwriting_job_started_again_by_its_launcher_resumes_its_own_run(tmp_path, monkeypatch, job, other_job):
    """run.overwrite=true moves another run aside once; when Slurm requeues the job (same job id) or
    torchrun restarts its workers (same run id), the same command resumes the run it started."""
    _started(tmp_path)  # a run of an earlier job
    overwrite = ("run.resume=false", "run.overwrite=true")
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    first = open_run_folder(_config(tmp_path, *overwrite))
    assert first.action == "overwrite"
    first.apply()
    (first.run_dir / "checkpoints").mkdir()
    (first.run_dir / "checkpoints" / "step_00000005.pt").write_bytes(b"")

    again = open_run_folder(_config(tmp_path, *overwrite))
    assert again.action == "resume"
    [notice] = again.apply()
    assert notice.startswith(f"run.overwrite=true, but {first.run_dir} was started by this same ") and "resuming it" in notice
    assert len(list(tmp_path.glob("tiny.old-*"))) == 1 and (first.run_dir / "checkpoints" / "step_00000005.pt").exists()

    for name, value in other_job.items():
        monkeypatch.setenv(name, value)
    assert open_run_folder(_config(tmp_path, *overwrite)).action == "overwrite"  # another job's overwrite moves it aside


def test_torchruns_default_run_id_names_no_job(tmp_path, monkeypatch):
    """Without --rdzv-id or --standalone every torchrun command has the run id "none": two such
    commands are two jobs, and the second's overwrite moves the first's run aside."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    open_run_folder(_config(tmp_path)).apply()
    assert not (tmp_path / "tiny" / LAUNCHED_BY).exists()
    assert open_run_folder(_config(tmp_path, "run.resume=false", "run.overwrite=true")).action == "overwrite"


def test_more_steps_need_an_explicit_extension_whose_effect_on_the_lr_is_stated(tmp_path):
    run_dir = _started(tmp_path, steps_done=200)  # digits: 200 steps, lr 2e-3, warmup 20: the lr has decayed to 0
    with pytest.raises(ConfigError) as raised:
        open_run_folder(_config(tmp_path, "train.steps=400"))
    assert "train.steps: 200 -> 400" in str(raised.value)
    assert "or, to train on to 400 steps, add run.extend_steps=true (the cosine learning-rate schedule is redrawn "\
           "over 400 steps, so at step 200 the lr goes from 0 to 0.00108" in str(raised.value)
    plan = open_run_folder(_config(tmp_path, "train.steps=400", "run.extend_steps=true"))
    assert plan.action == "resume" and plan.notices == [
        f"extending {run_dir} from 200 to 400 steps: the cosine learning-rate schedule is redrawn over 400 steps, "
        "so at step 200 the lr goes from 0 to 0.00108 and then decays to 0 at step 400"]
    with pytest.raises(ConfigError, match="train.steps=150: .* is already at step 200"):
        open_run_folder(_config(tmp_path, "train.steps=150", "run.extend_steps=true"))
    with pytest.raises(ConfigError, match="loss.name: 'vanilla' -> 'infcl'; train.steps: 200 -> 400"):
        open_run_folder(_config(tmp_path, "train.steps=400", "run.extend_steps=true", "loss.name=infcl"))


@pytest.mark.parametrize("schedule, said", [
    (["optim.lr_scheduler=const"],
     "the const learning-rate schedule is redrawn over 400 steps, so at step 200 the lr goes from 0.002 to 0.002 "
     "and then stays there to step 400"),
    (["optim.lr_scheduler=const-cooldown", "optim.lr_cooldown_steps=50", "optim.lr_cooldown_end=0.0001"],
     "the const-cooldown learning-rate schedule is redrawn over 400 steps, so at step 200 the lr goes from 0.0001 "
     "to 0.002 and then cools down to 0.0001 over the last 50 steps, to step 400"),
])
def test_an_extension_states_the_configured_schedule(tmp_path, schedule, said):
    """The extension's notice names optim.lr_scheduler's schedule and its rates, not the cosine's."""
    run_dir = _started(tmp_path, *schedule, steps_done=200)
    plan = open_run_folder(_config(tmp_path, *schedule, "train.steps=400", "run.extend_steps=true"))
    assert plan.notices == [f"extending {run_dir} from 200 to 400 steps: {said}"]


def test_a_folder_that_is_not_a_run_and_a_config_from_before_new_keys(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty and has no config.yaml, so it is not a clipscale run"):
        open_run_folder(_config(tmp_path))
    older = _config(tmp_path / "older").to_dict()
    del older["train"]["keep_checkpoints"]  # written by a clipscale without this key: it counts at its default
    (tmp_path / "older" / "tiny").mkdir(parents=True)
    (tmp_path / "older" / "tiny" / CONFIG_FILE).write_text(yaml.safe_dump(older))
    assert open_run_folder(_config(tmp_path / "older")).action == "resume"


# --- loss options are part of the run ---------------------------------------------------------


def _infcl_config(tmp_path, options: str):
    return load_config(DIGITS_YAML, [f"run.output_dir={tmp_path}", "run.name=tiny", "loss.name=infcl",
                                     f"loss.options={options}"])


@pytest.mark.parametrize("started, resumed, difference", [
    ("{exact: false}", "{exact: true}", "loss.options.exact: False -> True"),
    ("{backend: reference, tile_size: 8}", "{backend: reference, tile_size: 16}", "loss.options.tile_size: 8 -> 16"),
    ("{}", "{exact: true}", "loss.options.exact: (unset) -> True"),
], ids=["exact", "tile_size", "added"])
def test_a_resume_with_another_loss_option_is_refused_naming_the_key(tmp_path, started, resumed, difference):
    open_run_folder(_infcl_config(tmp_path, started)).apply()
    assert open_run_folder(_infcl_config(tmp_path, started)).action == "resume"
    with pytest.raises(ConfigError) as raised:
        open_run_folder(_infcl_config(tmp_path, resumed))
    assert "holds a run with another configuration (" in str(raised.value)
    assert difference in str(raised.value)


# --- checkpoints that go bad or fill the disk, as a resume finds them ---------------------------


def _saved(run_dir, steps, numel: int = 1000):
    from clipscale.checkpoint import save_checkpoint
    import torch

    for step in steps:
        save_checkpoint(run_dir / "checkpoints", step, {"step": step, "state_dict": {"w": torch.full((numel,), float(step))}})


def _resume(tmp_path, *overrides):
    """What train() does with the folder on a resume: read the newest checkpoint that loads, then apply."""
    from clipscale.console import Console
    from clipscale.distributed import World

    said = []
    console = Console(True)
    console.say = said.append
    plan = open_run_folder(_config(tmp_path, *overrides))
    checkpoint = plan.newest_checkpoint(World(), console)
    return checkpoint, said + plan.apply()


def test_a_corrupt_newest_checkpoint_is_set_aside_once_and_takes_no_retention_slot(tmp_path):
    run_dir = _started(tmp_path, "train.keep_checkpoints=2")
    (run_dir / "checkpoints" / "step_00000100.pt").unlink()
    _saved(run_dir, [10, 20, 30])
    newest = run_dir / "checkpoints" / "step_00000030.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a copy that died part-way
    checkpoint, said = _resume(tmp_path, "train.keep_checkpoints=2")
    assert checkpoint["step"] == 20
    warning = next(line for line in said if "does not load" in line)
    assert warning.endswith("; trying the one before it") and ", o);" not in warning
    assert f"set step_00000030.pt, which does not load, aside as {newest}.corrupt" in " ".join(said)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["latest", "step_00000010.pt", "step_00000020.pt", "step_00000030.pt.corrupt"]  # 10 and 20 both kept
    checkpoint, said = _resume(tmp_path, "train.keep_checkpoints=2")  # the next resume: no warning again
    assert checkpoint["step"] == 20 and not any("does not load" in line for line in said), said


def test_a_long_load_error_is_cut_at_a_word(tmp_path):
    from clipscale.checkpoint import error_in_one_line

    line = error_in_one_line(RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central "
                                          "directory " + "word " * 80 + "was transferred incorrectly, or"))
    assert len(line) <= 300 and line.endswith(" [...]") and line.split()[-2] == "word"


def test_a_resume_with_fewer_checkpoints_kept_frees_their_room_before_its_first_save(mounted):
    """A disk that holds two checkpoints: the third save fails (one error line); the resume with
    train.keep_checkpoints=1 deletes the older one first, and the save then fits."""
    from clipscale.checkpoint import save_checkpoint, step_checkpoints
    from clipscale.errors import StorageError
    import torch

    root = mounted("520k")
    run_dir = _started(root, "train.keep_checkpoints=3")
    (run_dir / "checkpoints" / "step_00000100.pt").unlink()
    _saved(run_dir, [10, 20], numel=50_000)  # 200 kB each
    state = {"step": 30, "state_dict": {"w": torch.zeros(50_000)}}
    with pytest.raises(StorageError, match="no space left on the device"):
        save_checkpoint(run_dir / "checkpoints", 30, state, keep=3)
    checkpoint, said = _resume(root, "train.keep_checkpoints=1")
    assert checkpoint["step"] == 20
    assert "deleted 1 checkpoints that train.keep_checkpoints=1 no longer keeps: step_00000010.pt" in said
    save_checkpoint(run_dir / "checkpoints", 30, state, keep=1)
    assert [step for step, _ in step_checkpoints(run_dir / "checkpoints")] == [30]
