"""The own-image crop geometry (common/data/geometry.py) against torchvision's own (in-process)."""
from __future__ import annotations

import pytest
import torch
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as F

from common.data.geometry import (
    Box,
    eval_box,
    random_resized_box,
    resized_crop,
    sample_generator,
    train_box,
)

# photo shapes, an extreme panorama and a sliver (the centre fallback), a tiny image
SHAPES = [(375, 500), (500, 375), (480, 640), (333, 1000), (40, 1000), (1000, 40), (7, 9)]


@pytest.mark.quick
@pytest.mark.parametrize("height,width", SHAPES)
def test_boxes_are_torchvisions_from_the_same_generator_state(height, width):
    image = torch.empty(3, height, width, dtype=torch.uint8)
    fallbacks = 0
    for seed in range(300):
        torch.manual_seed(seed)
        theirs = RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])
        ours = random_resized_box(torch.Generator().manual_seed(seed), height, width)
        assert tuple(ours[:4]) == tuple(theirs), (seed, ours, theirs)
        fallbacks += ours.top == (height - ours.height) // 2 and ours.left == (width - ours.width) // 2
    if width / height > 20:  # ten tries always miss: the centre crop clamped to 4/3
        assert fallbacks == 300


@pytest.mark.quick
@pytest.mark.parametrize("box", [Box(10, 20, 300, 200), Box(0, 0, 375, 500), Box(5, 7, 30, 41), Box(1, 2, 224, 224),
                                 Box(3, 4, 100, 120, flip=True)])
def test_the_crop_is_torchvisions_antialiased_resized_crop_of_the_box(box):
    image = torch.randint(0, 256, (3, 375, 500), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    theirs = F.resized_crop(image, *box[:4], [224, 224], antialias=True)
    if box.flip:
        theirs = F.horizontal_flip(theirs)
    out = torch.zeros(2, 3, 224, 224, dtype=torch.uint8)
    assert torch.equal(resized_crop(image, box, 224), theirs)
    assert torch.equal(resized_crop(image, box, 224, out=out[1]), theirs) and torch.equal(out[1], theirs)


@pytest.mark.quick
def test_a_samples_box_and_flip_depend_on_its_position_only_and_flip_half_the_time():
    boxes = [train_box(7, 2, 5, p, 375, 500) for p in range(400)]
    assert boxes == [train_box(7, 2, 5, p, 375, 500) for p in range(400)]
    assert boxes[3] != train_box(7, 3, 5, 3, 375, 500) and boxes[3] != train_box(8, 2, 5, 3, 375, 500)
    assert 150 < sum(b.flip for b in boxes) < 250
    g = sample_generator(7, 2, 5, 3)  # the flip follows the box's draws on the same generator
    assert random_resized_box(g, 375, 500) == boxes[3]._replace(flip=False)
    areas = torch.tensor([b.height * b.width / (375 * 500) for b in boxes])
    assert 0.07 < areas.min() < 0.15 and areas.max() > 0.9  # the whole image, not a stored centre square


@pytest.mark.quick
@pytest.mark.parametrize("height,width,size,expected", [(375, 500, 224, Box(23, 86, 328, 328)),
                                                         (256, 256, 224, Box(16, 16, 224, 224)),
                                                         (500, 375, 224, Box(86, 23, 328, 328)),
                                                         (10, 10, 224, Box(0, 0, 9, 9))])
def test_the_evaluation_crop_is_the_centre_of_the_short_side_scaled_to_s_over_0_875(height, width, size, expected):
    assert eval_box(height, width, size) == expected
