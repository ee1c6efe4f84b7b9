"""The own-image crop geometry (common/data/geometry.py) against torchvision's own (in-process)."""
from __future__ import annotations

import pytest
import torch
from torchvision.transforms import InterpolationMode, RandomResizedCrop
from torchvision.transforms.v2 import functional as F

from common.data.geometry import (
    INTERPOLATIONS,
    Box,
    Resampling,
    Stored,
    choose_resampling,
    eval_box,
    eval_short,
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
@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("box", [Box(10, 20, 300, 200), Box(0, 0, 375, 500), Box(5, 7, 30, 41), Box(1, 2, 224, 224),
                                 Box(3, 4, 100, 120, flip=True), Box(10, 20, 300, 200, flip=True),
                                 Box(5, 7, 30, 41, flip=True), Box(0, 0, 375, 500, flip=True)])
def test_the_crop_is_torchvisions_antialiased_resized_crop_of_the_box(box, interpolation):
    image = torch.randint(0, 256, (3, 375, 500), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    theirs = F.resized_crop(image, *box[:4], [224, 224], interpolation=InterpolationMode(interpolation),
                            antialias=True)
    if box.flip:
        theirs = F.horizontal_flip(theirs)
    assert torch.equal(resized_crop(image, box, 224, interpolation=interpolation), theirs)
    # Into a batch's row, channels-last as the workers' batches are, and CHW: mirrored before the
    # resize there (the kernel's taps are symmetric), the bits of torchvision's resize-then-flip.
    for layout in (torch.channels_last, torch.contiguous_format):
        out = torch.zeros(2, 3, 224, 224, dtype=torch.uint8).contiguous(memory_format=layout)
        resized_crop(image, box, 224, out[1], interpolation)
        assert torch.equal(out[1], theirs) and not out[0].any(), layout
    if interpolation == "bicubic" and box[2:4] != (224, 224):  # not the bilinear kernel under another name
        assert not torch.equal(resized_crop(image, box, 224), theirs)


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


@pytest.mark.quick
def test_a_large_jpeg_decodes_reduced_only_where_the_crop_keeps_s_pixels_and_crops_alike():
    """DCT scaling: 1/4 for a box 4 x 224 px across (2 x 224: 1/2; less: the whole decode), and the
    crop from the reduced decode is the full decode's to a few grey levels (smooth photo-like pixels)."""
    import io

    from PIL import Image

    from common.data.decoding import decode_whole, draft_scale
    from common.data.geometry import scaled

    coarse = torch.rand(3, 12, 16, generator=torch.Generator().manual_seed(3))
    pixels = torch.nn.functional.interpolate(coarse[None], size=(1500, 2000), mode="bicubic")[0]
    buffer = io.BytesIO()
    Image.fromarray(pixels.clamp(0, 1).mul(255).byte().permute(1, 2, 0).numpy()).save(buffer, "JPEG", quality=90)
    data = buffer.getvalue()
    assert [draft_scale(data, Box(0, 0, side, side), 224) for side in (900, 500, 447)] == [4, 2, 1]
    box = Box(100, 200, 1000, 1200)
    whole = decode_whole(data, 3)
    reduced = decode_whole(data, 3, draft_scale(data, box, 224))
    assert whole.shape == (3, 1500, 2000) and reduced.shape == (3, 375, 500)
    full = resized_crop(whole, box, 224).float()
    cheap = resized_crop(reduced, scaled(box, 375, 500, 1500, 2000), 224).float()
    assert (full - cheap).abs().mean() < 2.0


@pytest.mark.quick
@pytest.mark.parametrize("size", [224, 160, 32, 24, 384])
@pytest.mark.parametrize("crop_pct", [0.875, 0.9, 0.95, 0.8, 1.0])
def test_a_crop_fraction_resizes_the_short_side_as_timms_evaluation_does(size, crop_pct):
    """With --crop-pct (or a pretrained config's), the short side timm's own eval transform resizes
    to; without, torchvision's reference's S / 0.875 rounded, as before the flag (256 for 224)."""
    timm_data = pytest.importorskip("timm.data")
    from torchvision.transforms import Resize

    transform = timm_data.create_transform(input_size=size, crop_pct=crop_pct, interpolation="bicubic")
    (resize,) = [t for t in transform.transforms if isinstance(t, Resize)]
    assert eval_short(size, crop_pct) == resize.size
    assert eval_short(size) == round(size / 0.875) and eval_short(224) == 256


@pytest.mark.quick
@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_the_evaluation_view_is_torchvisions_resize_then_centre_crop_at_a_crop_fraction(interpolation):
    """decode() at crop fraction 0.9 (short side 248 for 224) against v2 Resize(248) + CenterCrop(224)
    of the same filter, on a 496 x 660 noise image, where torchvision's crop is whole source pixels
    (a scale of exactly 2): the same pixels but for the crop's border, where one resampling of the box
    sees no pixels outside it; the other filter's are not."""
    import io

    from PIL import Image
    from torchvision.transforms import v2

    from common.data.decoding import decode

    image = torch.randint(0, 256, (3, 496, 660), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    buffer = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, "PNG")
    short = Resampling(0.9, interpolation).short(224)
    theirs = v2.Compose([v2.Resize(short, interpolation=InterpolationMode(interpolation), antialias=True),
                         v2.CenterCrop(224)])(image).int()[:, 4:-4, 4:-4]
    ours = decode(buffer.getvalue(), Stored(224, short, 0, interpolation), 3).int()[:, 4:-4, 4:-4]
    other = decode(buffer.getvalue(), Stored(224, short, 0, next(i for i in INTERPOLATIONS if i != interpolation)),
                   3).int()[:, 4:-4, 4:-4]
    assert short == 248 and eval_box(496, 660, 224, short) == Box(24, 106, 448, 448)
    assert (ours - theirs).abs().max() <= 1
    assert (other - theirs).abs().float().mean() > 2


@pytest.mark.quick
def test_the_resampling_follows_the_flags_then_the_pretrained_config_then_the_reference():
    pretrained = {"crop_pct": 0.95, "crop_mode": "center", "interpolation": "bicubic", "source": "timm's config of X"}
    assert choose_resampling(None, None, None) == Resampling()
    assert choose_resampling(None, None, {"mean": [0.5] * 3, "source": "s"}) == Resampling()  # says neither
    chosen = choose_resampling(None, None, pretrained)
    assert (chosen.crop_pct, chosen.interpolation) == (0.95, "bicubic") and "timm's config of X" in chosen.why
    mixed = choose_resampling(0.9, None, pretrained)
    assert (mixed.crop_pct, mixed.interpolation) == (0.9, "bicubic") and "--crop-pct 0.9" in mixed.why
    assert choose_resampling(1.0, "bilinear", pretrained) == choose_resampling(1.0, "bilinear", None)
    assert "resized to 235 (crop fraction 0.95), bicubic" in chosen.describe(224)
    assert "resized to 256 (224 / 0.875), bilinear" in Resampling().describe(224)


@pytest.mark.quick
@pytest.mark.parametrize("config,says", [
    ({"crop_pct": 0.95, "crop_mode": "squash"}, "crop_mode squash, .*pass --crop-pct F"),
    ({"crop_pct": 1.15, "crop_mode": "center"}, "crop_pct 1.15, .*pass --crop-pct F"),
    ({"interpolation": "nearest"}, "resizes with 'nearest'; pass --interpolation bilinear or bicubic"),
])
def test_a_pretrained_config_the_suite_cannot_follow_stops_naming_the_flag(config, says):
    from common.errors import UserError

    with pytest.raises(UserError, match=says):
        choose_resampling(None, None, {**config, "source": "timm's config of X"})
    choose_resampling(1.0, "bilinear", {**config, "source": "timm's config of X"})  # the flags choose instead
