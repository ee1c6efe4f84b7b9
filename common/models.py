"""Model registry: each builder adapts to the data set's channels and image size."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


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


def resnet18(channels: int, size: int, classes: int) -> nn.Module:
    """torchvision's ResNet-18 with a 3x3 stride-1 stem and no max-pool: ImageNet's stem would
    shrink a 32x32 image to 8x8 before the first block and cost ~10 points of CIFAR accuracy."""
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(num_classes=classes)
    model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


MODELS: dict[str, Callable[[int, int, int], nn.Module]] = {
    "cifar_net": cifar_net,
    "simple_cnn": simple_cnn,
    "convnet": convnet,
    "lenet": lenet,
    "resnet18": resnet18,
}


def build_model(name: str, channels: int, size: int, classes: int, seed: int) -> nn.Module:
    """Same seed -> same initial weights on every rank (strategies still broadcast from rank 0)."""
    torch.manual_seed(seed)
    return MODELS[name](channels, size, classes)
