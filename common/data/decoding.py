"""Decoding own images: encoded bytes -> uint8 tensors (CHW), and the header read that indexing does.

JPEGs decode with torchvision.io.decode_jpeg (libjpeg-turbo straight into a tensor), or at a
reduced scale by libjpeg's DCT (PIL's draft) where the crop keeps enough pixels, or, for a crop
at full scale, only the crop's rows and columns (jpegcrop: decode_jpeg's pixels there); every
other format through PIL, 16-bit and float images scaled to 8 bits.
"""
from __future__ import annotations

import io
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from common import shards as layout
from common.data.geometry import Box, Stored, eval_box, resized_crop, scaled
from common.data.jpegcrop import decode_box

SKIP_FLAG = "--skip-broken"


class Undecodable(Exception):
    """An image that did not decode (its file named in the message)."""


# torchvision 0.29 announces on every decode_jpeg call that its decoders will move to TorchCodec:
# said once in docs/data.md, not once per image into every worker's stderr.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)
JPEG_MAGIC = b"\xff\xd8\xff"
DRAFT_SCALES = (8, 4, 2)  # the reduced sizes libjpeg decodes to directly (its DCT does the downscaling)


def is_jpeg(data: bytes) -> bool:
    return data[:3] == JPEG_MAGIC


def decode_whole(data: bytes, channels: int, reduce: int = 1) -> torch.Tensor:
    """Encoded bytes -> the whole image as uint8 (channels, height, width). A JPEG decodes with
    torchvision.io.decode_jpeg (libjpeg-turbo straight into a tensor, no PIL object), or with
    reduce 2, 4 or 8 with PIL's DCT-scaled draft decode at about 1/reduce of its size; any other
    format through PIL (16-bit and float images scaled to 8 bits: to_8_bits). An image above
    layout.MAX_PIXELS is refused before its pixels are read (the index refused it already; this
    holds if the file changed since)."""
    if is_jpeg(data) and reduce == 1:
        from torchvision.io import ImageReadMode, decode_jpeg
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                           mode=ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB)
    from PIL import Image

    with warnings.catch_warnings():  # PIL's path only: e.g. its "truncated" or EXIF warnings, the error says it
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as image:
            if problem := layout.pixels_problem(*image.size):
                raise ValueError(problem)
            if reduce > 1:
                image.draft("L" if channels == 1 else "RGB", (image.size[0] // reduce, image.size[1] // reduce))
            image = to_8_bits(image).convert("L" if channels == 1 else "RGB")
            pixels = torch.from_numpy(np.asarray(image))
    return pixels[None] if channels == 1 else pixels.permute(2, 0, 1)  # HWC viewed as CHW: no copy


def draft_scale(data: bytes, box: Box, size: int) -> int:
    """The reduced JPEG decode that keeps at least `size` source pixels across the drawn box (1: none)."""
    if not is_jpeg(data):
        return 1
    return next((k for k in DRAFT_SCALES if min(box.height, box.width) >= k * size), 1)


def decode_crop(data: bytes, channels: int, box: Box, height: int, width: int, size: int) -> tuple[torch.Tensor, Box]:
    """What a crop `box` of an image indexed as height x width, resized to `size`, needs: pixels
    that hold the box, and the box on them. A JPEG is decoded at a reduced scale where the box
    keeps at least `size` pixels across (draft_scale), and only the box's rows and columns where
    jpegcrop can (the pixels decode_jpeg, or PIL's draft, gives there); else the whole image."""
    reduce = draft_scale(data, box, size)
    if is_jpeg(data) and (part := decode_box(data, channels, box, height, width, reduce)):
        return part
    image = decode_whole(data, channels, reduce)
    return image, scaled(box, *image.shape[-2:], height, width)


def decode(data: bytes, stored: Stored, channels: int) -> torch.Tensor:
    """Encoded bytes -> uint8 (channels, side, side): the evaluation's view (the centre of the
    short side resized to stored.short: geometry.eval_box, resized in one antialiased step), or
    with short 0 the image as it is, which must be side x side. Memory is bounded: the resize
    produces only the stored square (a 4000x1 image is not first made 1,024,000 x 256)."""
    image = decode_whole(data, channels)
    height, width = image.shape[-2:]
    if stored.short:
        return resized_crop(image, eval_box(height, width, stored.side, stored.short), stored.side,
                            interpolation=stored.interpolation)
    if (width, height) != (stored.side, stored.side):
        raise ValueError(f"it is {width}x{height}, the set's images are {stored.side}x{stored.side}")
    return image.contiguous()


def to_8_bits(image):  # a PIL image: PIL is imported where it is used
    """16-bit grayscale (I;16*, and I: integer images are read as 16-bit) scaled from 0..65535, and
    float (F) from 0..1, to 0..255: PIL's convert clips them instead (a 16-bit scan turns white).
    Values outside those ranges are refused, not clipped."""
    from PIL import Image

    if image.mode == "F":
        values = np.asarray(image, dtype=np.float32)
        low, high = float(values.min(initial=0.0)), float(values.max(initial=0.0))
        if not (0 <= low and high <= 1):  # NaN too
            raise ValueError(f"it is a float image with values from {low:g} to {high:g}; float images are read as "
                             "0..1: rescale it, or save it as 8- or 16-bit")
        return Image.fromarray((values * 255).round().astype(np.uint8), "L")
    if image.mode.startswith("I"):
        values = np.asarray(image)
        if values.size and not 0 <= values.min() <= values.max() <= 65535:
            raise ValueError(f"it is a 32-bit image with values from {values.min()} to {values.max()}; integer "
                             "images are read as 16-bit (0..65535): rescale it")
        values = values.astype(np.uint32)  # 65535 * 255 fits: 4 bytes a pixel
        return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), "L")
    return image


def header(data_or_path: bytes | Path) -> tuple[tuple[int, int], str, str]:
    """(width, height), PIL mode and format ("JPEG", "PNG", ...), from the header alone; an image
    above layout.MAX_PIXELS is refused here, at indexing, before any run decodes it."""
    from PIL import Image

    source = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else data_or_path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(source) as image:
            if problem := layout.pixels_problem(*image.size):
                raise ValueError(problem)
            return image.size, image.mode, image.format or ""


def broken_message(name: str, error: BaseException, skip_hint: bool = True) -> str:
    detail = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", " ".join(str(error).split()))[:160] \
        or type(error).__name__  # PIL names the in-memory buffer; the file is named before
    return (f"{name} is not a readable image ({detail}); replace or delete it"
            + (f", or pass {SKIP_FLAG} to train without such files" if skip_hint else ""))


