"""`train.chunk_size: auto`: the chunk follows from the probe's figures (here fixed, as a GPU
would measure them; tests/test_gpu_memory.py measures them for real), and is measured at its
size before it is taken (`verified_chunk`, here with passes whose memory is given)."""

from __future__ import annotations

import pytest

from clipscale.memory import PROBE_CHUNKS, Probe, chunk_for, verified_chunk

MIB, GIB = 2**20, 2**30
PER_SAMPLE, FIXED = 30 * MIB, 200 * MIB  # a chunk's activations: 30 MiB a sample on 200 MiB whatever its size
H100 = Probe(capacity=0.85 * 80 * GIB, static=2 * GIB, features=GIB // 2, loss_peak=GIB,
             chunk_peaks=tuple(FIXED + size * PER_SAMPLE for size in PROBE_CHUNKS))


def peak(probe: Probe, chunk: int) -> float:
    """A step's peak: the chunks kept for pass 2, the model, the features, the loss while the
    last chunk's graph is held."""
    return probe.reserved + probe.static + probe.features + probe.loss_peak + FIXED + chunk * PER_SAMPLE


@pytest.mark.parametrize("batch_size, chunk", [(4096, 2048), (6000, 2000), (1000, 1000), (4099, 1)])
def test_the_chunk_is_the_largest_divisor_of_the_batch_that_fits(batch_size, chunk):
    # 68 GiB usable - 3.5 GiB - 200 MiB leave 65,848 MiB: 2,194 samples of 30 MiB.
    got, figures = chunk_for(batch_size, H100)
    assert figures["fits"] == min(batch_size, 2194) and figures["per_sample_mib"] == 30
    assert got == chunk
    assert peak(H100, got) <= H100.capacity
    larger = [d for d in range(got + 1, batch_size + 1) if batch_size % d == 0]
    assert not larger or peak(H100, larger[0]) > H100.capacity


def test_no_chunk_fits_says_what_takes_the_memory():
    crowded = Probe(capacity=8 * GIB, static=7.4 * GIB, features=GIB // 2, loss_peak=GIB // 4,
                    chunk_peaks=H100.chunk_peaks)
    with pytest.raises(RuntimeError, match=r"no chunk fits: 8.0 GiB usable, the model and optimizer take 7.4, "
                                           r"the batch's features 0.5, the loss 0.2, chunks kept for pass 2 0.0, "
                                           r"one sample's activations 30.0 MiB"):
        chunk_for(4096, crowded)
    loss_too_large = Probe(capacity=8 * GIB, static=GIB, features=GIB, loss_peak=7 * GIB, chunk_peaks=H100.chunk_peaks)
    with pytest.raises(RuntimeError, match="no chunk fits"):
        chunk_for(64, loss_too_large)


def test_the_loss_is_held_beside_the_last_chunks_activations():
    """Gradient Cache runs the loss while the last chunk's graph is alive: a b x b loss of 10 GiB
    leaves 56,632 MiB, 1,887 samples, so 1,500 (2,000 would peak at 70.7 GiB)."""
    vanilla = Probe(capacity=H100.capacity, static=H100.static, features=H100.features, loss_peak=10 * GIB,
                    chunk_peaks=H100.chunk_peaks)
    chunk, figures = chunk_for(6000, vanilla)
    assert (chunk, figures["fits"]) == (1500, 1887)
    assert peak(vanilla, chunk) <= vanilla.capacity < peak(vanilla, 2000)


def test_chunks_kept_on_the_device_for_pass_2_leave_less_room():
    """data.keep_on_device_gib's 17 GiB (a quarter of the usable 68) less: 48,440 MiB, 1,614 samples."""
    keeping = Probe(capacity=H100.capacity, static=H100.static, features=H100.features, loss_peak=H100.loss_peak,
                    chunk_peaks=H100.chunk_peaks, reserved=17 * GIB)
    chunk, figures = chunk_for(4096, keeping)
    assert (chunk, figures["fits"], figures["kept_gib"]) == (1024, 1614, 17)
    assert peak(keeping, chunk) <= keeping.capacity < peak(keeping, 2048)


def passes(peak_of):
    """A chunk pass measured by `peak_of(size)`, and the sizes it was measured at."""
    sizes: list[int] = []

    def measure(size: int):
        sizes.append(size)
        return peak_of(size)

    return measure, sizes


def test_a_chunk_whose_pass_takes_what_the_line_said_is_measured_once():
    measure, sizes = passes(lambda size: FIXED + size * PER_SAMPLE)
    chunk, figures = verified_chunk(4096, H100, measure)
    assert (chunk, sizes) == (2048, [2048]) and figures["chunk_gib"] == pytest.approx((FIXED + 2048 * PER_SAMPLE) / GIB)


def test_a_chunk_whose_pass_takes_more_than_the_line_is_chosen_again():
    """A workspace the probe's small chunks did not show (12 MiB a sample past 64, as a
    convolution's algorithm may take at a large batch): the line's 2,048 would take 84.2 GiB of
    the 64.5 left; drawn again through that measurement, the chunk is the largest divisor that
    measured to fit."""
    def peak_of(size):
        return FIXED + size * PER_SAMPLE + (size * 12 * MIB if size > 64 else 0)

    measure, sizes = passes(peak_of)
    chunk, figures = verified_chunk(4096, H100, measure)
    assert (chunk, sizes) == (1024, [2048, 1024])  # 42 MiB a sample now: 1,568 fit
    assert peak_of(chunk) <= H100.room_for_a_chunk() == pytest.approx(64.5 * GIB)
    assert figures["chunk_gib"] == pytest.approx(peak_of(chunk) / GIB)


def test_a_chunk_that_ran_out_of_memory_is_chosen_again_smaller():
    measure, sizes = passes(lambda size: None if size > 1000 else FIXED + size * PER_SAMPLE)
    chunk, _ = verified_chunk(4096, H100, measure)
    assert (chunk, sizes) == (512, [2048, 512])  # as if 2,048 took twice its room: 1,023 fit


def test_no_chunk_measured_to_fit_says_so():
    measure, sizes = passes(lambda size: None)
    with pytest.raises(RuntimeError, match="no chunk measured to fit in 4 tries"):
        verified_chunk(4096, H100, measure)
    assert len(sizes) <= 4
