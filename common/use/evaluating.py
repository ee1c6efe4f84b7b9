"""evaluate.py: a checkpoint's exact test metrics, at any world size.

    torchrun --standalone --nproc_per_node=N evaluate.py --checkpoint FILE_OR_DIR [--ema] [data flags]

The training run's own evaluation (common/train/trainer.py evaluate): every rank scores an
unpadded shard of the test split, one all-reduce combines the counts, and the count is checked
against the split's size, so top-1, top-5 and the confusion matrix are the same at any world size
and equal to the training run's last evaluation of the same checkpoint (the loss up to summation
order). By default the checkpoint's own data set; the data flags name another one of the same
classes, read with the checkpoint's preprocessing and normalization (not that set's statistics).
Every rank reads the checkpoint itself, before the process group: a checkpoint that cannot be
used is one line, exit 2.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from common.config import DATASETS, OWN_DATASETS, SHUFFLE_WINDOW
from common.data.fetch import load_dataset
from common.data.loader import Dataset, Expected
from common.data.own import OwnData
from common.data.reading import default_workers
from common.errors import ConfigError
from common.output import confusion
from common.output.logger import node_console
from common.parallel.context import DistContext, distributed
from common.parallel.failures import told
from common.train.evaluation import CONFUSION_MAX_CLASSES, Metrics, evaluate
from common.train.precision import Precision
from common.train.run import default_eval_batch, torch_memory_format
from common.use.program import check_storage, check_writable, make_parser, run_program, staged, writable_problem
from common.use.source import Preprocessing, Saved

OUTPUT_FILES = ("per_class.csv", "confusion.png", "metrics.json")  # in --output-dir, in the order they are put there


@dataclass(frozen=True)
class Flags:
    """evaluate.py's flags. device, backend, timeout_s and transport are what distributed() reads
    of a training Config: the process group is joined the same way."""

    checkpoint: str
    ema: bool
    dataset: str | None
    data_dir: str | None
    cache_dir: str | None
    download: bool
    download_from: str
    storage_options: dict[str, Any]
    skip_broken: bool
    workers: int | None
    batch_size: int | None
    image_size: int | None
    output_dir: str | None  # None: default_output_dir, once the checkpoint is read
    device: str
    backend: str
    timeout_s: float
    storage_timeout_s: float
    transport: str = "gloo"  # evaluation sends no gradients: no shared-memory region to set up


def parse_flags(argv: Sequence[str] | None = None) -> Flags:
    p = make_parser("evaluate.py", __doc__.split("\n\n")[0])
    add = p.add_argument
    add("--dataset", default=None, help=f"another data set of the checkpoint's classes: one of {', '.join(DATASETS)} "
                                        "(default: the checkpoint's)")
    add("--data-dir", default=None, help="where that data set is (default: the checkpoint's)")
    add("--cache-dir", default=None, help="where decoded sets are kept (default: the training run's)")
    add("--no-download", dest="download", action="store_false", help="never download a built-in set")
    add("--download-from", default="", metavar="BASE_URL", help="download a built-in set's archives from a mirror")
    add("--skip-broken", action="store_true", help="your own images: score without images that do not decode")
    add("--workers", type=int, default=None, metavar="N", help="DataLoader workers per rank for a streamed set")
    add("--batch-size", type=int, default=None,
        help="per-rank evaluation batch (default: the training run's --eval-batch-size, else 64 where any rank is "
             "on a CPU, 1000 where every rank is on a GPU); it never changes the counts")
    add("--image-size", type=int, default=None, metavar="S",
        help="your own images: resize and centre-crop them to S x S, as training does with --image-size; needed when "
             "the set's images differ in size (default: the training run's --image-size; S must be the model's input)")
    add("--output-dir", default=None,
        help="where metrics.json, per_class.csv and confusion.png are written (default: evaluation/step-N, or "
             "step-N-ema, in the checkpoint's run folder; ./evaluation/RUN-step-N for a checkpoint in an object store)")
    add("--device", default="auto", help="auto | cpu | cuda, as for training (default: %(default)s)")
    add("--backend", default="auto", choices=("auto", "gloo", "nccl"), help="as for training (default: %(default)s)")
    add("--timeout-s", type=float, default=300.0, help="process-group timeout (default: %(default)s)")
    a = p.parse_args(argv)
    if a.dataset is not None and a.dataset not in DATASETS:
        p.error(f"--dataset {a.dataset!r} is unknown; choose one of {', '.join(DATASETS)}")
    if (a.batch_size is not None and a.batch_size < 1) or (a.workers is not None and a.workers < 0) or \
            not 0 < a.timeout_s < math.inf or (a.image_size is not None and a.image_size < 1):
        p.error("--batch-size and --image-size must be >= 1, --workers >= 0 and --timeout-s > 0 (finite)")
    check_storage(p, a, "data_dir")
    if a.output_dir is not None:
        check_writable(p, "--output-dir", Path(a.output_dir), output_files(Path(a.output_dir)))
    return Flags(**vars(a))


def output_files(folder: Path) -> list[Path]:
    """The files evaluate.py may write in `folder` (--output-dir)."""
    return [folder / name for name in OUTPUT_FILES]


def default_output_dir(saved: Saved, ema: bool) -> Path:
    """evaluation/step-N[-ema] in the checkpoint's run folder, beside what it evaluates; for a
    checkpoint in an object store, ./evaluation/RUN-step-N[-ema] (the files are written locally)."""
    name = f"step-{saved.step:08d}{'-ema' if ema else ''}"
    if "://" in saved.path:
        run = saved.path.rstrip("/").split("/")[-2]
        return Path("evaluation") / f"{run}-{name}"
    return Path(saved.path).parent / "evaluation" / name


def main(argv: Sequence[str] | None = None) -> None:
    run_program(lambda: parse_flags(argv), evaluate_on_every_rank)


def evaluate_on_every_rank(flags: Flags, saved: Saved) -> None:
    preprocessing = saved.preprocessing()
    saved.weights(flags.ema)  # --ema without a moving average: refused before the process group
    if flags.output_dir is None:
        output = default_output_dir(saved, flags.ema)
        if problem := writable_problem("--output-dir (default)", output, output_files(output)):
            raise ConfigError(f"{problem}, or pass --output-dir")
        flags = replace(flags, output_dir=str(output))
    with distributed(flags) as ctx:
        try:
            score(flags, saved, preprocessing, ctx)
        except Exception as error:  # told while the ranks are known
            raise told(error, ctx) from None


def score(flags: Flags, saved: Saved, preprocessing: Preprocessing, ctx: DistContext) -> None:
    cfg = saved.config
    data = load_data(flags, saved, preprocessing, ctx)
    memory_format = torch_memory_format(cfg["memory_format"])
    model = ctx.together(lambda: saved.model(flags.ema)).to(ctx.device, memory_format=memory_format)
    batch = flags.batch_size or cfg.get("eval_batch_size") or default_eval_batch(ctx.devices)
    metrics = evaluate(model, data, ctx, batch, Precision(cfg["precision"], ctx.device), memory_format)
    if ctx.is_primary:  # after the last collective
        report(flags, saved, data, preprocessing.classes, metrics, ctx.world_size)


def load_data(flags: Flags, saved: Saved, preprocessing: Preprocessing, ctx: DistContext) -> Dataset:
    """The test split of the flags' data set (default: the checkpoint's), normalized as the
    training run was; every rank ends with one line if its classes or image shape differ (your own
    images: once indexed, before any is decoded, and the training split is never decoded)."""
    cfg = saved.config
    expected = Expected(saved.path, preprocessing.spec, preprocessing.classes)
    dataset, data_dir = flags.dataset or cfg["dataset"], flags.data_dir or cfg["data_dir"]
    cache_dir = cfg["cache_dir"] if flags.cache_dir is None else flags.cache_dir
    own = None
    if dataset in OWN_DATASETS:
        own = OwnData(dataset, data_dir, cache_dir, flags.storage_options,
                      # the model's input, made as the run made it (0: the images as they are)
                      cfg["image_size"] if flags.image_size is None else flags.image_size,
                      default_workers(ctx.local_world_size) if flags.workers is None else flags.workers,
                      default_workers(1) + 1, flags.skip_broken, cfg["cache_gb"], cfg["shard_cache_gb"],
                      cfg["verify_data"], image_key=cfg.get("hf_image_key", "image"),
                      label_key=cfg.get("hf_label_key", "label"), lanes=cfg.get("shard_lanes", SHUFFLE_WINDOW),
                      resampling=preprocessing.resampling,
                      evaluated=expected)
    data = load_dataset(dataset, data_dir, ctx=ctx, say=node_console(ctx), allow_download=flags.download,
                        download_from=flags.download_from, cache_dir=cache_dir, storage_options=flags.storage_options,
                        synthetic_shape=cfg["synthetic_shape"], deadline_s=flags.storage_timeout_s, own_data=own)
    if problem := expected.misfit(data.name, data.spec.channels, data.spec.size, data.names()):
        ctx.fail_together(problem)
    return replace(data, spec=preprocessing.spec)  # the training's normalization, not this set's statistics


def report(flags: Flags, saved: Saved, data: Dataset, names: Sequence[str], metrics: Metrics, world: int) -> None:
    """The console's lines, and metrics.json, per_class.csv and confusion.png in --output-dir."""
    correct = round(metrics.acc * metrics.samples)
    has_top5 = math.isfinite(metrics.acc_top5)  # not with 5 classes or fewer: every label is among the 5 highest
    top5 = round(metrics.acc_top5 * metrics.samples) if has_top5 else None
    weights = "the moving average's weights" if flags.ema else "its weights"
    print(f"checkpoint {saved.path} (step {saved.step}), {weights}: {data.name}, {metrics.samples} test images, "
          f"world {world}", flush=True)
    top5_text = f"  top-5 {100 * metrics.acc_top5:.2f}% ({top5}/{metrics.samples})" if has_top5 else ""
    print(f"top-1 {100 * metrics.acc:.2f}% ({correct}/{metrics.samples}){top5_text}  loss {metrics.loss:.4f}",
          flush=True)
    out = Path(flags.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = None if metrics.confusion is None else metrics.confusion.tolist()
    summary = {"checkpoint": saved.path, "step": saved.step, "weights": "ema" if flags.ema else "model",
               "data": data.name, "world_size": world, "samples": metrics.samples, "top1": metrics.acc,
               "top1_correct": correct, "top5": metrics.acc_top5 if has_top5 else None, "top5_correct": top5,
               "loss": metrics.loss,
               "classes": list(names), "confusion": counts}
    with staged(out, OUTPUT_FILES) as staging:  # metrics.json last: the three belong together
        (staging / "metrics.json").write_text(json.dumps(summary, indent=1) + "\n")
        if counts is not None:
            (staging / "per_class.csv").write_text(confusion.csv_text(confusion.per_class(counts, names)))
            (staging / "confusion.png").write_bytes(confusion.png(counts, names, f"{data.name}, step {saved.step}"))
    if counts is None:
        print(f"wrote {out / 'metrics.json'} (no per-class figures: more than {CONFUSION_MAX_CLASSES} classes)",
              flush=True)
        return
    print(f"wrote {out / 'metrics.json'}, {out / 'per_class.csv'} and {out / 'confusion.png'}", flush=True)
