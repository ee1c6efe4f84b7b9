"""--decode gpu's rank side (common/data/device_decode.py) on CPU tensors: the boxes are
torchvision's RandomResizedCrop + flip drawn per global sample position (the CPU workers' boxes),
the pixels those of the CPU path's crop of the same decoded image, the labels in order; the
batched crop CUDA ranks run (geometry.batched_resized_crop) is torch's antialiased float kernel,
weight for weight, on random and odd boxes, in a number of kernels that does not grow with the batch."""
from __future__ import annotations

import io
import itertools
from collections import Counter
from typing import Callable

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode, RandomResizedCrop
from torchvision.transforms.v2 import functional as F

from common.data.augment import sample_seed
from common.data.device_decode import choose_decode, decode_and_crop, encoded_batch, train_boxes
from common.data.geometry import (
    CHUNK_ELEMENTS,
    INTERPOLATIONS,
    Box,
    batched_resized_crop,
    crop_chunks,
    filter_weights,
    resized_chunks,
    resized_crop,
    resized_crops,
)
from common.errors import UserError

pytestmark = pytest.mark.quick

CPU = torch.device("cpu")
SIZES = [(500, 375), (375, 500), (640, 480), (96, 300), (33, 40), (1024, 700)]  # (width, height)
SEED, EPOCH, STEP, SIZE = 7, 3, 11, 64


def jpeg(width: int, height: int, mode: str = "RGB", seed: int = 0) -> bytes:
    """A smooth photo-like JPEG (quality 90)."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    out = io.BytesIO()
    coarse.convert(mode).save(out, "JPEG", quality=90)
    return out.getvalue()


@pytest.fixture(scope="module")
def files() -> list[bytes]:
    return [jpeg(w, h, seed=n) for n, (w, h) in enumerate(SIZES)]


def torchvision_box(position: int, height: int, width: int) -> Box:
    """torchvision's own RandomResizedCrop.get_params, then RandomHorizontalFlip's draw, from the
    sample's generator state (torch's global generator seeded as geometry seeds the sample's)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sample_seed(SEED, EPOCH, STEP, position, "crop"))
        top, left, h, w = RandomResizedCrop.get_params(torch.empty(1, height, width), (0.08, 1.0), (3 / 4, 4 / 3))
        return Box(top, left, h, w, bool(torch.rand(1) < 0.5))


def test_the_boxes_are_torchvisions_drawn_per_global_position_at_any_world_size(files):
    batch = encoded_batch(files, range(len(files)))
    assert batch.sizes == [(h, w) for w, h in SIZES]  # from the headers: nothing decoded
    positions = list(range(len(files)))
    boxes = train_boxes(batch.sizes, SEED, EPOCH, STEP, positions)
    assert boxes == [torchvision_box(p, h, w) for p, (h, w) in zip(positions, batch.sizes)]
    assert {box.flip for box in boxes} == {True, False} and len(set(boxes)) == len(boxes)
    for rank in range(2):  # world 2: rank r holds global positions r, r+2, ...: the same boxes as world 1's rows
        mine = positions[rank::2]
        assert train_boxes(batch.sizes[rank::2], SEED, EPOCH, STEP, mine) == boxes[rank::2]


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_decode_and_crop_makes_the_cpu_paths_crops_and_keeps_the_labels(files, interpolation):
    labels = [4, 0, 9, 2, 2, 7]
    batch = encoded_batch(files, labels)
    boxes = train_boxes(batch.sizes, SEED, EPOCH, STEP, range(len(files)))
    images = decode_and_crop(batch, boxes, SIZE, 3, CPU, interpolation)
    assert images.dtype == torch.uint8 and images.shape == (len(files), 3, SIZE, SIZE)
    assert batch.labels.tolist() == labels
    for data, box, made in zip(files, boxes, images):
        decoded = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        # the CPU workers' crop of the same box, with --interpolation's filter
        assert torch.equal(made, resized_crop(decoded, box, SIZE, interpolation=interpolation))
        reference = F.resized_crop(decoded, box.top, box.left, box.height, box.width, [SIZE, SIZE], antialias=True,
                                   interpolation=InterpolationMode(interpolation))
        reference = F.horizontal_flip(reference) if box.flip else reference
        assert (made.int() - reference.int()).abs().max() <= 1  # torchvision's v2 resized_crop on that box
    decoded = [decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
               for data in files]
    batched = batched_resized_crop(decoded, boxes, SIZE, interpolation)  # what a CUDA rank runs
    assert (batched.int() - images.int()).abs().max() <= 1


def test_grayscale_jpegs_decode_to_one_channel():
    files = [jpeg(120, 90, "L"), jpeg(90, 120, "L", seed=1)]
    batch = encoded_batch(files, [0, 1])
    images = decode_and_crop(batch, train_boxes(batch.sizes, SEED, EPOCH, STEP, [0, 1]), 32, 1, CPU)
    assert images.shape == (2, 1, 32, 32)


def test_a_header_that_disagrees_with_the_pixels_is_refused(files):
    batch = encoded_batch(files[:2], [0, 1])
    swapped = batch._replace(sizes=batch.sizes[::-1])
    with pytest.raises(ValueError, match=r"sample 0 of the batch decodes to \(375, 500\) pixels, its header says"):
        decode_and_crop(swapped, train_boxes(swapped.sizes, SEED, EPOCH, STEP, [0, 1]), 32, 3, CPU)


@pytest.mark.parametrize("requested, device, jpeg_only, chosen", [
    ("auto", "cuda", True, "gpu"), ("auto", "cuda", False, "cpu"), ("auto", "cpu", True, "cpu"),
    ("cpu", "cuda", True, "cpu"), ("gpu", "cuda", True, "gpu"),
])
def test_auto_decodes_on_the_gpu_where_the_rank_is_cuda_and_the_set_is_jpeg(requested, device, jpeg_only, chosen):
    assert choose_decode(requested, torch.device(device), jpeg_only) == chosen


@pytest.mark.parametrize("device, jpeg_only, says", [
    ("cpu", True, "--decode gpu decodes on the rank's CUDA device, and this rank's device is cpu; pass --decode cpu"),
    ("cuda", False, "--decode gpu decodes JPEGs only (nvJPEG), and the set holds other formats; pass --decode cpu"),
])
def test_gpu_where_it_cannot_be_is_one_line_naming_the_ways_out(device, jpeg_only, says):
    with pytest.raises(UserError) as refused:
        choose_decode("gpu", torch.device(device), jpeg_only)
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


@pytest.mark.parametrize("world, workers, augment", [(1, 0, "basic"), (2, 2, "randaugment")])
def test_the_device_path_gives_the_cpu_workers_batch(tmp_path, world, workers, augment):
    """The suite's CPU path (shards streamed, the worker cropping each sample by its global
    position) against --decode gpu's (the workers read the bytes, the rank decodes, crops and
    applies the policy: Streamed with gpu_decode, on CPU tensors here) on the same samples: the
    same labels and the same pixels (S is chosen so that no reduced JPEG decode applies in the
    worker: its boxes keep fewer than 2 S pixels across), for each rank's rows at world 1 and 2,
    with DataLoader workers or without."""
    from common.data import own
    from common.data.augment import Draws
    from common.data.reading import Streamed
    from common.shards import convert
    from tests.datagen import write_imagefolder

    tree = write_imagefolder(tmp_path / "tree", train_size=40, test_size=10, shape="cifar", formats=("jpg",),
                             sizes=(40, 60))
    convert(tree, str(tmp_path / "shards"))
    opts = own.OwnData("shards", str(tmp_path / "shards"), str(tmp_path / "cache"), {}, image_size=32, workers=workers,
                       prepare_workers=0, skip_broken=False, cache_gb=0.0, shard_cache_gb=1.0)
    data = own.open_prepared(own.prepare(opts, lambda line: None), opts)
    on_rank = Streamed(data.train.source, workers, gpu_decode=True)
    order, batch = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0)), 16
    draws = Draws(seed=SEED, epoch=EPOCH, step=STEP, global_batch=batch, augment=augment)
    for rank in range(world):
        positions = range(rank, batch, world)
        indices = [order[k * batch + rank:(k + 1) * batch:world] for k in range(2)]
        cpu = list(data.train.batches(indices, CPU, draws, positions))
        gpu = list(on_rank.batches(indices, CPU, draws, positions))
        for (cpu_images, cpu_labels), (gpu_images, gpu_labels) in zip(cpu, gpu, strict=True):
            assert torch.equal(gpu_labels, cpu_labels)
            assert torch.equal(gpu_images, cpu_images)


def test_a_jpeg_that_does_not_decode_on_the_device_is_named_in_one_line(files):
    cut = files[1][:len(files[1]) // 3]  # its header reads (indexing passed it), its pixels end early
    batch = encoded_batch([files[0], cut], [0, 1])._replace(names=["a.jpg", "train/cut.jpg"])
    with pytest.raises(UserError) as refused:
        decode_and_crop(batch, train_boxes(batch.sizes, SEED, EPOCH, STEP, [0, 1]), 32, 3, CPU)
    assert str(refused.value).startswith("train/cut.jpg does not decode on cpu (") and "pass --decode cpu" in \
        str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("image_size, decode, device, says", [
    (32, "gpu", "cpu", "--decode gpu decodes on the rank's CUDA device, and this rank's device is cpu; pass --decode"),
    (0, "gpu", "cuda", "--decode gpu makes the training crops of --image-size S on the GPU, and "),
])
def test_decode_gpu_where_the_run_cannot_is_refused_when_the_set_opens(tmp_path, image_size, decode, device, says):
    """What a rank says at start-up (open_prepared): a CPU rank, or a set that trains as stored."""
    from common.data import own
    from common.shards import convert
    from tests.datagen import write_imagefolder

    tree = write_imagefolder(tmp_path / "tree", train_size=40, test_size=10, shape="cifar", formats=("jpg",))
    convert(tree, str(tmp_path / "shards"))
    opts = own.OwnData("shards", str(tmp_path / "shards"), str(tmp_path / "cache"), {}, image_size=image_size,
                       workers=0, prepare_workers=0, skip_broken=False, cache_gb=0.0, shard_cache_gb=1.0,
                       decode=decode, device=device)
    with pytest.raises(UserError) as refused:
        own.open_prepared(own.prepare(opts, lambda line: None), opts)
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


def test_decoding_ahead_keeps_the_order_passes_errors_on_and_raises_the_threads_failure_where_taken():
    from types import SimpleNamespace

    from common.data.device_decode import DecodeAhead

    batches = [SimpleNamespace(error="", k=k) for k in range(5)] + [SimpleNamespace(error="b.jpg: broken")]
    ahead = DecodeAhead(iter(batches), lambda k, batch: torch.full((1,), k), CPU, deadline_s=30)
    taken = list(ahead)
    assert [batch.k for batch, _ in taken[:5]] == [int(images) for _, images in taken[:5]] == list(range(5))
    assert taken[5] == (batches[5], None)  # a batch that carries its error is not decoded: the consumer raises it

    def failing(k: int, batch: object) -> torch.Tensor:
        raise UserError("x.jpg does not decode on cpu")
    with pytest.raises(UserError, match="x.jpg does not decode"):
        list(DecodeAhead(iter(batches), failing, CPU, deadline_s=30))


# ---------------------------------------------------------------- the batched crop of CUDA ranks

# Before rounding, the batched crops may differ from torch's float kernel by float32 rounding alone:
# torch's own float32 weights are up to 5e-7 off the exact ones (255 x 5e-7 = 1.3e-4 grey levels),
# and the matmuls sum in another order. Measured at most 1.8e-4 (bicubic, uniform noise).
FLOAT_LEVELS = 2.5e-4


def torchs_weights(length: int, size: int, interpolation: str) -> torch.Tensor:
    """torch's own antialiased float32 weights making `size` pixels of a line of `length`: its
    vertical pass over an identity image (the horizontal pass keeps the width: a weight of 1 each)."""
    eye = torch.eye(length)[None, None]
    return torch.nn.functional.interpolate(eye, size=(size, length), mode=interpolation, antialias=True)[0, 0]


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_the_batched_weights_are_torchs_antialiased_kernels_weights(interpolation):
    lengths = [1, 2, 3, 5, 31, 63, 64, 65, 100, 223, 224, 225, 500]  # up, none and down
    for size in (7, 64, 224):
        weights = filter_weights(torch.tensor(lengths), size, max(lengths) + 3, interpolation)
        for length, row in zip(lengths, weights):
            assert (row[:, :length] - torchs_weights(length, size, interpolation)).abs().max() <= 1e-6, (size, length)
            assert not row[:, length:].any()  # taps beyond the line


def float_crop(image: torch.Tensor, box: Box, size: int, interpolation: str) -> torch.Tensor:
    """torch's antialiased float kernel on the box, mirrored where it says, before rounding: the
    per-sample crop as a GPU makes it (geometry.antialiased)."""
    crop = image[None, :, box.top:box.top + box.height, box.left:box.left + box.width].float()
    resized = torch.nn.functional.interpolate(crop, size=(size, size), mode=interpolation, antialias=True)[0]
    return resized.flip(-1) if box.flip else resized


def assert_torchs_float_kernel(images: list[torch.Tensor], boxes: list[Box], size: int, interpolation: str,
                               chunk_elements: int = CHUNK_ELEMENTS) -> None:
    """Each batched crop against torch's float kernel on its own: within FLOAT_LEVELS before
    rounding, within a grey level after; every sample made once."""
    made, places = batched_resized_crop(images, boxes, size, interpolation, chunk_elements), []
    for chunk, resized in resized_chunks(images, boxes, size, interpolation, chunk_elements):
        for place, floats in zip(chunk.tolist(), resized):
            reference = float_crop(images[place], boxes[place], size, interpolation)
            assert (floats - reference).abs().max() <= FLOAT_LEVELS, (place, boxes[place], images[place].shape)
            rounded = reference.clamp(0, 255).round()
            assert (made[place].float() - rounded).abs().max() <= 1, (place, boxes[place])
            places.append(place)
    assert sorted(places) == list(range(len(images))) and made.shape == (len(images), images[0].shape[0], size, size)


def random_batch(g: torch.Generator, count: int, channels: int = 3, sides: tuple[int, int] = (1, 300),
                 ) -> tuple[list[torch.Tensor], list[Box]]:
    """Noise images of random sizes, each with a random box (any size from 1 px to the whole image), half mirrored."""
    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    images, boxes = [], []
    for _ in range(count):
        height, width = draw(*sides), draw(*sides)
        images.append(torch.randint(0, 256, (channels, height, width), dtype=torch.uint8, generator=g))
        h, w = draw(1, height), draw(1, width)
        boxes.append(Box(draw(0, height - h), draw(0, width - w), h, w, bool(draw(0, 1))))
    return images, boxes


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("size", [48, 160])  # most boxes shrink to 48, many grow to 160
def test_the_batched_crop_is_torchs_float_kernel_on_random_boxes(interpolation, size):
    images, boxes = random_batch(torch.Generator().manual_seed(0), 8, sides=(1, 250))
    assert {box.flip for box in boxes} == {True, False}
    assert {side < size for box in boxes for side in box[2:4]} == {True, False}  # upscaled and downscaled sides
    assert_torchs_float_kernel(images, boxes, size, interpolation)
    assert len(crop_chunks(boxes, 3, 3 * 100 * 100)) > 2
    assert_torchs_float_kernel(images, boxes, size, interpolation, chunk_elements=3 * 100 * 100)


def odd_batch(case: str) -> tuple[list[torch.Tensor], list[Box]]:
    """A batch of one; boxes of 1 px (and 1 px across); boxes of the whole image (one of the
    output's size); a grey batch; images of very different sizes together."""
    g = torch.Generator().manual_seed(5)
    if case == "one":
        return random_batch(g, 1, sides=(200, 400))
    if case == "grey":
        return random_batch(g, 5, channels=1)
    image = torch.randint(0, 256, (3, 375, 500), dtype=torch.uint8, generator=g)
    if case == "1 px":
        return [image] * 4, [Box(0, 0, 1, 1), Box(374, 499, 1, 1, True), Box(10, 3, 1, 200), Box(7, 20, 300, 1, True)]
    if case == "whole":
        small = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g)
        return [image, small, small], [Box(0, 0, 375, 500), Box(0, 0, 64, 64), Box(0, 0, 64, 64, True)]
    sizes = [(6, 9), (500, 350), (12, 900), (1, 1), (240, 320)]  # "mixed": very different sizes in one batch
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
    return images, [Box(0, 0, h, w, k % 2 == 1) for k, (h, w) in enumerate(sizes)]


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("case", ["one", "1 px", "whole", "grey", "mixed"])
def test_the_batched_crop_of_odd_batches(case, interpolation):
    images, boxes = odd_batch(case)
    assert_torchs_float_kernel(images, boxes, 64, interpolation)
    if case == "whole":  # a box of the output's size is copied, pixel for pixel (mirrored where it says)
        made = batched_resized_crop(images, boxes, 64, interpolation)
        assert torch.equal(made[1], images[1]) and torch.equal(made[2], images[2].flip(-1))


def test_chunks_bound_the_padded_crops_and_take_every_sample_once():
    _, boxes = random_batch(torch.Generator().manual_seed(3), 40)
    for limit in (1, 3 * 100 * 100, 3 * 300 * 300, CHUNK_ELEMENTS):
        groups = crop_chunks(boxes, 3, limit)
        assert sorted(itertools.chain(*groups)) == list(range(len(boxes)))
        for group in groups:
            padded = len(group) * 3 * max(boxes[i].height for i in group) * max(boxes[i].width for i in group)
            assert padded <= limit or len(group) == 1, (limit, group)
    assert len(crop_chunks(boxes, 3, CHUNK_ELEMENTS)) == 1 and len(crop_chunks(boxes, 3, 1)) == len(boxes)


def kernels(crop: Callable[..., torch.Tensor], *args: object) -> Counter:
    """The aten operations crop(*args) runs that are not views (a view launches no kernel), by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ran: Counter = Counter()

        def __torch_dispatch__(self, func: torch._ops.OpOverload, types: object, args: tuple = (),
                               kwargs: dict | None = None) -> object:
            if not func.is_view:
                self.ran[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Counting() as counting:
        crop(*args)
    return counting.ran


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_the_batched_crops_kernels_do_not_grow_with_the_batch(interpolation):
    image = torch.randint(0, 256, (3, 60, 80), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    made = {}
    for count in (2, 32):
        images, boxes = [image] * count, [Box(k % 7, k % 9, 40 + k % 11, 50 + k % 13, k % 2 == 1) for k in range(count)]
        made[count] = [kernels(crop, images, boxes, 32, interpolation)
                       for crop in (batched_resized_crop, resized_crops)]
    assert made[2][0] == made[32][0] and sum(made[2][0].values()) < 100
    assert sum(made[32][1].values()) > 10 * sum(made[2][1].values())  # per sample: the count grows with the batch
