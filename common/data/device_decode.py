"""--decode gpu: the rank decodes its batch of JPEGs on its device and crops it there.

CPU decoding cannot feed GPUs (an 8-GPU node of ResNet-50 H100s wants ~24,000 images/s; a core
decodes ~450). With --decode gpu the DataLoader workers only read each sample's encoded bytes and
its size from the JPEG header (reading.Reader.encoded); the rank decodes the whole batch in one
torchvision.io.decode_jpeg(list, device=...) call (nvJPEG on CUDA) and makes each sample's crop
with the same geometry as the CPU workers: the box is geometry.train_box of the sample's global
position (torchvision's RandomResizedCrop and flip, drawn from the sample's own generator), the
pixels those of torch's antialiased kernel of --interpolation: on CUDA the whole batch's crops in
one batched pass (geometry.batched_resized_crop: the float kernel's weights as matmuls), on CPU
tensors geometry.resized_crop per sample. So a sample gets the same crop whichever path made it:
on CPU tensors the very pixels of the CPU workers' batch, where the worker decodes at full scale
(it decodes at 1/2, 1/4 or 1/8 where the box keeps 2, 4 or 8 times the model's size across;
nvJPEG decodes at full scale; on CUDA, nvJPEG's IDCT and the float resize may differ by a grey
level). The functions take any device: on a host without a GPU they run on CPU tensors, which is
how the tests check them against the CPU path.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from common.data.decoding import header
from common.data.geometry import Box, batched_resized_crop, resized_crops, train_box
from common.errors import UserError


class EncodedBatch(NamedTuple):
    """What a worker hands a --decode gpu rank: each sample's JPEG bytes (uint8, 1-D), its
    (height, width) from the header, the labels, and the files (named where one fails to decode)."""

    data: list[torch.Tensor]
    sizes: list[tuple[int, int]]
    labels: torch.Tensor
    names: Sequence[str] = ()


def choose_decode(requested: str, device: torch.device, jpeg_only: bool) -> str:
    """Where a rank decodes: "cpu" (its workers) or "gpu" (itself, on its device). auto is gpu on a
    CUDA rank whose set is all JPEG, else cpu; gpu where it cannot be is refused in one line."""
    if requested == "auto":
        return "gpu" if device.type == "cuda" and jpeg_only else "cpu"
    if requested == "gpu" and device.type != "cuda":
        raise UserError(f"--decode gpu decodes on the rank's CUDA device, and this rank's device is {device}; "
                        "pass --decode cpu (or auto), or run on GPUs (--device cuda)")
    if requested == "gpu" and not jpeg_only:
        raise UserError("--decode gpu decodes JPEGs only (nvJPEG), and the set holds other formats; pass --decode "
                        "cpu (or auto), or convert the set to JPEG shards (python -m common.shards SRC DEST "
                        "--quality 90)")
    return requested


def encoded_batch(files: Sequence[bytes], labels: Sequence[int]) -> EncodedBatch:
    """A worker's share of --decode gpu: the bytes as tensors and each image's size from its header
    (no pixel is decoded here)."""
    sizes = []
    for data in files:
        (width, height), *_ = header(data)
        sizes.append((height, width))
    return EncodedBatch([torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in files], sizes,
                        torch.tensor(list(labels), dtype=torch.int64))


def train_boxes(sizes: Sequence[tuple[int, int]], seed: int, epoch: int, step: int,
                positions: Sequence[int]) -> list[Box]:
    """Each sample's training crop, by its global position in step `step`'s batch: the boxes the CPU
    workers draw for the same samples (geometry.train_box)."""
    return [train_box(seed, epoch, step, position, height, width)
            for (height, width), position in zip(sizes, positions)]


def decode_and_crop(batch: EncodedBatch, boxes: Sequence[Box], size: int, channels: int,
                    device: torch.device, interpolation: str = "bilinear") -> torch.Tensor:
    """The batch decoded on `device` in one call (nvJPEG batched on CUDA) and each image's box
    resized to size x size with `interpolation` (mirrored where the box says): uint8 (N, channels,
    size, size) on `device`. On CUDA the crop is batched (a crop per sample is bound by its kernel
    launches there); on CPU tensors it is the CPU workers' own kernel, per sample (the batched
    float matmuls are 50 to 70 times slower on a CPU, and its uint8 kernel gives the workers' pixels)."""
    crop = batched_resized_crop if device.type == "cuda" else resized_crops
    return crop(decoded(batch, channels, device), boxes, size, interpolation)


def decoded(batch: EncodedBatch, channels: int, device: torch.device) -> list[torch.Tensor]:
    """The batch's JPEGs decoded on `device` in one call: uint8 (channels, H, W) each, of the size
    its header gave (the boxes were drawn for that size)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    try:
        images = decode_jpeg(batch.data, mode=mode, device=device)
    except RuntimeError:
        raise UserError(undecodable(batch, mode, device)) from None
    for i, image in enumerate(images):
        if tuple(image.shape[-2:]) != batch.sizes[i]:
            raise ValueError(f"sample {i} of the batch decodes to {tuple(image.shape[-2:])} pixels, its header "
                             f"says {batch.sizes[i]}")
    return images


def undecodable(batch: EncodedBatch, mode: object, device: torch.device) -> str:
    """One line naming the batch's first JPEG that does not decode on `device` (one call decodes the
    batch, and its error names no file). Its header read, so --skip-broken did not pass it over."""
    from torchvision.io import decode_jpeg

    for i, data in enumerate(batch.data):
        try:
            decode_jpeg(data, mode=mode, device=device)
        except RuntimeError as e:
            name = batch.names[i] if batch.names else f"sample {i} of the batch"
            return (f"{name} does not decode on {device} ({' '.join(str(e).split())[:160]}); replace or delete it, "
                    "or pass --decode cpu (with --skip-broken, the CPU workers train without such files)")
    return f"a batch of {len(batch.data)} JPEGs does not decode on {device} at once, each does alone; pass --decode cpu"


class DecodeAhead:
    """--decode gpu off the training thread: a thread takes the workers' encoded batches, decodes
    and crops each on a CUDA stream of its own (make(k, batch) -> images) while the step before runs,
    and hands over (batch, images) with an event the consumer's stream waits on. At most DEPTH
    batches are ready ahead (each is a batch of decoded images in device memory). A failure in the
    thread is raised where the batch is taken; a batch that carries an error is handed over as it is."""

    DEPTH = 2

    def __init__(self, batches: Iterator, make: Callable[[int, Any], torch.Tensor], device: torch.device,
                 deadline_s: float) -> None:
        self.device, self.deadline_s = device, deadline_s
        self.ready: queue.Queue = queue.Queue(maxsize=self.DEPTH)
        self.stopping = threading.Event()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._run, args=(batches, make), name="decode-ahead", daemon=True)
        self.thread.start()

    def _run(self, batches: Iterator, make: Callable[[int, Any], torch.Tensor]) -> None:
        try:
            if self.stream:  # a new thread's current device is GPU 0, not this rank's
                torch.cuda.set_device(self.device)
            with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
                for k, batch in enumerate(batches):
                    images = None if batch.error else make(k, batch)
                    done = torch.cuda.Event() if self.stream else None
                    if done:
                        done.record(self.stream)
                    if not self._put((batch, images, done)):
                        return
        except BaseException as error:  # noqa: BLE001 - raised again in the consumer's thread
            self._put(error)
            return
        self._put(None)

    def _put(self, item: object) -> bool:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor | None]]:
        while True:
            try:
                item = self.ready.get(timeout=self.deadline_s)
            except queue.Empty:
                raise UserError(f"--decode gpu: no batch was decoded in {self.deadline_s:g} s; the workers or the "
                                "device hang; pass --decode cpu to rule the device out") from None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            batch, images, done = item
            if done is not None and images is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
                images.record_stream(torch.cuda.current_stream(self.device))  # made on the side stream, used here
            yield batch, images

    def close(self) -> None:
        """Stops the thread at its next batch; not waited for (it may be waiting on a worker)."""
        self.stopping.set()
