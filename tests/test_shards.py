"""The ImageFolder layout's checks and the converter to WebDataset shards (common/shards.py)."""
from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import pytest
from PIL import Image

from common.errors import UserError
from common.shards import CLASSES_FILE, TRAIN, VAL, convert, folder_classes, folder_images, main, shard_pattern
from tests.conftest import ROOT, child_env
from tests.datagen import write_imagefolder, write_shards

pytestmark = pytest.mark.quick  # no launch: the quick tier (pytest -m quick)

CLASSES = [str(digit) for digit in range(10)]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """Images of varying sizes in three formats, the third image of each split named .jpeg."""
    return write_imagefolder(tmp_path_factory.mktemp("tree"), train_size=80, test_size=20,
                             formats=("png", "jpg", "jpeg"), sizes=(24, 40))


def read_split(dest: Path, split: str) -> list[tuple[str, str, bytes, int]]:
    """(key, image extension, image bytes, class) of every sample, in shard and member order; checks
    that each sample is its two members, plain files owned by no one at time 0."""
    samples = []
    for shard in sorted(dest.glob(shard_pattern(split))):
        with tarfile.open(shard) as tar:
            members = tar.getmembers()
            assert all(m.isreg() and (m.mode, m.mtime, m.uid, m.gid, m.uname, m.gname) == (0o644, 0, 0, 0, "", "")
                       for m in members)
            for image, label in zip(members[::2], members[1::2]):
                key, ext = image.name.split(".")
                assert label.name == f"{key}.cls"
                samples.append((key, ext, tar.extractfile(image).read(), int(tar.extractfile(label).read())))
    return samples


def source_samples(tree: Path, split: str) -> list[tuple[str, bytes, int]]:
    return [(path.suffix[1:], path.read_bytes(), int(path.parent.name))
            for path in sorted((tree / split).glob("*/*"), key=lambda p: (p.parent.name, p.name))]


def test_shards_hold_every_image_once_with_its_class(tree, tmp_path):
    write_shards(tree, tmp_path)
    assert (tmp_path / CLASSES_FILE).read_text() == "".join(f"{name}\n" for name in CLASSES)
    for split in (TRAIN, VAL):
        written, source = read_split(tmp_path, split), source_samples(tree, split)
        assert [key for key, *_ in written] == [f"{i:08d}" for i in range(len(source))]
        assert Counter(tuple(sample) for _, *sample in written) == Counter(source)  # the original bytes, jpeg kept
    assert {ext for _, ext, _, _ in read_split(tmp_path, TRAIN)} == {"png", "jpg", "jpeg"}
    assert [tuple(sample) for _, *sample in read_split(tmp_path, VAL)] == source_samples(tree, VAL)  # ImageFolder order
    train = [label for *_, label in read_split(tmp_path, TRAIN)]
    assert train != sorted(train) and len(set(train[:10])) > 3  # shuffled: a shard mixes the classes


def test_a_shard_ends_before_it_passes_shard_mb(tree, tmp_path):
    written = convert(tree, str(tmp_path), shard_mb=0.02)
    shards = sorted(tmp_path.glob("*.tar"))
    assert written[TRAIN][:2] == (80, len(list(tmp_path.glob(shard_pattern(TRAIN))))) and written[TRAIN][1] > 3
    assert all(path.stat().st_size <= 0.02 * 2**20 for path in shards)
    assert sum(bytes_ for *_, bytes_ in written.values()) == sum(path.stat().st_size for path in shards)
    assert len(read_split(tmp_path, TRAIN)) == 80

    tiny = convert(tree, str(tmp_path / "tiny"), shard_mb=1e-6)  # smaller than any sample: one per shard
    assert tiny == {TRAIN: (80, 80, tiny[TRAIN][2]), VAL: (20, 20, tiny[VAL][2])}


def test_a_rerun_writes_the_same_bytes_and_drops_shards_it_did_not_rewrite(tree, tmp_path):
    convert(tree, str(tmp_path / "a"), shard_mb=0.02)
    convert(tree, str(tmp_path / "b"), shard_mb=0.02)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir()) and len(files) > 5
    assert all((tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes() for name in files)
    convert(tree, str(tmp_path / "b"), shard_mb=0.02, seed=1)
    assert (tmp_path / "a" / "train-000000.tar").read_bytes() != (tmp_path / "b" / "train-000000.tar").read_bytes()

    convert(tree, str(tmp_path / "a"))  # one shard per split now: the earlier tail must not stay
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [CLASSES_FILE, "train-000000.tar", "val-000000.tar"]


def test_formats_a_shard_does_not_hold_become_lossless_png(tmp_path):
    tree = write_imagefolder(tmp_path / "tree", train_size=60, test_size=4, shape="cifar", formats=("bmp", "tif"))
    convert(tree, str(tmp_path / "out"))
    source = sorted((tree / VAL).glob("*/*"), key=lambda p: (p.parent.name, p.name))
    written = read_split(tmp_path / "out", VAL)
    assert [ext for _, ext, _, _ in written] == ["png"] * 4 and {p.suffix for p in source} == {".bmp", ".tif"}
    for path, (_, _, data, _) in zip(source, written):
        image = Image.open(io.BytesIO(data))
        assert image.format == "PNG" and image.mode == "RGB"
        assert np.array_equal(np.asarray(image), np.asarray(Image.open(path)))


def test_a_url_destination_goes_through_fsspec(tree, tmp_path):
    memory = fsspec.filesystem("memory")
    try:
        convert(tree, "memory://shards-test/out", shard_mb=0.02)
        convert(tree, str(tmp_path), shard_mb=0.02)
        names = sorted(path.rsplit("/", 1)[-1] for path in memory.ls("/shards-test/out", detail=False))
        assert names == sorted(p.name for p in tmp_path.iterdir())
        assert all(memory.cat_file(f"/shards-test/out/{name}") == (tmp_path / name).read_bytes() for name in names)
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
    assert (tmp_path / "out" / "train-000001.tar").read_bytes() == (tmp_path / "same" / "train-000001.tar").read_bytes()


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


def test_bad_storage_options_are_a_usage_error(tree, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(tree), str(tmp_path), "--storage-options", "env:SHARDS_TEST_UNSET"])
    assert exit_.value.code == 2 and not any(tmp_path.iterdir())
    assert capsys.readouterr().err == ("common.shards: error: --storage-options env:SHARDS_TEST_UNSET: the environment "
                                       "variable SHARDS_TEST_UNSET is not set; export it (a JSON object) where every "
                                       "rank starts (see --help)\n")


def test_folder_images_reads_imagefolders_order_and_val_may_lack_a_class(tmp_path):
    for name in ("train/b/2.png", "train/b/1.JPG", "train/a/z.webp", "train/a/notes.txt", "train/a/.hidden.png",
                 "val/b/x.bmp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    (tmp_path / "train" / ".cache").mkdir()
    classes = folder_classes(tmp_path)
    assert classes == ["a", "b"]
    assert folder_images(tmp_path, TRAIN, classes) == [("train/a/z.webp", 0), ("train/b/1.JPG", 1),
                                                       ("train/b/2.png", 1)]
    assert folder_images(tmp_path, VAL, classes) == [("val/b/x.bmp", 1)]


def test_folder_classes_needs_class_folders(tmp_path):
    (tmp_path / TRAIN).mkdir()
    with pytest.raises(UserError, match=f"{tmp_path / TRAIN} has no class folders"):
        folder_classes(tmp_path)


def test_the_generated_tree_is_grayscale_and_varies_in_size(tree):
    images = [Image.open(path) for path in sorted((tree / TRAIN).glob("*/*"))]
    assert len(images) == 80 and {image.mode for image in images} == {"L"}
    sizes = {image.size for image in images}
    assert len(sizes) > 10 and all(24 <= side <= 40 for size in sizes for side in size)
