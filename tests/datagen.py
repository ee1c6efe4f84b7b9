"""Write small data sets in the real on-disk formats, so tests run the real readers.

CIFAR-10: cifar-10-batches-py/ with data_batch_1..5, test_batch and batches.meta, each a pickled
dict {'batch_label', 'labels', 'data' (N x 3072 uint8, channel-major rows), 'filenames'}.
MNIST: MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte as big-endian IDX, plain or .gz;
or torchvision's older MNIST/processed/{training,test}.pt, each a torch.save'd (uint8 N x 28 x 28, int64 N).
Your own images: an ImageFolder tree (train/<class>/<image>, val/...) of PNG/JPEG files, the
WebDataset shards common.shards converts it to, and the same images as a Hugging Face data set
written by `datasets` itself (save_to_disk, or parquet files in the Hub's layout).
The pixels come from the synthetic generator, so the files are learnable.
"""
from __future__ import annotations

import gzip
import pickle
import random
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common.data.formats import CIFAR_DIR, CIFAR_TEST, CIFAR_TRAIN, MNIST_DIR, MNIST_PROCESSED, MNIST_PROCESSED_DIR
from common.data.loader import Dataset, make_synthetic
from common.shards import TRAIN, VAL, convert

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _write_pickle(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)  # the original files are Python 2 pickles


def write_cifar10(root: Path, per_batch: int = 200, test_size: int = 301) -> Path:
    data = make_synthetic("cifar", train_size=per_batch * len(CIFAR_TRAIN), test_size=test_size)
    folder = root / CIFAR_DIR
    folder.mkdir(parents=True, exist_ok=True)
    chunks = zip(data.train.images.split(per_batch), data.train.labels.split(per_batch))
    for name, (images, labels) in zip(CIFAR_TRAIN + CIFAR_TEST, [*chunks, (data.test.images, data.test.labels)]):
        _write_pickle(folder / name, {
            "batch_label": f"{name} (generated)",
            "labels": labels.tolist(),
            "data": images.reshape(len(images), -1).numpy().astype(np.uint8),
            "filenames": [f"img_{i}.png" for i in range(len(images))],
        })
    _write_pickle(folder / "batches.meta", {"label_names": CIFAR_CLASSES, "num_cases_per_batch": per_batch,
                                            "num_vis": 3072})
    return root


def _idx_bytes(array: np.ndarray) -> bytes:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(root: Path, train_size: int = 1200, test_size: int = 301, gz: bool = False) -> Path:
    data = make_synthetic("mnist", train_size=train_size, test_size=test_size)
    folder = root / MNIST_DIR
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "train-images-idx3-ubyte": data.train.images.squeeze(1).numpy(),
        "train-labels-idx1-ubyte": data.train.labels.numpy(),
        "t10k-images-idx3-ubyte": data.test.images.squeeze(1).numpy(),
        "t10k-labels-idx1-ubyte": data.test.labels.numpy(),
    }
    for stem, array in files.items():
        payload = _idx_bytes(array)
        if gz:
            with gzip.open(folder / f"{stem}.gz", "wb") as f:
                f.write(payload)
        else:
            (folder / stem).write_bytes(payload)
    return root


def write_mnist_processed(root: Path, train_size: int = 1200, test_size: int = 301) -> Path:
    """The same images as write_mnist, in the layout older torchvision versions left behind."""
    data = make_synthetic("mnist", train_size=train_size, test_size=test_size)
    folder = root / MNIST_PROCESSED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name, split in zip(MNIST_PROCESSED, (data.train, data.test)):
        torch.save((split.images.squeeze(1).contiguous(), split.labels), folder / name)
    return root


def write_image_tree(dataset: Dataset, root: Path, formats: tuple[str, ...] = ("png", "jpg"),
                     sizes: tuple[int, int] | None = None, seed: int = 0) -> Path:
    """`dataset` as an ImageFolder tree root/{train,val}/<class>/<n>.<format>, the formats taken in
    turn image by image (JPEG at quality 95); grayscale images stay mode L. sizes (low, high): each
    image resized to a random width and height in that range, for the --image-size tests."""
    rnd = random.Random(seed)
    for split, part in ((TRAIN, dataset.train), (VAL, dataset.test)):
        for n, (image, label) in enumerate(zip(part.images, part.labels)):
            folder = root / split / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            pixels = image.permute(1, 2, 0).squeeze(2).numpy()
            picture = Image.fromarray(pixels, "L" if pixels.ndim == 2 else "RGB")
            if sizes:
                picture = picture.resize((rnd.randint(*sizes), rnd.randint(*sizes)), Image.BILINEAR)
            picture.save(folder / f"{n:05d}.{formats[n % len(formats)]}", quality=95)
    return root


def write_imagefolder(root: Path, train_size: int = 200, test_size: int = 50, shape: str = "mnist",
                      formats: tuple[str, ...] = ("png", "jpg"), sizes: tuple[int, int] | None = None,
                      seed: int = 0) -> Path:
    """The synthetic set as an ImageFolder tree (classes "0".."9"; grayscale for mnist's shape, RGB
    for cifar's), by write_image_tree."""
    data = make_synthetic(shape, train_size=train_size, test_size=test_size)
    if len(data.train.labels.unique()) < data.spec.classes:
        raise ValueError(f"train_size {train_size} leaves a class without an image; write more")
    return write_image_tree(data, root, formats, sizes, seed)


def write_photos(root: Path, train_size: int = 64, test_size: int = 16, classes: int = 4, seed: int = 0) -> Path:
    """Photo-sized JPEGs (about 500 x 375, quality 90) as an ImageFolder tree: smooth random colour
    fields, one tint per class, for the decoding and data-share benchmarks."""
    g = torch.Generator().manual_seed(seed)
    for split, count in ((TRAIN, train_size), (VAL, test_size)):
        for n in range(count):
            label = n % classes
            coarse = torch.rand(3, 12, 16, generator=g) * 0.6 + torch.linspace(0, 0.4, classes)[label]
            width = 480 + int(torch.randint(0, 64, (1,), generator=g))
            height = 360 + int(torch.randint(0, 32, (1,), generator=g))
            pixels = torch.nn.functional.interpolate(coarse[None], size=(height, width), mode="bicubic")[0]
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            image = pixels.clamp(0, 1).mul(255).byte().permute(1, 2, 0).numpy()
            Image.fromarray(image, "RGB").save(folder / f"{n:05d}.jpg", quality=90)
    return root


def write_shards(folder_root: Path, dest: Path, shard_mb: float = 64, seed: int = 0) -> Path:
    """The converter's shards of an ImageFolder tree, written in-process."""
    convert(folder_root, str(dest), shard_mb=shard_mb, seed=seed)
    return dest


def write_hf(folder_root: Path, dest: Path, layout: str = "parquet", rows_per_group: int = 37, files: int = 2,
             seed: int = 0) -> Path:
    """An ImageFolder tree's images (their files' bytes: PNG and JPEG) as a Hugging Face data set
    with an Image column and a ClassLabel column named after the tree's classes, the training rows
    shuffled (as the Hub's sets are): `layout` "parquet" writes DEST/data/train-0000K-of-0000N.parquet
    and validation-*.parquet with row groups of `rows_per_group` rows, "disk" a
    DatasetDict.save_to_disk folder (datasets' own record batches of 100 rows)."""
    import datasets

    from common.shards import class_images, folder_classes

    classes = folder_classes(folder_root)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    splits = {}
    for split, name in ((TRAIN, "train"), (VAL, "validation")):
        rows = [(rel, label) for label, paths in class_images(folder_root, split, classes, lambda _: None)
                for rel in paths]
        if split == TRAIN:
            random.Random(seed).shuffle(rows)
        splits[name] = datasets.Dataset.from_dict(
            {"image": [{"bytes": (folder_root / rel).read_bytes(), "path": Path(rel).name} for rel, _ in rows],
             "label": [label for _, label in rows]}, features=features)
    if layout == "disk":
        datasets.DatasetDict(splits).save_to_disk(str(dest))
        return dest
    for name, split in splits.items():
        (dest / "data").mkdir(parents=True, exist_ok=True)
        for k in range(files):
            part = split.shard(num_shards=files, index=k, contiguous=True)
            part.to_parquet(str(dest / "data" / f"{name}-{k:05d}-of-{files:05d}.parquet"), batch_size=rows_per_group)
    return dest


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write a generated data set in the real on-disk format, for offline runs.")
    p.add_argument("dataset", choices=("cifar10", "mnist", "imagefolder", "shards", "hf"))
    p.add_argument("root", type=Path, help="the --data-dir to train from")
    p.add_argument("--train", type=int, default=None, help="training images (default: the real set's 50000 / 60000)")
    p.add_argument("--test", type=int, default=10000, help="test images (default: %(default)s)")
    p.add_argument("--shape", choices=("mnist", "cifar"), default="mnist",
                   help="imagefolder, shards and hf: grayscale 28x28 or RGB 32x32 images (default: %(default)s)")
    a = p.parse_args()
    if a.dataset == "cifar10":
        write_cifar10(a.root, per_batch=(a.train or 50000) // len(CIFAR_TRAIN), test_size=a.test)
    elif a.dataset == "mnist":
        write_mnist(a.root, train_size=a.train or 60000, test_size=a.test, gz=True)
    elif a.dataset == "imagefolder":
        write_imagefolder(a.root, train_size=a.train or 60000, test_size=a.test, shape=a.shape)
    else:
        write = write_shards if a.dataset == "shards" else write_hf
        with tempfile.TemporaryDirectory() as folder:
            write(write_imagefolder(Path(folder), a.train or 60000, a.test, a.shape), a.root)
    print(f"wrote generated {a.dataset} under {a.root}")


if __name__ == "__main__":
    main()
