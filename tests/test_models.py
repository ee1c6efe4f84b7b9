"""Every model trains a step on both image shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.data.loader import CIFAR_SPEC, MNIST_SPEC
from common.models import MODELS, build_model

pytestmark = pytest.mark.quick  # no launch: the quick tier (pytest -m quick)


@pytest.mark.parametrize("spec", [CIFAR_SPEC, MNIST_SPEC], ids=["cifar", "mnist"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_forward_backward(name, spec):
    torch.set_num_threads(1)
    model = build_model(name, spec.channels, spec.size, spec.classes, seed=0)
    images = torch.randn(4, spec.channels, spec.size, spec.size)
    logits = model(images)
    assert logits.shape == (4, 10)
    F.cross_entropy(logits, torch.arange(4)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_same_seed_same_weights():
    a, b = (build_model("lenet", 3, 32, 10, seed=7) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_resnet18_keeps_resolution_for_small_images_and_imagenets_stem_for_large_ones():
    """A 3x3 stride-1 stem suits CIFAR's 32 px; at 224 px it would cost 16x the reference's compute."""
    for size, first_block in ((32, 32), (64, 64), (224, 56)):
        model = build_model("resnet18", 3, size, 10, seed=0)
        features = model.maxpool(model.relu(model.bn1(model.conv1(torch.zeros(1, 3, size, size)))))
        assert features.shape[-1] == first_block, size
