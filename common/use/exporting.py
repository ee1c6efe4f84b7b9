"""export.py: the trained model as a file other runtimes load, and PATH.json beside it stating
what the model expects (image size, channels, resize and crop, mean and std) and its class names.

    python export.py --checkpoint FILE --format onnx|torchscript|safetensors --output PATH [--ema]

onnx: torch.onnx.export's torch.export-based exporter (its TorchScript-based one is deprecated),
input "images" (batch, C, S, S) float32 of any batch size, output "logits" (batch, classes); one
file, or with PATH.data beside it for a model above ONNX_ONE_FILE_BYTES.
torchscript: torch.jit.trace, the format libtorch (C++) loads; PyTorch deprecates torch.jit in
favour of torch.export, and its warning is silenced here. safetensors: the weights alone (the
state dict, PATH.json in the file's metadata too); load them into
common.models.build_model(model, channels, size, classes, seed).
Each file is checked when written: loaded back (ONNX through onnxruntime) and run on a batch of
another size than the export's example, its outputs within 1e-4 of PyTorch's (the largest
difference is printed); a file that fails the check is never put in place. A model that does not
export is one line naming the operator that failed. The files are written under a staging name and
renamed into place once checked (common/use/program.py staged): an error or a Ctrl-C leaves PATH,
PATH.data and PATH.json as they were, never cut.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from common.errors import UserError, first_line
from common.use.program import check_storage, check_writable, make_parser, run_program, staged
from common.use.source import Preprocessing, Saved

FORMATS = ("onnx", "torchscript", "safetensors")
TOLERANCE = 1e-4  # the largest |exported - PyTorch| allowed on a logit, relative to the largest |logit|
EXAMPLE_BATCH, CHECK_BATCH = 2, 3  # a file whose batch size were fixed at export would fail the check
Runner = Callable[[torch.Tensor], torch.Tensor]
# One ONNX file is a protobuf, at most 2 GiB: a model above this keeps its weights in PATH.data beside it.
ONNX_ONE_FILE_BYTES = 1800 * 2**20


def parse_flags(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = make_parser("export.py", __doc__.split("\n\n")[0])
    p.add_argument("--format", required=True, choices=FORMATS, help="the file's format")
    p.add_argument("--output", required=True, metavar="PATH", help="the file to write; PATH.json is written beside it")
    a = p.parse_args(argv)
    check_storage(p, a)
    check_writable(p, "--output", Path(a.output), written(Path(a.output)))
    return a


def main(argv: Sequence[str] | None = None) -> None:
    run_program(lambda: parse_flags(argv), export_checkpoint)


def export_checkpoint(flags: argparse.Namespace, saved: Saved) -> None:
    preprocessing = saved.preprocessing()
    model = saved.model(flags.ema)
    output = Path(flags.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    about = description(saved, preprocessing, flags.format, flags.ema)
    with staged(output.parent, [file.name for file in written(output)]) as staging:
        difference = export(model, saved, preprocessing, flags.format, staging / output.name, about)
        (staging / f"{output.name}.json").write_text(json.dumps(about, indent=1) + "\n")
    print(f"wrote {output} and {output}.json; its outputs on {CHECK_BATCH} inputs are within {difference:.2e} "
          f"of PyTorch's (tolerance {TOLERANCE:g})", flush=True)


def written(output: Path) -> list[Path]:
    """The files an export may write, in the order they are put in place: PATH.data before the model
    file that names it, PATH.json last: it describes the file in place."""
    return [output.with_name(f"{output.name}.data"), output, output.with_name(f"{output.name}.json")]


def description(saved: Saved, p: Preprocessing, fmt: str, ema: bool) -> dict[str, Any]:
    """PATH.json: what a user of the file needs to feed it and read its output."""
    return {"format": fmt, "model": saved.config["model"], "checkpoint": saved.path, "step": saved.step,
            "weights": "ema" if ema else "model",
            "input": {"name": "images", "shape": ["batch", p.channels, p.size, p.size], "dtype": "float32"},
            "output": {"name": "logits", "shape": ["batch", len(p.classes)], "note": "apply softmax for probabilities"},
            "classes": list(p.classes), "preprocessing": p.plain()}


def export(model: nn.Module, saved: Saved, p: Preprocessing, fmt: str, output: Path, about: dict[str, Any]) -> float:
    """Write `output` (a staged file: an error leaves nothing) and check it; the largest difference
    from PyTorch's logits."""
    example, check = inputs(p, EXAMPLE_BATCH, seed=0), inputs(p, CHECK_BATCH, seed=1)
    if fmt == "onnx":
        runner = to_onnx(model, example, output)
    elif fmt == "torchscript":
        runner = to_torchscript(model, example, output)
    else:
        runner = to_safetensors(model, output, saved.build, about)
    with torch.no_grad():
        expected = model(check).float()
        # Relative to the logits' size: logits of 1e-5 would pass an absolute bound whatever the file gave.
        difference = ((runner(check).float() - expected).abs().max() / expected.abs().max().clamp(min=1e-12)).item()
    if not difference <= TOLERANCE:  # NaN too
        raise UserError(f"--format {fmt}: the exported model's outputs differ from PyTorch's by up to {difference:.3g} "
                        f"of the largest logit (more than {TOLERANCE:g}) on {CHECK_BATCH} inputs; no file was written")
    return difference


def inputs(p: Preprocessing, batch: int, seed: int) -> torch.Tensor:
    """Random images, normalized as real ones are: inputs in the range the model was trained on."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(batch, p.channels, p.size, p.size, generator=g)
    return (pixels - torch.tensor(p.mean).view(1, -1, 1, 1)) / torch.tensor(p.std).view(1, -1, 1, 1)


def to_onnx(model: nn.Module, example: torch.Tensor, output: Path) -> Runner:
    import onnxruntime

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's advice on its internals, not the user's model
            torch.onnx.export(model, (example,), str(output), dynamo=True, input_names=["images"],
                              output_names=["logits"], dynamic_shapes=({0: torch.export.Dim("batch")},),
                              external_data=state_bytes(model) > ONNX_ONE_FILE_BYTES, verbose=False)
    except Exception as e:  # noqa: BLE001 - whatever the exporter raises, the user needs the operator
        raise UserError(f"--format onnx: the model does not export to ONNX: {failing_operator(e)}; try --format "
                        "torchscript or safetensors, or change the model") from None
    session = onnxruntime.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    return lambda images: torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])


def state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


OPERATOR_PATTERNS = (re.compile(r"op='([\w.:]+)'"), re.compile(r"target=torch\.ops\.([\w.]+)"))


def failing_operator(error: BaseException) -> str:
    """The operator the exporter could not translate, found in its chain of errors; else the
    innermost error's first line."""
    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 20:
        chain.append(cause)
    for pattern in OPERATOR_PATTERNS:
        for link in chain:
            if match := pattern.search(str(link)):
                return f"operator {match[1]} has no ONNX translation"
    return f"{type(chain[-1]).__name__}: {first_line(chain[-1])}"


def to_torchscript(model: nn.Module, example: torch.Tensor, output: Path) -> Runner:
    """A trace keeps the branches one input took: a forward that branches on its input's values
    (torch's TracerWarning) is refused, as the file would be wrong for other inputs."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit's deprecation notice
        warnings.simplefilter("always", torch.jit.TracerWarning)
        try:
            traced = torch.jit.trace(model, example)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"--format torchscript: tracing the model failed: {type(e).__name__}: {first_line(e)}; "
                            "try --format onnx or safetensors") from None
        if branching := [w for w in seen if issubclass(w.category, torch.jit.TracerWarning)]:
            raise UserError(f"--format torchscript: the model's forward depends on its inputs' values, which a trace "
                            f"cannot keep ({first_line(branching[0].message)}); use --format onnx or safetensors")
        traced.save(str(output))
        return torch.jit.load(str(output))


def current_umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def to_safetensors(model: nn.Module, output: Path, build: Callable[[], nn.Module], about: dict[str, Any]) -> Runner:
    """The weights, read back into a freshly built (untrained) model: the file alone carries them."""
    from safetensors.torch import load_model, save_model

    save_model(model, str(output), metadata={"format": "pt", "description": json.dumps(about)})
    output.chmod(0o666 & ~current_umask())  # safetensors creates it 0600: readable as the other formats are
    fresh = build().eval()
    load_model(fresh, str(output))
    return fresh
