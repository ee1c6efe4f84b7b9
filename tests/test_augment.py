"""--augment's policies and --random-erase: per sample, the same at any world size and on resume (in-process)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.data import own
from common.data.loader import DataSpec, Split, TrainLoader, make_synthetic, rank_places
from tests.datagen import write_imagefolder

CPU = torch.device("cpu")
POLICIES = ["randaugment", "trivialaugment", "autoaugment"]
CIFAR = make_synthetic("cifar", train_size=64, test_size=1)
MNIST = make_synthetic("mnist", train_size=64, test_size=1)


def batches(split: Split, spec: DataSpec, world: int, rank: int = 0, start_step: int = 0,
            **flags) -> list[torch.Tensor]:
    """This rank's batches of epoch 1 (3 steps of a global batch of 16), from start_step."""
    loader = TrainLoader(split, spec, 16, rank, world, seed=7, device=CPU, max_steps=3, **flags)
    return [images for images, _ in loader.epoch(1, start_step)]


def interleaved(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each step's global batch put back together, each rank's rows at its places (one node)."""
    world = len(per_rank)
    steps = []
    for rows in zip(*per_rank):
        whole = torch.empty(len(rows[0]) * world, *rows[0].shape[1:])
        for rank, part in enumerate(rows):
            whole[list(rank_places(rank, world, 1, len(whole)))] = part
        steps.append(whole)
    return steps


@pytest.mark.quick
@pytest.mark.parametrize("data, spec", [(CIFAR, CIFAR.spec)], ids=["pad-crop"])
def test_two_ranks_rows_are_the_one_process_batch_exactly(data, spec):
    flags = {"augment": "randaugment", "random_erase": 0.25}
    single = batches(data.train, spec, 1, **flags)
    both = interleaved([batches(data.train, spec, 2, rank, **flags) for rank in range(2)])
    assert len(single) == len(both) == 3
    for one, two in zip(single, both):
        assert torch.equal(one, two)


@pytest.mark.quick
def test_streamed_own_images_are_augmented_as_decoded_ones(tmp_path):
    """Your own images go through the same transform whether decoded into the cache or streamed
    by DataLoader workers: an RGB set at --image-size 24 (random-resized crops of the whole image,
    cut by the workers), streamed at world 2 and 4 by two workers per rank, decoded at world 1 by
    none; and a stream resumed mid-epoch (world 2, step 2 of 3) is the rest of that epoch."""
    folder = write_imagefolder(tmp_path / "set", train_size=48, test_size=4, shape="cifar", sizes=(20, 36))
    opts = own.OwnData("imagefolder", str(folder), str(tmp_path / "cache"), {}, image_size=24, workers=0,
                       prepare_workers=0, skip_broken=False, cache_gb=1.0, shard_cache_gb=1.0)
    decoded, streamed = (own.open_prepared(own.prepare(o, lambda line: None), o)
                         for o in (opts, replace(opts, cache_gb=0.0, workers=2)))
    assert streamed.held.startswith("streamed") and decoded.spec.augment == "resized-crop-flip"
    flags = {"augment": "trivialaugment", "random_erase": 0.5}
    single = batches(decoded.train, decoded.spec, 1, **flags)
    for world in (2, 4):
        every = interleaved([batches(streamed.train, streamed.spec, world, rank, **flags) for rank in range(world)])
        assert len(single) == len(every) == 3 and all(torch.equal(a, b) for a, b in zip(single, every)), world
    resumed = interleaved([batches(streamed.train, streamed.spec, 2, rank, start_step=2, **flags) for rank in range(2)])
    assert len(resumed) == 1 and torch.equal(resumed[0], single[2])
    assert not torch.equal(single[0], batches(decoded.train, decoded.spec, 1)[0])


@pytest.mark.quick
def test_a_resumed_epoch_draws_what_the_uninterrupted_one_drew():
    flags = {"augment": "autoaugment", "random_erase": 0.5}
    whole = batches(CIFAR.train, CIFAR.spec, 2, 1, **flags)
    resumed = batches(CIFAR.train, CIFAR.spec, 2, 1, start_step=2, **flags)
    assert len(resumed) == 1 and torch.equal(resumed[0], whole[2])


@pytest.mark.quick
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("data", [CIFAR, MNIST], ids=["rgb", "grayscale"])
def test_policies_change_most_images_in_colour_and_grayscale(policy, data):
    """Grayscale works: every op takes one channel (Color, a saturation change, is the identity there)."""
    basic = torch.cat(batches(data.train, data.spec, 1))
    augmented = torch.cat(batches(data.train, data.spec, 1, augment=policy))
    assert augmented.shape == basic.shape and augmented.isfinite().all()
    changed = (augmented != basic).flatten(1).any(1)
    assert changed.float().mean() > 0.5, f"{policy}: {changed.sum()} of {len(changed)} images changed"


@pytest.mark.quick
def test_random_erase_zeroes_one_box_of_the_chosen_images_and_leaves_the_rest():
    basic = torch.cat(batches(CIFAR.train, CIFAR.spec, 1))
    erased = torch.cat(batches(CIFAR.train, CIFAR.spec, 1, random_erase=0.5))
    differs = erased != basic
    assert (erased[differs] == 0).all()  # value 0 on the normalized image: the data set's mean
    hit = differs.flatten(1).any(1)
    assert 0.25 < hit.float().mean() < 0.75, f"{hit.sum()} of {len(hit)} images erased at P=0.5"
    for image, mask in zip(erased[hit], differs[hit].any(1)):  # what changed fills one box, every channel 0
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        assert (image[:, rows.min():rows.max() + 1, cols.min():cols.max() + 1] == 0).all()


@pytest.mark.quick
def test_the_global_random_state_is_left_as_it_was():
    """Dropout's reseeding (common/train/step.py) draws from the global generator: the loader restores it."""
    torch.manual_seed(11)
    before = torch.get_rng_state()
    batches(MNIST.train, MNIST.spec, 1, augment="trivialaugment", random_erase=1.0)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.quick
def test_the_erased_box_is_torchvisions_random_erasing_from_the_same_generator_state():
    """Eraser draws what v2.RandomErasing draws from the global generator, box for box, and fills it
    with 0 in place: over 200 seeds at P = 0.5 on a 32 x 24 image, the same images erased, the same boxes."""
    from torchvision.transforms import v2

    from common.data.augment import ERASE_RATIO, ERASE_SCALE, Eraser

    theirs, ours, erased = v2.RandomErasing(p=0.5, scale=ERASE_SCALE, ratio=ERASE_RATIO, value=0), Eraser(0.5), 0
    for seed in range(200):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            expected = theirs(torch.ones(3, 32, 24))
        box = ours.box(torch.Generator().manual_seed(seed), 32, 24)
        made = torch.ones(3, 32, 24)
        if box is not None:
            top, left, h, w = box
            made[:, top:top + h, left:left + w] = 0
            erased += 1
        assert torch.equal(made, expected), seed
    assert 60 < erased < 140


def photo_like(channels: int) -> torch.Tensor:
    """A 40 x 56 uint8 (H, W, C) image of smooth ramps, a different one per channel."""
    grid = torch.stack(torch.meshgrid(torch.arange(40), torch.arange(56), indexing="ij"))
    return torch.stack([(grid[0] * 5 + grid[1] * 3 + 60 * c) % 256 for c in range(channels)], -1).to(torch.uint8)


@pytest.mark.quick
@pytest.mark.parametrize("augment", POLICIES)
@pytest.mark.parametrize("channels", [3, 1], ids=["rgb", "grayscale"])
def test_a_cpu_policy_is_torchvisions_on_the_pil_image_from_the_same_generator_state(augment, channels):
    """Policy on a CPU uint8 image (a channels-last row, as the workers' batches hold them) gives,
    pixel for pixel, what torchvision's own transform gives on that image as PIL (the reference
    applies its policy there) with the global generator in the same state: the same ops, the same
    magnitudes and signs, PIL's kernels. 40 seeds on a 40 x 56 photo-like image."""
    import numpy as np
    from PIL import Image

    from common.data.augment import PIL_MODES, Policy

    ours = Policy(augment)
    hwc = photo_like(channels)
    row = hwc.permute(2, 0, 1)  # (C, H, W) over channels-last memory
    pil = Image.fromarray(hwc.numpy()[..., 0] if channels == 1 else hwc.numpy(), PIL_MODES[channels])
    changed = 0
    for seed in range(40):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            expected = torch.from_numpy(np.array(ours.transform(pil))).reshape(40, 56, channels).permute(2, 0, 1)
        made = ours(row.clone(), torch.Generator().manual_seed(seed))
        assert torch.equal(made, expected), seed
        changed += not torch.equal(made, row)
    assert changed > 20, f"{augment}: {changed} of 40 images changed"


@pytest.mark.quick
@pytest.mark.parametrize("augment", POLICIES)
def test_a_gpu_policy_is_torchvisions_on_the_tensor_and_not_quite_the_cpus_pixels(augment):
    """What a CUDA rank runs (torchvision's tensor kernels on the drawn ops; on a CPU tensor here,
    where __call__ takes PIL, so nothing else in the suite runs them) gives, pixel for pixel,
    torchvision's transform on the uint8 tensor from the same global generator state; and the
    CPU's PIL pixels differ from it on some images (Color, Contrast, Rotate), as docs/data.md says."""
    from common.data.augment import Policy

    ours, image, differs = Policy(augment), photo_like(3).permute(2, 0, 1), 0
    for seed in range(40):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            expected = ours.transform(image)
        made = ours.apply(image, ours.draw(torch.Generator().manual_seed(seed), 40, 56))
        assert torch.equal(made, expected), seed
        differs += not torch.equal(made, ours(image, torch.Generator().manual_seed(seed)))
    assert differs > 0, f"{augment}: the CPU's pixels are the GPU's on all 40 images: docs/data.md says otherwise"
