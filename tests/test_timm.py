"""--model timm:NAME and its fine-tuning flags, on timm's own tiny test architectures (test_resnet,
test_vit, test_efficientnet: timm ships them for its CI). Pretrained weights are written here, in the
files the real ones come in: a Hugging Face cache laid out as huggingface_hub lays it out
(models--timm--NAME/refs/main + snapshots/REV/model.safetensors), read with HF_HUB_OFFLINE set, and a
folder as timm's own save_for_hf writes it (config.json + model.safetensors) for local-dir:. Nothing is
downloaded. In-process tests, and two runs on an existing launch of tests/test_weights.py (ZeRO-1 from
the cache with layer decay, FSDP2's --check-equivalence with it)."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("timm", reason="timm is optional for users; CI installs it (requirements-dev.txt)")

import timm  # noqa: E402

from common.data.geometry import choose_resampling  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.models import build_model, spread_rgb  # noqa: E402
from common.train.flags import parse_args  # noqa: E402
from common.train.optim import Stepping, make_optimizer, whole_pieces  # noqa: E402
from common.train.step import uses_randomness  # noqa: E402
from common.use.source import Saved  # noqa: E402
from common.weights import Source, load_into  # noqa: E402
from tests.hfcache import hub_cache, pretrained_state  # noqa: E402

RESNET = "test_resnet.r160_in1k"


def parse(*argv: str):
    return parse_args(list(argv), strategy="ddp", default_dataset="synthetic", world_size=1)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline: HF_HUB_OFFLINE and HF_HUB_CACHE as huggingface_hub
    reads them (its constants, read when it is imported, and the environment, for child processes)."""
    from huggingface_hub import constants

    root = tmp_path / "hf-hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


@pytest.mark.quick
@pytest.mark.parametrize("name", ["test_resnet", "test_vit", "test_efficientnet"])
@pytest.mark.parametrize("channels, size, classes", [(1, 32, 10), (3, 48, 7)])
def test_timm_models_are_built_for_the_sets_classes_channels_and_size(name, channels, size, classes):
    """num_classes and in_chans from the data set; a fixed-size model (the ViT) built for its images."""
    model, same = (build_model(f"timm:{name}", channels, size, classes, seed=0) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))
    assert model.eval()(torch.zeros(2, channels, size, size)).shape == (2, classes)
    if name == "test_vit":
        assert model.patch_embed.img_size == (size, size)


@pytest.mark.quick
def test_unknown_names_tags_and_timm_missing_are_one_line(monkeypatch):
    with pytest.raises(UserError) as error:
        build_model("timm:test_resnett", 3, 32, 10, 0)
    assert str(error.value).startswith("--model timm:test_resnett: not a timm model; close names: test_resnet")
    with pytest.raises(UserError) as error:
        build_model("timm:test_resnet.in22k", 3, 32, 10, 0)
    assert str(error.value) == ("--model timm:test_resnet.in22k: timm has no pretrained tag 'in22k' for test_resnet; "
                                "its tags: test_resnet.r160_in1k")
    with pytest.raises(UserError) as error:
        build_model("timm:ghostnet_050", 3, 32, 10, 0, drop_path=0.1)
    assert str(error.value) == ("--drop-path: --model timm:ghostnet_050 takes no drop-path rate (its blocks have no "
                                "stochastic depth); drop the flag")
    monkeypatch.setitem(sys.modules, "timm", None)  # what `import timm` meets where it is not installed
    with pytest.raises(UserError) as error:
        build_model("timm:test_resnet", 3, 32, 10, 0)
    assert str(error.value) == "--model timm:test_resnet needs timm, which is not installed: pip install timm"


@pytest.mark.quick
@pytest.mark.parametrize("argv, says", [
    (["--model", "timm:test_resnet", "--weights", "IMAGENET1K_V1"], "is not a timm weights name: timm chooses"),
    (["--layer-decay", "0.7"], "--layer-decay needs a timm model"),
    (["--model", "lenet", "--drop-path", "0.1"], "--drop-path needs a timm model"),
    (["--model", "timm:test_vit", "--layer-decay", "1.5"], "--layer-decay must be in (0, 1], or 0 for off (got 1.5)"),
    (["--model", "timm:test_vit", "--drop-path", "1"], "--drop-path must be in [0, 1), 0 for off (got 1)"),
    (["--model", "timm:test_vit", "--backbone-lr-scale", "nan"], "--backbone-lr-scale must be >= 0 and finite"),
    (["--model", "timm:test_vit", "--drop-path", "0.1", "--check-equivalence", "2"],
     "--check-equivalence cannot pass with --drop-path"),
    (["--model", "timm:bad name"], "--model 'timm:bad name' is unknown"),
])
def test_the_flags_alone_refuse_exits_2_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as ended:
        parse(*argv)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.quick
def test_fine_tuning_flags_join_the_identity_only_when_chosen():
    plain = parse("--model", "timm:test_vit").identity()
    assert not {"layer_decay", "backbone_lr_scale", "drop_path"} & plain.keys()
    chosen = parse("--model", "timm:test_vit", "--layer-decay", "0.7", "--backbone-lr-scale", "0.1",
                   "--drop-path", "0.1").identity()
    assert (chosen["layer_decay"], chosen["backbone_lr_scale"], chosen["drop_path"]) == (0.7, 0.1, 0.1)


@pytest.mark.quick
def test_default_weights_are_read_from_the_hub_cache_offline_with_their_data_config(offline_cache):
    """--weights DEFAULT: the file of the model's tag in the Hugging Face cache; on 1-channel images
    the RGB stem spread over the channel; the head replaced; the pretrained config's mean and std
    normalize (averaged over RGB), and the whole data config comes with the weights."""
    weights = pretrained_state(RESNET)
    file = hub_cache(offline_cache, RESNET, weights)
    source = Source.parse("DEFAULT", f"timm:{RESNET}")
    data = source.read({}, True, print)
    assert data == file.read_bytes()
    config = source.data_config()
    assert config == {"mean": [0.5] * 3, "std": [0.5] * 3, "input_size": [3, 160, 160], "crop_pct": 0.95,
                      "crop_mode": "center", "interpolation": "bilinear",
                      "source": "timm's pretrained config of timm/test_resnet.r160_in1k"}
    resampling = choose_resampling(None, None, config)  # what a run at --image-size S evaluates with
    assert (resampling.crop_pct, resampling.interpolation, resampling.short(160)) == (0.95, "bilinear", 168)
    model = build_model(f"timm:{RESNET}", 1, 32, 10, 0)
    loaded = load_into(model, data, source, 1, seed=0, pretrained=config)
    state = model.state_dict()
    assert torch.allclose(state["conv1.0.weight"], spread_rgb(weights["conv1.0.weight"], 1))
    assert all(torch.equal(state[k], weights[k]) for k in state if not k.startswith(("fc.", "conv1.0.")))
    assert loaded.normalization == ((0.5,), (0.5,)) and loaded.pretrained == config
    banner = loaded.banner()
    assert "timm's pretrained test_resnet.r160_in1k, a safetensors file from the Hugging Face cache" in banner
    assert "not loaded: fc.weight, fc.bias (the head, (1000, 96) in the weights, (10, 96) here" in banner
    assert "normalized with timm's pretrained config of timm/test_resnet.r160_in1k (mean 0.5, std 0.5)" in banner


@pytest.mark.quick
def test_a_file_missing_from_the_cache_offline_says_which_file_to_put_where(offline_cache):
    with pytest.raises(UserError) as error:
        Source.parse("DEFAULT", "timm:test_vit").read({}, True, print)
    folder = offline_cache / "models--timm--test_vit.r160_in1k"
    assert str(error.value) == (
        f"--weights DEFAULT: model.safetensors of timm/test_vit.r160_in1k is not in the Hugging Face cache "
        f"{offline_cache} and HF_HUB_OFFLINE is set; on a machine with network run `hf download "
        f"timm/test_vit.r160_in1k model.safetensors` and copy its {folder} folder into {offline_cache} here (or set "
        "HF_HUB_CACHE to a folder that holds it), or `hf download timm/test_vit.r160_in1k --local-dir DIR` and give "
        "--weights local-dir:DIR")


@pytest.mark.quick
def test_a_truncated_weights_file_is_one_line_naming_it_and_how_to_download_it_again(offline_cache, tmp_path):
    """A download cut short (in the cache, in a local-dir folder) is named with its path and the command
    that downloads it again, not 'give a state dict saved with torch.save'."""
    file = hub_cache(offline_cache, RESNET, pretrained_state(RESNET))
    whole = file.read_bytes()
    file.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(UserError) as error:
        Source.parse("DEFAULT", f"timm:{RESNET}").read({}, True, print)
    assert str(error.value).startswith(f"--weights DEFAULT: {file} is truncated or not a safetensors file (")
    assert str(error.value).endswith(f"`hf download timm/{RESNET} model.safetensors --force-download`)")
    folder = tmp_path / "cut"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(whole[:5])
    with pytest.raises(UserError) as error:
        Source.parse(f"local-dir:{folder}", f"timm:{RESNET}").read({}, True, print)
    assert str(error.value).startswith(f"--weights local-dir:{folder}: {folder / 'model.safetensors'} is truncated")
    assert str(error.value).endswith(f"(`hf download REPO --local-dir {folder}`)")


@pytest.mark.quick
def test_a_local_dir_folder_as_timm_saves_it_loads_with_its_config(tmp_path):
    """local-dir:FOLDER, written by timm's save_for_hf (config.json + model.safetensors, the layout of
    `hf download --local-dir`): a ViT's weights at 160 px into a model for 32 px images, the position
    embeddings resampled by timm's own conversion; the config.json's mean and std normalize."""
    from timm.models import save_for_hf

    torch.manual_seed(3)
    pretrained = timm.create_model("test_vit.r160_in1k", pretrained=False)
    folder = tmp_path / "vit"
    save_for_hf(pretrained, str(folder), safe_serialization=True)
    source = Source.parse(f"local-dir:{folder}", "timm:test_vit")
    config = source.data_config()
    assert config["source"] == f"the pretrained config in {folder / 'config.json'}"
    assert config["interpolation"] == "bicubic" and config["input_size"] == [3, 160, 160]
    model = build_model("timm:test_vit", 3, 32, 5, 0)
    loaded = load_into(model, source.read({}, True, print), source, 3, seed=0, pretrained=config)
    state, weights = model.state_dict(), pretrained.state_dict()
    assert state["pos_embed"].shape != weights["pos_embed"].shape  # resampled, not refused
    assert all(torch.equal(state[k], weights[k]) for k in state if k.startswith("blocks."))
    assert loaded.normalization == ((0.5,) * 3, (0.5,) * 3) and loaded.flag.startswith(f"local-dir:{folder}@sha256:")
    edited = {**config, "mean": (0.3, 0.3, 0.3)}  # config.json edited between a run and its resume
    again = load_into(build_model("timm:test_vit", 3, 32, 5, 0), source.read({}, True, print), source, 3, seed=0,
                      pretrained=edited)
    assert again.flag != loaded.flag  # the digest covers the config: a new run, not a resume normalized otherwise
    for missing, says in ((tmp_path / "none", "no such folder"), (tmp_path, "the folder holds none of")):
        with pytest.raises(UserError) as error:
            Source.parse(f"local-dir:{missing}", "timm:test_vit").read({}, True, print)
        assert str(error.value).startswith(f"--weights local-dir:{missing}: {says}")


@pytest.mark.quick
@pytest.mark.parametrize("config, says", [
    ({"architecture": "test_vit", "pretrained_cfg": {"mean": [0.1] * 3, "std": [0.9] * 3}},
     "is the config of test_vit, not of --model timm:test_resnet: its mean and std are not this model's"),
    ({"mean": "imagenet", "std": [0.2] * 3}, 'mean "imagenet" and std [0.2, 0.2, 0.2] are not two lists of 1 or 3'),
    ({"mean": [0.5, 0.5], "std": [0.2, 0.2]}, "mean [0.5, 0.5] and std [0.2, 0.2] are not two lists of 1 or 3"),
    ({"mean": [0.5] * 3, "std": [0, 0, 0]}, "std [0, 0, 0] is not positive (images are divided by it)"),
    ({"mean": [0.5] * 3}, "its mean comes without its std"),
    ({"mean": [0.5] * 3, "std": [0.2] * 3, "input_size": "big"}, 'input_size "big" is not [channels, height, width]'),
    ({"crop_pct": -1}, "crop_pct -1 is not a positive fraction"),
])
def test_a_local_dir_config_that_is_not_this_models_or_cannot_normalize_is_one_line(tmp_path, config, says):
    """config.json normalizes every image: one of another architecture, or a mean and std that would
    raise deep in the set-up or divide by zero (a NaN loss), is refused naming the file, not used."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as error:
        Source.parse(f"local-dir:{tmp_path}", f"timm:{RESNET}").data_config()
    assert str(error.value).startswith(f"--weights local-dir:{tmp_path}: {tmp_path / 'config.json'}")
    assert says in str(error.value)
    plain = {"architecture": "test_resnet", "pretrained_cfg": {"mean": [0.5], "std": [0.25]}}
    (tmp_path / "config.json").write_text(json.dumps(plain))  # a one-channel model's: no input size to show
    config = Source.parse(f"local-dir:{tmp_path}", f"timm:{RESNET}").data_config()
    assert config == {"mean": [0.5], "std": [0.25], "source": f"the pretrained config in {tmp_path / 'config.json'}"}
    model, file = build_model("timm:test_resnet", 3, 32, 5, 0), io.BytesIO()
    torch.save(model.state_dict(), file)
    banner = load_into(model, file.getvalue(), Source.parse("x.pt", "timm:test_resnet"), 3, 0,
                       pretrained=config).banner()
    assert banner.endswith("(mean 0.5,0.5,0.5, std 0.25,0.25,0.25)")  # no empty "pretrained at" note


@pytest.mark.quick
def test_layer_decay_gives_timms_scales_and_the_backbone_scale_multiplies_them():
    """Each parameter's lr is timm's param_groups_layer_decay's lr_scale x --lr; with
    --backbone-lr-scale 0 only the head moves (a linear probe)."""
    from timm.optim import param_groups_layer_decay

    model = build_model("timm:test_vit", 3, 32, 5, 0)
    cfg = parse("--model", "timm:test_vit", "--layer-decay", "0.6", "--optimizer", "adamw", "--lr", "0.01")
    stepping = Stepping.of(cfg, model)
    expected = {id(p): g["lr_scale"] for g in param_groups_layer_decay(model, layer_decay=0.6) for p in g["params"]}
    assert list(stepping.scales) == [expected[id(p)] for p in model.parameters()]
    assert len(set(stepping.scales)) > 3
    optimizer = make_optimizer(cfg, whole_pieces(model.parameters()), stepping)
    lr = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert [lr[id(p)] for p in model.parameters()] == [0.01 * s for s in stepping.scales]

    probe = parse("--model", "timm:test_vit", "--backbone-lr-scale", "0", "--lr", "0.1")
    optimizer = make_optimizer(probe, whole_pieces(model.parameters()), Stepping.of(probe, model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 3, 32, 32)).sum().backward()
    optimizer.step()
    moved = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert moved == {"head.weight", "head.bias"}


@pytest.mark.quick
def test_drop_path_makes_steps_reseeded_and_the_checkpoint_carries_the_data_config(tmp_path):
    """Stochastic depth draws random numbers: the trainer reseeds each step for it, as for dropout.
    A checkpoint's data entry with a pretrained config gives it to predict.py and export.py."""
    assert uses_randomness(build_model("timm:test_resnet", 3, 32, 5, 0, drop_path=0.1))
    assert not uses_randomness(build_model("timm:test_resnet", 3, 32, 5, 0))
    pretrained = {"mean": [0.5] * 3, "std": [0.5] * 3, "crop_pct": 0.95, "source": "timm's ..."}
    saved = Saved("x.pt", {"config": {"model": "timm:test_vit", "seed": 0, "drop_path": 0.1},
                           "data": {"classes": list("abcde"), "channels": 3, "size": 32, "mean": [0.5] * 3,
                                    "std": [0.5] * 3, "resize": 0, "pretrained": pretrained}})
    assert saved.preprocessing().plain()["pretrained"] == pretrained
    assert saved.build()(torch.zeros(2, 3, 32, 32)).shape == (2, 5)
