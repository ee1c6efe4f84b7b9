"""The input pipeline per CPU core: images per CPU-second of each way to make a training batch.

One process, one thread (torch.set_num_threads(1)), time.process_time() around each row, so that
other load on the host does not skew it. Rows: torchvision.io.decode_jpeg alone (the decode
limit); PIL open + convert("RGB") alone (the reference's loader); torchvision's reference train
transform (its presets.ClassificationPresetTrain: PIL RandomResizedCrop(224) + RandomHorizontalFlip
+ PILToTensor + ConvertImageDtype(float) + Normalize, then its DataLoader's collate), and with
RandAugment and TrivialAugmentWide; ours: one worker's work (the suite's own-data loader reading,
decoding, cropping, flipping and augmenting batches, --workers 0) and the whole training input
path (the same loader feeding TrainLoader: worker + rank, everything the step gets), from the
original photos and from shards converted with --max-side 320. "cores/node" is what an 8-GPU node
of ResNet-50 H100s needs at that rate (3,000 images/s per GPU, 24,000 a node). A second table: the
rank's own process per sample with each --augment when 2 DataLoader workers make its batches (as a
run with --workers 2 does; process_time counts this process, not its workers), in 5 interleaved
rounds: what the training loop's thread spends on the input, and the part of it the policy adds.

The photos: an ImageNet-like set derived from real photos (70% at 500x375 or 375x500, the rest up
to 1024 px on the long side, JPEG quality 90): each a random crop (60-100% of the largest crop of
its aspect), rescaled and maybe mirrored, of one source photo; its class is the source. Sources:
--photos DIR, else the photos scikit-image ships (skimage/data: astronaut, coffee, chelsea, rocket,
motorcycles...) and scikit-learn's sample images (china, flower) where installed. Without any,
the set falls back to tests/datagen.py's generated colour fields, and the table says so.

    python -m bench pipeline                       # 1,000 photos, image size 224
    python -m bench pipeline --images 2000 --photos ~/my-photos
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from PIL import Image

from common.data import own
from common.data.augment import Draws
from common.data.loader import TrainLoader
from common.shards import Reencode, convert
from common.train.run import DEFAULT_MEMORY_FORMAT, torch_memory_format

NODE_DEMAND = 8 * 3000  # images/s: eight H100s training ResNet-50
PHOTO_NAMES = ("astronaut", "coffee", "chelsea", "rocket", "motorcycle_left", "motorcycle_right", "hubble_deep_field",
               "retina", "ihc", "china", "flower")  # colour photos of skimage/data and sklearn/datasets/images
BATCH = 32
AUGMENTS = ("basic", "randaugment", "trivialaugment", "autoaugment")  # basic first: the others are against it
RANK_ROUNDS = 5
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# ---------------------------------------------------------------- the photo set

def installed_photos() -> list[Path]:
    """The real colour photos that scikit-image and scikit-learn ship, where installed (found by
    their packages' folders: neither is imported)."""
    found = []
    for package, folder in (("skimage", "data"), ("sklearn", "datasets/images")):
        spec = importlib.util.find_spec(package)
        if spec and spec.origin:
            where = Path(spec.origin).parent / folder
            found += [p for p in sorted(where.glob("*")) if p.stem in PHOTO_NAMES and p.suffix in (".png", ".jpg")]
    return found


def photo_size(rng: random.Random) -> tuple[int, int]:
    """ImageNet's shapes: 70% 500x375 or 375x500, the rest a long side of 500-1024, aspect 3:4 to 4:3."""
    if rng.random() < 0.7:
        return rng.choice(((500, 375), (375, 500)))
    long = rng.randint(500, 1024)
    short = round(long * rng.uniform(0.75, 1.0))
    return (long, short) if rng.random() < 0.5 else (short, long)


def derive(source: Image.Image, size: tuple[int, int], rng: random.Random) -> Image.Image:
    """A new photo of `size` from `source`: a random crop of its aspect, rescaled, maybe mirrored."""
    width, height = source.size
    aspect = size[0] / size[1]
    largest = (min(width, height * aspect), min(width, height * aspect) / aspect)
    fraction = rng.uniform(0.6, 1.0)
    w, h = largest[0] * fraction, largest[1] * fraction
    left, top = rng.uniform(0, width - w), rng.uniform(0, height - h)
    photo = source.resize(size, Image.Resampling.LANCZOS, box=(left, top, left + w, top + h))
    return photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else photo


def write_photo_set(root: Path, count: int, sources: list[Path], seed: int = 0) -> Path:
    """An ImageFolder tree of `count` training photos (and a tenth as many for val/), class = source."""
    rng = random.Random(seed)
    images = [Image.open(path).convert("RGB") for path in sources]
    for split, n in (("train", count), ("val", max(len(sources), count // 10))):
        for i in range(n):
            k = i % len(sources)  # every class in both splits
            folder = root / split / sources[k].stem
            folder.mkdir(parents=True, exist_ok=True)
            derive(images[k], photo_size(rng), rng).save(folder / f"{i:06d}.jpg", quality=90)
    return root


def photo_set(root: Path, count: int, photos: Path | None) -> tuple[Path, str]:
    """The set, and a line that says what it was made from."""
    sources = sorted(p for p in photos.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png")) if photos \
        else installed_photos()
    if not sources:
        from tests.datagen import write_photos

        return (write_photos(root, train_size=count, test_size=max(4, count // 10)),
                "GENERATED colour fields (tests/datagen.py write_photos): no real photos found; pip install "
                "scikit-image, or pass --photos DIR")
    names = ", ".join(p.stem for p in sources)
    return write_photo_set(root, count, sources), f"derived from {len(sources)} real photos ({names})"


# ---------------------------------------------------------------- the rows

@dataclass(frozen=True)
class Row:
    name: str
    images: int
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.images / self.cpu_s


def measure(name: str, run: Callable[[], int]) -> Row:
    """`run` (which returns the images it made) once to warm up, then timed in process CPU seconds."""
    run()
    start = time.process_time()
    images = run()
    row = Row(name, images, time.process_time() - start)
    print(f"  {name}: {row.rate:.0f} img/s per core", file=sys.stderr, flush=True)
    return row


def batched(items: list, size: int) -> Iterator[list]:
    return (items[i:i + size] for i in range(0, len(items), size))


def reference_transform(size: int, policy: str | None) -> Callable:
    """torchvision's references/classification presets.ClassificationPresetTrain (hflip 0.5)."""
    from torchvision import transforms as T

    steps = [T.RandomResizedCrop(size, interpolation=T.InterpolationMode.BILINEAR, antialias=True),
             T.RandomHorizontalFlip(0.5)]
    if policy == "randaugment":
        steps.append(T.RandAugment(interpolation=T.InterpolationMode.BILINEAR))
    elif policy == "trivialaugment":
        steps.append(T.TrivialAugmentWide(interpolation=T.InterpolationMode.BILINEAR))
    steps += [T.PILToTensor(), T.ConvertImageDtype(torch.float), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return T.Compose(steps)


def pil_rgb(data: bytearray) -> Image.Image:
    """The reference's loader: torchvision's ImageFolder default_loader, on the file's bytes."""
    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def reference(files: list[bytearray], size: int, policy: str | None) -> Callable[[], int]:
    transform = reference_transform(size, policy)

    def run() -> int:
        for batch in batched(files, BATCH):
            torch.utils.data.default_collate([transform(pil_rgb(data)) for data in batch])
        return len(files)
    return run


def decode_jpeg_alone(files: list[bytearray]) -> Callable[[], int]:
    from torchvision.io import decode_jpeg

    def run() -> int:
        for data in files:
            decode_jpeg(torch.frombuffer(data, dtype=torch.uint8))
        return len(files)
    return run


def pil_alone(files: list[bytearray]) -> Callable[[], int]:
    def run() -> int:
        for data in files:
            pil_rgb(data)
        return len(files)
    return run


def our_data(kind: str, data_dir: Path, cache: Path, size: int, workers: int = 0) -> own.Dataset:
    """The suite's own-data loader on the set, streamed (--cache-gb 0), decoding in this process
    (--workers 0) or in `workers` DataLoader worker processes: index and statistics made here, not timed."""
    opts = own.OwnData(kind, str(data_dir), str(cache), {}, image_size=size, workers=workers, prepare_workers=0,
                       skip_broken=False, cache_gb=0.0, shard_cache_gb=1.0)
    return own.open_prepared(own.prepare(opts, lambda line: None), opts)


def our_worker(data: own.Dataset, augment: str) -> Callable[[], int]:
    """What DataLoader workers do for the training split: read, decode, crop, flip and --augment's
    policy on uint8 (each sample drawn by its global position), collate; whole batches only."""
    indices = list(torch.arange(len(data.train) // BATCH * BATCH).split(BATCH))
    epochs = iter(range(1, 10**9))

    def run() -> int:
        draws = Draws(seed=0, epoch=next(epochs), step=0, global_batch=BATCH, augment=augment)
        return sum(len(labels) for _, labels in data.train.batches(indices, torch.device("cpu"), draws, range(BATCH)))
    return run


def our_path(data: own.Dataset, augment: str) -> Callable[[], int]:
    """The whole training input path of a CPU rank: the worker's batches through TrainLoader (crop,
    flip, --augment, normalize), what the step is handed."""
    loader = TrainLoader(data.train, data.spec, BATCH, 0, 1, seed=0, device=torch.device("cpu"), augment=augment,
                         memory_format=torch_memory_format(DEFAULT_MEMORY_FORMAT))  # the layout a run hands its model
    epochs = iter(range(1, 10**9))

    def run() -> int:
        return sum(len(labels) for _, labels in loader.epoch(next(epochs)))
    return run


def training_files(tree: Path) -> list[bytearray]:
    """The encoded training images, in memory (writable: torch.frombuffer wants that)."""
    return [bytearray(path.read_bytes()) for path in sorted((tree / "train").glob("*/*"))]


def stored_files(shards: Path) -> list[bytearray]:
    """The encoded training images of a converter's shards."""
    import tarfile

    files = []
    for shard in sorted(shards.glob("train-*.tar")):
        with tarfile.open(shard) as tar:
            files += [bytearray(tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".jpg")]
    return files


def rows(tree: Path, tmp: Path, size: int, max_side: int) -> list[Row]:
    files = training_files(tree)
    small = tmp / "small"
    convert(tree, str(small), reencode=Reencode(max_side=max_side))
    ours, smaller = our_data("imagefolder", tree, tmp / "cache", size), our_data("shards", small, tmp / "cache", size)
    plans: list[tuple[str, Callable[[], int]]] = [
        ("decode_jpeg alone", decode_jpeg_alone(files)),
        ("PIL open + convert alone", pil_alone(files)),
        ("torchvision reference", reference(files, size, None)),
        ("torchvision reference + RandAugment", reference(files, size, "randaugment")),
        ("torchvision reference + TrivialAugment", reference(files, size, "trivialaugment")),
        ("ours: one worker", our_worker(ours, "basic")),
        ("ours: one worker + RandAugment", our_worker(ours, "randaugment")),
        ("ours: worker + rank", our_path(ours, "basic")),
        ("ours: worker + rank + RandAugment", our_path(ours, "randaugment")),
        ("ours: worker + rank + TrivialAugment", our_path(ours, "trivialaugment")),
        (f"decode_jpeg alone, --max-side {max_side}", decode_jpeg_alone(stored_files(small))),
        (f"torchvision reference, --max-side {max_side}", reference(stored_files(small), size, None)),
        (f"ours, --max-side {max_side} shards: one worker", our_worker(smaller, "basic")),
        (f"ours, --max-side {max_side} shards: worker + rank", our_path(smaller, "basic")),
        (f"ours, --max-side {max_side} shards: worker + rank + RandAugment", our_path(smaller, "randaugment")),
    ]
    return [measure(name, run) for name, run in plans]


def rank_rows(tree: Path, tmp: Path, size: int, rounds: int = RANK_ROUNDS) -> list[list[Row]]:
    """The rank's process alone, its batches made by 2 workers: `our_path` with the decode, crop, flip
    and policy in worker processes, whose CPU process_time does not count. Per --augment, `rounds`
    measurements interleaved with the other policies' (the rank's share is small: its noise is not)."""
    fed = our_data("imagefolder", tree, tmp / "cache", size, workers=2)
    measured: list[list[Row]] = [[] for _ in AUGMENTS]
    for _ in range(rounds):
        for rows_of, augment in zip(measured, AUGMENTS):
            rows_of.append(measure(f"rank's process, 2 workers, --augment {augment}", our_path(fed, augment)))
    return measured


def table(measured: Iterable[Row]) -> str:
    measured = list(measured)
    ref = {row.name: row.rate for row in measured}
    lines = ["| pipeline | images per CPU-second | x reference | cores an 8-GPU node needs |", "|---|---|---|---|"]
    for row in measured:
        policy = next((p for p in ("RandAugment", "TrivialAugment") if p in row.name), None)
        base = ref[f"torchvision reference + {policy}" if policy else "torchvision reference"]
        lines.append(f"| {row.name} | {row.rate:.0f} | {row.rate / base:.2f} | {NODE_DEMAND / row.rate:.0f} |")
    return "\n".join(lines)


def ms_per_sample(rows: list[Row]) -> list[float]:
    return [row.cpu_s / row.images * 1e3 for row in rows]


def rank_table(measured: list[list[Row]]) -> str:
    """ms of the rank's CPU per sample (median and range over the rounds), and what each policy adds
    over --augment basic (its crop and flip also made in the workers): the median of the rounds'
    differences, the policy's cost on the training loop's thread."""
    basic = ms_per_sample(measured[0])
    lines = ["| the rank's process (2 workers make the batches) | ms per sample: median (range) | "
             "added by the policy, ms: median (range) |", "|---|---|---|"]
    for rows in measured:
        ms = ms_per_sample(rows)
        added = [m - b for m, b in zip(ms, basic)]
        extra = f"{statistics.median(added):+.3f} ({min(added):+.3f} to {max(added):+.3f})" if rows is not measured[0] \
            else ""
        lines.append(f"| {rows[0].name} | {statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f}) | {extra} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=1000, help="training photos in the set (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=224, help="the model's input side (default: %(default)s)")
    p.add_argument("--max-side", type=int, default=320, help="the smaller shards' --max-side (default: %(default)s)")
    p.add_argument("--photos", type=Path, default=None,
                   help="a folder of real photos to derive the set from (default: scikit-image's and scikit-learn's)")
    a = p.parse_args()
    if a.images < BATCH:
        p.error(f"--images must be at least {BATCH} (one batch)")
    if a.photos is not None and not a.photos.is_dir():
        p.error(f"--photos {a.photos} is not a folder")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tree, made_from = photo_set(Path(tmp) / "photos", a.images, a.photos)
        median_kb = statistics.median(map(len, training_files(tree))) / 1000
        print(f"python {sys.version.split()[0]}, torch {torch.__version__}, one thread; {a.images} training photos "
              f"{made_from}, median {median_kb:.0f} KB; image size {a.image_size}; x reference: against "
              "torchvision's reference with the same policy (none, RandAugment or TrivialAugment), on the "
              "original photos\n")
        print(table(rows(tree, Path(tmp), a.image_size, a.max_side)))
        print()
        print(rank_table(rank_rows(tree, Path(tmp), a.image_size)))


if __name__ == "__main__":
    main()
