"""Your own images at their edges (the files real people have) and at scale (what a set of a
million costs per sample and per process): real files written by PIL and tarfile, cut and
replaced as users do, read by the real loading code in-process. The cost figures themselves come
from `python -m bench scale` (docs/benchmarks.md)."""
from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.data import own
from common.data.cache import staging_path
from common.data.decoding import decode
from common.data.geometry import Stored
from common.data.index import map_index
from common.data.reading import Reader
from common.errors import UserError
from common.train.flags import parse_args
from tests.conftest import ROOT, child_env, free_port
from tests.datagen import write_imagefolder, write_shards
from tests.s3server import S3Server
from tests.test_own_data import _tamper_shard, dataset, handmade, options
from tests.test_trust import tmpfs

pytestmark = pytest.mark.quick  # in-process: the quick tier, except where marked otherwise


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A 28-px grayscale tree: 40 training and 20 validation images, classes 0..9."""
    return write_imagefolder(tmp_path_factory.mktemp("small"), train_size=40, test_size=20)


def copy(tree: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tree, tmp_path / "copy", symlinks=True))


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and "Traceback" not in text
    return text


# ---------------------------------------------------------------- at scale: the index is mapped arrays

def test_the_index_is_mapped_files_and_a_spawned_worker_maps_them_again(small, tmp_path):
    data = dataset(options(small, tmp_path, cache_gb=0.0))
    table = data.train.source.table
    maps = Path("/proc/self/maps").read_text()
    assert f"{table.folder}/train_labels" in maps and f"{table.folder}/train_names_blob" in maps  # mapped, not read
    pickled = pickle.dumps(data.train.source)
    assert len(pickled) < 4096  # a path and a split name, not the set's paths
    again: Reader = pickle.loads(pickled)
    assert [again.table.names[i] for i in range(len(again))] == [table.names[i] for i in range(len(table))]
    assert torch.equal(again[7][0], data.train.source[7][0])


def test_skip_broken_takes_the_next_sample_and_wraps_around_at_the_end(small, tmp_path):
    tree = copy(small, tmp_path)
    data = dataset(options(tree, tmp_path / "cache", cache_gb=0.0, skip_broken=True))
    source: Reader = data.train.source
    last = len(source) - 1
    (tree / source.table.names[last]).write_bytes((tree / source.table.names[last]).read_bytes()[:60])
    batch = source.__getitems__([last])
    assert not batch.error and batch.skipped == [source.name(last)] and torch.equal(batch.images[0], source[0][0])


def test_statistics_are_exact_sums_in_chunks(small, tmp_path):
    data = dataset(options(small, tmp_path))
    pixels = data.train.images.double() / 255
    assert data.spec.mean[0] == pytest.approx(pixels.mean().item(), abs=1e-9)
    assert data.spec.std[0] == pytest.approx(pixels.std().item(), abs=1e-9)


def test_a_tiny_wide_image_decodes_to_the_stored_square_without_a_giant_resize():
    """100000x1 at short side 36: resizing first would make a 3,600,000 x 36 image (~390 MB); the
    box resize makes 32 x 32 directly."""
    buffer = io.BytesIO()
    Image.new("RGB", (100_000, 1), (200, 10, 10)).save(buffer, format="PNG")
    assert len(buffer.getvalue()) < 2000
    start = time.perf_counter()
    image = decode(buffer.getvalue(), Stored(32, 36), 3)
    assert image.shape == (3, 32, 32) and image[0].float().mean() == pytest.approx(200, abs=1)
    assert time.perf_counter() - start < 5


def test_an_image_past_the_pixel_bound_is_one_line_at_indexing(small, tmp_path):
    tree = copy(small, tmp_path)
    huge = tree / "train" / "3" / "huge.png"
    Image.new("1", (12_000, 8_000)).save(huge)  # 96 M pixels, 12 KB of PNG
    with pytest.raises(UserError) as error:
        dataset(options(tree, tmp_path / "cache"))
    assert str(huge) in one_line(error) and "12000 x 8000" in str(error.value)


@pytest.mark.parametrize("kind", ["imagefolder", "shards"])
def test_a_broken_file_met_by_an_indexing_worker_is_one_line(kind, small, tmp_path):
    """Before: the DataLoader re-raised the worker's error with its traceback in the message."""
    tree = copy(small, tmp_path)
    if kind == "imagefolder":
        sorted((tree / "train").rglob("*.png"))[0].write_bytes(b"garbage")
        source, message = tree, "is not a readable image"
    else:
        source = handmade(write_shards(tree, tmp_path / "shards"))
        _tamper_shard(source / "train-000000.tar", lambda n, d: (n, b"cat") if n.endswith(".cls") else (n, d))
        message = "holds 'cat', not a class index"
    with pytest.raises(UserError, match=message) as error:
        dataset(options(source, tmp_path / "cache", kind, prepare_workers=2))
    one_line(error)


# ---------------------------------------------------------------- 1. empty validation

@pytest.mark.parametrize("case", ["no class folder", "every image skipped"])
def test_an_empty_validation_split_is_refused_before_training(case, small, tmp_path):
    tree = copy(small, tmp_path)
    for image in list((tree / "val").rglob("*.*")):
        image.write_bytes(b"not an image")
    if case == "no class folder":
        for folder in (tree / "val").iterdir():
            shutil.rmtree(folder)
    with pytest.raises(UserError, match=r"its val split holds no image") as error:
        dataset(options(tree, tmp_path / "cache", skip_broken=True))
    assert ("unreadable file(s) skipped" in one_line(error)) == (case == "every image skipped")


def test_val_shards_without_a_sample_are_refused_before_training(small, tmp_path):
    source = copy(small, tmp_path)
    for image in (source / "val").rglob("*.*"):
        image.write_bytes(b"not an image")
    shards = write_shards(small, tmp_path / "shards")
    handmade(shards)
    for shard in shards.glob("val-*.tar"):  # the converter checks its sources: break the shard's images after it
        _tamper_shard(shard, lambda name, data: (name, b"not an image" if not name.endswith(".cls") else data))
    with pytest.raises(UserError, match=r"its val split holds no image \(20 unreadable"):
        dataset(options(shards, tmp_path / "cache", "shards", skip_broken=True))


# ---------------------------------------------------------------- 2. symlinked class folders

def test_a_symlinked_class_folder_is_read_and_its_changes_seen(small, tmp_path):
    tree = copy(small, tmp_path)
    outside = Path(shutil.move(tree / "train" / "3", tmp_path / "elsewhere"))
    (tree / "train" / "3").symlink_to(outside, target_is_directory=True)
    first = dataset(options(tree, tmp_path / "cache"))
    assert len(first.train) == 40
    changed = sorted(outside.iterdir())[0]
    Image.new("L", (28, 28), 255).save(changed)  # white: the old pixels were noise
    second = dataset(options(tree, tmp_path / "cache"))
    index = map_index(Path(own.prepare(options(tree, tmp_path / "cache"), lambda line: None)["index"]))
    position = [index.train.names[i] for i in range(len(index.train))].index(str(changed.relative_to(outside.parent)
                                                                                   ).replace("elsewhere", "train/3"))
    assert second.train.images[position].min() == 255 and first.train.images[position].min() < 255


# ---------------------------------------------------------------- 3. 16-bit and float images

def test_sixteen_bit_and_float_images_are_scaled_not_clipped(tmp_path):
    sixteen = np.array([[0, 257, 32896, 65535]], dtype=np.uint16).repeat(4, axis=0)
    png = tmp_path / "deep.png"
    Image.fromarray(sixteen).save(png)
    assert Image.open(png).mode in ("I;16", "I")
    assert decode(png.read_bytes(), Stored(4), 1)[0, 0].tolist() == [0, 1, 128, 255]
    floats = np.array([[0.0, 0.5, 1.0, 0.25]], dtype=np.float32).repeat(4, axis=0)
    tiff = tmp_path / "float.tif"
    Image.fromarray(floats, "F").save(tiff)
    assert decode(tiff.read_bytes(), Stored(4), 1)[0, 0].tolist() == [0, 128, 255, 64]
    Image.fromarray(floats * 200, "F").save(tiff)
    with pytest.raises(ValueError, match="float image with values from 0 to 200.*rescale it"):
        decode(tiff.read_bytes(), Stored(4), 1)


def test_a_sixteen_bit_set_trains_on_one_channel_with_its_full_range(small, tmp_path):
    tree = copy(small, tmp_path)
    for path in list(tree.rglob("*.*")):
        pixels = np.asarray(Image.open(path).convert("L"), dtype=np.uint16) * 257
        Image.fromarray(pixels).save(path.with_suffix(".png"))
        if path.suffix != ".png":
            path.unlink()
    data = dataset(options(tree, tmp_path / "cache"))
    reference = dataset(options(small, tmp_path / "reference"))
    assert data.spec.channels == 1 and data.train.images.max() > 200
    assert (data.train.images.float() - reference.train.images.float()).abs().max() <= 3  # jpg vs png sources


# ---------------------------------------------------------------- 5, 6. full disks and killed builds

@pytest.mark.parametrize("size", ["16k", "64k"])
def test_a_full_cache_disk_is_one_line_and_leaves_nothing_that_breaks_the_next_run(size, small, tmp_path):
    """16 KB: the index's arrays do not fit; 64 KB: the index does (40 KB), the decoded set does not."""
    with tmpfs(tmp_path / "disk", size) as disk:
        with pytest.raises(UserError, match=rf"--cache-dir {disk}/\w+: No space left on device") as error:
            dataset(options(small, disk))
        assert f"{disk}/{'index' if size == '16k' else 'decoded'}:" in one_line(error)
        assert not list(disk.rglob(".*.tmp-*"))
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        data = dataset(options(small, disk))
        assert len(data.train) == 40 and data.held.startswith("decoded")


KILLED_BUILD = """
import os, signal, sys
from common.data import own
from tests.test_own_data import options
opts = options(sys.argv[1], sys.argv[2])
real = own.decode_split
def decode_then_die(source, folder, split, opts, say):
    skipped = real(source, folder, split, opts, say)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-build: the training split is in the staging folder
own.decode_split = decode_then_die
own.prepare(opts, print)
"""


@pytest.mark.slow
def test_a_build_killed_mid_way_leaves_staging_that_the_next_run_sweeps(small, tmp_path):
    cache = tmp_path / "cache"
    killed = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(small), str(cache)], cwd=ROOT, env=child_env(),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(list((cache / "decoded").glob(".*.tmp-*"))) == 1
    data = dataset(options(small, cache))
    assert data.held.startswith("decoded") and not list(cache.rglob(".*.tmp-*"))


PREPARE = """
import sys
from common.data import own
from tests.test_own_data import options
own.prepare(options(sys.argv[1], sys.argv[2], image_size=int(sys.argv[3]), cache_gb=float(sys.argv[4])), print)
"""


@pytest.mark.slow
def test_decoded_sets_together_stay_within_cache_gb_and_one_in_use_is_kept(tmp_path):
    varying = write_imagefolder(tmp_path / "varying", train_size=40, test_size=10, sizes=(20, 30))
    cache, budget = tmp_path / "cache", 1.5 * (40 * 23 ** 2 + 10 * 20 ** 2) / 2**30  # one set at 20 px fits, not two
    earlier = subprocess.run([sys.executable, "-c", PREPARE, str(varying), str(cache), "20", str(budget)], cwd=ROOT,
                             env=child_env(), capture_output=True, text=True, timeout=120)  # a job that has ended
    assert earlier.returncode == 0, earlier.stderr
    decoded = lambda: sorted(p.name for p in (cache / "decoded").iterdir() if not p.name.startswith("."))  # noqa: E731
    (first,) = decoded()
    now = dataset(options(varying, cache, image_size=16, cache_gb=budget))
    assert now.held.startswith("decoded") and first not in decoded() and len(decoded()) == 1
    (second,) = decoded()
    dataset(options(varying, cache, image_size=20, cache_gb=budget))
    assert second in decoded() and len(decoded()) == 2  # mapped by this process: never deleted under it


def test_the_decoded_cache_key_includes_skip_broken(small, tmp_path):
    tree = copy(small, tmp_path)
    with_skip = own.prepare(options(tree, tmp_path / "cache", skip_broken=True), lambda line: None)["decoded"]
    without = own.prepare(options(tree, tmp_path / "cache"), lambda line: None)["decoded"]
    assert with_skip != without


# ---------------------------------------------------------------- 7. the shard cache's budget

@pytest.mark.slow
def test_a_lowered_shard_cache_budget_is_checked_and_trims_the_cache(small, tmp_path, monkeypatch):
    shards = write_shards(small, tmp_path / "shards", shard_mb=0.004)
    count, largest = len(list(shards.glob("*.tar"))), max(p.stat().st_size for p in shards.glob("*.tar"))
    server = S3Server(free_port())
    server.start()
    try:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        server.client().create_bucket(Bucket="data")
        server.upload_tree("data", "s", shards)
        opts = options("s3://data/s", tmp_path / "cache", "shards", cache_gb=0.0, shard_cache_gb=1.0)
        dataset(opts)
        held = list((tmp_path / "cache").rglob("*.tar"))
        assert len(held) == count > 8
        with pytest.raises(UserError, match=r"--shard-cache-gb .* holds fewer than 8 of the largest shard") as error:
            dataset(replace(opts, shard_cache_gb=largest / 2**30))
        one_line(error)
        budget = 8 * largest
        dataset(replace(opts, shard_cache_gb=budget / 2**30))
        assert sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*.tar")) <= budget
    finally:
        server.stop()


# ---------------------------------------------------------------- 8. what the index includes and says

def test_subfolders_gifs_and_files_that_are_not_images_in_a_class_folder(small, tmp_path):
    tree = copy(small, tmp_path)
    nested = tree / "train" / "3" / "batch2"
    nested.mkdir()
    Image.new("L", (28, 28), 7).save(nested / "a.png")
    Image.new("L", (28, 28), 9).save(tree / "train" / "4" / "b.gif")
    (tree / "train" / "5" / "notes.txt").write_text("scanned 2024")
    lines: list[str] = []
    opts = options(tree, tmp_path / "cache")
    data = own.open_prepared(own.prepare(opts, lines.append), opts)
    assert len(data.train) == 42
    assert any("ignored 1 file(s)" in line and "notes.txt" in line for line in lines), lines


def test_shards_hold_every_format_pil_reads_and_a_cls_without_its_image_is_named(small, tmp_path):
    tree = copy(small, tmp_path)
    for n, path in enumerate(sorted((tree / "train").rglob("*.png"))[:3]):
        image = Image.open(path)
        image.load()
        path.unlink()
        image.save(path.with_suffix((".gif", ".bmp", ".tif")[n]))
    shards = write_shards(tree, tmp_path / "shards")
    assert len(dataset(options(shards, tmp_path / "cache", "shards")).train) == 40
    shard = handmade(shards) / "train-000000.tar"
    _tamper_shard(shard, lambda name, data: None if name.startswith("00000002.") and not name.endswith(".cls")
                  else (name, data))
    with pytest.raises(UserError, match=r"sample 00000002 has 00000002\.cls but no image member") as error:
        dataset(options(shards, tmp_path / "cache2", "shards"))
    assert str(shard) in one_line(error)


# ---------------------------------------------------------------- 9. cut shards

def test_a_shard_cut_at_a_member_boundary_is_refused(small, tmp_path):
    shard = handmade(write_shards(small, tmp_path / "shards")) / "train-000000.tar"  # no manifest's sizes to tell
    with tarfile.open(shard) as tar:
        cut = tar.getmembers()[10].offset  # the 11th member's header: a whole number of members before it
    shard.write_bytes(shard.read_bytes()[:cut])
    with pytest.raises(UserError, match=r"ends without tar's end-of-archive blocks: it was cut") as error:
        dataset(options(shard.parent, tmp_path / "cache", "shards"))
    assert str(shard) in one_line(error)


# ---------------------------------------------------------------- 10. odd values, messages and URLs

def test_a_huge_class_number_is_one_line(small, tmp_path):
    shards = handmade(write_shards(small, tmp_path / "shards"))
    _tamper_shard(shards / "train-000000.tar",
                  lambda name, data: (name, b"99999999999999999999999") if name == "00000001.cls" else (name, data))
    with pytest.raises(UserError, match=r"00000001\.cls holds '99999999999999999999', not a class index") as error:
        dataset(options(shards, tmp_path / "cache", "shards"))
    one_line(error)


def test_an_empty_val_class_folder_is_told_to_fill_or_delete_it(small, tmp_path):
    tree = copy(small, tmp_path)
    for image in (tree / "val" / "3").iterdir():
        image.unlink()
    with pytest.raises(UserError, match=r"val/3 holds no image") as error:
        dataset(options(tree, tmp_path / "cache"))
    assert "delete the empty folder" in one_line(error) and "from train" not in str(error.value)


def test_a_file_url_names_the_local_folder(small):
    cfg = parse_args(["--dataset", "imagefolder", "--data-dir", f"file://{small}"], strategy="ddp",
                     default_dataset="cifar10", world_size=1)
    assert cfg.data_dir == str(small)


# ---------------------------------------------------------------- 11. a cache on NFS

def test_temp_names_differ_between_processes_with_the_same_pid(tmp_path):
    assert staging_path(tmp_path / "x") != staging_path(tmp_path / "x")  # a random part beside host and pid
    name = staging_path(tmp_path / "x").name
    assert str(os.getpid()) in name and os.uname().nodename in name


def test_a_shard_evicted_by_another_node_is_fetched_again(small, tmp_path, monkeypatch):
    """ESTALE is what NFS gives a client whose open file another client deleted."""
    from common.data.shardcache import ShardCache

    shards = write_shards(small, tmp_path / "shards")
    versions = {p.name: f"{p.stat().st_size}-0" for p in shards.glob("*.tar")}
    cache = ShardCache("s3://unused/shards", {}, tmp_path / "cache", 2**30, versions)
    name = sorted(versions)[0]
    cache.local(name).parent.mkdir(parents=True)
    shutil.copy(shards / name, cache.local(name))  # fetched earlier: this node's copy
    expected = (shards / name).read_bytes()[512:600]
    real_open, failures = open, []

    def stale_once(path, *args, **kwargs):
        if str(path).endswith(".tar") and not failures:
            failures.append(path)
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr("builtins.open", stale_once)
    assert cache.read(name, 512, 88) == expected and failures


# ---------------------------------------------------------------- 12. files replaced with their dates

def test_verify_data_sees_a_file_replaced_with_its_size_and_date(small, tmp_path):
    tree = copy(small, tmp_path)
    target = sorted((tree / "train").rglob("*.png"))[0]
    before = dataset(options(tree, tmp_path / "cache"))
    stat = target.stat()
    pixels = np.asarray(Image.open(target)).copy()
    pixels[:] = 255 - pixels
    Image.fromarray(pixels).save(target)
    _pad_to(target, stat.st_size)
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # cp -p, rsync -a
    index = map_index(Path(own.prepare(options(tree, tmp_path / "cache"), lambda line: None)["index"]))
    position = [index.train.names[i] for i in range(len(index.train))].index(str(target.relative_to(tree)))
    stale = dataset(options(tree, tmp_path / "cache"))
    fresh = dataset(options(tree, tmp_path / "cache", verify_data=True))
    assert torch.equal(stale.train.images[position], before.train.images[position])  # the documented limit
    assert torch.equal(fresh.train.images[position].flatten(), torch.from_numpy(pixels).flatten())


# ---------------------------------------------------------------- helpers

def _pad_to(path: Path, size: int) -> None:
    """A PNG padded (or re-saved smaller) to exactly `size` bytes: PNG readers ignore bytes after IEND."""
    data = path.read_bytes()
    assert len(data) <= size, (len(data), size)
    path.write_bytes(data + b"\0" * (size - len(data)))


# ---------------------------------------------------------------- what a hostile reviewer found

HOLD = """
import sys, time
from common.data import own
from tests.test_own_data import options
real = own.index_folder
own.index_folder = lambda *args: time.sleep(8) or real(*args)  # a build that takes a while
own.prepare(options(sys.argv[1], sys.argv[2]), lambda line: print(line, flush=True))
print("prepared", flush=True)
time.sleep(float(sys.argv[3]))  # a job training on the set: it maps the index and the decoded set
"""


@pytest.mark.slow
def test_a_second_preparer_waits_for_a_live_first_ones_build_then_maps_it(small, tmp_path):
    """Before: the builder went on to hold its build lock shared for its life, and a second
    preparer waiting for that lock waited as long (two nodes sharing a cache: until
    --storage-timeout-s)."""
    run = lambda hold_s: subprocess.Popen([sys.executable, "-c", HOLD, str(small), str(tmp_path / "cache"),  # noqa: E731
                                           str(hold_s)], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)
    processes = [run(120)]
    try:
        assert processes[0].stdout.readline().startswith("indexing")  # building, for 8 s: the second arrives meanwhile
        processes.append(run(0))
        out, _ = processes[1].communicate(timeout=60)
        assert processes[1].returncode == 0 and "prepared" in out and "indexing" not in out, out
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_a_run_of_undecodable_images_costs_one_decode_each_and_counts_once(small, tmp_path, monkeypatch):
    """Before: each sample of a run of k rescanned the rest of it: k^2/2 decodes, k^2/2 counted."""
    tree = copy(small, tmp_path)
    opts = options(tree, tmp_path / "cache", skip_broken=True, cache_gb=0.0)
    names = list(dataset(opts).train.source.table.names)
    cut_png = sorted(tree.rglob("*.png"))[0].read_bytes()[:60]  # its header reads, its pixels do not
    for name in names[10:22]:  # a run of 12 in the index's order
        (tree / name).write_bytes(cut_png)
    decoded = dataset(replace(opts, cache_gb=20.0))
    assert "; 12 unreadable file(s) replaced" in decoded.held
    reader: Reader = dataset(opts).train.source
    decodes = []
    real = Reader.pixels
    monkeypatch.setattr(Reader, "pixels", lambda self, i, *rest: decodes.append(i) or real(self, i, *rest))
    batch = reader.__getitems__(list(range(len(reader))))
    assert not batch.error and len(batch.images) == 40
    assert sorted(batch.skipped) == sorted(str(tree / n) for n in names[10:22])
    assert sorted(decodes) == sorted([*range(40), *[22] * 12])  # each once; sample 22 for each of the run too


def test_a_file_name_that_is_not_utf8_is_indexed_and_read(small, tmp_path):
    tree = copy(small, tmp_path)
    source = sorted((tree / "train" / "3").iterdir())[0]
    odd = Path(os.fsdecode(bytes(source.parent) + b"/\xff\xfe" + source.suffix.encode()))
    source.rename(odd)
    data = dataset(options(tree, tmp_path / "cache", cache_gb=0.0))
    names = list(data.train.source.table.names)
    assert str(odd.relative_to(tree)) in names and len(names) == 40


def test_a_dangling_link_in_the_tree_is_one_line(small, tmp_path):
    tree = copy(small, tmp_path)
    (tree / "train" / "3" / "gone.png").symlink_to(tmp_path / "unmounted" / "x.png")
    with pytest.raises(UserError, match=r"train/3/gone.png: No such file or directory; check that --data-dir is "
                                        r"readable \(and mounted\)") as error:
        dataset(options(tree, tmp_path / "cache"))
    one_line(error)


@pytest.mark.parametrize("argv", [["--cache-gb", "inf"], ["--cache-gb", "nan"], ["--shard-cache-gb", "inf"]])
def test_cache_sizes_must_be_finite(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--dataset", "imagefolder", "--data-dir", "d", *argv], strategy="ddp", default_dataset="cifar10",
                   world_size=1)
    assert "(finite: for no bound, give more than the disk holds)" in capsys.readouterr().err


def test_a_shard_with_a_key_twice_is_one_line(small, tmp_path):
    shards = handmade(write_shards(small, tmp_path / "shards"))
    _tamper_shard(shards / "train-000000.tar",
                  lambda name, data: (name.replace("00000001.", "00000000."), data) if name.startswith("00000001.")
                  else (name, data))
    with pytest.raises(UserError, match=r"sample 00000000 has two image members") as error:
        dataset(options(shards, tmp_path / "cache", "shards"))
    one_line(error)


def test_a_32_bit_image_outside_16_bits_is_refused_not_clipped(tmp_path):
    tiff = tmp_path / "wide.tif"
    Image.fromarray(np.array([[0, 70000]], dtype=np.int32), "I").save(tiff)
    with pytest.raises(ValueError, match=r"32-bit image with values from 0 to 70000; .* read as 16-bit"):
        decode(tiff.read_bytes(), Stored(2), 1)


def test_a_cache_dir_that_is_a_file_or_read_only_says_so(small, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UserError, match=r"a part of that path is a file, not a folder") as error:
        dataset(options(small, tmp_path / "file"))
    one_line(error)
    with tmpfs(tmp_path / "ro", "1m", "ro") as disk:
        with pytest.raises(UserError, match=r"Read-only file system; pass a --cache-dir on a writable file system"):
            dataset(options(small, disk))
