"""Model registry: each builder adapts to the data set's channels and image size.

Besides the built-ins, --model takes `torchvision:NAME` (a torchvision classification model,
untrained), `timm:NAME` (a timm model, untrained: common/timm_models.py) and `MODULE:FUNCTION` (the
user's builder, with the built-ins' signature). Every model is
checked on a dummy batch when built, so a model that cannot train on the data set fails at start-up
with one line naming --model, not with a traceback at the first step.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from typing import Callable

import torch
from torch import nn

from common.errors import UserError, first_line
from common.timm_models import TIMM, timm_builder

Builder = Callable[[int, int, int], nn.Module]
TORCHVISION = "torchvision:"


def _flat_size(features: nn.Module, channels: int, size: int) -> int:
    """Width of the flattened feature map, found by one dummy forward instead of hand arithmetic."""
    with torch.no_grad():
        return features(torch.zeros(1, channels, size, size)).numel()


def _classifier(features: nn.Module, head: Callable[[int], nn.Module], channels: int, size: int) -> nn.Module:
    return nn.Sequential(features, nn.Flatten(), head(_flat_size(features, channels, size)))


def cifar_net(channels: int, size: int, classes: int) -> nn.Module:
    """The seeds' 5-conv CIFAR net with a 120-84 MLP head."""
    def conv(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True)]

    features = nn.Sequential(
        *conv(channels, 32), *conv(32, 32), nn.MaxPool2d(2),
        *conv(32, 64), *conv(64, 64), nn.MaxPool2d(2),
        *conv(64, 128), nn.MaxPool2d(2),
    )
    return _classifier(features, lambda n: nn.Sequential(
        nn.Linear(n, 120), nn.ReLU(inplace=True), nn.Linear(120, 84), nn.ReLU(inplace=True), nn.Linear(84, classes),
    ), channels, size)


def simple_cnn(channels: int, size: int, classes: int) -> nn.Module:
    """The seeds' MNIST CNN: two convs, max-pool, dropout, a 128-wide hidden layer."""
    features = nn.Sequential(
        nn.Conv2d(channels, 32, 3), nn.ReLU(inplace=True), nn.Conv2d(32, 64, 3), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), nn.Dropout(0.25),
    )
    return _classifier(features, lambda n: nn.Sequential(
        nn.Linear(n, 128), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(128, classes),
    ), channels, size)


def convnet(channels: int, size: int, classes: int) -> nn.Module:
    """The seeds' 2-conv BatchNorm ConvNet (16 and 32 channels, 5x5 kernels)."""
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 5, padding=2), nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.MaxPool2d(2)]

    features = nn.Sequential(*block(channels, 16), *block(16, 32))
    return _classifier(features, lambda n: nn.Linear(n, classes), channels, size)


def lenet(channels: int, size: int, classes: int) -> nn.Module:
    """LeNet-style net with 20 and 50 conv channels and a 500-wide hidden layer."""
    features = nn.Sequential(
        nn.Conv2d(channels, 20, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(20, 50, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
    )
    return _classifier(features, lambda n: nn.Sequential(
        nn.Linear(n, 500), nn.ReLU(inplace=True), nn.Linear(500, classes),
    ), channels, size)


SMALL_IMAGE = 64  # the largest size that gets resnet18's small-image stem


def resnet18(channels: int, size: int, classes: int) -> nn.Module:
    """torchvision's ResNet-18. Small images (CIFAR's 32 px) get a 3x3 stride-1 stem and no
    max-pool: ImageNet's stem would shrink a 32x32 image to 8x8 before the first block and cost ~10
    points of CIFAR accuracy. Larger images keep ImageNet's stem: the small one would cost 16x the
    compute and activation memory of the reference ResNet-18 at 224 px."""
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(num_classes=classes)
    if size <= SMALL_IMAGE:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    else:  # ImageNet's stem, for any number of channels
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


MODELS: dict[str, Builder] = {
    "cifar_net": cifar_net,
    "simple_cnn": simple_cnn,
    "convnet": convnet,
    "lenet": lenet,
    "resnet18": resnet18,
}


def model_problem(name: str) -> str | None:
    """What is wrong with a --model string's form, found from the string alone (no imports), or None."""
    if name in MODELS or re.fullmatch(rf"{TIMM}\w+(\.\w+)?", name):
        return None
    module, colon, function = name.rpartition(":")
    if colon and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module) and re.fullmatch(r"[A-Za-z_]\w*", function):
        return None
    return (f"is unknown; choose one of {', '.join(MODELS)}, torchvision:NAME (a torchvision classification model), "
            "timm:NAME[.TAG] (a timm model) or MODULE:FUNCTION (your FUNCTION(channels, size, classes) returning an "
            "nn.Module)")


def build_model(name: str, channels: int, size: int, classes: int, seed: int, drop_path: float = 0.0) -> nn.Module:
    """Same seed -> same initial weights on every rank (strategies still broadcast from rank 0).
    Raises UserError, naming --model, for a model that cannot be found, built or run on this data set.
    drop_path: --drop-path, the stochastic depth rate of a timm model."""
    builder = find_builder(name, drop_path)
    torch.manual_seed(seed)
    try:
        model = builder(channels, size, classes)
    except UserError:
        raise
    except Exception as e:  # the user's code, torchvision's or timm's: any failure is the flag's to report
        raise UserError(f"--model {name}: building it for (channels, size, classes) = ({channels}, {size}, {classes}) "
                        f"raised {first_line(e, with_type=True)}") from e
    if not isinstance(model, nn.Module):
        raise UserError(f"--model {name}: the builder returned a {type(model).__name__}, not a torch.nn.Module")
    check_on_dummy_batch(name, model, channels, size, classes)
    return model


def find_builder(name: str, drop_path: float = 0.0) -> Builder:
    if name in MODELS:
        return MODELS[name]
    if name.startswith(TORCHVISION):
        return torchvision_builder(name[len(TORCHVISION):])
    if name.startswith(TIMM):
        return timm_builder(name[len(TIMM):], drop_path)
    module, _, function = name.rpartition(":")
    return user_builder(name, module, function)


# --- torchvision:NAME --------------------------------------------------------------------------------

def torchvision_builder(model: str) -> Builder:
    """A torchvision classification builder, untrained (weights=None: nothing is downloaded)."""
    import torchvision.models as tv

    names = tv.list_models(module=tv)  # classification only: detection, video, ... live in submodules
    if model not in names:
        kind = "not a classification model (only torchvision.models' own are)" if model in tv.list_models() else \
            "not a torchvision model"
        close = difflib.get_close_matches(model, names, n=4, cutoff=0.6)
        hint = f"close names: {', '.join(close)}" if close else \
            "see torchvision.models.list_models(module=torchvision.models)"
        raise UserError(f"--model {TORCHVISION}{model}: {kind}; {hint}")

    def build(channels: int, size: int, classes: int) -> nn.Module:
        net = tv.get_model(model, weights=None, num_classes=classes, **torchvision_options(model, size))
        return adapt_first_conv(f"{TORCHVISION}{model}", net, channels)

    return build


def torchvision_options(model: str, size: int) -> dict[str, object]:
    """Builder options where torchvision's defaults do not fit training from scratch on our images:
    auxiliary heads make the training-mode output a tuple instead of logits, and a vision
    transformer fixes its input size when built (224 by default)."""
    if model in ("googlenet", "inception_v3"):
        return {"aux_logits": False, "init_weights": True}
    if model.startswith("vit_"):
        return {"image_size": size}
    return {}


# The auxiliary heads that torchvision_options turns off: their tensors in torchvision's weights of
# these models have no place in the model (common/weights.py leaves them out).
AUXILIARY_HEADS = {"googlenet": ("aux1.", "aux2."), "inception_v3": ("AuxLogits.",)}


def adapt_first_conv(name: str, model: nn.Module, channels: int) -> nn.Module:
    """torchvision's models take RGB. For another channel count the first 3-channel convolution
    takes `channels` inputs instead, its weights the RGB ones summed and spread evenly over the
    channels: at initialisation the model sees each image as the grey image of its channels' mean."""
    if channels == 3:
        return model
    found = next(((parent, attr, conv) for parent in model.modules() for attr, conv in parent.named_children()
                  if isinstance(conv, nn.Conv2d) and conv.in_channels == 3 and conv.groups == 1), None)
    if found is None:
        raise UserError(f"--model {name} takes 3-channel images and has no first convolution to adapt to this "
                        f"{channels}-channel data set; use a built-in model or your own (--model MODULE:FUNCTION)")
    parent, attr, rgb = found
    conv = nn.Conv2d(channels, rgb.out_channels, rgb.kernel_size, rgb.stride, rgb.padding, rgb.dilation,
                     bias=rgb.bias is not None, padding_mode=rgb.padding_mode)
    with torch.no_grad():
        conv.weight.copy_(spread_rgb(rgb.weight, channels))
        if rgb.bias is not None:
            conv.bias.copy_(rgb.bias)
    setattr(parent, attr, conv)
    return model


def spread_rgb(weight: torch.Tensor, channels: int) -> torch.Tensor:
    """An RGB convolution's weights (out, 3, kh, kw) for `channels` inputs: summed over RGB and spread
    evenly, so that each image reads as the grey image of its channels' mean. Trained weights
    (--weights) get the same treatment as the initial ones."""
    return weight.sum(dim=1, keepdim=True).expand(-1, channels, -1, -1) / channels


# --- MODULE:FUNCTION ---------------------------------------------------------------------------------

def user_builder(name: str, module_name: str, function: str) -> Builder:
    """FUNCTION from MODULE, imported from PYTHONPATH or the current directory."""
    module = import_user_module(name, module_name)
    builder = getattr(module, function, None)
    if not callable(builder):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(function, public, n=4, cutoff=0.5)
        where = getattr(module, "__file__", None) or module_name
        hint = f"; close names: {', '.join(close)}" if close else ""
        raise UserError(f"--model {name}: {where} has no function {function!r}{hint}")
    return builder


def import_user_module(name: str, module_name: str) -> object:
    """The current directory joins the search path: torchrun puts the script's folder first on
    sys.path, not the directory the user started it from. It goes after that folder, so a module of
    the user's cannot hide the suite's own."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(1, cwd)
    importlib.invalidate_caches()  # a module written moments ago (by a test, a notebook) is found
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(f"{e.name}.")):
            raise UserError(f"--model {name}: no module {module_name!r} in the current directory ({cwd}) or on "
                            "PYTHONPATH; run from the folder that holds it or add that folder to PYTHONPATH") from e
        raise UserError(f"--model {name}: importing {module_name} failed: {first_line(e, with_type=True)}") from e
    except Exception as e:  # a syntax error, or the module's own code raising
        raise UserError(f"--model {name}: importing {module_name} raised {first_line(e, with_type=True)}") from e


# --- the check every model passes ----------------------------------------------------------------------

DUMMY_BATCH = 2  # BatchNorm needs more than one value per channel in training mode
TRY_SIZES = (64, 96, 128, 224, 299)  # where a model too deep for the images first runs, named in its error


def check_on_dummy_batch(name: str, model: nn.Module, channels: int, size: int, classes: int) -> None:
    """The model must turn a batch of images into (batch, classes) logits, in training and in
    evaluation mode (the trainer and the evaluator call it in each)."""
    try:
        outputs = dummy_outputs(model, channels, size)
    except Exception as e:
        raise UserError(forward_failure(name, model, channels, size, e)) from e
    for mode, out in outputs.items():
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (DUMMY_BATCH, classes):
            got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
            raise UserError(f"--model {name}: on a batch of shape {(DUMMY_BATCH, channels, size, size)} in {mode} "
                            f"mode it returned {got}; it must return logits of shape (batch, classes) = "
                            f"({DUMMY_BATCH}, {classes})")


def dummy_outputs(model: nn.Module, channels: int, size: int) -> dict[str, object]:
    """The model's outputs on a batch of zeros in each mode, leaving no trace: the training-mode
    forward's BatchNorm statistics are put back and random streams (dropout) are untouched, so the
    run starts from the weights and state a model built without the check would have."""
    batch = torch.zeros(DUMMY_BATCH, channels, size, size)
    saved = [b.detach().clone() for b in model.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            return {mode: model.train(mode == "training")(batch) for mode in ("training", "evaluation")}
    finally:
        model.train()
        with torch.no_grad():
            for buffer, value in zip(model.buffers(), saved):
                buffer.copy_(value)


def forward_failure(name: str, model: nn.Module, channels: int, size: int, error: Exception) -> str:
    """The one line for a model whose forward fails; for a model too deep for small images it says
    from which size on it runs."""
    fits = next((s for s in TRY_SIZES if s > size and runs_at(model, channels, s)), None)
    way_out = (f"it runs on {fits}x{fits} images: choose a model for {size}x{size} images (a built-in one, "
               "torchvision:resnet18) or train on larger images" if fits else
               "check the model's forward on images of this shape")
    shape = (DUMMY_BATCH, channels, size, size)
    return f"--model {name} fails on a batch of shape {shape} ({first_line(error, with_type=True)}); {way_out}"


def runs_at(model: nn.Module, channels: int, size: int) -> bool:
    try:
        dummy_outputs(model, channels, size)
        return True
    except Exception:
        return False


def add_model_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of build_model."""
    group.add_argument("--model", default=None,
                       help=f"one of {', '.join(MODELS)}; torchvision:NAME, a torchvision classification "
                            "model, untrained; timm:NAME[.TAG], any model of timm.list_models() (pip "
                            "install timm), untrained; or MODULE:FUNCTION, your FUNCTION(channels, size, "
                            "classes) returning an nn.Module, from PYTHONPATH or the current directory "
                            "(default: per data set)")


def check_model_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if problem := model_problem(a.model):
        p.error(f"--model {a.model!r} {problem}")
