"""The README and docs/ say only what is there: the README stays short with its two commands first,
every link and every repository path they name exists, and the README's speed table is the one
scripts/results_table.py makes from results/ (a number edited by hand fails here)."""

from __future__ import annotations

import glob
import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.helpers.tiny_runs import REPO

README = REPO / "README.md"
DOCS = sorted([README, *(REPO / "docs").glob("*.md")])
TWO_COMMANDS = ("pip install -r requirements.txt && python train.py --config configs/digits.yaml\n"
                "pip install -r requirements-dev.txt && python -m pytest -q tests\n")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:configs|scripts|docs|results|tests|slurm|clipscale)/[\w./{},*<>-]*[\w}>])")


def results_table():
    spec = importlib.util.spec_from_file_location("results_table", REPO / "scripts" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def expand(pattern: str) -> list[str]:
    """A path as the docs write it, brace lists and ranges expanded: {a,b} and {0000..0159}."""
    braces = re.search(r"\{([^{}]*)\}", pattern)
    if not braces:
        return [pattern]
    inside = braces.group(1)
    if ".." in inside:
        first, last = inside.split("..")
        choices = [str(n).zfill(len(first)) for n in (int(first), int(last))]
    else:
        choices = inside.split(",")
    return [path for choice in choices for path in expand(pattern[:braces.start()] + choice + pattern[braces.end():])]


def test_the_readme_is_short_and_starts_with_its_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert first_block == TWO_COMMANDS
    assert text.index("```bash") < text.index("\n## ")  # before any section


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_link_leads_somewhere(doc):
    missing = []
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            missing.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            missing.append(target)
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_repository_path_named_exists(doc):
    """configs/, scripts/, results/, ... paths in the text and its commands; a pattern
    (results/bench_step*_h100.json) must match a file, a placeholder (<device>) is not a path."""
    text = LINK.sub("", doc.read_text())  # links are the test above's, relative to their file
    named = {match for match in REPO_PATH.findall(text) if "<" not in match}
    missing = [path for path in sorted(named) for one in expand(path)
               if not glob.glob(str(REPO / one))]
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_no_reference_to_files_outside_the_repository(doc):
    text = doc.read_text()
    for outside in ("DESIGN.md", "../shared", ".library", "configs/my_run.yaml"):
        assert outside not in text


def test_the_speed_table_is_made_from_results():
    module = results_table()
    text = README.read_text()
    written = text[text.index(module.BEGIN) + len(module.BEGIN):text.index(module.END)].strip("\n")
    assert written == module.table()


def test_the_table_shows_current_cases_only(tmp_path):
    """A new results file appears once the table is made again; void and superseded cases do not, nor
    cases measured over fewer than 10 steps or with the last step in (no `window`), nor ceilings alone."""
    (tmp_path / "results").mkdir()
    case = {"case": {"runner": "clipscale", "model": "ViT-B-16", "batch": "65536", "chunk": "512", "steps": "12"},
            "exit_code": 0, "steps_done": 12, "window": "steps 2..11 of 12", "samples_per_s": 1234.4, "first_step_s": 80.0,
            "steady_step_s": 50.0, "peak_host_gib": 20.0, "peak_gpu_used_gib": 44.0}
    void = {**case, "case": {**case["case"], "batch": "1024"}, "void": "a loss was not finite"}
    superseded = {**case, "case": {**case["case"], "batch": "2048"}, "superseded": "measured again"}
    short = {**case, "case": {**case["case"], "batch": "4096"}, "short_window": "3 steps measured"}
    last_step_in = {key: value for key, value in {**case, "case": {**case["case"], "batch": "8192"}}.items() if key != "window"}
    ceiling_alone = {**case, "case": {**case["case"], "runner": "ceiling", "batch": "16384"}}  # no trainer ran
    record = {"device": "NVIDIA H100 80GB HBM3", "workers": 14, "cases": [case, void, superseded, short, last_step_in, ceiling_alone]}
    (tmp_path / "results" / "bench_e2e_new.json").write_text(json.dumps(record))
    lines = results_table().table(tmp_path).splitlines()
    assert len(lines) == 3
    assert lines[2].startswith("| clipscale | ViT-B-16 | 1 × H100 (14) | – | 65,536 | 512 | loader | – | 1,234 | 80 s / 50.0 s "
                               "| 20.0 GiB | 44.0 GiB |")  # no text positions logged: "–"


def test_a_case_measured_beside_its_ceiling_shows_the_fraction(tmp_path):
    (tmp_path / "results").mkdir()
    case = {"case": {"runner": "clipscale", "model": "ViT-B-32", "batch": "65536", "chunk": "512", "steps": "12"},
            "exit_code": 0, "steps_done": 12, "window": "steps 2..11 of 12", "samples_per_s": 4800.0, "first_step_s": 80.0,
            "steady_step_s": 13.6, "peak_host_gib": 9.0, "peak_gpu_used_gib": 40.0, "of_ceiling": 0.956,
            "of_ceiling_median": 0.95}
    record = {"device": "NVIDIA H100 80GB HBM3", "workers": 14, "cases": [case]}
    (tmp_path / "results" / "bench_e2e_ceiling.json").write_text(json.dumps(record))
    assert "| 4,800 (96% of its towers' ceiling, median step 95%, same command) |" in results_table().table(tmp_path)
    assert "| 1 × H100 (14) | – | 65,536 |" in results_table().table(tmp_path)  # shards not recorded: images unknown
    record["shards"] = "/tmp/shards-img/synthetic-{0000..0259}.tar"
    (tmp_path / "results" / "bench_e2e_ceiling.json").write_text(json.dumps(record))
    assert "| 1 × H100 (14) | img2dataset-like: short side 256, 25 KiB | 65,536 |" in results_table().table(tmp_path)


def test_a_case_shows_its_text_positions_and_a_ceiling_measured_beside_its_twin(tmp_path):
    """The text positions a sample, the run's median; a case run without a ceiling (ceiling=0) gets
    the fraction of the ceiling measured beside another case of the command with the same model,
    batch, chunk and towers, and says so; one with another batch or attention gets none."""
    (tmp_path / "results").mkdir()
    base = {"exit_code": 0, "steps_done": 12, "window": "steps 2..11 of 12", "first_step_s": 70.0, "steady_step_s": 8.0,
            "peak_host_gib": 7.0, "peak_gpu_used_gib": 26.0}
    case = {"runner": "clipscale", "model": "ViT-B-32", "batch": "32768", "chunk": "512", "steps": "12"}
    measured = {**base, "case": {**case, "decode_in": "thread"}, "samples_per_s": 4000.0, "of_ceiling": 0.74,
                "text_positions_per_sample": [27.9, 28.1, 27.9, 50.0], "ceiling": {"samples_per_s": 5400.0}}
    twin = {**base, "case": {**case, "decode_in": "process", "ceiling": "0"}, "samples_per_s": 4050.0}
    other = {**base, "case": {**case, "batch": "65536", "ceiling": "0"}, "samples_per_s": 3900.0}
    other_towers = {**base, "case": {**case, "attention": "short", "ceiling": "0"}, "samples_per_s": 4800.0}
    record = {"device": "NVIDIA H100 80GB HBM3", "workers": 14, "cases": [measured, twin, other, other_towers]}
    (tmp_path / "results" / "bench_e2e_twins.json").write_text(json.dumps(record))
    table = results_table().table(tmp_path)
    assert "| 28.0 | 4,000 (74% of its towers' ceiling, same command) |" in table
    assert "| 4,050 (75% of the ceiling measured beside another case of the command) |" in table
    assert "| 3,900 |" in table
    assert "| 4,800 |" in table  # another attention than the ceiling's: not its twin
