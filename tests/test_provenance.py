"""Every committed figure says where it comes from: each JSON under results/ and docs/results/
names its device, versions, date and command (a value the run did not record says so, and a
recovered one names its source), and every benchmark script builds that record with
clipscale.provenance, so no script writes a record of its own that lacks a field."""

from __future__ import annotations

import ast
import datetime
import json
import shlex
import subprocess
import sys

import pytest

from clipscale.provenance import REQUIRED, REQUIRED_VERSIONS, UNKNOWN, provenance, recovered
from tests.helpers.tiny_runs import REPO

RESULT_FILES = sorted([*(REPO / "results").glob("*.json"), *(REPO / "docs" / "results").glob("*.json")])
BENCHMARK_SCRIPTS = sorted([*(REPO / "scripts").glob("bench_*.py"), *(REPO / "scripts" / "reproduce").glob("*.py")])


def provenance_problems(record) -> list[str]:
    """What a results record lacks: each required field present and a non-empty string, every
    named version present, the date an ISO date."""
    if not isinstance(record, dict):
        return ["the file is not a JSON object"]
    problems = [f"no {key!r}" for key in REQUIRED if key not in record]
    for key in ("device", "command", "date"):
        if key in record and not (isinstance(record[key], str) and record[key].strip()):
            problems.append(f"{key!r} is {record[key]!r}, not a non-empty string")
    versions = record.get("versions")
    if "versions" in record and not isinstance(versions, dict):
        problems.append(f"'versions' is {versions!r}, not an object")
    elif versions is not None:
        problems += [f"no version of {name!r}" for name in REQUIRED_VERSIONS if name not in versions]
        problems += [f"version of {name!r} is {value!r}" for name, value in versions.items()
                     if not (isinstance(value, str) and value.strip())]
    if isinstance(record.get("date"), str):
        try:
            datetime.date.fromisoformat(record["date"][:10])
        except ValueError:
            problems.append(f"'date' {record['date']!r} does not start with a YYYY-MM-DD date")
    return problems


def test_there_are_results_to_check():
    assert len(RESULT_FILES) >= 40


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda path: str(path.relative_to(REPO)))
def test_every_results_file_names_device_versions_date_and_command(path):
    record = json.loads(path.read_text())
    assert provenance_problems(record) == []
    unknown = [name for name, value in record["versions"].items() if value.startswith("unknown")]
    assert all(name in record.get("versions_source", "") for name in unknown), "an unknown version not explained"


def test_the_check_finds_each_missing_field():
    good = {"device": "NVIDIA H100", "date": "2026-11-24", "command": "python scripts/bench_e2e.py",
            "versions": {name: "1.0" for name in REQUIRED_VERSIONS}}
    assert provenance_problems(good) == []
    for key in REQUIRED:
        assert provenance_problems({k: v for k, v in good.items() if k != key}) == [f"no {key!r}"]
    assert provenance_problems({**good, "versions": {"torch": "2.11"}}) != []
    assert provenance_problems({**good, "date": "Nov 24"}) != []
    assert provenance_problems({**good, "device": ""}) != []


def test_the_record_a_benchmark_writes_today():
    record = provenance(["--out", "x.json"])
    assert provenance_problems(record) == []
    assert record["command"] == shlex.join(["python", sys.argv[0], "--out", "x.json"])
    written = datetime.datetime.fromisoformat(record["date"])
    assert abs(datetime.datetime.now(datetime.timezone.utc) - written) < datetime.timedelta(minutes=5)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert record["git_commit"].startswith(head or "unknown")
    assert not any(value.startswith("unknown") for value in record["versions"].values())


def test_the_record_names_the_settings_of_ours_and_inductors_read_from_the_environment(monkeypatch):
    """A benchmark run under CLIPSCALE_ATTENTION=flash or TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1
    measures something else: its record says so."""
    monkeypatch.setenv("CLIPSCALE_ATTENTION", "flash")
    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    environment = provenance([])["environment"]
    assert {"CLIPSCALE_ATTENTION": "flash", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1", "OMP_NUM_THREADS": "3"}.items() <= environment.items()
    assert "UNRELATED_SETTING" not in environment


def test_a_command_line_is_the_interpreters_own():
    script = "from clipscale.provenance import provenance; print(provenance()['command'])"
    out = subprocess.run([sys.executable, "-c", script, "--flag", "a b"], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith(shlex.join(["-c", script, "--flag", "a b"]))


def test_recovery_fills_only_what_the_run_did_not_write_and_says_so():
    path = REPO / "results" / "bench_step_h100.json"
    complete = json.loads(path.read_text())
    assert recovered(complete, path) == complete
    as_run = {k: v for k, v in complete.items() if k not in ("date", "date_source", "versions_source")}
    as_run["versions"] = {k: v for k, v in complete["versions"].items() if k not in ("cuda", "triton")}
    found = recovered(as_run, path)
    assert found["versions"]["cuda"] == "13.0" and found["versions"]["triton"] == UNKNOWN
    assert "torch's build tag" in found["versions_source"] and "triton" in found["versions_source"]
    committed = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%cI", "--", str(path)],
                               capture_output=True, text=True, check=True).stdout
    assert found["date"] == committed[:10] and "git" in found["date_source"]
    assert {k: v for k, v in found.items() if k not in ("versions", "versions_source", "date", "date_source")} == \
        {k: v for k, v in as_run.items() if k != "versions"}


def test_an_uncommitted_file_without_a_date_is_one_error_line(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"device": "NVIDIA H100", "command": "python x.py", "versions": {}}))
    run = subprocess.run([sys.executable, "-m", "clipscale.provenance", str(path)], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith("error: ") and "Traceback" not in run.stderr
    assert str(path) in run.stderr


def calls(path) -> set[str]:
    nodes = [node.func for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]
    return {f.id if isinstance(f, ast.Name) else f.attr for f in nodes if isinstance(f, (ast.Name, ast.Attribute))}


@pytest.mark.parametrize("path", BENCHMARK_SCRIPTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_benchmark_builds_its_record_with_the_one_helper(path):
    """A script that writes JSON calls provenance(); none reads the device or a version itself."""
    source, called = path.read_text(), calls(path)
    writes_json = bool(called & {"dump", "dumps", "write_json", "publish"}) and path.name != "common.py"
    if writes_json:
        assert "provenance" in called, f"{path.name} writes JSON without clipscale.provenance"
    for own_record in ("get_device_name", "python_version", "__version__", "strftime"):
        assert own_record not in source, f"{path.name} builds its own provenance ({own_record})"
