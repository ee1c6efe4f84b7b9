"""The partial JPEG decode (common/data/jpegcrop.c): a crop box's rows and columns decoded alone must
be, bit for bit, decode_jpeg's pixels there (or, reduced, PIL's draft decode's), on photo-like JPEGs
of every chroma subsampling, odd sizes and restart markers; files it does not handle fall back, a
corrupt file never crashes, and without a compiler the crop decodes whole, said once."""
from __future__ import annotations

import io
import random

import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from common.data import jpegcrop
from common.data.decoding import decode_crop, decode_whole
from common.data.geometry import Box, random_resized_box, resized_crop, scaled

pytestmark = pytest.mark.quick


def photo(height: int, width: int, seed: int) -> Image.Image:
    """Smooth colour fields with sharp colour edges and grain: chroma that changes within a block,
    where upsampling at a cropped edge would show."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.nn.functional.interpolate(torch.rand(1, 3, 6, 8, generator=g), size=(height, width),
                                             mode="bicubic")[0]
    edges = torch.nn.functional.interpolate(torch.rand(1, 3, height // 7 + 1, width // 9 + 1, generator=g),
                                            size=(height, width), mode="nearest")[0]
    pixels = 0.5 * coarse + 0.4 * edges + 0.1 * torch.rand(3, height, width, generator=g)
    return Image.fromarray(pixels.clamp(0, 1).mul(255).byte().permute(1, 2, 0).numpy(), "RGB")


def encoded(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **options)
    return buffer.getvalue()


def boxes(height: int, width: int, count: int, seed: int) -> list[Box]:
    """RandomResizedCrop boxes, arbitrary ones, and the corners and the whole image."""
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    drawn = [random_resized_box(g, height, width) for _ in range(count)]
    for _ in range(count // 2):
        top, left = rng.randrange(height), rng.randrange(width)
        drawn.append(Box(top, left, rng.randint(1, height - top), rng.randint(1, width - left)))
    return drawn + [Box(0, 0, height, width), Box(height - 1, width - 1, 1, 1), Box(0, width - 3, 3, 3),
                    Box(height - 5, 0, 5, width)]


def region_box(part: tuple[torch.Tensor, Box]) -> torch.Tensor:
    region, box = part
    return region[:, box.top:box.top + box.height, box.left:box.left + box.width]


@pytest.fixture(scope="module")
def decoder():
    if jpegcrop.library().decoder is None:
        pytest.skip(f"jpegcrop.c did not build: {jpegcrop.library().problem} (install cc and libjpeg62-turbo-dev)")


FILES = {  # name -> (height, width, save options)
    "4:2:0": (375, 500, {"quality": 90, "subsampling": 2}),
    "4:2:2 odd size": (333, 467, {"quality": 75, "subsampling": 1}),
    "4:4:4 odd size": (301, 257, {"quality": 90, "subsampling": 0}),
    "4:2:0 restart markers": (250, 371, {"quality": 90, "subsampling": 2, "restart_marker_blocks": 3}),
    "grey": (283, 390, {"quality": 90}),
}


@pytest.mark.parametrize("name", list(FILES))
def test_a_boxs_rows_and_columns_are_decode_jpegs_bit_for_bit(decoder, name):
    height, width, options = FILES[name]
    image = photo(height, width, seed=len(name))
    data = encoded(image.convert("L") if name == "grey" else image, **options)
    for channels, mode in ((3, ImageReadMode.RGB), (1, ImageReadMode.GRAY)):
        whole = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)
        for box in boxes(height, width, 50, seed=channels):
            part = jpegcrop.decode_box(data, channels, box, height, width)
            assert part is not None, (name, box)
            expected = whole[:, box.top:box.top + box.height, box.left:box.left + box.width]
            assert torch.equal(region_box(part), expected), (name, channels, box)


@pytest.mark.parametrize("reduce", [2, 4, 8])
def test_a_reduced_boxs_rows_and_columns_are_pils_draft_decodes_bit_for_bit(decoder, reduce):
    height, width = 603, 805
    for name, options in (("4:2:0", {"quality": 90}), ("4:4:4", {"quality": 90, "subsampling": 0})):
        data = encoded(photo(height, width, seed=reduce), **options)
        reduced = decode_whole(data, 3, reduce)
        for box in boxes(height, width, 12, seed=reduce):
            part = jpegcrop.decode_box(data, 3, box, height, width, reduce)
            on = scaled(box, *reduced.shape[-2:], height, width)
            assert torch.equal(region_box(part), reduced[:, on.top:on.top + on.height, on.left:on.left + on.width]), \
                (name, box)


def test_the_training_crop_is_torchvisions_resized_crop_of_decode_jpegs_image(decoder):
    data = encoded(photo(375, 500, seed=7), quality=90)
    whole = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    for box in boxes(375, 500, 12, seed=7):
        flipped = box._replace(flip=True)
        row = torch.empty(3, 224, 224, dtype=torch.uint8)  # a batch's row: the worker's numpy copy into it
        ours = resized_crop(*decode_crop(data, 3, flipped, 375, 500, 224), 224, row)
        theirs = F.horizontal_flip(F.resized_crop(whole, box.top, box.left, box.height, box.width, [224, 224],
                                                  antialias=True))
        assert torch.equal(ours, theirs), box


def test_files_it_does_not_handle_and_broken_files_fall_back_without_a_crash(decoder):
    image = photo(200, 300, seed=1)
    box = Box(20, 30, 100, 150)
    unhandled = {"progressive": encoded(image, quality=90, progressive=True),
                 "CMYK": encoded(image.convert("CMYK"), quality=90),
                 "other dimensions than indexed": encoded(image.resize((299, 200)), quality=90)}
    for name, data in unhandled.items():
        assert jpegcrop.decode_box(data, 3, box, 200, 300) is None, name
    good = encoded(image, quality=90)
    broken = {"truncated after the box": good[:len(good) * 3 // 4], "no EOI": good[:-2], "header only": good[:300],
              "not a JPEG": b"\xff\xd8\xff" + bytes(500)}
    for name, data in broken.items():
        assert jpegcrop.decode_box(data, 3, box, 200, 300) is None, name
        with pytest.raises(RuntimeError):  # and decode_jpeg, which then decodes it, says why
            decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    rng = random.Random(0)
    for _ in range(60):  # bytes flipped in the scan: whatever decode_jpeg decodes, the box is its pixels
        damaged = bytearray(good)
        for _ in range(3):
            damaged[rng.randrange(600, len(good) - 2)] = rng.randrange(256)
        part = jpegcrop.decode_box(bytes(damaged), 3, box, 200, 300)
        try:
            whole = decode_jpeg(torch.frombuffer(damaged, dtype=torch.uint8))
        except RuntimeError:
            assert part is None
            continue
        if part is not None:
            assert torch.equal(region_box(part), whole[:, 20:120, 30:180])


def test_without_a_compiler_the_crop_decodes_whole_and_says_so_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    broken = tmp_path / "jpegcrop.c"
    broken.write_text("#include <no_such_header.h>\n")
    monkeypatch.setattr(jpegcrop, "SOURCE", broken)
    jpegcrop.library.cache_clear()
    try:
        assert jpegcrop.library().decoder is None and "no_such_header.h" in jpegcrop.library().problem
        said: list[str] = []
        jpegcrop.announce(said.append)
        assert len(said) == 1 and "libjpeg62-turbo-dev" in said[0] and "decode_jpeg" in said[0]
        data = encoded(photo(120, 160, seed=2), quality=90)
        image, box = decode_crop(data, 3, Box(10, 20, 50, 60), 120, 160, 224)
        assert torch.equal(image, decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))) and \
            box == Box(10, 20, 50, 60)
    finally:
        jpegcrop.library.cache_clear()
