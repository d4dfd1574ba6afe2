"""The README's speed table, made from the committed results/bench_e2e_*.json files alone.

    python scripts/results_table.py            # print the table
    python scripts/results_table.py --write    # rewrite it in README.md, between its markers

Every case of every results/bench_e2e_*.json file (what scripts/bench_e2e.py writes) is a row,
unless it has no figures (a process that ended before its first step), was not measured over a
window of at least 10 steps without the first and the last (`claims_speed`), or it or its file
carries "void" (figures known to be wrong) or "superseded" (why a later file replaces it), or is a
ceiling alone (`runner=ceiling`: the towers' step, no trainer): those
stay in their files and in docs/benchmarks.md, not in the README. A new file of the same kind
shows up by running --write; to retire a row, add "superseded": "<why>" to its case.
tests/test_readme.py fails while README.md's table differs from this script's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = "results/bench_e2e_*.json"
BEGIN = "<!-- speed table: written by scripts/results_table.py from results/bench_e2e_*.json; do not edit by hand -->"
END = "<!-- end of speed table -->"
HEADER = ("| trainer | model | GPUs (loader workers each) | images | global batch | chunk | decoder | text positions a sample "
          "| samples/s | first / steady step | peak host | peak GPU used, per GPU | file |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
# The shards scripts/gpu_setup.sh writes, by their folder: which images a row decoded.
IMAGES = {"/tmp/shards-img/": "img2dataset-like: short side 256, 25 KiB", "/tmp/shards-web/": "224-px noise, 28 KiB",
          "/tmp/shards/": "224-px noise, 28 KiB"}


def rows(repo: Path = REPO) -> list[tuple[tuple, str]]:
    """(sort key, markdown row) for every current case with figures."""
    found = []
    for path in sorted(repo.glob(SOURCES)):
        record = json.loads(path.read_text())
        if "void" in record or "superseded" in record:
            continue
        for result in record["cases"]:
            if result["case"]["runner"] == "ceiling":  # a towers' step on resident tensors, no trainer: docs/benchmarks.md
                continue
            if "void" in result or "superseded" in result or not result.get("steps_done") or not claims_speed(result):
                continue
            found.append(row(result, record, path.relative_to(repo)))
    return sorted(found)


def claims_speed(result: dict) -> bool:
    """Measured over a window of at least 10 steps that leaves out the first and the last (bench_e2e
    writes `window`, and `short_window` when it is shorter); a one-step case reports its time only.
    Files measured before such windows (steps 2..N, the last step in) stay in results/ and
    docs/benchmarks.md, not in the README."""
    return result["steps_done"] == 1 or ("window" in result and "short_window" not in result)


def row(result: dict, record: dict, path: Path) -> tuple[tuple, str]:
    case = result["case"]
    gpus = int(case.get("nproc", 1))
    batch = int(case["batch"])
    clipscale = case["runner"] == "clipscale"
    decoder = decoder_of(result) if clipscale else "loader (open_clip_train's)"
    if not clipscale and case.get("compile") == "1":
        decoder += ", --torchcompile"
    if not clipscale and int(case.get("accum", 1)) > 1:  # its batch in micro-batches, features cached between them
        decoder += f", --accum-freq {case['accum']}"
    if not clipscale and case.get("local_loss") == "1":
        decoder += ", --local-loss --gather-with-grad"
    share = float(case["worker_share"]) if "worker_share" in case else auto_share(result)
    if share:
        decoder += f", {share:.0%} of its JPEGs by the workers"
    if int(case.get("offload", 0)):
        decoder += ", train.offload"
    if clipscale and compiled(result):
        decoder += ", compiled"
    if result["steps_done"] == 1:
        speed, steps = f"one step: {result['first_step_s']:.0f} s", "–"
    else:
        speed = f"{result['samples_per_s']:,.0f}{ratio(result, record)}"
        if "of_ceiling" in result:  # bench_e2e's ceiling: the same compiled towers' step on GPU-resident tensors
            median = f", median step {result['of_ceiling_median']:.0%}" if result.get("of_ceiling_median") else ""
            speed += f" ({result['of_ceiling']:.0%} of its towers' ceiling{median}, same command)"
        elif clipscale and sibling_ceiling(result, record) is not None:
            speed += f" ({result['samples_per_s'] / (gpus * sibling_ceiling(result, record)):.0%} of the ceiling measured beside another case of the command)"
        steps = f"{result['first_step_s']:.0f} s / {result['steady_step_s']:.1f} s"
    if result.get("exit_code"):
        speed += f" (stopped after step {result['steps_done']}, exit {result['exit_code']})"
    # nvidia-smi's, summed over the GPUs: the allocator's own figures miss what CUDA graph replays use
    gpu = f"{result['peak_gpu_used_gib'] / gpus:.1f} GiB" if result.get("peak_gpu_used_gib") else "–"
    trainer = "open_clip_train" if not clipscale else f"clipscale, loss {case['loss']}" if "loss" in case else "clipscale"
    if "patch_embed" in case:  # model.patch_embed set by the case (issue 49); auto's choice otherwise
        trainer += f", patch_embed {case['patch_embed']}"
    if "attention" in case:  # model.attention set by the case (issue 49)
        trainer += f", attention {case['attention']}"
    if case.get("parallel") == "fsdp":
        trainer += ", FSDP" + (" with offload" if case.get("fsdp_offload") == "1" else "")
    cells = [trainer, case["model"], f"{gpus} × {short(record['device'])} ({record['workers']})", images_of(record), f"{batch:,}",
             chunk_of(case, result, batch // gpus), decoder, text_positions(result, clipscale), speed, steps, f"{result['peak_host_gib']:.1f} GiB", gpu,
             f"[{path.name}]({path})"]
    return (case["model"], batch, gpus, decoder, not clipscale, str(path)), "| " + " | ".join(cells) + " |"


def images_of(record: dict) -> str:
    """What the shards of a record held, from their folder (scripts/gpu_setup.sh's kinds); "–" where unknown."""
    shards = record.get("shards", "")
    return next((kind for folder, kind in IMAGES.items() if shards.startswith(folder)), "–")


def chunk_of(case: dict, result: dict, per_gpu_batch: int) -> str:
    """The case's train.chunk_size, the shipped config's 512 where the case left it (runs that
    printed console lines); "–" for a plain step (no chunk, or a chunk of the whole batch)."""
    chunk = case.get("chunk", "512" if "console" in result else "–")
    return "–" if chunk.isdigit() and int(chunk) >= per_gpu_batch else chunk


def text_positions(result: dict, clipscale: bool) -> str:
    """Text positions the text tower computed a sample (the run's median; padding cut to each chunk's
    longest caption): with web-length captions about 28, with the short synthetic ones about 8.
    open_clip_train computes every position of the context; "–" where a run did not log it."""
    if not clipscale:
        return "77 (every position)"
    logged = [n for n in result.get("text_positions_per_sample") or [] if n is not None]
    return f"{statistics.median(logged):.1f}" if logged else "–"


def sibling_ceiling(result: dict, record: dict) -> float | None:
    """The samples/s of a ceiling measured beside another case of the same command with the same
    model, batch, chunk, processes and tower settings (a case run with ceiling=0 to save the command's time)."""
    same = ("model", "batch", "chunk", "nproc", "patch_embed", "attention")
    for other in record["cases"]:
        ceiling = other.get("ceiling") or {}
        if other is not result and "samples_per_s" in ceiling and all(other["case"].get(k) == result["case"].get(k) for k in same):
            return ceiling["samples_per_s"]
    return None


def auto_share(result: dict) -> float:
    """data.worker_decode_share as the run's console said `auto` chose it (0 where it said nothing)."""
    said = re.search(r"(\d+)% of its JPEGs by the loader workers", " ".join(result.get("console", [])))
    return int(said.group(1)) / 100 if said else 0.0


def decoder_of(result: dict) -> str:
    """The case's data.decoder; where the case left it to the config (auto), what the run said it chose."""
    if "decoder" in result["case"]:
        return result["case"]["decoder"]
    if "console" not in result:  # recorded before data.decoder had "auto": its default was the loader
        return "loader"
    said = " ".join(result.get("console", []))
    if "into page-locked shared memory, each chunk resized on the GPU" in said:  # share 1: the workers' arenas (2026-11-28 on)
        who = "libjpeg-turbo" if "(libjpeg-turbo)" in said else "PIL"
        return f"auto: the workers ({who}) into arenas, resized on the GPU by the training thread"
    if "the GPU (nvJPEG) in the training thread" in said:  # data.decode_workers: 0
        return "auto: GPU, nvJPEG, in the training thread"
    if "the GPU (nvJPEG)" in said:  # the one decoder: torchvision's nvJPEG in the training process (2026-11-27 on)
        return "auto: GPU, nvJPEG, the one chunk decoder"
    if "(nvimgcodec)" in said or "(nvjpeg)" in said:
        where = {"thread": ", in threads", "process": ", in its own process"}.get(result["case"].get("decode_in"), "")
        return "auto: " + ("GPU, nvImageCodec engines" if "(nvimgcodec)" in said else "GPU, nvJPEG") + where
    return "auto: loader" if "decoded by the loader" in said else "auto (the run's console did not say which)"


def compiled(result: dict) -> bool:
    """model.compile on: asked for by the case, or said by the run (the default, auto, on a GPU)."""
    return result["case"].get("compile") == "1" or any("compiling the towers" in line for line in result.get("console", []))


def short(device: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "H100"."""
    return device.removeprefix("NVIDIA ").split()[0]


def ratio(result: dict, record: dict) -> str:
    """clipscale against open_clip_train's cases of the same model and batch in the same command
    (plain, and with --torchcompile where the command ran it)."""
    case = result["case"]
    if case["runner"] != "clipscale":
        return ""
    against = []
    for other in record["cases"]:
        peer = other["case"]
        if (peer["runner"] == "openclip" and (peer["model"], peer["batch"]) == (case["model"], case["batch"])
                and other.get("samples_per_s") and "superseded" not in other):
            name = "open_clip_train --torchcompile" if peer.get("compile") == "1" else "open_clip_train"
            against.append(f"{result['samples_per_s'] / other['samples_per_s']:.2f}× {name}")
    return f" ({', '.join(against)}, same command)" if against else ""


def table(repo: Path = REPO) -> str:
    return "\n".join([HEADER, *(line for _, line in rows(repo))])


def with_table(text: str, new_table: str) -> str:
    """text with the part between the markers replaced by new_table."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + new_table + "\n" + text[end:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if not args.write:
        print(table())
        return
    readme = REPO / "README.md"
    readme.write_text(with_table(readme.read_text(), table()))
    print(f"wrote the speed table of {readme}")


if __name__ == "__main__":
    main()
