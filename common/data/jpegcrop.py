"""A training crop's rows and columns of a JPEG decoded alone (jpegcrop.c: libjpeg-turbo's
jpeg_crop_scanline and jpeg_skip_scanlines), the pixels torchvision.io.decode_jpeg gives there;
or at 1/2, 1/4 or 1/8 of the size, those of the DCT-scaled decode PIL's draft gives.

jpegcrop.c is compiled at first use with the system's `cc` against libjpeg-turbo's headers
(Debian: libjpeg62-turbo-dev) into the per-user cache folder, under a lock (a node's workers start
at once), and loaded with ctypes. Without a compiler or the headers, JPEGs decode whole with
decode_jpeg, as before: slower, the same pixels (`announce` says so once).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from common.data.cache import default_cache_dir, file_lock, staging_path
from common.data.geometry import Box, scaled

SOURCE = Path(__file__).with_name("jpegcrop.c")
COMPILE_TIMEOUT_S = 120.0
DECODED, NOT_HANDLED, FAILED = 0, 1, 2  # jpegcrop_decode's results
MESSAGE_BYTES = 200  # libjpeg's JMSG_LENGTH_MAX
MAX_MARGIN = 32  # jpegcrop.c's margin: one iMCU, at most 4 blocks of 8 (sampling factors are 1 to 4)


class Library(NamedTuple):
    """The compiled decoder, or None and why not."""

    decoder: ctypes.CDLL | None
    problem: str


@functools.cache
def library() -> Library:
    """jpegcrop.c compiled (once per source, for every process of this user) and loaded."""
    folder = Path(default_cache_dir()) / "jpegcrop"
    target = folder / f"jpegcrop-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}.so"
    try:
        if not target.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            with file_lock(folder / ".build.lock"):
                if not target.is_file():
                    compile_into(target)
        decoder = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        return Library(None, str(e))
    decoder.jpegcrop_decode.restype = ctypes.c_int
    decoder.jpegcrop_decode.argtypes = [ctypes.c_char_p, ctypes.c_ulong, *[ctypes.c_int] * 8, ctypes.c_void_p,
                                        ctypes.c_ulong, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p]
    return Library(decoder, "")


def compile_into(target: Path) -> None:
    """cc jpegcrop.c -> target, through a staging name (a reader never maps a half-written file)."""
    staging = staging_path(target)
    try:
        done = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(staging), str(SOURCE), "-ljpeg"],
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
        if done.returncode:
            lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise OSError(f"cc failed: {(lines or ['no message'])[0].strip()}")
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


def announce(say: Callable[[str], None]) -> None:
    """One line where the partial decode is not available (said once, where the data is prepared)."""
    if (problem := library().problem):
        say(f"JPEG crops decode whole with decode_jpeg (slower, the same pixels): {SOURCE.name} did not build "
            f"({problem}); install a C compiler and libjpeg-turbo's headers (Debian: libjpeg62-turbo-dev)")


def decode_box(data: bytes, channels: int, box: Box, height: int, width: int,
               reduce: int = 1) -> tuple[torch.Tensor, Box] | None:
    """The rows and columns of an 8-bit baseline JPEG (height x width, as indexed) that hold `box`,
    uint8 (channels, h, w): decode_jpeg's pixels there, or with reduce 2, 4 or 8 those of the image
    decoded at 1/reduce of its size (PIL's draft); and the box on them. None where the whole file
    must be decoded the usual way: no library, a progressive or CMYK file, other dimensions than
    indexed, or a file libjpeg refuses (decode_jpeg or PIL then says why, in its words)."""
    decoder = library().decoder
    if decoder is None:
        return None
    box = scaled(box, -(-height // reduce), -(-width // reduce), height, width)  # libjpeg's output rounds up
    rows, columns = min(height, box.height + MAX_MARGIN), min(width, box.width + 3 * MAX_MARGIN)  # + alignment
    out = torch.empty(rows * columns * channels, dtype=torch.uint8)
    region = (ctypes.c_int * 4)()
    message = ctypes.create_string_buffer(MESSAGE_BYTES)
    result = decoder.jpegcrop_decode(data, len(data), channels, reduce, height, width, box.top, box.left, box.height,
                                     box.width, out.data_ptr(), out.numel(), region, message)
    if result != DECODED:
        return None
    top, left, rows, columns = region
    pixels = out[:rows * columns * channels].view(rows, columns, channels).permute(2, 0, 1)  # HWC as CHW: no copy
    return pixels, box._replace(top=box.top - top, left=box.left - left)
