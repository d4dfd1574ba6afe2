"""Checkpoints: open_clip's layout, written atomically, loaded with a fallback, pruned.

A checkpoint is a dict with open_clip's keys (`state_dict` of the unwrapped
model, `optimizer`, `scaler`, `epoch`, `name`) so `open_clip.load_checkpoint`
and `open_clip.create_model(name, pretrained=path)` read it, plus what exact
resumption needs: `step`, the scheduler-free training state, every rank's
data-stream cursors and RNG states. It is read with `weights_only=True`, as is every
checkpoint from elsewhere: one that holds pickled objects is refused (`refusing_pickled_objects`).

    runs/<name>/checkpoints/step_00000100.pt
    runs/<name>/checkpoints/step_00000200.pt
    runs/<name>/checkpoints/step_00000200.dcp/   under train.parallel=fsdp: the model and optimizer
                                                 shards (torch.distributed.checkpoint), every rank's own
    runs/<name>/checkpoints/latest          the text "step_00000200.pt"

Every file is written to a temporary file in the same folder and renamed over
the target, so a crash never leaves a truncated checkpoint; the temporary file
is created like any other (mode 0666 less the umask). `latest` is a separate
small file naming the newest checkpoint: damage to it cannot reach a
checkpoint, and resuming does not depend on it (the newest step file that
loads is used; see `load_latest`; a resume sets the newer ones that do not load aside as
`step_<n>.pt.corrupt`, which nothing counts or loads, `set_aside`). A full disk or an unwritable folder is a
`StorageError` naming the path. A sharded folder is written the same way, whole: under a
temporary name, renamed once every rank has written its part; the step file, written after it,
names it (`sharded`), so a checkpoint exists only when both do.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
import shutil
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from clipscale.errors import STORAGE_ERRNOS, StorageError, UserError, storage_errors

LATEST = "latest"
POINTER_NAMES = (LATEST, "latest.pt")  # "latest.pt": a hard link before, still in users' commands
CHECKPOINTS = "checkpoints"  # the run folder's subfolder holding them
WHOLE_WEIGHTS = ("state_dict", "optimizer")  # the whole model and optimizer, open_clip's keys: rank 0's alone
STEP_FILE = re.compile(r"step_(\d+)\.pt")
TMP_SUFFIX = ".tmp"
CORRUPT_SUFFIX = ".corrupt"  # a step checkpoint that does not load, set aside (step_<n>.pt.corrupt)


class CheckpointError(UserError):
    """No checkpoint of a run can be loaded, or none exists where one was asked for."""


class PickledObjectError(CheckpointError):
    """A checkpoint that holds pickled Python objects, not only tensors, numbers, strings and
    containers: unpickling them could run any code, so it is refused unread."""


@contextmanager
def refusing_pickled_objects(path) -> Iterator[None]:
    """Report a weights-only load's refusal of a pickled object as a PickledObjectError naming
    `path`: torch's UnpicklingError (timm re-raises it as a RuntimeError) or numpy's refusal of
    an object array (open_clip reads .npy/.npz weights with np.load)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - anything else is re-raised as it was
        refused = _pickled_object_refusal(err)
        if refused is None:
            raise
        raise PickledObjectError(f"{path} holds pickled Python objects ({refused}), which loading would run as code; "
                                 "refused: weights are read as tensors only (weights_only=True)") from None


def _pickled_object_refusal(err: BaseException) -> Optional[str]:
    """What a weights-only load refused, from the error or the errors it was raised from; None if it refused nothing."""
    while err is not None:
        message = str(err)
        if isinstance(err, pickle.UnpicklingError) and message.startswith("Weights only load failed"):
            found = re.search(r"Unsupported global: GLOBAL (\S+)", message)
            return found.group(1) if found else "an object torch does not allow"
        if isinstance(err, ValueError) and "allow_pickle=False" in message:
            return "a numpy object array"
        err = err.__cause__ or err.__context__
    return None


def step_file(step: int) -> str:
    return f"step_{step:08d}.pt"


def sharded_folder(step: int) -> str:
    """The folder of a step's shards, beside its step file."""
    return f"step_{step:08d}.dcp"


def temporary_name(path: Path) -> Path:
    """A temporary path beside `path` that no other save uses (and `remove_partial_saves` finds)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")


def replace_folder(tmp: Path, path: Path) -> None:
    """Rename a finished folder over `path` (a folder of a previous save of that step goes first)."""
    with storage_errors(path, "write"):
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)


def _write_atomic(path: Path, write: Callable) -> None:
    """Call `write(file)` on a temporary file beside `path`, then rename it to `path`."""
    with storage_errors(path, "write"):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_name(path)
        # os.open with 0o666 lets the kernel apply the umask, as for any file the user creates
        # (tempfile.mkstemp would make it 0600 whatever the umask).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                write(_RecordedWrites(f))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


class _RecordedWrites:
    """A file whose write errors survive torch.save, which turns an OSError raised inside
    its zip writer into `RuntimeError: [enforce fail at inline_container.cc] unexpected pos`."""

    def __init__(self, f):
        self.f = f

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def save_atomic(obj, path: Path) -> None:
    """torch.save `obj` to `path`, atomically."""

    def write(f: _RecordedWrites) -> None:
        try:
            torch.save(obj, f)
        except RuntimeError:
            if hasattr(f, "error"):  # the disk refused a write: raise that (ENOSPC, EDQUOT, ...)
                raise f.error from None
            raise

    _write_atomic(path, write)


def write_text_atomic(path: Path, text: str) -> None:
    _write_atomic(path, lambda f: f.write(text.encode()))


def check_writable(folder: Path) -> None:
    """Preflight, before data and model work: `folder` (or the nearest existing folder above
    it, where it will be created) takes a new file of one byte. A StorageError otherwise."""
    existing = Path(folder).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise StorageError(f"cannot create the run folder {folder}: {existing} is a file")
    probe = existing / f".clipscale-write-test.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}"
    with storage_errors(existing, "write to"):
        try:
            with open(probe, "wb") as f:
                f.write(b"\0")
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            if err.errno in STORAGE_ERRNOS:
                raise
            # /proc, /sys and other pseudo file systems refuse new files with errors of their own
            raise StorageError(f"cannot create the run folder {folder}: {existing} takes no new files ({err.strerror})") from None
        finally:
            probe.unlink(missing_ok=True)


def step_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step checkpoint in the folder, newest first."""
    found = [(int(m.group(1)), p) for p in Path(checkpoint_dir).glob("step_*.pt") if (m := STEP_FILE.fullmatch(p.name))]
    return sorted(found, reverse=True)


def save_checkpoint(checkpoint_dir: Path, step: int, state: dict, keep: Optional[int] = None,
                    keep_every: Optional[int] = None) -> Path:
    """Write step_<n>.pt, point `latest` at it, then delete the checkpoints that `keep`
    (the newest N; None keeps all) and `keep_every` (multiples of it) do not retain, with
    their sharded folders."""
    path = Path(checkpoint_dir) / step_file(step)
    save_atomic(state, path)
    write_text_atomic(path.parent / LATEST, path.name + "\n")
    prune(checkpoint_dir, keep, keep_every)
    return path


def prune(checkpoint_dir: Path, keep: Optional[int], keep_every: Optional[int] = None) -> list[Path]:
    """Delete the step checkpoints (and their sharded folders) past the newest `keep` (None: keep
    all) that are not multiples of `keep_every`; the deleted step files."""
    if keep is None:
        return []
    deleted = []
    for old_step, old in step_checkpoints(checkpoint_dir)[keep:]:
        if not (keep_every and old_step % keep_every == 0):
            old.unlink(missing_ok=True)  # first: a step file without its folder would not load
            shutil.rmtree(old.with_name(sharded_folder(old_step)), ignore_errors=True)
            deleted.append(old)
    return deleted


def set_aside(path: Path) -> Path:
    """Rename a step checkpoint that does not load (and its sharded folder, if any) to
    `<name>.corrupt`, out of what resumes, retention and `latest` look at; the new path."""
    aside = path.with_name(path.name + CORRUPT_SUFFIX)
    n = 1
    while aside.exists():  # the same step went bad twice
        aside, n = path.with_name(f"{path.name}{CORRUPT_SUFFIX}-{n}"), n + 1
    with storage_errors(path, "rename"):
        os.replace(path, aside)
        match = STEP_FILE.fullmatch(path.name)
        shards = path.with_name(sharded_folder(int(match.group(1)))) if match else None
        if shards is not None and shards.is_dir():
            os.replace(shards, shards.with_name(shards.name + aside.name.removeprefix(path.name)))
    return aside


def remove_partial_saves(run_dir: Path) -> list[Path]:
    """Delete the temporary files of saves that were killed, in the run folder and its
    subfolders (checkpoints/, eval/). Only while no process of this run writes."""
    stale = [*Path(run_dir).glob(f".*{TMP_SUFFIX}"), *Path(run_dir).glob(f"*/.*{TMP_SUFFIX}")]
    for path in stale:
        if path.is_dir():  # a sharded checkpoint's folder
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    with refusing_pickled_objects(path):
        return torch.load(path, map_location=map_location, weights_only=True)


def require_shards(path: Path, checkpoint: dict) -> None:
    """A step file that names a sharded folder holds only part of its checkpoint: the folder must
    be there, with the metadata torch.distributed.checkpoint writes last."""
    if "sharded" in checkpoint and not (Path(path).parent / checkpoint["sharded"] / ".metadata").is_file():
        raise CheckpointError(f"its shards {Path(path).parent / checkpoint['sharded']} are missing")


def error_in_one_line(err: BaseException, width: int = 300) -> str:
    """`Type: message` on one line, cut at a word to about `width` characters (" [...]" where it is cut)."""
    return textwrap.shorten(f"{type(err).__name__}: {err}", width=width, placeholder=" [...]")


def load_latest(checkpoint_dir: Path, report: Callable[[str], None] = print,
                failed_paths: Optional[list] = None) -> Optional[tuple[Path, dict]]:
    """The newest step checkpoint that loads, as (path, checkpoint); None when there is none.

    A checkpoint that fails to load is reported with its error and the one before it is
    tried (and added to `failed_paths`, where given: the resume sets them aside, `set_aside`);
    when none loads, a CheckpointError names the newest and its error."""
    candidates = step_checkpoints(checkpoint_dir)
    failed = []
    for _, path in candidates:
        try:
            checkpoint = load_checkpoint(path)
            require_shards(path, checkpoint)
        except Exception as err:  # a damaged file raises anything from EOFError to a zip or unpickling error
            report(f"warning: checkpoint {path} does not load ({error_in_one_line(err)}); trying the one before it")
            failed.append((path, err))
            continue
        if failed:
            report(f"falling back to {path}, the newest checkpoint that loads")
            if failed_paths is not None:
                failed_paths += [bad for bad, _ in failed]
        return path, checkpoint
    if failed:
        newest, err = failed[0]
        raise CheckpointError(
            f"none of the {len(failed)} checkpoints in {checkpoint_dir} loads (the newest, {newest.name}: {error_in_one_line(err)}); "
            "start afresh with run.resume=false run.overwrite=true (the run is moved aside) or choose a new run.name"
        )
    return None


def latest_checkpoint(checkpoint_dir: Path) -> Optional[Path]:
    """The checkpoint `latest` names, or the newest step file when `latest` is missing or
    names no file; None when the folder holds no checkpoint."""
    pointer = Path(checkpoint_dir) / LATEST
    if pointer.is_file():
        named = pointer.parent / pointer.read_bytes().decode(errors="replace").strip()  # damaged: any bytes
        if named.parent == pointer.parent and STEP_FILE.fullmatch(named.name) and named.is_file():
            return named
    found = step_checkpoints(checkpoint_dir)
    return found[0][1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, its run folder, the run's checkpoints folder or `latest` (or
    `latest.pt`), as the checkpoint file to load. A CheckpointError when there is none."""
    path = Path(path)
    if path.is_file() and path.name != LATEST:
        return path
    folder = path.parent if path.name in POINTER_NAMES else path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    found = latest_checkpoint(folder) if folder.is_dir() else None
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}" + ("" if path.exists() else " (no such file or folder)"))
    return found
