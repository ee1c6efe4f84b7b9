"""The GPU paths in one command: on a machine with CUDA, every strategy on every visible GPU over
nccl (fp32, bf16, --compile), the equivalence check on CUDA (every strategy, and the recipes it
covers), DataParallel over all GPUs, `--device cpu,cuda` ranks over gloo, FSDP2 and ZeRO-1, and a
kill-and-resume; --decode gpu's input path (nvJPEG batch decode alone, then with our crop and flip
per sample and batched, DALI's fused decode + random crop beside it where nvidia-dali is installed)
on bench pipeline's photo set; then one table: images/s, max |dw|, peak CUDA memory per rank, pass/fail.

    python -m bench gpu                          # every row (several minutes)
    python -m bench gpu --only equivalence       # the rows whose label contains these words
    python -m bench gpu --only decode            # the input path's rows alone

Every figure is one the scripts report themselves: images/s from the step clock's TensorBoard
scalars (as `python -m bench strategies` reads them), max |dw| from the `equivalence: max |dw| =
...` line, memory from `mem/cuda_max_alloc_mb` (the largest of any rank). Exits 1 if a row failed;
where there is no CUDA device, says so in one line and exits 1.
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from bench.strategies import Finished, synthetic, timing, train

STRATEGIES = {  # label -> script and flags
    "ddp": ["train_ddp.py"],
    "allreduce": ["train_allreduce.py"],
    "allreduce --allreduce ring": ["train_allreduce.py", "--allreduce", "ring"],
    "master": ["train_master.py"],
    "master --master-update": ["train_master.py", "--master-update"],
    "fsdp --shard full (FSDP2)": ["train_fsdp.py", "--shard", "full"],
    "fsdp --shard optimizer (ZeRO-1)": ["train_fsdp.py", "--shard", "optimizer"],
    "localsgd": ["train_localsgd.py"],
}
EQUIVALENT = {**STRATEGIES, "localsgd": ["train_localsgd.py", "--sync-every", "1"]}  # H=1 equals averaging
MIXED = ["ddp", "allreduce", "master"]  # the strategies that take --device cpu,cuda
RECIPES = {"fp32": [], "bf16": ["--precision", "bf16"], "compile": ["--compile"]}
EQUIVALENT_RECIPES = {  # the recipe rows of docs/recipes.md's equivalence table, on DDP
    "--accumulate 2": ["--accumulate", "2"],
    "bf16, bf16 wire, --accumulate 2": ["--precision", "bf16", "--grad-compression", "bf16", "--accumulate", "2"],
    "fp16 (GradScaler), fp16 wire": ["--precision", "fp16", "--grad-compression", "fp16"],
    "--compile": ["--compile"],
}
NCCL = ["--device", "cuda", "--backend", "nccl"]
FAILURE_TAIL = 4000  # characters of a failed row's stderr printed under it (its traceback)
MAX_DW = re.compile(r"equivalence: max \|dw\| = (\S+) after")
KILL_AND_RESUME = "kill-and-resume: ddp, nccl"


@dataclass(frozen=True)
class Check:
    label: str
    script: list[str]
    flags: list[str]
    world: int
    images: int = 0  # global batch of a throughput row; 0 for an equivalence row


@dataclass
class Row:
    label: str
    world: int
    passed: bool
    images_per_s: float | None = None
    max_dw: float | None = None
    cuda_mb: float | None = None
    why: str = field(default="")  # a failed row's error line


def plan(gpus: int, model: str, per_rank: int) -> list[Check]:
    """Every row but the kill-and-resume, in the table's order."""
    batch = per_rank * gpus
    steps = min(40, 10000 // batch)  # within one epoch of the 10,000 synthetic images
    training = synthetic(model, batch, steps, max(1, steps // 5))
    small = synthetic("convnet", 64, 40, 8)  # mixed ranks: the CPU rank sets the pace
    equal = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "lenet", "--check-equivalence", "4",
             "--batch-size", str(48 if 48 % gpus == 0 else 12 * gpus)]  # the tests' check: lenet, batch 48, 4 steps
    return [
        *(Check(f"{name}, {recipe}, nccl", script, [*training, *flags, *NCCL], gpus, batch)
          for name, script in STRATEGIES.items() for recipe, flags in RECIPES.items()),
        *(Check(f"dp over {gpus} GPU(s), {recipe}", ["train_dp.py"], [*training, *flags], 1, batch)
          for recipe, flags in RECIPES.items()),
        *(Check(f"{name}, --device cpu,cuda, gloo", STRATEGIES[name], [*small, "--device", "cpu,cuda"], 2, 64)
          for name in MIXED),
        *(Check(f"equivalence: {name}, nccl", script, [*equal, *NCCL], gpus) for name, script in EQUIVALENT.items()),
        Check(f"equivalence: dp over {gpus} GPU(s)", ["train_dp.py"], equal, 1),
        *(Check(f"equivalence: ddp {name}, nccl", ["train_ddp.py"], [*equal, *flags, *NCCL], gpus)
          for name, flags in EQUIVALENT_RECIPES.items()),
    ]


def row(label: str, world: int, done: Finished, images: int = 0, passed: bool | None = None,
        max_dw: float | None = None) -> Row:
    """A row from a finished run, with the figures it reported; passed: its exit status unless given."""
    scalars, found = done.scalars, MAX_DW.search(done.stdout)
    timed = images and len(scalars.get("time/data_ms", [])) > 1  # the first interval is warm-up
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    why = next((line for line in lines if line.startswith("error:")), lines[-1] if lines else "no output")
    passed = done.returncode == 0 if passed is None else passed
    return Row(label, world, passed, 1000 * images / timing(scalars).step_ms if timed else None,
               float(found.group(1)) if found else max_dw,
               scalars["mem/cuda_max_alloc_mb"][-1] if scalars.get("mem/cuda_max_alloc_mb") else None,
               "" if passed else why)


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The model in the checkpoint that the one run under this --checkpoint-dir saved last."""
    pointer = json.loads(next(folder.glob("*/latest.json")).read_text())
    return torch.load(folder / pointer["checkpoint"], map_location="cpu", weights_only=True)["model"]


def kill_and_resume(gpus: int) -> Row:
    """DDP over nccl cut after step 5 and resumed from its checkpoint, against an uninterrupted run.
    With 2+ GPUs rank 1 is SIGKILLed and torchrun restarts the job (--max-restarts=1); with one GPU
    (rank 0 alone) the run is stopped by SIGTERM and the same command run again. With
    --deterministic (the restarted process picks the kernels the first one did) the weights must be
    equal bit for bit, as on a CPU."""
    fault = "sigkill" if gpus >= 2 else "sigterm"
    flags = [*synthetic("resnet18", 64 * gpus, 16, 4), "--save-every-steps", "3", "--deterministic", *NCCL]
    faulty = lambda fault_: ["tests/faults.py", "ddp", fault_, "5"]  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        whole, cut = ["--checkpoint-dir", f"{tmp}/whole"], ["--checkpoint-dir", f"{tmp}/cut"]
        done = train(faulty("none"), [*flags, *whole], gpus)
        if done.returncode == 0:
            done = train(faulty(fault), [*flags, *cut], gpus, torchrun=["--max-restarts=1"])
        if fault == "sigterm" and any(Path(tmp, "cut").glob("*/latest.json")):  # it saved: the same command resumes
            done = train(faulty("none"), [*flags, *cut], gpus)
        if done.returncode:
            return row(KILL_AND_RESUME, gpus, done)
        before, after = final_weights(Path(tmp, "whole")), final_weights(Path(tmp, "cut"))
    max_dw = max((before[k].double() - after[k].double()).abs().max().item() for k in before)
    return row(KILL_AND_RESUME, gpus, done, passed=max_dw == 0, max_dw=max_dw)


DECODE_BATCH = 128
DECODE_SIZE = 224


def decode_rows(photos: Path | None, count: int, device: torch.device, model: str) -> list[Row]:
    """Images/s of the rank's side of --decode gpu on `device` (GPU 0; wall clock, synchronized,
    after one warm-up pass): nvJPEG on the batch alone; with geometry's crop + flip per sample, and
    batched (ours); DALI's decoders.image_random_crop + resize + flip where nvidia-dali is installed. Then
    how far the GPU's crops are from the CPU workers' (grey levels), and train_ddp.py streaming the
    photos with --decode gpu and with --decode cpu (the node's cores as workers)."""
    from bench.pipeline import photo_set, training_files

    with tempfile.TemporaryDirectory() as tmp:
        tree, made_from = photo_set(Path(tmp) / "photos", count, photos)
        files = [bytes(data) for data in training_files(tree)]
        print(f"decode rows: {len(files)} photos {made_from}", flush=True)
        rows = decode_speed_rows(files, device)
        for made in (lambda: crops_against_cpu(tree, device), *(lambda d=d: training_row(tree, d, model)
                                                                 for d in ("gpu", "cpu"))):
            rows.append(made())
            print(table_line(rows[-1]), f"({rows[-1].why})" if rows[-1].why else "", flush=True)
    return rows


def decode_speed_rows(files: list[bytes], device: torch.device) -> list[Row]:
    """Images/s on `device` of nvJPEG's batch decode alone, then with the crop and flip made per
    sample (geometry.resized_crops: several kernels a sample) and batched (batched_resized_crop,
    what --decode gpu runs on CUDA), then --decode gpu with RandAugment; DALI's beside them where
    it is installed."""
    from common.data.device_decode import decoded, encoded_batch, train_boxes
    from common.data.geometry import batched_resized_crop, resized_crops

    batches = [encoded_batch(files[i:i + DECODE_BATCH], [0] * len(files[i:i + DECODE_BATCH]))
               for i in range(0, len(files), DECODE_BATCH)]
    boxes = [train_boxes(b.sizes, 0, 1, step, range(len(b.sizes))) for step, b in enumerate(batches)]

    def nvjpeg() -> None:
        for batch in batches:
            decoded(batch, 3, device)

    def cropped(crop: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def epoch() -> None:
            for batch, its_boxes in zip(batches, boxes):
                crop(decoded(batch, 3, device), its_boxes, DECODE_SIZE)
        return epoch

    rows = [timed_row("decode: nvJPEG batch decode alone", nvjpeg, len(files), device),
            timed_row("decode: nvJPEG + per-sample crop + flip", cropped(resized_crops), len(files), device),
            timed_row("decode: nvJPEG + batched crop + flip (--decode gpu)", cropped(batched_resized_crop),
                      len(files), device)]
    rows.append(timed_row("decode: --decode gpu + RandAugment (ours)", lambda: with_policy(batches, boxes, device),
                          len(files), device))
    try:
        dali = dali_epoch(files)
    except ImportError:
        print("decode: nvidia-dali is not installed: no DALI row (pip install nvidia-dali-cuda130)", flush=True)
    else:
        rows.append(timed_row("decode: DALI image_random_crop + resize + flip", dali, len(files), device))
    return rows


def with_policy(batches: list, boxes: list, device: torch.device) -> None:
    """Ours, then RandAugment on each crop on the device, drawn per sample as the workers draw it."""
    from common.data.augment import Policy, policy_generator
    from common.data.device_decode import decode_and_crop

    policy = Policy("randaugment")
    for step, (batch, its_boxes) in enumerate(zip(batches, boxes)):
        images = decode_and_crop(batch, its_boxes, DECODE_SIZE, 3, device)
        for k in range(len(images)):
            images[k] = policy(images[k], policy_generator(0, 1, step, k))


def crops_against_cpu(tree: Path, device: torch.device) -> Row:
    """How far --decode gpu's training crops on `device` are from the CPU workers' (streamed, the
    same draws, the same boxes), in grey levels: the row's max |dw| is the largest difference, and
    it passes where they agree within CROP_MEAN_LEVELS on average."""
    from common.data import own
    from common.data.augment import Draws
    from common.data.reading import Streamed

    label = "decode: --decode gpu crops vs the CPU workers' (max grey-level difference)"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            opts = own.OwnData("imagefolder", str(tree), tmp, {}, image_size=DECODE_SIZE, workers=0, prepare_workers=8,
                               skip_broken=False, cache_gb=0.0, shard_cache_gb=1.0)
            data = own.open_prepared(own.prepare(opts, lambda line: None), opts)
            indices, draws = [torch.arange(k, k + 64) for k in range(0, 256, 64)], Draws(0, 1, 0, 64, "basic")
            cpu = [images for images, _ in data.train.batches(indices, torch.device("cpu"), draws, range(64))]
            gpu = [images.cpu() for images, _ in
                   Streamed(data.train.source, 0, gpu_decode=True).batches(indices, device, draws, range(64))]
    except Exception as e:  # noqa: BLE001 - the row reports it, the others still run
        return Row(label, 1, False, why=" ".join(str(e).split())[:200])
    worst = max((a.int() - b.int()).abs().max().item() for a, b in zip(cpu, gpu))
    mean = sum((a.float() - b.float()).abs().mean().item() for a, b in zip(cpu, gpu)) / len(cpu)
    print(f"decode: GPU crops vs CPU crops: max {worst} grey levels, mean {mean:.3f}", flush=True)
    return Row(label, 1, mean <= CROP_MEAN_LEVELS, max_dw=float(worst),
               why=f"{mean:.3f} grey levels apart on average, {worst} at most")


# nvJPEG's IDCT and libjpeg-turbo's may differ by a level, and the CPU decodes at a reduced DCT scale
# where the box keeps twice the model's size: on average the crops must agree within a grey level.
CROP_MEAN_LEVELS = 1.0


def training_row(tree: Path, decode: str, model: str) -> Row:
    """train_ddp.py on one GPU streaming the photos (--cache-gb 0) at 224, with --decode `decode`:
    images/s after the first interval; the CPU path gets the node's cores as workers."""
    steps = max(2, len(list((tree / "train").glob("*/*"))) // DECODE_BATCH)
    flags = ["--dataset", "imagefolder", "--data-dir", str(tree), "--image-size", str(DECODE_SIZE), "--cache-gb", "0",
             "--model", model, "--batch-size", str(DECODE_BATCH), "--epochs", "1", "--max-steps", str(steps),
             "--log-every", str(max(1, steps // 4)), "--decode", decode, *NCCL, "--precision", "bf16"]
    done = train(["train_ddp.py"], flags, 1)
    print("\n".join(line for line in done.stdout.splitlines() if "input" in line or "streamed" in line), flush=True)
    return row(f"input: train_ddp.py {model}, photos streamed, --decode {decode}", 1, done, DECODE_BATCH)


def timed_row(label: str, epoch: Callable[[], None], images: int, device: torch.device) -> Row:
    """One warm-up pass, then one timed pass of `epoch`; a failure is a FAIL row with its line."""
    import time

    cuda = device.type == "cuda"
    try:
        epoch()
        torch.cuda.synchronize(device) if cuda else None
        start = time.perf_counter()
        epoch()
        torch.cuda.synchronize(device) if cuda else None
    except Exception as e:  # noqa: BLE001 - a row's failure is reported in the table, the others still run
        return Row(label, 1, False, why=" ".join(str(e).split())[:200])
    return Row(label, 1, True, images / (time.perf_counter() - start),
               cuda_mb=torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None)


def dali_epoch(files: list[bytes]) -> Callable[[], None]:
    """DALI's fused GPU decode + random-resized crop (its ROI decode), resize and flip, fed the same
    encoded bytes; ImportError where DALI is not installed."""
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    arrays = [np.frombuffer(data, dtype=np.uint8) for data in files]
    batches = [arrays[i:i + DECODE_BATCH] for i in range(0, len(arrays), DECODE_BATCH)]

    @pipeline_def(batch_size=DECODE_BATCH, num_threads=4, device_id=0)
    def crops():
        encoded = fn.external_source(name="jpegs", dtype=types.UINT8)
        images = fn.decoders.image_random_crop(encoded, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=DECODE_SIZE, resize_y=DECODE_SIZE)
        return fn.flip(images, horizontal=fn.random.coin_flip())

    pipe = crops()
    pipe.build()

    def epoch() -> None:
        for batch in batches:
            pipe.feed_input("jpegs", batch)
            pipe.run()
    return epoch


def table_line(r: Row) -> str:
    figure = lambda value, form: "" if value is None else format(value, form)  # noqa: E731
    return (f"| {r.label} | {r.world} | {figure(r.images_per_s, ',.0f')} | {figure(r.max_dw, '.3g')} | "
            f"{figure(r.cuda_mb, ',.0f')} | {'pass' if r.passed else 'FAIL'} |")


def print_table(rows: list[Row]) -> None:
    print("\n| check | world | images/s | max \\|dw\\| | CUDA MB per rank (max) | result |\n|---|---|---|---|---|---|")
    for r in rows:
        print(table_line(r))
    for r in rows:
        if not r.passed:
            print(f"FAIL {r.label}: {r.why}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", default=[], help="run only the rows whose label contains one of these")
    p.add_argument("--model", default="resnet18", help="model of the throughput rows (default: %(default)s)")
    p.add_argument("--per-rank", type=int, default=64, help="images per GPU and step (default: %(default)s)")
    p.add_argument("--photos", type=Path, default=None,
                   help="the decode rows' source photos (default: bench pipeline's: scikit-image's, scikit-learn's)")
    p.add_argument("--decode-images", type=int, default=2048, help="photos of the decode rows (default: %(default)s)")
    p.add_argument("--decode-model", default="torchvision:resnet50",
                   help="model of the decode rows' training runs (default: %(default)s)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"error: no CUDA device here (torch {torch.__version__}, CUDA build "
                         f"{torch.version.cuda or 'none'}): python -m bench gpu needs a machine with a GPU")
    gpus = torch.cuda.device_count()
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    wanted = lambda label: not a.only or any(word in label for word in a.only)  # noqa: E731
    rows = []
    for check in (c for c in plan(gpus, a.model, a.per_rank) if wanted(c.label)):
        done = train(check.script, check.flags, check.world)
        rows.append(row(check.label, check.world, done, check.images))
        print(table_line(rows[-1]), f"({rows[-1].why})" if rows[-1].why else "", flush=True)  # kept if cut short
        if not rows[-1].passed:
            print(done.stderr[-FAILURE_TAIL:], flush=True)
    if wanted(KILL_AND_RESUME):
        rows.append(kill_and_resume(gpus))
    if wanted("decode: "):
        rows += decode_rows(a.photos, a.decode_images, torch.device("cuda", 0), a.decode_model)
    print_table(rows)
    if not all(r.passed for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
