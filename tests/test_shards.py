"""The ImageFolder layout's checks, the converter to WebDataset shards and the readers' view of a
shard folder (common/shards.py)."""
from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from PIL import Image

from common.errors import UserError
from common.shards import (
    CLASSES_FILE,
    GENERATION_SHARD,
    MANIFEST,
    TRAIN,
    VAL,
    Reencode,
    ShardSet,
    class_images,
    convert,
    folder_classes,
    main,
    pixels_problem,
    resolve,
    scaled_size,
    shard_pattern,
)
from common.storage import DENIED, FsspecStorage, LocalStorage, StorageError
from tests.conftest import ROOT, child_env
from tests.datagen import write_imagefolder, write_shards

pytestmark = pytest.mark.quick  # no launch: the quick tier (pytest -m quick)

CLASSES = [str(digit) for digit in range(10)]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """Images of varying sizes in three formats, the third image of each split named .jpeg."""
    return write_imagefolder(tmp_path_factory.mktemp("tree"), train_size=80, test_size=20,
                             formats=("png", "jpg", "jpeg"), sizes=(24, 40))


def listing(folder: Path) -> dict[str, str]:
    """A local folder as readers list it for resolve: file name -> "SIZE-MTIME"."""
    return {p.name: f"{p.stat().st_size}-{p.stat().st_mtime_ns}" for p in folder.iterdir() if p.is_file()}


def shard_set(dest: Path) -> ShardSet:
    return resolve(listing(dest), lambda name: (dest / name).read_bytes(), str(dest))


def read_split(dest: Path, split: str) -> list[tuple[str, str, bytes, int]]:
    """(key, image extension, image bytes, class) of every sample, in the order resolve gives the
    shards and in member order; checks that each sample is its two members, plain files owned by
    no one at time 0, and each shard's sample count against the manifest's."""
    shards, samples = shard_set(dest), []
    for shard in shards.train if split == TRAIN else shards.val:
        with tarfile.open(dest / shard) as tar:
            members = tar.getmembers()
            assert all(m.isreg() and (m.mode, m.mtime, m.uid, m.gid, m.uname, m.gname) == (0o644, 0, 0, 0, "", "")
                       for m in members)
            assert len(members) == 2 * shards.samples[shard]
            for image, label in zip(members[::2], members[1::2]):
                key, ext = image.name.split(".")
                assert label.name == f"{key}.cls"
                samples.append((key, ext, tar.extractfile(image).read(), int(tar.extractfile(label).read())))
    return samples


def source_samples(tree: Path, split: str) -> list[tuple[str, bytes, int]]:
    return [(path.suffix[1:], path.read_bytes(), int(path.parent.name))
            for path in sorted((tree / split).glob("*/*"), key=lambda p: (p.parent.name, p.name))]


def shard_bytes(dest: Path) -> list[bytes]:
    """Every shard's bytes, train's then val's, in the manifest's order."""
    shards = shard_set(dest)
    return [(dest / name).read_bytes() for name in shards.train + shards.val]


def test_shards_hold_every_image_once_with_its_class(tree, tmp_path):
    write_shards(tree, tmp_path)
    assert (tmp_path / CLASSES_FILE).read_text() == "".join(f"{name}\n" for name in CLASSES)
    shards = shard_set(tmp_path)
    assert shards.manifest and shards.classes == CLASSES and len(shards.train) == len(shards.val) == 1
    assert all(GENERATION_SHARD.fullmatch(name) for name in shards.train + shards.val)
    assert sorted(listing(tmp_path)) == sorted([CLASSES_FILE, MANIFEST, *shards.train, *shards.val])
    for split in (TRAIN, VAL):
        written, source = read_split(tmp_path, split), source_samples(tree, split)
        assert [key for key, *_ in written] == [f"{i:08d}" for i in range(len(source))]
        assert Counter(tuple(sample) for _, *sample in written) == Counter(source)  # the original bytes, jpeg kept
    assert {ext for _, ext, _, _ in read_split(tmp_path, TRAIN)} == {"png", "jpg", "jpeg"}
    assert [tuple(sample) for _, *sample in read_split(tmp_path, VAL)] == source_samples(tree, VAL)  # ImageFolder order
    train = [label for *_, label in read_split(tmp_path, TRAIN)]
    assert train != sorted(train) and len(set(train[:10])) > 3  # shuffled: a shard mixes the classes


def test_the_manifest_names_the_generation_the_classes_and_each_shards_size_and_samples(tree, tmp_path):
    written = convert(tree, str(tmp_path), shard_mb=0.02)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert set(manifest) == {"format", "generation", "classes", "splits"} and manifest["classes"] == CLASSES
    for split in (TRAIN, VAL):
        entries = manifest["splits"][split]
        assert [entry["name"] for entry in entries] == [f"{split}-{manifest['generation']}-{i:06d}.tar"
                                                        for i in range(len(entries))]
        assert [entry["bytes"] for entry in entries] == [(tmp_path / entry["name"]).stat().st_size for entry in entries]
        assert written[split] == (sum(entry["samples"] for entry in entries), len(entries),
                                  sum(entry["bytes"] for entry in entries))


def test_a_shard_ends_before_it_passes_shard_mb(tree, tmp_path):
    written = convert(tree, str(tmp_path), shard_mb=0.02)
    shards = sorted(tmp_path.glob("*.tar"))
    assert written[TRAIN][:2] == (80, len(list(tmp_path.glob(shard_pattern(TRAIN))))) and written[TRAIN][1] > 3
    assert all(path.stat().st_size <= 0.02 * 2**20 for path in shards)
    assert sum(bytes_ for *_, bytes_ in written.values()) == sum(path.stat().st_size for path in shards)
    assert len(read_split(tmp_path, TRAIN)) == 80

    tiny = convert(tree, str(tmp_path / "tiny"), shard_mb=1e-6)  # smaller than any sample: one per shard
    assert tiny == {TRAIN: (80, 80, tiny[TRAIN][2]), VAL: (20, 20, tiny[VAL][2])}


def test_a_rerun_writes_the_same_bytes_under_new_names_and_deletes_every_other_shard(tree, tmp_path):
    convert(tree, str(tmp_path / "a"), shard_mb=0.02)
    convert(tree, str(tmp_path / "b"), shard_mb=0.02)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b") and len(shard_bytes(tmp_path / "a")) > 5
    assert set(shard_set(tmp_path / "a").train).isdisjoint(shard_set(tmp_path / "b").train)  # a new generation
    convert(tree, str(tmp_path / "b"), shard_mb=0.02, seed=1)
    assert shard_bytes(tmp_path / "a")[0] != shard_bytes(tmp_path / "b")[0]

    for hand_named in ("train-000000.tar", "val-000007.tar"):
        (tmp_path / "a" / hand_named).write_bytes(b"another tool's")
    (tmp_path / "a" / "notes.txt").write_text("kept: not a shard")
    convert(tree, str(tmp_path / "a"))  # one shard per split now: the earlier ones must not stay
    shards = shard_set(tmp_path / "a")
    assert sorted(listing(tmp_path / "a")) == sorted([CLASSES_FILE, MANIFEST, "notes.txt", *shards.train, *shards.val])
    assert len(shards.train) == len(shards.val) == 1


class Killed(Exception):
    """The converter's process dying at a chosen write."""


@pytest.mark.parametrize("dies_at", [lambda name, writes: writes == 3, lambda name, writes: name == MANIFEST],
                         ids=["after-three-shards", "at-the-manifest"])
def test_an_interrupted_reconversion_leaves_the_earlier_set_whole(tree, tmp_path, monkeypatch, dies_at):
    dest, other = tmp_path / "dest", write_imagefolder(tmp_path / "other", train_size=40, test_size=10, shape="cifar")
    convert(tree, str(dest), shard_mb=0.02)
    earlier = {split: read_split(dest, split) for split in (TRAIN, VAL)}
    assert [tuple(sample) for _, *sample in earlier[VAL]] == source_samples(tree, VAL)
    write_from, written = LocalStorage.write_from, []

    def dying_write_from(self, name, produce):
        if dies_at(name, len(written)):
            raise Killed
        write_from(self, name, produce)
        written.append(name)
    monkeypatch.setattr(LocalStorage, "write_from", dying_write_from)
    with pytest.raises(Killed):
        convert(other, str(dest), shard_mb=0.02)
    monkeypatch.undo()
    assert len(written) >= 3 and all(GENERATION_SHARD.fullmatch(name) for name in written[:3])
    assert set(written[:3]) <= set(listing(dest)) - set(shard_set(dest).train)  # the new shards are there, unread
    assert {split: read_split(dest, split) for split in (TRAIN, VAL)} == earlier

    convert(other, str(dest), shard_mb=0.02)
    shards = shard_set(dest)
    assert sorted(listing(dest)) == sorted([CLASSES_FILE, MANIFEST, *shards.train, *shards.val])
    assert [tuple(sample) for _, *sample in read_split(dest, VAL)] == source_samples(other, VAL)


def test_generation_named_shards_without_a_manifest_are_an_interrupted_conversion(tree, tmp_path):
    convert(tree, str(tmp_path))
    (tmp_path / MANIFEST).unlink()
    with pytest.raises(UserError, match=f"^{tmp_path} holds train-[0-9a-f]{{12}}-000000.tar but no {MANIFEST}: a "
                                        f"conversion into {tmp_path} was interrupted before it finished; run "
                                        f"python -m common.shards SRC {tmp_path} again$"):
        shard_set(tmp_path)


def test_without_a_manifest_hand_named_shards_are_read_by_glob_in_order():
    def no_read(name: str) -> bytes:
        raise AssertionError(f"read {name}")
    found = resolve({"train-000001.tar": "10-b", "train-000000.tar": "10-a", "val-000000.tar": "10-c",
                     CLASSES_FILE: "4-d", "train-000002.tar.part": "3-e", "notes.txt": "1-f"}, no_read, "s3://b/p/")
    assert found == ShardSet(["train-000000.tar", "train-000001.tar"], ["val-000000.tar"], None, {}, False)
    assert resolve({"train-000000.tar": "10-a"}, no_read, "s3://b/p").val == []  # the caller refuses an empty split


def truncate_a_shard(dest: Path) -> str:
    name = shard_set(dest).val[0]
    size = (dest / name).stat().st_size
    (dest / name).write_bytes((dest / name).read_bytes()[:1024])
    return (f"{dest}/{name} is 1024 bytes but {MANIFEST} says {size}: it was cut short or changed; copy it again "
            f"from where the shards were converted, or run python -m common.shards SRC {dest} again")


def delete_a_shard(dest: Path) -> str:
    name = shard_set(dest).train[-1]
    size = (dest / name).stat().st_size
    (dest / name).unlink()
    return f"{dest}/{name} is missing ({MANIFEST} lists it, {size} bytes); copy it again"


def garble_the_manifest(dest: Path) -> str:
    (dest / MANIFEST).write_text("{")
    return f"{dest}/{MANIFEST} is not a valid shard manifest (not JSON: "


def edit_manifest(dest: Path, **changes) -> None:
    (dest / MANIFEST).write_text(json.dumps({**json.loads((dest / MANIFEST).read_text()), **changes}))


def give_a_newer_format(dest: Path) -> str:
    edit_manifest(dest, format=2)
    return (f"{dest}/{MANIFEST} is not a valid shard manifest (format 2; this version reads format 1); run "
            f"python -m common.shards SRC {dest} again")


def name_a_file_outside(dest: Path) -> str:
    edit_manifest(dest, splits={TRAIN: [{"name": "../train-x.tar", "bytes": 1, "samples": 1}], VAL: []})
    return f"{dest}/{MANIFEST} is not a valid shard manifest (train lists {{'name': '../train-x.tar'"


@pytest.mark.parametrize("damage", [truncate_a_shard, delete_a_shard, garble_the_manifest, give_a_newer_format,
                                    name_a_file_outside])
def test_a_set_that_differs_from_its_manifest_is_refused_naming_the_file(tree, tmp_path, damage):
    convert(tree, str(tmp_path), shard_mb=0.02)
    message = damage(tmp_path)
    with pytest.raises(UserError) as error:
        shard_set(tmp_path)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_an_unreadable_manifest_is_named():
    def denied(name: str) -> bytes:
        raise StorageError(f"s3://b/p/{name}", "access denied, wrong or missing credentials", DENIED)
    with pytest.raises(UserError, match=r"^s3://b/p/manifest.json cannot be read \(access denied, wrong or missing "
                                        r"credentials\); check its access, or run python -m common.shards SRC "
                                        r"s3://b/p again$"):
        resolve({MANIFEST: "300-etag"}, denied, "s3://b/p/")


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    """An ImageFolder tree of the given files (path -> bytes)."""
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def encoded(image: Image.Image, format: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=format)
    return out.getvalue()


def test_every_format_is_copied_verbatim_16_bit_and_float_included(tmp_path):
    gray = np.arange(12 * 16).reshape(12, 16)
    deep, real = Image.fromarray((gray * 300).astype(np.uint16)), Image.fromarray((gray / 7).astype(np.float32))
    assert (deep.mode, real.mode) == ("I;16", "F")
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (12, 16, 3), dtype=np.uint8))
    tree = write_tree(tmp_path / "tree", {
        "train/a/deep.png": encoded(deep, "PNG"), "train/a/real.TIF": encoded(real, "TIFF"),
        "train/b/pic.gif": encoded(rgb, "GIF"), "train/b/pic.bmp": encoded(rgb, "BMP"),
        "train/b/pic.ppm": encoded(rgb, "PPM"), "train/b/pic.webp": encoded(rgb, "WEBP"),
        "val/a/gray.pgm": encoded(rgb.convert("L"), "PPM"), "val/b/pic.tiff": encoded(rgb, "TIFF")})
    convert(tree, str(tmp_path / "out"))
    for split in (TRAIN, VAL):
        source = sorted((path.suffix.lower()[1:], path.read_bytes(), "ab".index(path.parent.name))
                        for path in (tree / split).glob("*/*"))
        assert sorted((ext, data, label) for _, ext, data, label in read_split(tmp_path / "out", split)) == source
    with Image.open(tree / "train/a/deep.png") as image:
        assert image.mode == "I;16"  # the PNG encoder kept 16 bits: the shard holds them, byte for byte


def test_a_url_destination_goes_through_fsspec(tree, tmp_path):
    memory = fsspec.filesystem("memory")
    try:
        convert(tree, "memory://shards-test/out", shard_mb=0.02)
        convert(tree, str(tmp_path), shard_mb=0.02)
        store = FsspecStorage("memory://shards-test/out", {})
        shards = resolve(store.versions(), store.read, "memory://shards-test/out")
        assert sorted(store.versions()) == sorted([CLASSES_FILE, MANIFEST, *shards.train, *shards.val])
        assert [store.read(name) for name in shards.train + shards.val] == shard_bytes(tmp_path)
        assert store.read(CLASSES_FILE) == (tmp_path / CLASSES_FILE).read_bytes()
    finally:
        memory.rm("/shards-test", recursive=True)


def test_the_summary_line_counts_and_hides_a_urls_password(tree, capsys):
    try:
        assert main([str(tree), "memory://user:hunter22@shards-test/out", "--storage-options", "{}"]) == 0
    finally:
        fsspec.filesystem("memory").rm("/user:hunter22@shards-test", recursive=True)
    out = capsys.readouterr().out
    assert out == ("common.shards: wrote train 80 samples in 1 shard, val 20 samples in 1 shard, 0.3 MiB, "
                   "to memory://user:***@shards-test/out\n")


def run_converter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.shards", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60)


def test_the_command_line_converts(tree, tmp_path):
    result = run_converter(str(tree), str(tmp_path / "out"), "--shard-mb", "0.02", "--seed", "3")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("common.shards: wrote train 80 samples in ") and result.stdout.count("\n") == 1
    convert(tree, str(tmp_path / "same"), shard_mb=0.02, seed=3)
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "same")


def test_images_in_subfolders_are_converted_and_files_that_are_not_images_named(tree, tmp_path):
    copy = Path(shutil.copytree(tree, tmp_path / "tree"))
    (copy / TRAIN / "3" / "more").mkdir()
    shutil.copy(next((copy / TRAIN / "3").glob("*.png")), copy / TRAIN / "3" / "more" / "nested.png")
    (copy / TRAIN / "4" / "notes.txt").write_text("scanned 2024")
    lines: list[str] = []
    written = convert(copy, str(tmp_path / "out"), say=lines.append)
    assert written[TRAIN][0] == 81 and len(lines) == 1 and "left out 1 file(s)" in lines[0] and "notes.txt" in lines[0]


@pytest.mark.parametrize("break_tree, named", [
    (lambda tree: shutil.rmtree(tree / VAL), "val"),
    (lambda tree: (tree / TRAIN / "extra").mkdir(), "train/extra"),
    (lambda tree: shutil.copytree(tree / VAL / "3", tree / VAL / "cat"), "val/cat"),
], ids=["no-val-folder", "empty-class-folder", "val-class-not-in-train"])
def test_a_broken_tree_is_one_line_and_exit_2(tree, tmp_path, break_tree, named):
    broken = tmp_path / "tree"
    shutil.copytree(tree, broken)
    break_tree(broken)
    result = run_converter(str(broken), str(tmp_path / "out"))
    assert result.returncode == 2 and result.stdout == "" and not (tmp_path / "out").exists()  # nothing written
    assert result.stderr.startswith("common.shards: error: ") and result.stderr.count("\n") == 1
    assert f"{broken / named}" in result.stderr


def bmp_claiming(width: int, height: int) -> bytes:
    """A small 1-bit BMP whose header claims width x height: PIL reads the header, not the pixels."""
    data = bytearray(encoded(Image.new("1", (8, 8)), "BMP"))
    struct.pack_into("<ii", data, 18, width, height)  # BITMAPINFOHEADER's biWidth, biHeight
    return bytes(data)


PNG = encoded(Image.new("L", (16, 16), 128), "PNG")
NOISE = encoded(Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32), dtype=np.uint8)), "PNG")


@pytest.mark.filterwarnings("error")  # PIL's DecompressionBombWarning included
@pytest.mark.parametrize("name, data, says", [
    ("train/b/cut.png", NOISE[:len(NOISE) // 2], "does not decode as an image (image file is truncated"),
    ("val/a/text.jpg", b"not an image", "does not decode as an image (cannot identify image file"),
    ("train/a/big.bmp", bmp_claiming(10000, 10000), "is 10000 x 10000 = 100000000 pixels, more than the 89478485 "
                                                    "an image may have (PIL's decompression-bomb limit); shrink it"),
    ("train/b/huge.bmp", bmp_claiming(20000, 20000), "is too large to decode (Image size (400000000 pixels) "),
], ids=["truncated-png", "not-an-image-jpg", "bmp-past-the-limit", "bmp-past-twice-the-limit"])
def test_an_image_that_does_not_decode_or_is_too_large_stops_the_converter_before_it_writes(
        tmp_path, capsys, name, data, says):
    tree = write_tree(tmp_path / "tree", {"train/a/0.png": PNG, "train/b/1.png": NOISE, "val/a/2.png": PNG,
                                          name: data})
    with pytest.raises(SystemExit) as exit_:
        main([str(tree), str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and not (tmp_path / "out").exists()  # nothing written
    assert err.startswith(f"common.shards: error: {tree / name} {says}") and err.count("\n") == 1


def test_every_broken_image_is_counted_and_the_first_five_named_in_one_line(tmp_path, capsys):
    broken = {f"train/a/cut{i}.png": NOISE[:len(NOISE) // 2] for i in range(7)}
    tree = write_tree(tmp_path / "tree", {"train/a/0.png": PNG, "train/b/1.png": NOISE, "val/a/2.png": PNG, **broken})
    with pytest.raises(SystemExit) as exit_:
        main([str(tree), str(tmp_path / "out")])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and not (tmp_path / "out").exists() and err.count("\n") == 1
    assert err.startswith("common.shards: error: 7 images do not decode or are too large: ") and err.endswith("; ...\n")
    assert sum(f"{tree / name} does not decode" in err for name in broken) == 5


def test_pixels_problem_refuses_past_pils_limit():
    assert pixels_problem(9459, 9459) is None and pixels_problem(89_478_485, 1) is None
    assert pixels_problem(89_478_486, 1).startswith("is 89478486 x 1 = 89478486 pixels, more than the 89478485 ")


def test_bad_storage_options_are_a_usage_error(tree, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(tree), str(tmp_path), "--storage-options", "env:SHARDS_TEST_UNSET"])
    assert exit_.value.code == 2 and not any(tmp_path.iterdir())
    assert capsys.readouterr().err == ("common.shards: error: --storage-options env:SHARDS_TEST_UNSET: the environment "
                                       "variable SHARDS_TEST_UNSET is not set; export it (a JSON object) where every "
                                       "rank starts (see --help)\n")


def images_of(root: Path, split: str, classes: list[str], ignored: list[str] | None = None) -> list[tuple[str, int]]:
    keep_ignored = [].extend if ignored is None else ignored.extend
    return [(rel, label) for label, paths in class_images(root, split, classes, keep_ignored) for rel in paths]


def test_class_images_reads_imagefolders_order_and_val_may_lack_a_class(tmp_path):
    for name in ("train/b/2.png", "train/b/1.JPG", "train/a/z.webp", "train/a/notes.txt", "train/a/.hidden.png",
                 "train/loose.jpg", "train/.DS_Store", "val/b/x.bmp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    (tmp_path / "train" / ".cache").mkdir()
    classes = folder_classes(tmp_path)
    assert classes == ["a", "b"]
    ignored: list[str] = []
    assert images_of(tmp_path, TRAIN, classes, ignored) == [("train/a/z.webp", 0), ("train/b/1.JPG", 1),
                                                            ("train/b/2.png", 1)]
    assert ignored == ["train/loose.jpg", "train/a/notes.txt"]  # an image beside the classes has none: named
    assert images_of(tmp_path, VAL, classes) == [("val/b/x.bmp", 1)]


def test_links_up_the_tree_are_not_followed_and_dangling_ones_are_named(tmp_path):
    for name in ("train/a/1.png", "train/b/2.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    (tmp_path / "train" / "a" / "up").symlink_to(tmp_path / "train")  # would add b's images to a, forever
    (tmp_path / "train" / "a" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    ignored: list[str] = []
    assert images_of(tmp_path, TRAIN, ["a", "b"], ignored) == [("train/a/1.png", 0), ("train/b/2.png", 1)]
    assert ignored == ["train/a/gone.png"]
    (tmp_path / "train" / "c").symlink_to(tmp_path / "unmounted", target_is_directory=True)
    with pytest.raises(UserError, match=r"train/c is a link to .*unmounted, which does not exist"):
        folder_classes(tmp_path)


def test_folder_classes_needs_class_folders(tmp_path):
    (tmp_path / TRAIN).mkdir()
    with pytest.raises(UserError, match=f"{tmp_path / TRAIN} has no class folders"):
        folder_classes(tmp_path)


def test_the_generated_tree_is_grayscale_and_varies_in_size(tree):
    images = [Image.open(path) for path in sorted((tree / TRAIN).glob("*/*"))]
    assert len(images) == 80 and {image.mode for image in images} == {"L"}
    sizes = {image.size for image in images}
    assert len(sizes) > 10 and all(24 <= side <= 40 for size in sizes for side in size)


@pytest.mark.parametrize("args, message", [
    (["--shard-mb", "nan"], "--shard-mb must be a number > 0 (got nan)"),
    (["--shard-mb", "inf"], "--shard-mb must be a number > 0 (got inf)"),
], ids=["nan", "inf"])
def test_odd_shard_sizes_are_a_usage_error(tree, tmp_path, args, message):
    result = run_converter(str(tree), str(tmp_path / "out"), *args)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1


def test_a_conversion_whose_shards_another_deleted_writes_no_manifest(tree, tmp_path, monkeypatch):
    """Two converters into one destination: the one that ends first deletes the other's shards."""
    from common import shards as module
    from common.storage import LocalStorage

    class Raced(LocalStorage):
        def write(self, name: str, data: bytes) -> None:
            if name == CLASSES_FILE:  # the other converter ends meanwhile, deleting shards not in its manifest
                next(self.root.glob("train-*.tar")).unlink()
            super().write(name, data)
    monkeypatch.setattr(module, "storage_for", lambda dest, options: Raced(dest))
    with pytest.raises(UserError, match=r"was deleted while this conversion ran .* one converter per destination"):
        convert(tree, str(tmp_path / "out"))
    assert not (tmp_path / "out" / MANIFEST).exists()


# ---------------------------------------------------------------- --max-side and --quality

@pytest.fixture(scope="module")
def colour_tree(tmp_path_factory) -> Path:
    """RGB images from 20 to 64 px a side, PNG and JPEG: some above a --max-side of 32, some below."""
    return write_imagefolder(tmp_path_factory.mktemp("colour"), train_size=40, test_size=12, shape="cifar",
                             formats=("png", "jpg"), sizes=(20, 64))


def decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def test_max_side_scales_the_long_side_down_keeping_the_aspect(colour_tree, tmp_path):
    convert(colour_tree, str(tmp_path), reencode=Reencode(max_side=32))
    for split in (TRAIN, VAL):
        stored = [decoded(data) for _, ext, data, _ in read_split(tmp_path, split)]
        assert {ext for _, ext, _, _ in read_split(tmp_path, split)} == {"jpg"}
        assert {image.format for image in stored} == {"JPEG"} and {image.mode for image in stored} == {"RGB"}
        originals = [Image.open(path).size for path in (colour_tree / split).glob("*/*")]
        assert any(max(size) > 32 for size in originals) and any(max(size) <= 32 for size in originals)
        assert sorted(image.size for image in stored) == sorted(scaled_size(w, h, 32) for w, h in originals)
    val = [decoded(data).size for _, _, data, _ in read_split(tmp_path, VAL)]  # val keeps the tree's order
    source = source_samples(colour_tree, VAL)
    assert val == [scaled_size(*Image.open(io.BytesIO(data)).size, 32) for _, data, _ in source]
    assert [label for *_, label in read_split(tmp_path, VAL)] == [label for *_, label in source]


def test_scaled_size_keeps_the_aspect_and_leaves_small_images_alone():
    assert scaled_size(500, 375, 320) == (320, 240) and scaled_size(375, 500, 320) == (240, 320)
    assert scaled_size(1024, 683, 320) == (320, 213) and scaled_size(4000, 1, 320) == (320, 1)
    assert scaled_size(300, 200, 320) == (300, 200) and scaled_size(500, 375, None) == (500, 375)


def test_quality_alone_reencodes_at_full_size_and_sets_the_size_and_the_fidelity(colour_tree, tmp_path):
    """Without --max-side the sizes are the originals'; a lower quality makes smaller files that
    stray further from the source pixels; grayscale images stay grayscale."""
    source = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32)
              for _, data, _ in source_samples(colour_tree, VAL)]
    errors, sizes = {}, {}
    for quality in (95, 20):
        convert(colour_tree, str(tmp_path / str(quality)), reencode=Reencode(quality=quality))
        stored = [decoded(data) for _, _, data, _ in read_split(tmp_path / str(quality), VAL)]
        assert [image.size for image in stored] == [image.shape[1::-1] for image in source]
        errors[quality] = np.mean([np.abs(np.asarray(image, np.float32) - pixels).mean()
                                   for image, pixels in zip(stored, source)])
        sizes[quality] = sum(len(data) for _, _, data, _ in read_split(tmp_path / str(quality), VAL))
    assert errors[95] < errors[20] and sizes[95] > 1.5 * sizes[20], (errors, sizes)
    gray = write_imagefolder(tmp_path / "gray", train_size=60, test_size=10, sizes=(24, 40))
    convert(gray, str(tmp_path / "gray-out"), reencode=Reencode(max_side=30, quality=80))
    assert {decoded(data).mode for _, _, data, _ in read_split(tmp_path / "gray-out", TRAIN)} == {"L"}


@pytest.mark.parametrize("args, message", [
    (["--max-side", "0"], "--max-side must be a number of pixels >= 1 (got 0)"),
    (["--max-side", "-5"], "--max-side must be a number of pixels >= 1 (got -5)"),
    (["--quality", "0"], "--quality must be a JPEG quality from 1 to 100 (got 0)"),
    (["--max-side", "320", "--quality", "101"], "--quality must be a JPEG quality from 1 to 100 (got 101)"),
    (["--max-side", "big"], "--max-side: invalid int value: 'big'"),
], ids=["zero", "negative", "quality-0", "quality-101", "not-a-number"])
def test_bad_max_side_or_quality_is_one_line_and_exit_2(tree, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main([str(tree), str(tmp_path / "out"), *args])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and not (tmp_path / "out").exists()
    assert message in err and err.count("\n") == 1, err


def test_a_destination_that_is_a_file_is_one_line_naming_the_way_out(tree, tmp_path, capsys):
    dest = tmp_path / "a-file"
    dest.write_text("keep me")
    with pytest.raises(SystemExit) as exit_:
        main([str(tree), str(dest)])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and dest.read_text() == "keep me"
    assert f"DEST {dest} is a file: give a folder" in err and err.count("\n") == 1, err


def test_the_scratch_a_killed_conversion_left_is_deleted_by_the_next_one(colour_tree, tmp_path, monkeypatch):
    """A conversion's scratch (its re-encoded copy of the set) is named for its host and process: the
    next conversion deletes those whose process is gone and keeps a live one's (and another host's)."""
    import socket
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    ended = subprocess.Popen(["true"])
    ended.wait()
    host = socket.gethostname()
    killed, live, elsewhere = (scratch / f"common.shards.{host}-{ended.pid}-abc", scratch / f"common.shards.{host}-1-x",
                               scratch / f"common.shards.other-host-{ended.pid}-y")
    for left in (killed, live, elsewhere):
        (left / "train").mkdir(parents=True)
    convert(colour_tree, str(tmp_path / "out"), reencode=Reencode(max_side=16, quality=80))
    assert not killed.exists() and live.exists() and elsewhere.exists()
    assert sorted(p.name for p in scratch.iterdir()) == sorted(p.name for p in (live, elsewhere))  # its own: gone


def test_the_command_line_stores_smaller_photos(colour_tree, tmp_path):
    result = run_converter(str(colour_tree), str(tmp_path), "--max-side", "24", "--quality", "70")
    assert result.returncode == 0, result.stderr
    assert all(max(decoded(data).size) <= 24 for _, _, data, _ in read_split(tmp_path, TRAIN))


def test_training_reads_shards_of_smaller_photos(colour_tree, tmp_path):
    """The real loading code (index, geometry, statistics, streamed workers' decode) on --max-side
    shards at --image-size: the batches are the model's size, every label comes through."""

    from common.data import own
    from common.data.loader import TrainLoader

    convert(colour_tree, str(tmp_path / "shards"), shard_mb=0.01, reencode=Reencode(max_side=28, quality=85))
    opts = own.OwnData("shards", str(tmp_path / "shards"), str(tmp_path / "cache"), {}, image_size=20, workers=0,
                       prepare_workers=0, skip_broken=False, cache_gb=0.0, shard_cache_gb=1.0)
    data = own.open_prepared(own.prepare(opts, lambda line: None), opts)
    loader = TrainLoader(data.train, data.spec, 8, 0, 1, seed=3, device=torch.device("cpu"))
    labels = []
    for images, batch_labels in loader.epoch(1):
        assert images.shape[1:] == (3, 20, 20) and torch.isfinite(images).all()
        labels += batch_labels.tolist()
    assert sorted(labels) == sorted(label for *_, label in source_samples(colour_tree, TRAIN))


def test_smaller_photos_refuse_a_16_bit_image_before_writing_anything(tmp_path, capsys):
    """An 8-bit JPEG would lose what the readers' scaling of a 16-bit image keeps: refused, named."""
    deep = Image.fromarray((np.arange(12 * 16).reshape(12, 16) * 300).astype(np.uint16))
    tree = write_tree(tmp_path / "tree", {"train/a/0.png": PNG, "train/b/deep.png": encoded(deep, "PNG"),
                                          "val/a/1.png": PNG})
    with pytest.raises(SystemExit) as exit_:
        main([str(tree), str(tmp_path / "out"), "--max-side", "8"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and not (tmp_path / "out").exists()
    assert err.startswith(f"common.shards: error: {tree / 'train/b/deep.png'} is a I;16") and err.count("\n") == 1
    assert "convert this set without them" in err
