"""The device's JPEG decoding in a process of its own (`data.decoder: device`): its Python never waits on the trainer's GIL.

Measured on an H100 (docs/benchmarks.md, "What the steps wait for now"): decoding threads in the
training process spend about 0.1 ms of Python an image (nvImageCodec's code stream and per-image
GIL hand-off inside `decode`, DLPack, the crop tables); beside a step whose compiled towers replay
CUDA graphs (the main thread held 60% of the GIL samples, a quarter of all in cudagraph trees'
per-replay checks) each image took 3-4.5x longer than alone, and the steps waited for images.
Here the same `DeviceDecoder` (its threads, decoders and CUDA streams) runs in a spawned process
with an interpreter of its own. Its cost: its GPU work runs in a second CUDA context, which the GPU
time-slices with the trainer's (the step beside it took 1.23x its time alone); through train.py
it measured 4,059 samples/s against 3,987 in threads (`data.decode_in` chooses).

    trainer                                          decode process (`serve`)
    put(rows, piece)   -- ("piece", batch, bytes) -> EncodedBatch (shared memory: no copy)
    prepare(start, stop) -- ("decode", id, batch, start, stop) -> DeviceDecoder.submit
    the reply thread   <- ("decoded", id, pixels) --- a CUDA tensor (CUDA IPC), its stream synchronised
        copies the pixels into its own memory, then lets the decoder's go
    release()          -- ("release", batch) ----> its bytes dropped

Every chunk crosses as one tensor: the training process spends a few Python calls a chunk on
decoding, none an image. On a CPU device the same process decodes with torchvision's CPU decoder
and the pixels cross in shared memory: that is how the tests hold it.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from concurrent.futures import Future, InvalidStateError

import torch
import torch.multiprocessing as mp

from clipscale.data.chunks import Arrivals, ChunkSource, DeviceTransform, KeepBudget, on_the_callers_device
from clipscale.data.device_decode import DeviceDecoder, JpegEngines, TorchvisionJpeg, decoded_column
from clipscale.data.encoded import EncodedBatch
from clipscale.data.transforms import SplitTransform
from clipscale.signals import ignore_stop_signals

PARENT_CHECK_S = 1.0  # how often each side looks whether the other is still there


class DecodeProcess:
    """An `ImageDecoder` (data/batches.py) whose decoding runs in a spawned process (see the module
    doc). `device_decoder`: "nvimgcodec" (the JPEG engines) or "nvjpeg", as the run resolved it;
    the process makes its own. `images_decoded` and `decode_s` are the process's counts, as its
    replies report them."""

    def __init__(self, split: SplitTransform, device: torch.device, device_decoder: str, chunk_size: int | None):
        self.device, self.split, self.chunk_size = device, split, chunk_size
        context = mp.get_context("spawn")  # a CUDA context cannot cross a fork
        self.requests, self.replies = context.Queue(), context.Queue()
        self.process = context.Process(target=serve, name="clipscale-decode", daemon=True,
                                       args=(split, device, device_decoder, chunk_size, self.requests, self.replies, os.getpid()))
        self.process.start()
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.request_ids, self.batch_ids = itertools.count(), itertools.count()
        self.images_decoded, self.decode_s = 0, 0.0
        self.closing = False
        self.receiver = threading.Thread(target=on_the_callers_device(self._receive), name="clipscale-decoded", daemon=True)
        self.receiver.start()

    def column(self, batch_size: int, arrivals: Arrivals, device_transform: DeviceTransform | None,
               budget: KeepBudget | None) -> ChunkSource:
        """A batch's images column, decoded in the process; its chunks decoded ahead as
        `DeviceDecoder.column` does it."""
        return decoded_column(ProcessDecodedRows(batch_size, self), self.split, self.chunk_size, arrivals,
                              device_transform, budget)

    def send(self, message: tuple) -> None:
        self.requests.put(message)

    def request(self, batch: int, start: int, stop: int) -> "DecodedElsewhere":
        future: Future = Future()
        request = next(self.request_ids)
        with self.lock:
            if not self.process.is_alive() and self.process.exitcode is not None:
                future.set_exception(self._died())
                return DecodedElsewhere(future)
            self.pending[request] = future
        self.send(("decode", request, batch, start, stop))
        return DecodedElsewhere(future)

    def _died(self) -> RuntimeError:
        return RuntimeError(f"the JPEG decoding process ended (exit code {self.process.exitcode}); "
                            "its error, if it printed one, is above")

    def _receive(self) -> None:
        """The replies: each chunk's pixels copied into this process's memory (on a stream of its
        own, waited for here, with the GIL released) before the decoder's copy is let go."""
        copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        while True:
            try:
                reply = self.replies.get(timeout=PARENT_CHECK_S)
            except queue.Empty:
                if self.closing:
                    return
                if not self.process.is_alive():
                    self._fail_pending(self._died())
                    return
                continue
            kind, request, payload, counts = reply
            with self.lock:
                future = self.pending.pop(request, None)
            self.images_decoded, self.decode_s = counts
            if kind == "decoded":
                if copy_stream is not None:
                    with torch.cuda.stream(copy_stream):
                        pixels = payload.clone()
                    copy_stream.synchronize()
                else:
                    pixels = payload.clone()
                del reply, payload  # the decoder's memory may be reused now
                result = pixels
            else:
                result = RuntimeError(f"the JPEG decoding process could not decode a chunk: {payload}")
            if future is not None:
                try:
                    future.set_exception(result) if isinstance(result, BaseException) else future.set_result(result)
                except InvalidStateError:  # cancelled meanwhile: nobody wants it
                    pass

    def _fail_pending(self, error: BaseException) -> None:
        with self.lock:
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        self.closing = True
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.receiver.join(timeout=2 * PARENT_CHECK_S)
        self._fail_pending(RuntimeError("the JPEG decoder was closed"))
        for channel in (self.requests, self.replies):
            channel.close()
            channel.cancel_join_thread()


class DecodedElsewhere:
    """A chunk being decoded in the decode process (`Prepared`, data/chunks.py)."""

    def __init__(self, future: Future):
        self.future = future

    def on_device(self, device: torch.device, copy_stream) -> torch.Tensor:
        pixels = self.future.result()
        if pixels.is_cuda:  # copied on the reply thread's stream: freed only after the compute stream's use
            pixels.record_stream(torch.cuda.current_stream(device))
        return pixels

    def cancel(self) -> None:
        self.future.cancel()  # its reply, when it comes, is dropped


class ProcessDecodedRows:
    """The images of a batch that the decode process decodes (`Rows`, data/chunks.py): the pieces'
    bytes go there as they arrive, every pass asks it for what was not kept."""

    def __init__(self, batch_size: int, decoder: DecodeProcess):
        self.batch_size, self.decoder = batch_size, decoder
        self.batch = next(decoder.batch_ids)

    def __len__(self) -> int:
        return self.batch_size

    def put(self, rows: slice, piece: dict) -> None:
        self.decoder.send(("piece", self.batch, rows.start, piece["encoded"]))

    def prepare(self, start: int, stop: int, pass_number: int) -> DecodedElsewhere:
        return self.decoder.request(self.batch, start, stop)

    def release(self) -> None:
        self.decoder.send(("release", self.batch))


def serve(split: SplitTransform, device: torch.device, device_decoder: str, chunk_size: int | None,
          requests, replies, parent: int) -> None:
    """The decode process: a `DeviceDecoder` fed from `requests` until None, or until the
    training process is gone. The stop signals are the trainer's: it checkpoints, then closes this."""
    ignore_stop_signals(0)  # as a loader worker: only the trainer's SIGTERM (multiprocessing's exit) ends it
    if device.type == "cuda":
        torch.cuda.set_device(device)
    jpeg = JpegEngines.create(device)[0] if device_decoder == "nvimgcodec" else None
    decoder = DeviceDecoder(split, device, jpeg or TorchvisionJpeg(device), chunk_size=chunk_size)
    batches: dict[int, tuple[EncodedBatch, Arrivals]] = {}
    released: set[int] = set()  # pieces still on their way for these are dropped

    def reply(request: int, decoded: Future) -> None:
        try:
            pixels, done = decoded.result()
            if done is not None:
                done.synchronize()  # the pixels are whole before the trainer reads them
            message = ("decoded", request, pixels)
        except Exception as error:  # noqa: BLE001 - the trainer raises it where the step asks for this chunk
            message = ("failed", request, repr(error))
        replies.put((*message, (decoder.images_decoded, decoder.decode_s)))

    while True:
        try:
            message = requests.get(timeout=PARENT_CHECK_S)
        except queue.Empty:
            if os.getppid() != parent:
                break
            continue
        if message is None:
            break
        kind, batch, *rest = message
        if kind == "piece" and batch in released:
            continue
        if kind == "piece":
            first_row, encoded = rest
            held = batches.setdefault(batch, (EncodedBatch(), Arrivals()))
            held[0].add(first_row, encoded)
            held[1].add(len(encoded))
        elif kind == "decode":
            request, (batch, start, stop) = batch, rest
            if batch in released:  # asked ahead for a batch the step is done with
                replies.put(("failed", request, "the batch was released", (decoder.images_decoded, decoder.decode_s)))
                continue
            encoded, arrivals = batches.setdefault(batch, (EncodedBatch(), Arrivals()))
            decoder.submit(encoded, arrivals, start, stop).future.add_done_callback(lambda done, r=request: reply(r, done))
        elif kind == "release":
            released.add(batch)
            held = batches.pop(batch, None)
            if held is not None:
                held[1].fail(RuntimeError("the batch was released"))  # a decode still waiting for its rows ends
    for _, arrivals in batches.values():
        arrivals.fail(RuntimeError("the decoder is closing"))  # its threads end, so the process can
    decoder.close()
