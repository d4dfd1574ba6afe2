"""Where a benchmark's numbers come from: the device, the versions, the date, the command and
the commit, one record that every results JSON starts from (scripts/bench_*.py and
scripts/reproduce/*.py call `provenance()`; tests/test_provenance.py checks every
committed file for it).

A file written before a field was recorded gets it from what is known after the fact, marked as
such (`recovered`):

    git add results/bench_x.json && git commit ...   # as the run wrote it: the date is this commit's
    python -m clipscale.provenance results/bench_x.json

It lives in the package, not in scripts/, because the scripts run from two folders (scripts/
and scripts/reproduce/) and on machines where only `import clipscale` is set up; a module there
would need a sys.path edit in each of them.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from clipscale.errors import UserError, run_main

REQUIRED = ("device", "versions", "date", "command")
# Versions every record names, installed or not: what a speed or memory figure depends on.
REQUIRED_VERSIONS = ("python", "torch", "cuda", "triton", "open_clip")
# The rest of the stack, recorded where installed, by module (their __version__ keeps the build tag, +cu130).
OPTIONAL_MODULES = ("torchvision", "webdataset", "timm", "PIL")
MODULE_KEYS = {"PIL": "pillow"}
# Image decoders the data path may load besides PIL and torchvision's nvJPEG, by distribution name.
DECODER_DISTRIBUTION = re.compile(r"^(nvidia-nvjpeg.*|nvidia-dali.*|simplejpeg|pyturbojpeg|pillow-simd)$", re.I)
# Settings read from the environment that change what a benchmark measures, recorded where set:
# these, and every variable of ours (CLIPSCALE_*) and of Inductor's (TORCHINDUCTOR_*).
ENVIRONMENT = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF")
ENVIRONMENT_PREFIXES = ("CLIPSCALE_", "TORCHINDUCTOR_")
NOT_INSTALLED = "not installed"
UNKNOWN = "unknown (not recorded)"
REPO = Path(__file__).resolve().parents[1]


def provenance(argv: list[str] | None = None) -> dict:
    """The record's first keys: device, cpus, versions, date (UTC), command, git_commit, and
    environment (the variables of ENVIRONMENT and ENVIRONMENT_PREFIXES that are set).

    argv: the arguments a script's main() was given when it was not sys.argv (a test calling
    main([...])); the command is then `python <script> <argv>`."""
    return {"device": device_name(), "cpus": os.cpu_count(), "versions": versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(argv), "git_commit": git_commit(),
            "environment": {name: value for name, value in sorted(os.environ.items())
                            if name in ENVIRONMENT or name.startswith(ENVIRONMENT_PREFIXES)}}


def device_name() -> str:
    """The GPU's name ("2 x NVIDIA H200" inside a process group of two), else the CPU's."""
    import torch

    if not torch.cuda.is_available():
        return f"cpu ({platform.processor() or platform.machine()})"
    name = torch.cuda.get_device_name()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"{torch.distributed.get_world_size()} x {name}"
    return name


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for module in ("torch", "triton", "open_clip", *OPTIONAL_MODULES):
        try:
            found[MODULE_KEYS.get(module, module)] = __import__(module).__version__
        except ImportError:
            if module in REQUIRED_VERSIONS:
                found[module] = NOT_INSTALLED
    if found["torch"] == NOT_INSTALLED:
        found["cuda"] = NOT_INSTALLED
    else:
        found["cuda"] = sys.modules["torch"].version.cuda or "none (a CPU build of torch)"
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"] or ""
        if DECODER_DISTRIBUTION.match(name):
            found[name.lower()] = distribution.version
    return found


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: the interpreter's own argv (flags and script included)."""
    if argv is not None:
        return shlex.join(["python", sys.argv[0], *argv])
    return shlex.join([os.path.basename(sys.orig_argv[0]), *sys.orig_argv[1:]])


def git_commit() -> str:
    """HEAD of the checkout the code runs from, marked when files differ from it.

    A copy without .git (a device machine given the working tree) records CLIPSCALE_GIT_COMMIT
    when the command sets it, else says it is unknown."""
    if os.environ.get("CLIPSCALE_GIT_COMMIT"):
        return os.environ["CLIPSCALE_GIT_COMMIT"] + " (from CLIPSCALE_GIT_COMMIT)"
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return "unknown (not a git checkout; set CLIPSCALE_GIT_COMMIT)"
        changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown (git: {error})"
    return head.stdout.strip() + (" (with uncommitted changes)" if changed else "")


def recovered(record: dict, path: Path) -> dict:
    """The record with the fields its run did not write filled in, each marked as recovered: the
    date is the day git last committed the file (`date_source`), CUDA is read from torch's build
    tag (+cu130), a version nobody recorded is UNKNOWN (`versions_source` names both). What the run
    wrote is kept as it is; an older layout's top-level versions move into `versions`."""
    out, notes = dict(record), []
    if not isinstance(out.get("versions"), dict):
        moved = {name: out.pop(name) for name in REQUIRED_VERSIONS if name in out}
        out["versions"] = moved
        if moved:
            notes.append(f"moved {', '.join(moved)} from the record's top level into versions")
    found = dict(out["versions"])
    tag = re.search(r"\+cu(\d+)(\d)$", found.get("torch", ""))
    if "cuda" not in found and tag:
        found["cuda"] = f"{tag.group(1)}.{tag.group(2)}"
        notes.append(f"cuda read from torch's build tag (+cu{tag.group(1)}{tag.group(2)})")
    unknown = [name for name in REQUIRED_VERSIONS if name not in found]
    found.update({name: UNKNOWN for name in unknown})
    if unknown:
        notes.append(f"{', '.join(unknown)} not recorded by the run")
    out["versions"] = found
    if notes:
        out["versions_source"] = "; ".join(notes)
    if "date" not in out:
        last = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %cI", "--", str(path.resolve())],
                              capture_output=True, text=True).stdout.split()
        if not last:
            raise UserError(f"{path} has no date and git has no commit of it: commit the file as the run wrote it, "
                            "then recover its date from that commit")
        commit, date = last
        out["date"] = date[:10]
        out["date_source"] = f"the day git last committed this file's figures ({commit}); the run did not record its date"
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fill in the provenance fields a results file lacks, marked as recovered.")
    parser.add_argument("files", nargs="+", type=Path, help="results JSON files, committed (the date comes from git)")
    for path in parser.parse_args(argv).files:
        text = path.read_text()
        record = json.loads(text)
        completed = recovered(record, path)
        if completed != record:
            path.write_text(json.dumps(completed, indent=1) + ("\n" if text.endswith("\n") else ""))
            print(f"{path}: recovered {sorted(set(completed) ^ set(record)) or ['versions']}")


if __name__ == "__main__":
    run_main(main)
