"""Your own images: ImageFolder trees, WebDataset shards and Hugging Face data sets, written in the real
formats (PIL's PNG and JPEG, tarfile's shards, `datasets`' save_to_disk and parquet files), read by the
real loading code; in-process where the behaviour is the loader's, under torchrun where it is the job's."""
from __future__ import annotations

import errno
import fcntl
import io
import math
import os
import re
import shutil
import sys
import tarfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from common import hfsets
from common.data import cache, hf, own
from common.data.cache import file_lock, remove_lock, staging_path
from common.data.loader import (
    MNIST_SPEC,
    ORDER_VERSION,
    SHUFFLE_WINDOW,
    Split,
    TrainLoader,
    global_order,
    nodes_per_shard,
    rank_places,
    shared_reads_notice,
)
from common.data.reading import Reader
from common.data.shardcache import FETCH_LOCK_COUNT, STAGING, ShardCache, fetch_lock
from common.errors import UserError
from common.parallel.context import DistContext
from common.shards import MANIFEST
from common.shards import main as shards_main
from common.train.flags import parse_args
from common.train.state import order_changed
from tests.conftest import (
    SharedLaunch,
    child_env,
    equivalence,
    error_lines,
    free_port,
    latest_state,
    own_folders,
    read_scalars,
    run_script,
    shared_launch,
    stop_after,
)
from tests.datagen import write_hf, write_imagefolder, write_shards
from tests.s3server import S3Server

CPU = torch.device("cpu")
RUN = ["--model", "lenet", "--batch-size", "24", "--eval-batch-size", "16", "--lr", "0.05"]


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    """A learnable 28-px grayscale set as an ImageFolder tree (PNG and JPEG mixed), its shards
    (uneven: 37 samples each, the last shorter), the same images as a Hugging Face set in parquet
    files of the Hub's layout (two files a split, row groups of 37 rows) and as a save_to_disk
    folder (record batches of 100), and an RGB set of varying sizes."""
    root = tmp_path_factory.mktemp("sets")
    folder = write_imagefolder(root / "folder", train_size=240, test_size=61)
    return {"folder": folder, "shards": write_shards(folder, root / "shards", shard_mb=0.02),
            "hf": write_hf(folder, root / "hf"), "hf-disk": write_hf(folder, root / "hf-disk", "disk"),
            "varying": write_imagefolder(root / "varying", train_size=96, test_size=20, shape="cifar", sizes=(20, 36))}


LAYOUTS = {"imagefolder": ("folder", "imagefolder"), "shards": ("shards", "shards"), "hf parquet": ("hf", "hf"),
           "hf save_to_disk": ("hf-disk", "hf")}  # a layout -> its set in `sets` and its --dataset


def options(data_dir: Path | str, cache: Path, kind: str = "imagefolder", **changes) -> own.OwnData:
    base = own.OwnData(kind, str(data_dir), str(cache), {}, image_size=0, workers=0, prepare_workers=0,
                       skip_broken=False, cache_gb=20.0, shard_cache_gb=1.0)
    return replace(base, **changes)


def dataset(opts: own.OwnData):
    return own.open_prepared(own.prepare(opts, lambda line: None), opts)


def global_batches(data, world: int, epoch: int = 1, nodes: int = 1) -> list[torch.Tensor]:
    """Each step's global batch as the ranks of a world (on `nodes` nodes) hold it, put back in global order."""
    loaders = [TrainLoader(data.train, data.spec, 24, rank, world, seed=3, device=CPU, nodes=nodes)
               for rank in range(world)]
    steps = zip(*(loader.epoch(epoch) for loader in loaders))
    out = []
    for per_rank in steps:
        batch = torch.empty(24, *per_rank[0][0].shape[1:])
        for loader, (images, _) in zip(loaders, per_rank):
            batch[list(loader.positions)] = images
        out.append(batch)
    return out


# ---------------------------------------------------------------- the sample stream

@pytest.mark.quick
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_sample_stream_is_the_same_at_every_world_size_worker_count_and_holding(layout, sets, tmp_path):
    """Decoded into the cache or streamed by 0 or 2 workers, at world 1, 2 and 4 (and 4 as 2 nodes of 2,
    whose ranks take the places node by node): the same global batches, bit for bit (the
    augmentation too: drawn per global batch)."""
    name, kind = LAYOUTS[layout]
    source = sets[name]
    cached = dataset(options(source, tmp_path, kind))
    reference = global_batches(cached, 1)
    assert len(reference) == 240 // 24
    holdings = {"cached": (cached, (2, 4))}
    for workers, worlds in ((0, (1, 2, 4)), (2, (2, 4))):
        streamed = dataset(options(source, tmp_path, kind, cache_gb=0.0, workers=workers))
        assert streamed.held.startswith("streamed")
        holdings[f"streamed by {workers} workers"] = (streamed, worlds)
    for holding, (data, worlds) in holdings.items():
        for world, nodes in [(world, 1) for world in worlds] + [(4, 2)] * (4 in worlds):
            got = global_batches(data, world, nodes=nodes)
            assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference)), \
                (holding, world, nodes)


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["shards", "hf parquet"])
def test_a_stream_resumed_mid_epoch_is_the_rest_of_the_epoch(layout, sets, tmp_path):
    """What a run resumed at step k of an epoch reads (2 workers a rank, world 2): the batches of
    steps k.. of the epoch it was cut in, bit for bit."""
    name, kind = LAYOUTS[layout]
    streamed = dataset(options(sets[name], tmp_path, kind, cache_gb=0.0, workers=2))
    loaders = [TrainLoader(streamed.train, streamed.spec, 24, rank, 2, seed=3, device=CPU) for rank in range(2)]
    for loader in loaders:
        whole = [images for images, _ in loader.epoch(1)]
        resumed = [images for images, _ in loader.epoch(1, start_step=7)]
        assert len(resumed) == 3 and all(torch.equal(a, b) for a, b in zip(resumed, whole[7:]))


@pytest.mark.quick
def test_a_parquet_row_group_is_decompressed_once_a_node_and_a_rank_reads_only_its_rows(sets, tmp_path,
                                                                                         monkeypatch):
    """World 2 in one process (workers 0): every row group read by pyarrow once, into the node's
    row-group cache, however many ranks (and the statistics) read it; each rank reads back exactly
    the bytes of its own samples. A later epoch decompresses nothing while the cache holds the set."""
    copied, read_back = [], []
    column_batches, pread = hfsets.Files.column_batches, os.pread

    def copying(self, name, group, *rest):
        copied.append(f"{name}#{group}")
        return column_batches(self, name, group, *rest)

    def reading(fd, size, offset):
        read_back.append(size)
        return pread(fd, size, offset)

    monkeypatch.setattr(hfsets.Files, "column_batches", copying)
    monkeypatch.setattr(os, "pread", reading)
    streamed = dataset(options(sets["hf"], tmp_path, "hf", cache_gb=0.0))  # its statistics read training rows
    sizes = streamed.train.source.table.size
    for rank in range(2):
        loader = TrainLoader(streamed.train, streamed.spec, 24, rank, 2, seed=3, device=CPU)
        read_back.clear()
        assert sum(1 for _ in loader.epoch(1)) == 10
        used = torch.cat(loader.indices(1))
        assert sum(read_back) == int(sizes[used.numpy()].sum()) and len(read_back) == len(used), rank
    groups = streamed.train.source.table.names
    assert sorted(copied) == sorted(groups)  # once each, for both ranks
    copied.clear()
    assert sum(1 for _ in TrainLoader(streamed.train, streamed.spec, 24, 0, 2, seed=3, device=CPU).epoch(2)) == 10
    assert copied == []


@pytest.mark.quick
def test_at_two_nodes_each_row_group_is_decompressed_and_read_by_one_node(sets, tmp_path, monkeypatch):
    """Row groups of 10 rows (24 training groups), world 4 as 2 nodes of 2 ranks, each node with a
    cache of its own: in an epoch each node's ranks read the rows of 12 row groups and the other
    node's none, and a node decompresses no other (every node used to copy and read all 24)."""
    source = write_hf(sets["folder"], tmp_path / "hf", rows_per_group=10)
    read, copied = [set(), set()], [set(), set()]
    node = 0
    opened, column_batches = hf.RowGroupCache.opened, hfsets.Files.column_batches

    def reading(self, name):
        read[node].add(name)
        return opened(self, name)

    def copying(self, name, group, *rest):
        copied[node].add(f"{name}#{group}")
        return column_batches(self, name, group, *rest)

    monkeypatch.setattr(hf.RowGroupCache, "opened", reading)
    monkeypatch.setattr(hfsets.Files, "column_batches", copying)
    for node in range(2):
        data = dataset(options(source, tmp_path / f"node{node}", "hf", cache_gb=0.0))
        read[node].clear(), copied[node].clear()  # what the statistics took; the epoch's alone from here
        for rank in (2 * node, 2 * node + 1):
            loader = TrainLoader(data.train, data.spec, 24, rank, 4, seed=3, device=CPU, nodes=2)
            assert sum(1 for _ in loader.epoch(1)) == 10
    groups = set(data.train.source.table.names)
    assert len(groups) == 24 and read[0] | read[1] == groups, (len(groups), read)
    assert len(read[0]) == len(read[1]) == 12 and not read[0] & read[1], read
    assert copied[0] <= read[0] and copied[1] <= read[1], (copied, read)  # statistics copied some before


@pytest.mark.quick
def test_a_row_group_cache_smaller_than_the_set_stays_in_its_budget_and_streams_the_same(sets, tmp_path):
    """Row groups of 10 rows (24 for training) and --shard-cache-gb holding 8 of the largest: copies
    are evicted as the epoch goes, the folder stays within the budget (each copy's row offsets
    aside), and the global batches (world 2, 2 workers) are those of the set decoded into the cache.
    The ledger (the copies' total, kept per copy instead of listing the folder) is the folder's total,
    and no temp file is left in the staging folder."""
    source = write_hf(sets["folder"], tmp_path / "hf", rows_per_group=10)
    reference = global_batches(dataset(options(source, tmp_path / "decoded", "hf")), 1)
    largest = dataset(options(source, tmp_path / "probe", "hf", cache_gb=0.0)).train.source.cache.largest()
    budget = 8 * largest
    streamed = dataset(options(source, tmp_path / "small", "hf", cache_gb=0.0, workers=2,
                               shard_cache_gb=budget / 2**30))
    got = global_batches(streamed, 2)
    assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))
    folder = tmp_path / "small" / "rowgroups"
    copies = [p.stat().st_size for p in folder.glob("*.rows")]
    assert 0 < len(copies) < 24 and sum(copies) <= budget + len(copies) * 8 * 12, (len(copies), sum(copies), budget)
    assert int((folder / ".usage").read_text()) == sum(copies) and not list((folder / ".staging").iterdir())
    assert [p.name for p in folder.glob(".*.lock")] == [".evict.lock"], "a lock file per copy"
    assert 0 < len(list((folder / ".locks").iterdir())) <= FETCH_LOCK_COUNT  # a fixed set, not one per copy


@pytest.mark.quick
def test_a_row_group_is_copied_in_pieces_and_a_reader_holds_no_image(sets, tmp_path):
    """The copy's memory is bounded by its pieces, not the row group: a quarter of the group's bytes
    asked for gives pieces of a quarter of its rows, which together are the column; a reader
    process holds only row starts (8 bytes a row) of at most two windows' groups (2 x --shard-lanes)."""
    files = hfsets.Files(str(sets["hf"]), {})
    name = "data/train-00000-of-00002.parquet"
    whole = files.columns(name, 0, ["image"])[0]
    quarter = files.opened(name).metadata.row_group(0).total_byte_size // 4
    pieces = list(files.column_batches(name, 0, "image", quarter))
    assert len(pieces) >= 4 and max(map(len, pieces)) <= len(whole) // 4
    assert [row for piece in pieces for row in piece.to_pylist()] == whole.to_pylist()
    streamed = dataset(options(sets["hf"], tmp_path, "hf", cache_gb=0.0))
    reader = streamed.train.source
    for i in range(len(reader)):
        reader.read(i)
    assert 0 < len(reader.held) <= reader.cache.least == 2 * SHUFFLE_WINDOW
    assert all(starts.dtype == np.int64 and starts.nbytes <= 8 * 38 for starts, _ in reader.held.values())


@pytest.mark.quick
def test_a_cache_budget_below_eight_row_groups_is_one_line_with_the_ways_out_when_streamed(sets, tmp_path):
    """Refused for a streamed set only: one decoded into the cache reads its row groups once, in
    order, and trains on the same pixels with a budget below one row group (10 KB here)."""
    with pytest.raises(UserError, match=r"^--shard-cache-gb [\d.e-]+ holds fewer than 8 of the largest row group "
                                        r"\(.* MB\); pass --shard-cache-gb .* or more, or write smaller row groups"):
        dataset(options(sets["hf"], tmp_path, "hf", cache_gb=0.0, shard_cache_gb=1e-5))
    decoded = dataset(options(sets["hf"], tmp_path / "small", "hf", shard_cache_gb=1e-5))
    reference = dataset(options(sets["hf"], tmp_path / "roomy", "hf"))
    assert decoded.held.startswith("decoded") and torch.equal(decoded.train.images, reference.train.images)
    assert torch.equal(decoded.test.images, reference.test.images)
    copies = list((tmp_path / "small" / "rowgroups").glob("*.rows"))
    assert len(copies) == 1, copies  # each copy evicted by the next: a row group is above the budget


@pytest.mark.quick
def test_the_cache_budget_holds_two_windows_of_the_lanes_or_the_whole_set(sets, tmp_path):
    """--shard-lanes K: the budget must hold 2K of the largest row group, its line naming fewer lanes
    as a way out; never more than the set's row groups (a budget that holds them all is enough)."""
    groups = len(dataset(options(sets["hf"], tmp_path / "count", "hf", cache_gb=0.0)).train.source.cache.versions)
    assert 2 * 1 < groups < 2 * 16  # the set: between one window of one and two windows of 16
    with pytest.raises(UserError, match=r"holds fewer than 2 of the largest row group .* or fewer --shard-lanes "
                                        r"\(two windows of 1 are held\)"):
        dataset(options(sets["hf"], tmp_path / "one", "hf", cache_gb=0.0, shard_cache_gb=1e-7, lanes=1))
    whole = dataset(options(sets["hf"], tmp_path / "whole", "hf", cache_gb=0.0, shard_cache_gb=1.0, lanes=16))
    assert whole.train.source.cache.least == groups


@pytest.mark.quick
@pytest.mark.parametrize("damage", ["emptied", "cut short", "zeroed"])
def test_a_damaged_row_group_copy_is_made_again_never_read_as_rows(damage, sets, tmp_path):
    """A copy in the row-group cache left cut short or zeroed (a crash before its bytes reached the
    disk: the rename did), or emptied: deleted and made again, the batches those of an intact cache
    (it was an IndexError, a ValueError, or a line blaming --data-dir); the ledger stays the folder's total."""
    opts = options(sets["hf"], tmp_path, "hf", cache_gb=0.0)
    reference = global_batches(dataset(opts), 2)
    folder = tmp_path / "rowgroups"
    for copy in sorted(folder.glob("*.rows"))[:3]:
        data = copy.read_bytes()
        copy.write_bytes({"emptied": b"", "cut short": data[:len(data) // 2], "zeroed": bytes(len(data))}[damage])
    got = global_batches(dataset(opts), 2)
    assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))
    copies = list(folder.glob("*.rows"))
    for copy in copies:
        with open(copy, "rb") as opened:
            assert hf.row_starts(opened) is not None, copy
    assert int((folder / ".usage").read_text()) == sum(copy.stat().st_size for copy in copies)


@pytest.mark.quick
def test_a_row_group_cache_that_cannot_be_written_is_one_line_naming_cache_dir(sets, tmp_path, monkeypatch):
    """The row-group cache's folder is a file (as a read-only or full --cache-dir, a write that
    fails): one line naming --cache-dir and the way out, not a traceback from the lock or the
    staging folder; the same for the index's in-use mark, which every run opens for writing."""
    dataset(options(sets["hf"], tmp_path, "hf", cache_gb=0.0))
    shutil.rmtree(tmp_path / "rowgroups")
    (tmp_path / "rowgroups").write_text("")
    with pytest.raises(UserError, match=rf"^--cache-dir {re.escape(str(tmp_path))}/rowgroups: .*; a part of that "
                                        "path is a file, not a folder: pass another --cache-dir$"):
        global_batches(dataset(options(sets["hf"], tmp_path, "hf", cache_gb=0.0)), 1)
    monkeypatch.setattr(cache, "_HELD", {})  # as a new process: it marks the index in use again
    (mark,) = (tmp_path / "index").glob(".hf-*.use")
    mark.unlink()
    mark.mkdir()
    with pytest.raises(UserError, match=rf"^--cache-dir {re.escape(str(tmp_path))}/index: Is a directory; "):
        dataset(options(sets["hf"], tmp_path, "hf"))


@pytest.mark.quick
def test_a_copy_killed_mid_way_is_swept_at_the_next_start_unless_in_flight(sets, tmp_path):
    """A temp file a killed fetch left in the staging folder, for a copy no later run fetches (the
    set changed), is deleted at the next start, outside the budget as it is; one whose fetch holds
    its lock (in flight in another process) is left to it."""
    opts = options(sets["hf"], tmp_path, "hf", cache_gb=0.0)
    dataset(opts)
    staging = tmp_path / "rowgroups" / ".staging"
    killed = staging / ".gone.parquet#0.abc.rows.tmp-host-1-ab"
    in_flight = staging / ".busy.parquet#0.abc.rows.tmp-host-2-cd"
    killed.write_bytes(b"x" * 100)
    in_flight.write_bytes(b"y" * 100)
    legacy_lock = tmp_path / "rowgroups" / ".evicted.parquet#0.abc.rows.lock"  # an older version's, one per copy
    legacy_lock.touch()
    with file_lock(fetch_lock(tmp_path / "rowgroups", "busy.parquet#0.abc.rows")):
        dataset(opts)
    assert not killed.exists() and in_flight.exists()
    assert not legacy_lock.exists() and (tmp_path / "rowgroups" / ".evict.lock").exists()


@pytest.mark.quick
def test_a_fetch_in_flight_keeps_its_temp_file_whatever_its_copy_is_named(tmp_path):
    """A copy whose name holds ".tmp-" (a shard or parquet file so named): its fetch's temp file is
    its own (.NAME.tmp-HOST-PID-RANDOM), left to the fetch that holds the copy's lock by another
    process's start-up sweep."""
    cache = ShardCache("s3://unused/shards", {}, tmp_path, 2**30, {"day.tmp-1.tar": "10-x"})
    target = cache.local("day.tmp-1.tar")
    (tmp_path / STAGING).mkdir()
    (tmp_path / ".locks").mkdir()
    with file_lock(cache.fetch_lock(target.name)):  # the fetch in flight
        part = staging_path(tmp_path / STAGING / target.name)
        part.write_bytes(b"partial")
        ShardCache("s3://unused/shards", {}, tmp_path, 2**30, {}).evict()  # another process starts
        assert part.exists()


def _opened(path: Path) -> int:
    """How many of this process's file descriptors are open on `path`."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            pass
    return count


def test_a_lock_file_removed_while_waited_on_is_locked_again_as_newly_made(tmp_path):
    """A lock file deleted by its holder (remove_lock, a failed download's clean-up): a process
    already waiting on the deleted file must not take it while another process holds the lock file
    now at that path (both would do the work, e.g. each sweeping the other's temp files)."""
    lock, entered = tmp_path / ".copy.rows.lock", threading.Event()
    with open(lock, "a") as old:
        fcntl.flock(old, fcntl.LOCK_EX)

        def waiter() -> None:
            with file_lock(lock):
                entered.set()
        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while _opened(lock) < 2:
            assert time.monotonic() < deadline, "the waiter never opened the lock file"
            time.sleep(0.01)  # a poll with a deadline: the waiter's open is what is waited for
        lock.unlink()
        with open(lock, "a") as successor:
            fcntl.flock(successor, fcntl.LOCK_EX)
            fcntl.flock(old, fcntl.LOCK_UN)  # the deleted file free: the waiter must see it is not the lock now
            assert not entered.wait(1.0), "the waiter took a deleted lock file while its successor was held"
            fcntl.flock(successor, fcntl.LOCK_UN)
            assert entered.wait(10), "the waiter never took the lock file once it was free"
    thread.join(10)  # entered is set while the waiter still holds the lock: removed once it lets go
    assert not thread.is_alive(), "the waiter never let go of the lock file"
    remove_lock(lock)
    assert not lock.exists()


@pytest.mark.quick
def test_fetch_locks_are_removed_where_an_exclusive_flock_needs_a_file_open_for_writing(tmp_path, monkeypatch):
    """On NFS, flock is a byte-range lock and an exclusive one is refused (EBADF) on a file open only
    for reading (flock(2), NOTES): the start's removal of an older version's fetch locks (one per copy)
    must not end the run."""
    real = fcntl.flock

    def nfs_flock(handle, operation: int) -> None:
        fd = handle if isinstance(handle, int) else handle.fileno()
        if operation & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        real(handle, operation)
    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    folder = tmp_path / "shards"
    folder.mkdir()
    for name in ("old.aaa.tar", "new.bbb.tar"):
        (folder / name).write_bytes(b"x" * 10)
        (folder / f".{name}.lock").touch()
    orphan = folder / ".gone.ccc.tar.lock"  # its copy deleted by an earlier run
    orphan.touch()
    os.utime(folder / "old.aaa.tar", (0, 0))  # the least recently used: evicted
    ShardCache("s3://unused/shards", {}, folder, 15, {}).evict()
    assert sorted(p.name for p in folder.iterdir()) == [".evict.lock", ".usage", "new.bbb.tar"]


@pytest.mark.quick
def test_the_same_rows_under_two_names_are_one_line_naming_both(sets, tmp_path, capsys):
    """A parquet file copied under another name (here train-copy.parquet: a name of the train
    split) would train its rows twice an epoch: refused by --dataset hf and by the converter, which
    calls its source SRC."""
    source = Path(shutil.copytree(sets["hf"], tmp_path / "copy"))
    shutil.copy(source / "data" / "train-00001-of-00002.parquet", source / "data" / "train-copy.parquet")
    both = rf"{source}/data/train-00001-of-00002.parquet and {source}/data/train-copy.parquet hold the same rows"
    with pytest.raises(UserError, match=f"^{re.escape(both)}.*remove one of them$") as error:
        dataset(options(source, tmp_path / "cache", "hf"))
    assert "\n" not in str(error.value)
    with pytest.raises(SystemExit) as exit:
        shards_main([str(source), str(tmp_path / "shards")])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and both in err, err
    with pytest.raises(SystemExit):
        shards_main([str(tmp_path / "nowhere"), str(tmp_path / "shards")])
    err = capsys.readouterr().err
    assert f"SRC {tmp_path / 'nowhere'} is not a folder" in err and "--data-dir" not in err, err


@pytest.mark.quick
def test_an_epoch_takes_each_sample_once_and_equal_steps_on_uneven_shards(sets, tmp_path):
    data = dataset(options(sets["shards"], tmp_path, "shards"))
    sizes = torch.bincount(data.train.groups).tolist()
    assert len(set(sizes)) > 1, sizes  # uneven shards
    order = global_order(len(data.train), 5, 2, data.train.groups)
    assert sorted(order.tolist()) == list(range(len(data.train)))
    one_last = torch.arange(9).repeat_interleave(torch.tensor([10] * 8 + [1]))  # in some epochs a window of 1 sample
    for epoch in range(40):
        assert sorted(global_order(len(one_last), 0, epoch, one_last).tolist()) == list(range(81)), epoch
    loaders = [TrainLoader(data.train, data.spec, 24, rank, 4, 5, CPU) for rank in range(4)]
    assert len({sum(1 for _ in loader.epoch(2)) for loader in loaders}) == 1


def shards_each_node_reads(groups: torch.Tensor, world: int, nodes: int, batch: int = 24,
                           lanes: int = SHUFFLE_WINDOW) -> list[set[int]]:
    """The shards (row groups) each node's ranks read in an epoch: those of the samples at their places."""
    split = Split(torch.zeros(len(groups), 1, 1, 1, dtype=torch.uint8), torch.zeros(len(groups), dtype=torch.int64),
                  groups)
    read: list[set[int]] = [set() for _ in range(nodes)]
    for rank in range(world):
        loader = TrainLoader(split, MNIST_SPEC, batch, rank, world, seed=5, device=CPU, nodes=nodes, lanes=lanes)
        read[rank // (world // nodes)] |= set(groups[torch.cat(loader.indices(2))].tolist())
    return read


@pytest.mark.quick
def test_each_node_reads_only_the_shards_of_its_places_lanes():
    """16 shards of 12 samples, global batch 24: where the node count divides the window of 4 shards,
    the nodes read disjoint shards that together are the set (at 2 nodes of 2 ranks: 8 each, where
    every node used to read all 16); at 8 nodes each shard is read by 2. Shards of unequal sizes
    lend samples between lanes: only a window's lending shards (at most 3) are read by two nodes."""
    equal = torch.arange(16).repeat_interleave(12)
    for world, nodes in ((4, 2), (4, 4), (8, 2), (8, 4)):
        read = shards_each_node_reads(equal, world, nodes)
        assert sum(len(r) for r in read) == 16 and set().union(*read) == set(range(16)), (world, nodes, read)
    assert [len(r) for r in shards_each_node_reads(equal, 8, 8)] == [4] * 8  # 32 reads of 16 shards
    assert [len(r) for r in shards_each_node_reads(equal, 6, 3)] == [16] * 3  # 3 nodes a shard: gcd(3, 4) = 1
    uneven = torch.arange(16).repeat_interleave(torch.tensor([12] * 15 + [5]))
    read = shards_each_node_reads(uneven, 4, 2)
    assert len(read[0] & read[1]) <= SHUFFLE_WINDOW - 1 and len(read[0] | read[1]) >= 15, read


@pytest.mark.quick
def test_shard_lanes_that_the_nodes_divide_give_each_node_its_own_shards_at_3_5_and_6_nodes():
    """Where 4 lanes read each shard on every node of 3 (and 5, 6: gcd 1, 1, 2), K lanes a multiple of
    the node count that divides the global batch give each node its own: disjoint, together the set
    (60 shards of 10, a multiple of every K here: equal shards in full windows lend none). The run says
    which K would."""
    equal = torch.arange(60).repeat_interleave(10)
    for world, nodes, batch, lanes in ((6, 3, 24, 6), (6, 3, 24, 12), (5, 5, 40, 5), (6, 6, 24, 6), (12, 6, 48, 12)):
        assert nodes_per_shard(nodes, SHUFFLE_WINDOW, batch) > 1 and nodes_per_shard(nodes, lanes, batch) == 1
        before = shards_each_node_reads(equal, world, nodes, batch)
        assert sum(len(r) for r in before) >= 2 * 60, (world, nodes, before)  # each shard read by 2 or more nodes
        read = shards_each_node_reads(equal, world, nodes, batch, lanes)
        assert sum(len(r) for r in read) == 60 and set().union(*read) == set(range(60)), (world, nodes, lanes, read)
    assert shared_reads_notice(3, SHUFFLE_WINDOW, 24) == (
        "each shard (row group) is read by 3 of the 3 nodes (--shard-lanes 4): --shard-lanes 6 (a multiple of the "
        "node count that divides the global batch 24) would have each node read only its own, each batch mixing 6 "
        "of them; it changes the sample order, and a checkpoint cut mid-epoch resumes only with the lanes it was "
        "written with")
    assert "--shard-lanes 8 (" in shared_reads_notice(8, SHUFFLE_WINDOW, 64)  # 2 readers at 8 nodes of 4 lanes
    assert "--shard-lanes 3 (" in shared_reads_notice(3, SHUFFLE_WINDOW, 3)  # only the node count fits
    assert shared_reads_notice(2, SHUFFLE_WINDOW, 24) == shared_reads_notice(3, 6, 24) == ""
    assert nodes_per_shard(2, 4, 26) == 2  # lanes that do not divide the batch move with each step: every node


@pytest.mark.quick
@pytest.mark.parametrize("hosts, dealt", [("aabb", 2), ("aaabbbccc", 3), ("abab", 1), ("aaab", 1), ("aaaa", 1)])
def test_the_places_are_dealt_by_host_only_where_hosts_hold_equal_blocks_of_ranks(hosts, dealt):
    """Hosts of equal, contiguous blocks of ranks (torchrun's numbering) deal the places host by host;
    any other layout (nodes of different sizes) as one node: every layout one partition of the batch."""
    world = len(hosts)
    peers = tuple((host, pid) for pid, host in enumerate(hosts))
    ctx = DistContext(0, world, 0, 1, CPU, "gloo", peers=peers)
    assert ctx.hosts == dealt
    for batch in (36, 72):  # a rank's share odd (9 at 4 ranks) and even
        places = sorted(p for rank in range(world) for p in rank_places(rank, world, ctx.hosts, batch))
        assert places == list(range(batch)), batch


@pytest.mark.quick
def test_a_checkpoint_cut_mid_epoch_under_the_older_order_of_shards_is_refused_with_the_ways_out():
    """Written before the lanes (no order recorded), mid-epoch, on shards or row groups: its epoch
    would go on with other samples; at an epoch's end, or on a set without shards, it resumes."""
    older = {"epoch": 1, "step_in_epoch": 7}
    said = order_changed(older, grouped=True)
    assert "step 7 of epoch 2" in said and "--resume PATH" in said and "the version that wrote it" in said, said
    assert order_changed(older, grouped=False) == ""  # DistributedSampler's permutation is as it was
    assert order_changed({**older, "step_in_epoch": 0}, grouped=True) == ""
    assert order_changed({**older, "order": ORDER_VERSION}, grouped=True) == ""


@pytest.mark.quick
def test_a_checkpoint_cut_mid_epoch_under_other_shard_lanes_is_refused_with_the_ways_out():
    """Another --shard-lanes deals the shards otherwise: mid-epoch, refused naming the lanes that
    finish it; at an epoch's end, or without shards, the new lanes take over. A checkpoint that
    records no lanes was written with the default."""
    cut = {"epoch": 0, "step_in_epoch": 5, "order": ORDER_VERSION, "lanes": 6}
    said = order_changed(cut, grouped=True, lanes=SHUFFLE_WINDOW)
    assert said.startswith("was written at step 5 of epoch 1 with --shard-lanes 6: --shard-lanes 4 deals") and \
        "pass --shard-lanes 6 to finish the epoch" in said and "--resume PATH" in said, said
    assert order_changed(cut, grouped=True, lanes=6) == ""
    assert order_changed({**cut, "step_in_epoch": 0}, grouped=True, lanes=12) == ""
    assert order_changed(cut, grouped=False, lanes=12) == ""
    assert order_changed({**cut, "step_in_epoch": 10}, grouped=True, lanes=4, epoch_steps=10) == ""  # stopped in
    assert order_changed(cut, grouped=True, lanes=4, epoch_steps=10) != ""  # its evaluation: no step left, not 5
    unrecorded = {"epoch": 0, "step_in_epoch": 5, "order": ORDER_VERSION}
    assert order_changed(unrecorded, grouped=True) == "" and "--shard-lanes 4 to finish" in order_changed(
        unrecorded, grouped=True, lanes=8)


@pytest.mark.quick
def test_normalization_is_measured_on_the_set(sets, tmp_path):
    data = dataset(options(sets["folder"], tmp_path))
    pixels = data.train.images.double() / 255
    assert data.spec.channels == 1 and data.spec.size == 28 and data.spec.augment == "none"
    assert abs(data.spec.mean[0] - pixels.mean().item()) < 0.01
    assert abs(data.spec.std[0] - pixels.std().item()) < 0.01


@pytest.mark.quick
def test_varying_sizes_need_image_size_and_then_train_as_the_reference_recipe(sets, tmp_path):
    with pytest.raises(UserError, match="differ in size.*--image-size"):
        own.prepare(options(sets["varying"], tmp_path), lambda line: None)
    data = dataset(options(sets["varying"], tmp_path, image_size=24))
    assert (data.spec.channels, data.spec.size, data.spec.augment) == (3, 24, "resized-crop-flip")
    assert data.test.images.shape[1:] == (3, 24, 24)  # evaluation: the centre crops, decoded once
    store = data.train.source.store  # training: each image whole (the set's are small: within the bound)
    assert [tuple(store.image(i).shape[1:]) for i in range(3)] == [store.original(i) for i in range(3)]
    images, _ = next(TrainLoader(data.train, data.spec, 24, 0, 1, 0, CPU).epoch(0))
    assert images.shape == (24, 3, 24, 24) and torch.isfinite(images).all()


# ---------------------------------------------------------------- bad input: one line naming the file

def _truncate(path: Path) -> None:
    """A PNG cut after its header: the header reads, the pixels do not decode."""
    path.write_bytes(path.read_bytes()[:60])


def _first(folder: Path, split: str, ext: str) -> Path:
    return sorted((folder / split).rglob(f"*.{ext}"))[0]


def handmade(shards: Path) -> Path:
    """The converter's shards as another tool leaves them: no manifest, named train-000000.tar..."""
    (shards / MANIFEST).unlink()
    for split in ("train", "val"):
        for n, shard in enumerate(sorted(shards.glob(f"{split}-*.tar"))):
            shard.rename(shards / f"{split}-{n:06d}.tar")
    return shards


def _tamper_shard(shard: Path, change) -> None:
    """Rewrite a shard with change(name, data) -> (name, data) or None per member."""
    with tarfile.open(shard) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    with tarfile.open(shard, "w") as tar:
        for name, data in filter(None, (change(n, d) for n, d in members)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


FOLDER_DAMAGE = {
    "not an image": (lambda f: _first(f, "train", "png").write_bytes(b"<html>not found</html>"),
                     r"\.png is not a readable image .*--skip-broken"),
    "truncated image": (lambda f: _truncate(_first(f, "val", "png")), r"\.png is not a readable image"),
    "empty class folder": (lambda f: [p.unlink() for p in (f / "val" / "3").iterdir()], r"val/3 holds no image"),
    "val class train lacks": (lambda f: (f / "val" / "extra").mkdir(), r"val/extra is a class that .*train lacks"),
    "no train folder": (lambda f: (f / "train").rename(f / "training"), r"has no train/ folder"),
    "no val folder": (lambda f: (f / "val").rename(f / "validation"), r"has no val/ folder"),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", FOLDER_DAMAGE)
def test_a_damaged_image_folder_is_one_line_naming_the_file(case, sets, tmp_path):
    folder = Path(shutil.copytree(sets["folder"], tmp_path / "copy"))
    damage, message = FOLDER_DAMAGE[case]
    damage(folder)
    with pytest.raises(UserError, match=message) as error:
        dataset(options(folder, tmp_path / "cache"))
    assert "\n" not in str(error.value)


SHARD_DAMAGE = {
    "image without .cls": (lambda n, d: None if n == "00000001.cls" else (n, d),
                           r"00000001 has .* but no 00000001\.cls"),
    ".cls out of range": (lambda n, d: (n, b"10") if n.endswith(".cls") and n.startswith("00000002") else (n, d),
                          r"has class 10, outside the 10 classes"),
    ".cls not a number": (lambda n, d: (n, b"cat") if n == "00000003.cls" else (n, d),
                          r"holds 'cat', not a class index"),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", SHARD_DAMAGE)
def test_a_damaged_shard_is_one_line_naming_the_shard_and_sample(case, sets, tmp_path):
    shards = handmade(Path(shutil.copytree(sets["shards"], tmp_path / "copy")))
    change, message = SHARD_DAMAGE[case]
    target = shards / "val-000000.tar" if case == ".cls out of range" else shards / "train-000000.tar"
    _tamper_shard(target, change)
    with pytest.raises(UserError, match=message) as error:
        dataset(options(shards, tmp_path / "cache", "shards"))
    assert target.name in str(error.value) and "\n" not in str(error.value)


@pytest.mark.quick
def test_skip_broken_trains_without_the_files_and_names_them(sets, tmp_path):
    folder = Path(shutil.copytree(sets["folder"], tmp_path / "copy"))
    garbage, truncated = _first(folder, "train", "jpg"), _first(folder, "train", "png")
    garbage.write_bytes(b"\x00" * 100)
    _truncate(truncated)
    lines: list[str] = []
    opts = options(folder, tmp_path / "cache", skip_broken=True)
    data = own.open_prepared(own.prepare(opts, lines.append), opts)
    assert any(str(garbage) in line and "skipped 1" in line for line in lines), lines  # header unreadable
    assert len(data.train) == 239
    assert str(truncated) in data.held and "1 unreadable" in data.held  # decoded: replaced by its next sample
    streamed = dataset(replace(opts, cache_gb=0.0))
    reader: Reader = streamed.train.source
    position = list(reader.table.names).index(str(truncated.relative_to(folder)))
    batch = reader.__getitems__([position])
    assert not batch.error and batch.skipped == [str(truncated)]
    assert torch.equal(batch.images[0], reader[position + 1][0])


@pytest.mark.quick
def test_skip_broken_never_leaves_a_class_without_a_training_image(sets, tmp_path):
    """A class folder whose every image is unreadable: --skip-broken refuses the set in one line naming
    the class and its files, where it would otherwise train a model that cannot learn that class."""
    folder = Path(shutil.copytree(sets["folder"], tmp_path / "copy"))
    lost = folder / "train" / "3"
    for image in lost.iterdir():
        image.write_bytes(b"\x00" * 100)
    with pytest.raises(UserError, match=r"--skip-broken left class\(es\) 3 without a readable training image") as e:
        dataset(options(folder, tmp_path / "cache", skip_broken=True))
    assert str(e.value).count(f"{lost}{os.sep}") == 5  # the first five of its unreadable files, by path


# ---------------------------------------------------------------- Hugging Face data sets

@pytest.mark.quick
@pytest.mark.parametrize("layout", ["hf parquet", "hf save_to_disk"])
def test_a_hugging_face_set_holds_the_images_of_its_tree_with_the_classlabel_names(layout, sets, tmp_path):
    """The same images as the ImageFolder tree: the validation split row for row (it keeps the tree's
    order), the training split as the same multiset (shuffled when written); the ClassLabel's names."""
    tree = dataset(options(sets["folder"], tmp_path))
    name, kind = LAYOUTS[layout]
    data = dataset(options(sets[name], tmp_path, kind))
    assert data.names() == tree.names() and data.spec == tree.spec
    assert torch.equal(data.test.images, tree.test.images) and torch.equal(data.test.labels, tree.test.labels)
    flat = lambda split: sorted(zip(split.labels.tolist(), split.images.flatten(1).tolist()))  # noqa: E731
    assert flat(data.train) == flat(tree.train)


def _hub_cache(source: Path, cache: Path, name: str) -> None:
    """`source` as huggingface_hub leaves a data set's download in its cache: refs/main naming a
    snapshot folder that holds the repository's files."""
    repo = cache / f"datasets--{name.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(source, repo / "snapshots" / ("0" * 40))


@pytest.mark.quick
def test_a_hub_name_is_read_from_the_local_cache_only(sets, tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _hub_cache(sets["hf"], tmp_path / "hub", "someone/digits")
    data = dataset(options("someone/digits", tmp_path / "cache", "hf"))
    assert len(data.train) == 240 and len(data.test) == 61
    with pytest.raises(UserError, match=r"no snapshot of the Hub data set someone/other .*hf download") as error:
        dataset(options("someone/other", tmp_path / "cache", "hf"))
    assert "\n" not in str(error.value)


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["hf parquet", "hf save_to_disk"])
def test_the_converter_takes_a_hugging_face_set(layout, sets, tmp_path, capsys):
    """python -m common.shards HF_SOURCE DEST: shards of the same images and class names, each row's
    bytes verbatim (PNG and JPEG members)."""
    name, kind = LAYOUTS[layout]
    assert shards_main([str(sets[name]), str(tmp_path / "shards")]) == 0
    assert "wrote train 240 samples" in capsys.readouterr().out
    members = {n.rsplit(".", 1)[1] for shard in (tmp_path / "shards").glob("train-*.tar")
               for n in tarfile.open(shard).getnames()}
    assert members == {"png", "jpg", "cls"}
    hf, shards = dataset(options(sets[name], tmp_path, kind)), dataset(options(tmp_path / "shards", tmp_path, "shards"))
    assert shards.names() == hf.names() and torch.equal(shards.test.images, hf.test.images)


@pytest.mark.quick
def test_without_pyarrow_the_hugging_face_layout_is_one_line_naming_the_install(sets, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an import finds when the package is not installed
    with pytest.raises(UserError, match=r"--dataset hf needs pyarrow, .*pip install -r requirements-hf\.txt$"):
        dataset(options(sets["hf"], tmp_path, "hf"))


def _rewrite_parquet(path: Path, change) -> None:
    """The parquet file rewritten with change(rows) applied to its rows (dicts), its schema (and so
    its ClassLabel metadata) and row groups of 37 kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pq.read_table(path)
    rows = table.to_pylist()
    change(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path, row_group_size=37)


def _set_row(index: int, column: str, value) -> Callable:
    def change(rows: list[dict]) -> None:
        if column == "image":
            rows[index]["image"] = {**rows[index]["image"], "bytes": value}
        else:
            rows[index][column] = value
    return change


def _sorted_by_class(data: Path) -> None:
    """The training split as one file whose rows are sorted by class."""
    (data / "train-00001-of-00002.parquet").unlink()
    _rewrite_parquet(data / "train-00000-of-00002.parquet", lambda rows: rows.sort(key=lambda row: row["label"]))


def _cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


HF_DAMAGE = {  # case -> (its damage to the data/ folder, the flags, the line)
    "a missing image column": (lambda data: None, {"image_key": "img"},
                               r"has no column 'img' \(--hf-image-key\); its columns: image, label"),
    "a label out of range": (lambda data: _rewrite_parquet(data / "validation-00000-of-00002.parquet",
                                                           _set_row(3, "label", 10)), {},
                             r"validation-00000-of-00002\.parquet:row 3 has label 10 .*outside the 10 classes"),
    "an image that does not decode": (lambda data: _rewrite_parquet(data / "train-00001-of-00002.parquet",
                                                                    _set_row(5, "image", b"<html>")), {},
                                      r"train-00001-of-00002\.parquet:row 5 is not a readable image .*--skip-broken"),
    "an image given by its path, not its bytes": (
        lambda data: _rewrite_parquet(data / "train-00001-of-00002.parquet", _set_row(40, "image", None)), {},
        r"train-00001-of-00002\.parquet:row 40 holds the path '\d+\.(png|jpg)' of an image, not its bytes .*"
        r"save_to_disk.*embed_table_storage"),
    "a parquet file cut short": (lambda data: _cut_short(data / "train-00000-of-00002.parquet"), {},
                                 r"train-00000-of-00002\.parquet is not a readable parquet file .*copy it again"),
    "training rows sorted by class": (_sorted_by_class, {}, r"training rows of .* are sorted by class.*ds\.shuffle"),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", HF_DAMAGE)
def test_a_damaged_hugging_face_set_is_one_line_naming_the_file_and_row(case, sets, tmp_path):
    source = Path(shutil.copytree(sets["hf"], tmp_path / "copy"))
    damage, flags, message = HF_DAMAGE[case]
    damage(source / "data")
    with pytest.raises(UserError, match=message) as error:
        dataset(options(source, tmp_path / "cache", "hf", **flags))
    assert "\n" not in str(error.value)


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["hf parquet", "imagefolder"])
def test_the_content_a_checkpoint_records_changes_with_the_samples_not_the_dates(layout, sets, tmp_path):
    """A copy whose files are all newer (cp without -p) is the same content: a run resumes on it;
    rows in another order, or an image moved to another class, is other content: a run is not
    resumed on it (tests/test_resume.py)."""
    name, kind = LAYOUTS[layout]
    source = Path(shutil.copytree(sets[name], tmp_path / "copy"))
    before = dataset(options(source, tmp_path / "cache", kind)).content
    for path in source.rglob("*.*"):
        path.touch()
    assert dataset(options(source, tmp_path / "cache", kind)).content == before != ""
    if kind == "hf":
        _rewrite_parquet(source / "data" / "train-00001-of-00002.parquet", lambda rows: rows.reverse())
    else:
        first = _first(source, "train", "png")
        first.rename(sorted((source / "train").iterdir())[-1] / f"moved-{first.name}")
    assert dataset(options(source, tmp_path / "cache", kind)).content != before


@pytest.mark.quick
def test_a_file_this_user_may_not_read_is_one_line_saying_so(sets, tmp_path, monkeypatch):
    """Not 'a partial copy: copy it again' (the tests run as root, whom chmod does not stop: the
    denial is pyarrow's, as an unprivileged user meets it)."""
    import pyarrow.parquet as pq

    def denied(path, **_):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(pq, "ParquetFile", denied)
    with pytest.raises(UserError, match=r"train-00000-of-00002\.parquet is not readable by this user \(permission "
                                        r"denied\); make it readable") as error:
        dataset(options(sets["hf"], tmp_path, "hf"))
    assert "\n" not in str(error.value)


@pytest.mark.quick
def test_the_converter_names_a_damaged_row_as_training_does(sets, tmp_path, capsys):
    """python -m common.shards: the same line as --dataset hf, the row numbered in its file."""
    source = Path(shutil.copytree(sets["hf"], tmp_path / "copy"))
    damage, _, message = HF_DAMAGE["an image given by its path, not its bytes"]
    damage(source / "data")
    with pytest.raises(SystemExit) as exit:
        shards_main([str(source), str(tmp_path / "shards")])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and re.search(message, err), err


# ---------------------------------------------------------------- whole jobs

def train(data: Path | str, tmp_path: Path, *flags: str, nproc: int | None = 2,
          script: tuple[str, ...] = ("train_ddp.py",), torchrun: tuple[str, ...] = (),
          env: dict[str, str] | None = None, name: str = "run"):
    return run_script(train_args(data, tmp_path, *flags, script=script, name=name), nproc=nproc, torchrun=torchrun,
                      env=env, timeout=300)


def train_args(data: Path | str, tmp_path: Path, *flags: str, script: tuple[str, ...] = ("train_ddp.py",),
               name: str = "run") -> list[str]:
    return [*script, "--data-dir", str(data), "--cache-dir", str(tmp_path / "cache"), *RUN,
            "--checkpoint-dir", str(tmp_path / name), "--log-dir", str(tmp_path / f"tb-{name}"), *flags]


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


STREAMED = ("shards", "hf")  # the layouts whose streamed runs are cut: each its set in `sets` and its --dataset
EQUIVALENCE_ROWS = {"shards": ("shards", ["--cache-gb", "0", "--workers", "2"]),  # row: (its set, its flags)
                    "hf": ("hf", ["--cache-gb", "0", "--workers", "2", "--shard-lanes", "3"]),
                    "varying": ("imagefolder", ["--image-size", "20"])}


def stream(kind: str) -> list[str]:
    return ["--dataset", kind, "--cache-gb", "0", "--workers", "2", "--save-every-steps", "3"]


def learning(sets: dict[str, Path], folder: Path) -> list[str]:
    """An image folder trained 4 epochs, decoded into `folder`'s cache."""
    return train_args(sets["folder"], folder, "--dataset", "imagefolder", "--epochs", "4", "--model", "convnet",
                      "--lr", "0.03")


def cut_by(fault: str, layout: str, sets: dict[str, Path], folder: Path) -> list[str]:
    """The streamed run of `layout`, 2 epochs of 10 steps, with `fault` at step 13."""
    return train_args(sets[layout], folder, *stream(layout), "--epochs", "2",
                      script=("tests/faults.py", "ddp", fault, "13"))


def with_a_broken_image(sets: dict[str, Path], folder: Path) -> Path:
    """A copy of the image folder whose first training PNG's header reads and whose pixels do not."""
    copy = Path(shutil.copytree(sets["folder"], folder / "copy"))
    _truncate(_first(copy, "train", "png"))
    return copy


@pytest.fixture(scope="module")
def shared(sets, tmp_path_factory) -> tuple[SharedLaunch, Path]:
    """The runs at world 2 that need no process of their own, one launch (tests/runs.py), each in a
    folder of its own under the returned one: the EQUIVALENCE_ROWS (equivalence-NAME), each STREAMED
    layout's 2 uninterrupted epochs (uninterrupted/NAME), the image folder's 4 epochs (learning/), the
    shards' SIGTERM cut and its resume in the processes that stopped (sigterm/; --then-after-stop),
    and last the run that fails (broken/: a broken image met while streaming)."""
    folder = tmp_path_factory.mktemp("shared")
    runs = {f"equivalence-{name}": ["train_ddp.py", "--dataset", kind, "--data-dir", str(sets[name]), "--cache-dir",
                                    str(folder / "equivalence-cache"), *RUN, "--check-equivalence", "3", *flags,
                                    *own_folders(folder, f"equivalence-{name}")]
            for name, (kind, flags) in EQUIVALENCE_ROWS.items()}
    runs.update({f"uninterrupted-{kind}": train_args(sets[kind], folder / "uninterrupted", *stream(kind), "--epochs",
                                                     "2", name=kind) for kind in STREAMED})
    runs["learning"] = learning(sets, folder / "learning")
    runs["sigterm"] = cut_by("sigterm", "shards", sets, folder / "sigterm")
    runs["sigterm-resumed"] = train_args(sets["shards"], folder / "sigterm", *stream("shards"), "--epochs", "2")
    runs["broken"] = train_args(with_a_broken_image(sets, folder / "broken"), folder / "broken", "--dataset",
                                "imagefolder", "--cache-gb", "0", "--workers", "1", "--epochs", "1")
    return shared_launch(runs, 2, stopping=["sigterm"], timeout=500), folder


def test_an_image_folder_learns_evaluates_exactly_and_is_decoded_once(shared, sets):
    """The 4 epochs are `shared`'s run; the run beside it, in a process of its own, finds the node's
    decoded cache on disk (a run of the same launch could have found it in its process)."""
    launch, folder = shared
    first = launch["learning"]
    ok(first)
    assert "decoded 240 train images" in first.stdout + first.stderr
    assert "decoded once into the node's cache" in first.stdout and "(61 images)" in first.stdout
    acc = read_scalars(folder / "learning" / "tb-run")[1]["test/acc"][-1][1]
    assert acc > 0.5, first.stdout[-2000:]  # chance: 0.1
    again = train(sets["folder"], folder / "learning", "--dataset", "imagefolder", "--epochs", "1", "--resume", "none",
                  name="again")
    ok(again)
    assert "decoded" not in again.stderr and "indexing" not in again.stderr  # the node's cache, reused


def test_check_equivalence_holds_on_own_images(shared):
    """Covers (`shared`'s runs): streamed shards and a streamed Hugging Face parquet set with 2 workers
    per rank (its row groups dealt into 3 lanes: the one-process reference deals them so too); varying
    sizes with random-resized crops drawn per global batch. Each equals one process within the tolerance."""
    launch, _ = shared
    for name in EQUIVALENCE_ROWS:
        run = launch[f"equivalence-{name}"]
        ok(run)
        verdict = equivalence(run.stdout, 2)
        print(f"\n{name}: max |dw| = {verdict.max_dw:.3g} after {verdict.steps} steps")
        assert verdict.max_dw <= verdict.tolerance and verdict.steps == 3


@pytest.fixture(scope="module")
def uninterrupted(shared) -> dict:
    """Each streamed layout's weights after 2 uninterrupted epochs (`shared`'s runs)."""
    launch, folder = shared
    for kind in STREAMED:
        ok(launch[f"uninterrupted-{kind}"])
    return {name: latest_state(folder / "uninterrupted" / name)["model"] for name in STREAMED}


@pytest.mark.parametrize("fault, layout", [("sigkill", "hf"), ("sigterm", "shards")])
def test_a_streamed_run_cut_mid_epoch_resumes_to_the_same_weights(fault, layout, uninterrupted, shared, sets,
                                                                  tmp_path):
    """10 steps per epoch; the fault at step 13: SIGKILL restarts from step 12's checkpoint (a Hugging
    Face parquet set), SIGTERM stops after step 15's save (epoch 2, step 5; shards); both continue
    mid-epoch with 2 workers per rank. The SIGKILL row is a launch of its own: torchrun restarts the
    SIGKILLed rank's group in fresh processes; the SIGTERM's cut and resume are runs of `shared`'s
    launch, the resume in the processes that stopped (tests/runs.py, --then-after-stop), the
    fresh-process resume being the SIGKILL row's."""
    if fault == "sigterm":
        launch, folder = shared
        stop, resumed = launch["sigterm"], launch["sigterm-resumed"]
        assert stop.returncode != 0 and f"stopped by SIGTERM after step {stop_after(13, 10, 3)} " in stop.stderr, \
            stop.stderr[-2000:]
        ok(resumed)
        assert "epoch 2, step 5" in resumed.stdout
        state = latest_state(folder / "sigterm" / "run")
    else:
        restarted = run_script(cut_by(fault, layout, sets, tmp_path), nproc=2, torchrun=("--max-restarts=1",),
                               timeout=300)
        ok(restarted)
        assert "resumed from" in restarted.stdout
        state = latest_state(tmp_path / "run")
    assert state["epoch"] == 2 and state["lanes"] == SHUFFLE_WINDOW  # what a resume checks the order by
    reference = uninterrupted[layout]
    dw = max((state["model"][k] - reference[k]).abs().max().item() for k in reference)
    print(f"\n{fault} mid-epoch ({layout}) with 2 workers per rank, resumed: max |dw| = {dw:.3g}")
    assert dw <= 1e-5  # the same world and the same sums in the same order: the same bits by design, on any CPU


def test_a_broken_image_met_while_streaming_ends_every_rank_with_one_line(shared):
    """`shared`'s last run (a run that fails ends its launch)."""
    launch, folder = shared
    result = launch["broken"]
    assert result.returncode != 0 and launch.result.returncode == result.returncode
    lines = error_lines(result.stderr)
    broken = _first(folder / "broken" / "copy", "train", "png")
    assert len(lines) == 1 and str(broken) in lines[0], result.stderr[-3000:]


@pytest.fixture(scope="module")
def s3(sets) -> S3Server:
    server = S3Server(free_port())
    server.start()
    server.client().create_bucket(Bucket="data")
    server.upload_tree("data", "shards", sets["shards"])
    yield server
    server.stop()


def test_a_hugging_face_set_at_a_url_streams_the_batches_of_its_local_copy(s3, sets, tmp_path, monkeypatch):
    """In-process (the server is the module's): parquet files at s3://, read by row groups through
    fsspec with 2 workers, give the local copy's global batches at world 2, and its class names."""
    s3.upload_tree("data", "hf", sets["hf"])
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    remote = dataset(options("s3://data/hf", tmp_path / "remote", "hf", cache_gb=0.0, workers=2))
    local = dataset(options(sets["hf"], tmp_path / "local", "hf", cache_gb=0.0))
    assert remote.names() == local.names() and remote.held.startswith("streamed")
    got, reference = global_batches(remote, 2), global_batches(local, 1)
    assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))


def test_shards_from_the_store_are_fetched_once_and_a_small_cache_still_completes(s3, sets, tmp_path):
    shards = len(list(sets["shards"].glob("*.tar")))
    largest = max(p.stat().st_size for p in sets["shards"].glob("*.tar"))
    env = {**child_env(), **s3.env()}
    s3.log.clear()
    ok(train("s3://data/shards", tmp_path, "--dataset", "shards", "--cache-gb", "0", "--epochs", "2", env=env))
    assert s3.log.gets("/data/shards/") - 1 == shards  # each shard once (and classes.txt): epoch 2 made no GET
    s3.log.clear()
    budget = 8 * largest  # the least a cache may hold: fewer shards than the set
    small = tmp_path / "small"  # a node whose cache is empty
    ok(train("s3://data/shards", small, "--dataset", "shards", "--cache-gb", "0", "--epochs", "2",
             "--shard-cache-gb", f"{budget / 2**30:.9f}", env=env))
    held = sum(p.stat().st_size for p in (small / "cache").rglob("*.tar"))
    scalars = read_scalars(small / "tb-run")[1]
    rss = max(value for _, value in scalars["mem/rss_mb"])
    assert [step for step, _ in scalars["data/shard_cache_hits"]] == [10, 20]  # once per epoch, over ranks
    assert sum(value for _, value in scalars["data/shard_cache_hits"]) > 0
    print(f"\nshard cache of {budget / 1024:.0f} KiB for {shards} shards: {s3.log.gets('/data/shards/')} GETs, "
          f"{held / 1024:.0f} KiB held at the end, peak RSS per rank {rss:.0f} MB")
    assert s3.log.gets("/data/shards/") > shards and held <= budget


# ---------------------------------------------------------------- flags

@pytest.mark.quick
@pytest.mark.parametrize("argv, message", [
    (["--dataset", "mnist", "--image-size", "32"], "--image-size applies to --dataset imagefolder or shards"),
    (["--dataset", "imagefolder"], "--dataset imagefolder needs --data-dir"),
    (["--dataset", "imagefolder", "--data-dir", "s3://b/x"], "convert it to shards"),
    (["--dataset", "shards", "--data-dir", "d", "--shard-cache-gb", "0"], "--shard-cache-gb > 0"),
    (["--dataset", "shards", "--data-dir", "d", "--hf-image-key", "img"], "--hf-image-key applies to --dataset hf"),
    (["--dataset", "shards", "--data-dir", "d", "--crop-pct", "0.9"], "--crop-pct chooses how --image-size S resizes"),
    (["--dataset", "cifar10", "--crop-pct", "0.9", "--interpolation", "bicubic"],
     "--crop-pct and --interpolation choose how --image-size S resizes"),
    (["--dataset", "shards", "--data-dir", "d", "--image-size", "32", "--crop-pct", "1.2"],
     "--crop-pct must be in (0, 1]"),
    (["--dataset", "shards", "--data-dir", "d", "--image-size", "32", "--interpolation", "lanczos"],
     "--interpolation: invalid choice: 'lanczos'"),
    (["--dataset", "imagefolder", "--data-dir", "d", "--shard-lanes", "6"],
     "--shard-lanes applies to --dataset shards or hf (sets read by shards or row groups); drop it for --dataset "
     "imagefolder"),
    (["--dataset", "hf", "--data-dir", "d", "--shard-lanes", "0"], "--shard-lanes must be 1 to 256"),
    (["--dataset", "shards", "--data-dir", "d", "--shard-lanes", "1000000000"], "--shard-lanes must be 1 to 256"),
    (["--dataset", "imagefolder", "--data-dir", "d", "--shard-lanes", "4"], "--shard-lanes applies to --dataset"),
])
def test_own_data_flags_are_checked_before_any_process_group(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, strategy="ddp", default_dataset="cifar10", world_size=1)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.quick
def test_the_data_folder_and_image_size_are_part_of_a_runs_identity():
    def run_id(*argv: str) -> str:
        return parse_args(["--dataset", "imagefolder", *argv], strategy="ddp", default_dataset="cifar10",
                          world_size=1).run_id
    assert run_id("--data-dir", "a") != run_id("--data-dir", "b") != run_id("--data-dir", "b", "--image-size", "64")
    assert run_id("--data-dir", "a", "--workers", "3", "--cache-gb", "0") == run_id("--data-dir", "a")
    hf = lambda *argv: parse_args(["--dataset", "hf", "--data-dir", "a", *argv], strategy="ddp",  # noqa: E731
                                  default_dataset="cifar10", world_size=1).run_id
    assert hf() == hf("--hf-label-key", "label") != hf("--hf-label-key", "fine_label")


@pytest.mark.quick
@pytest.mark.parametrize("decodes, device, cores, expected", [
    (True, "cpu", 8, "give each rank more --workers (now 2), or store the images smaller with python -m "
                     "common.shards --max-side N"),
    (True, "cuda", 8, "give each rank more --workers (now 2), decode on the GPU (--decode gpu), or store the images"),
    (False, "cuda", 8, "wait for data (50%); give each rank more --workers (now 2)\n"),
    (False, "cpu", 2, "wait for data (50%); give each rank more cores (its 2 --workers share 1)\n"),
], ids=["streamed", "streamed-gpu", "cached", "workers-past-the-cores"])
def test_a_data_wait_is_said_once_with_the_ways_that_apply_to_the_set(decodes, device, cores, expected, monkeypatch):
    """The ways out the warning names fit the set: a set held decoded in the cache decodes nothing, so
    neither --max-side nor --decode gpu would shorten its wait; a rank whose workers already have
    its share of the cores (2 ranks on 2 cores) needs cores, not workers."""
    from types import SimpleNamespace

    from common.output.logger import StepTimes
    from common.train.trainer import StepLog

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    said = []
    train = SimpleNamespace(augments=True, workers=2, gpu_decode=False, decodes=decodes)
    run = SimpleNamespace(data=SimpleNamespace(train=train),
                          ctx=SimpleNamespace(device=torch.device(device), local_world_size=2))
    log = SimpleNamespace(warn=said.append)
    steps = StepLog(run.ctx)
    for _ in range(2):
        steps.check_data_wait(StepTimes(10.0, 8.0, 2.0), False, run, log)
    assert len(said) == 1 and expected in said[0] + "\n", said


@pytest.mark.quick
@pytest.mark.parametrize("cores, ranks, expected", [(64, 2, 31), (64, 1, 63), (16, 8, 1), (2, 4, 1), (1, 1, 1)])
def test_the_default_workers_follow_the_cores_with_one_kept_per_rank_and_no_cap(cores, ranks, expected,
                                                                                 monkeypatch):
    """A 64-core node of 2 ranks gets 31 workers a rank (no cap of 8: a GPU rank eats what ~10 cores
    decode); more ranks than cores still get one worker each (decoding never blocks the step)."""
    from common.data.reading import default_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert default_workers(ranks) == expected


def test_the_banner_says_what_the_workers_deliver_per_rank(shared):
    """`shared`'s streamed runs (2 workers a rank, 2 ranks): the rate one worker measured, times the
    workers that have a core (1 on this 2-core host: 2 ranks share it)."""
    launch, _ = shared
    for kind in STREAMED:
        said = re.search(r"input: one worker makes (\d+) training images per CPU-second here \(--augment basic\); "
                         r"2 worker\(s\) per rank on its (\d+) core\(s\) deliver up to (\d+) images/s per rank",
                         launch[f"uninterrupted-{kind}"].stdout)
        cores = max(1, len(os.sched_getaffinity(0)) // 2)
        assert said and int(said[1]) > 0 and int(said[2]) == cores, kind
        assert abs(int(said[3]) - min(2, cores) * int(said[1])) <= 1, kind


@pytest.mark.quick
def test_the_banners_rate_is_measured_on_a_batch_smaller_than_its_samples(tmp_path):
    """A streamed square set (pad-crop draws, one per position of the global batch) at --batch-size 8:
    the rate is measured on at most the batch's positions (it was an IndexError past them)."""
    from common.data.augment import Draws

    folder = write_imagefolder(tmp_path / "set", train_size=40, test_size=4, shape="cifar")
    streamed = dataset(options(folder, tmp_path / "cache", cache_gb=0.0))
    assert streamed.held.startswith("streamed")
    for batch in (1, 8):
        assert 0 < streamed.train.rate_per_worker(Draws(0, 0, 0, batch, "basic")) < math.inf


@pytest.mark.quick
def test_a_cache_dir_that_cannot_be_made_is_one_line_naming_it_not_the_data(sets, tmp_path):
    """A --cache-dir under a folder that cannot hold one (/proc): the error names --cache-dir, not the
    data (the failing path is an ancestor of the cache's folder)."""
    with pytest.raises(UserError, match="--cache-dir") as refused:
        dataset(options(sets["folder"], Path("/proc/no-such-cache") / "sub"))
    assert "the data does not change" not in str(refused.value)


@pytest.mark.quick
def test_a_file_gone_while_streaming_is_named_in_the_batchs_error(tmp_path):
    """An image deleted after indexing: the batch's one line names that file, not only the set's folder."""
    from common.data.reading import Request

    folder = write_imagefolder(tmp_path / "set", train_size=40, test_size=4)
    streamed = dataset(options(folder, tmp_path / "cache", cache_gb=0.0))
    gone = sorted((folder / "train").glob("*/*"))
    for path in gone:
        path.unlink()
    batch = streamed.train.source.__getitems__(Request([0, 1]))
    assert batch.error.split(":")[0] in {str(path) for path in gone}, batch.error
