"""How fast host memory becomes page-locked, each way the data path could get it, and what a
registration does to another thread's CUDA work meanwhile.

The trainer page-locks the loader workers' arenas (a memfd mapping, `SharedPages`) and pass 2's
waiting room (plain host memory, `pinned_empty`) with cudaHostRegister (`page_lock`). At 262,144
samples a step on an H200 host py-spy saw the room's 27 GiB take 24 s of the training thread and
the arenas' window 24 s of the page-lock thread, both in the first step. Cases, each on a fresh
`--gib` buffer, freed after:

  untouched           torch.empty, registered at once: CUDA faults every page in (and the kernel zeroes it)
  touched             torch.empty, every page written first by torch's threads (`zero_`), then registered
  huge_pages          an anonymous mapping advised MADV_HUGEPAGE, written, then registered
  memfd_untouched     a `SharedPages` memfd mapping (the arenas'), registered at once
  memfd_touched       the same, written first
  memfd_populated     the same, its pages brought in with madvise(MADV_POPULATE_WRITE) (Linux 5.14), which
                      writes nothing: safe beside workers already writing there, as `zero_` is not
  memfd_huge_populated
                      the same, the mapping advised MADV_HUGEPAGE first (huge pages where the machine's
                      shmem_enabled allows them)
  pin_memory          torch.empty(pin_memory=True): cudaHostAlloc through torch's caching host allocator
  stall               `untouched` registered in a second thread while this one times a tiny kernel's
                      round trip (launch, synchronize) again and again: whether a registration
                      holds up the process's other CUDA calls, against the same loop alone

The machine's transparent huge page settings are written beside them.

    python scripts/bench_page_lock.py --gib 8 --out /tmp/page_lock.json
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from clipscale.data.chunks import GIB, SharedPages, page_lock  # noqa: E402
from clipscale.provenance import provenance  # noqa: E402

THP = Path("/sys/kernel/mm/transparent_hugepage")


def huge_page_memory(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8), mapping


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Python 3.12's mmap may not name it
STALL_LIMIT_S = 60.0  # the timing loop beside a registration stops here whatever happens to the registration


def populated(shared: SharedPages, huge: bool) -> torch.Tensor:
    mapping = mmap.mmap(shared.fd, shared.nbytes)
    if huge:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    mapping.madvise(MADV_POPULATE_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def registration(nbytes: int, make, touch: bool) -> dict:
    made_s, made = timed(make)
    tensor = made[0] if isinstance(made, tuple) else made
    touch_s = timed(tensor.zero_)[0] if touch else 0.0
    register_s, locked = timed(lambda: page_lock(tensor))
    gib = nbytes / GIB
    record = {"gib": gib, "made_s": made_s, "touch_s": touch_s, "register_s": register_s, "locked": locked,
              "register_gib_per_s": gib / register_s, "all_gib_per_s": gib / (made_s + touch_s + register_s)}
    del tensor, made
    gc.collect()
    return record


def round_trips(seconds: float | None, until: threading.Event | None, x: torch.Tensor) -> list[float]:
    """Times of a tiny kernel's launch and synchronize on `x` (made beforehand, so the loop's first
    check runs before any CUDA call), for `seconds` or until `until` is set."""
    times, started = [], time.perf_counter()
    while (time.perf_counter() - started < (seconds or STALL_LIMIT_S)) and not (until is not None and until.is_set()):
        began = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize(x.device)
        times.append(time.perf_counter() - began)
    return times


def summary(times: list[float]) -> dict:
    if not times:  # the registration was over before the first round trip (or failed at once: see `locked`)
        return {"count": 0}
    return {"count": len(times), "median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times),
            "over_10ms_s": sum(t for t in times if t > 0.01)}


def stall(nbytes: int, device: torch.device) -> dict:
    """A count of 0 beside the registration would mean this thread never got the interpreter back
    while it ran (the binding releases the GIL); one long round trip, that the registration held the
    launch or the synchronize (the H100 run of 2026-12-07, before `x` was made here, counted 0: its
    loop's first CUDA call, making `x`, returned only after the registration)."""
    x = torch.zeros(1, device=device)
    alone = round_trips(3.0, None, x)
    done = threading.Event()
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    seconds = {}

    def register():
        try:
            torch.cuda.set_device(device)
            seconds["register_s"], seconds["locked"] = timed(lambda: page_lock(tensor))
        finally:
            done.set()

    thread = threading.Thread(target=register)
    thread.start()
    beside = round_trips(None, done, x)
    thread.join()
    del tensor
    gc.collect()
    return {"alone": summary(alone), "beside_a_registration": summary(beside), **seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    nbytes = int(args.gib * GIB)
    settings = {name: (THP / name).read_text().strip() for name in ("enabled", "defrag", "shmem_enabled")
                if (THP / name).exists()}
    print("transparent huge pages:", settings, flush=True)
    cases = {
        "untouched": lambda: registration(nbytes, lambda: torch.empty(nbytes, dtype=torch.uint8), touch=False),
        "touched": lambda: registration(nbytes, lambda: torch.empty(nbytes, dtype=torch.uint8), touch=True),
        "huge_pages": lambda: registration(nbytes, lambda: huge_page_memory(nbytes), touch=True),
        "memfd_untouched": lambda: registration(nbytes, lambda: SharedPages(nbytes).tensor, touch=False),
        "memfd_touched": lambda: registration(nbytes, lambda: SharedPages(nbytes).tensor, touch=True),
        "memfd_populated": lambda: registration(nbytes, lambda: populated(SharedPages(nbytes), huge=False), touch=False),
        "memfd_huge_populated": lambda: registration(nbytes, lambda: populated(SharedPages(nbytes), huge=True),
                                                     touch=False),
        "pin_memory": lambda: {"gib": args.gib, "pin_memory_s": timed(
            lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))[0]},
        "stall": lambda: stall(nbytes, device),
    }
    results = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception as error:  # noqa: BLE001 - a case the machine refuses (an old kernel's madvise) is recorded
            results[name] = {"error": repr(error)}
        print(name, json.dumps(results[name]), flush=True)
        torch.cuda.empty_cache()
        torch._C._host_emptyCache() if hasattr(torch._C, "_host_emptyCache") else None
    record = {**provenance(), "threads": torch.get_num_threads(), "transparent_huge_pages": settings,
              "cases": results}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
