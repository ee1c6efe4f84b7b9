"""--weights SOURCE: a run that starts from trained weights. The weights are built here (a model
initialized in the test and saved to a file, or to the torch hub cache path torchvision looks up):
nothing is downloaded from the internet. In-process tests for the flag's rules, the reading and
fitting of files and the run's identity; one launch of the real script for ZeRO-1 and FSDP2."""
from __future__ import annotations

import hashlib
import io
import os

import pytest
import torch

from common.data.loader import make_synthetic
from common.errors import UserError
from common.models import build_model, spread_rgb
from common.train.app import normalized_for_weights, pinned
from common.train.flags import parse_args
from common.train.optim import Stepping
from common.train.state import parse_checkpoint
from common.weights import Source, fetch_into_hub, hub_path, load_into
from tests.conftest import EQUIVALENCE, child_env, error_lines, latest_state, one_launch, run_script, split_runs
from tests.hfcache import hub_cache, pretrained_state
from tests.httpserver import FileServer

TV = "torchvision:squeezenet1_0"  # a small torchvision model (0.7 M parameters at 10 classes)
SQUEEZENET_URL = "https://download.pytorch.org/models/squeezenet1_0-b66bff10.pth"
LENET_HEAD = ("2.2.weight", "2.2.bias")


def parse(*argv: str):
    return parse_args(list(argv), strategy="fsdp", default_dataset="synthetic", world_size=1)


def saved(obj: object, legacy: bool = False) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
    return buffer.getvalue()


def lenet(classes: int, seed: int, channels: int = 3) -> torch.nn.Module:
    return build_model("lenet", channels, 32, classes, seed)


def suite_checkpoint(model: torch.nn.Module) -> dict:
    """A checkpoint in this suite's layout (checked by its own reader below), of another run."""
    state = {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "scheduler": {},
             "epoch": 1, "step_in_epoch": 0, "global_step": 3, "config": {"model": "lenet"}, "world_size": 2,
             "identity": {"model": "lenet", "seed": 7}}
    parse_checkpoint(saved(state))
    return state


def load(model: torch.nn.Module, data: bytes, flag: str, model_name: str = "lenet", channels: int = 3):
    return load_into(model, data, Source.parse(flag, model_name), channels, seed=0)


def squeezenet_weights(seed: int = 5) -> dict:
    """torchvision's squeezenet1_0 for ImageNet's 1000 classes, as its registry's weights are."""
    import torchvision.models as tv

    torch.manual_seed(seed)
    return tv.squeezenet1_0(num_classes=1000).state_dict()


@pytest.mark.quick
@pytest.mark.parametrize("model, weights, says", [
    ("lenet", "DEFAULT", "--weights DEFAULT is a torchvision weights name, for --model torchvision:NAME"),
    (TV, "IMAGENET1K_V9", f"--weights IMAGENET1K_V9 is not a weights name of {TV}; choose one of DEFAULT, "
                          "IMAGENET1K_V1"),
    ("lenet", "nosuch://bucket/w.pt", "--weights nosuch://bucket/w.pt cannot be read here: no file system"),
])
def test_a_weights_flag_the_flags_alone_refuse_exits_2_naming_it(model, weights, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("--model", model, "--weights", weights)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert parse("--model", TV, "--weights", "DEFAULT").weights == "DEFAULT"


@pytest.mark.quick
def test_another_runs_checkpoint_loads_all_but_a_head_of_another_shape():
    """Its model only, the head (5 classes there, 10 here) left as the model built it from --seed."""
    trained = lenet(classes=5, seed=7)
    data = saved(suite_checkpoint(trained))
    model = lenet(classes=10, seed=0)
    loaded = load(model, data, "other.pt")
    state, fresh, source = model.state_dict(), lenet(classes=10, seed=0).state_dict(), trained.state_dict()
    assert all(torch.equal(state[k], source[k]) for k in state if k not in LENET_HEAD)
    assert all(torch.equal(state[k], fresh[k]) for k in LENET_HEAD)
    # the absolute path: the same file given from another folder is the same run
    assert loaded.flag == f"{os.path.abspath('other.pt')}@sha256:{hashlib.sha256(data).hexdigest()[:16]}"
    banner = loaded.banner()
    assert "checkpoint of this suite at step 3" in banner and "6 tensors loaded" in banner, banner
    assert "not loaded: 2.2.weight, 2.2.bias (the head, (5, 500) in the weights, (10, 500) here" in banner, banner


@pytest.mark.quick
def test_a_state_dict_saved_through_ddp_and_compile_loads_whole():
    trained = lenet(classes=10, seed=7)
    data = saved({f"module._orig_mod.{k}": v for k, v in trained.state_dict().items()})
    model = lenet(classes=10, seed=0)
    loaded = load(model, data, "ddp.pt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values()))
    assert "8 tensors loaded" in loaded.banner() and "not loaded" not in loaded.banner()


@pytest.mark.quick
def test_weights_without_a_head_or_with_part_of_one_leave_the_whole_head_as_built():
    trained = lenet(classes=10, seed=7).state_dict()
    for dropped in (LENET_HEAD, LENET_HEAD[1:]):
        model = lenet(classes=10, seed=0)
        loaded = load(model, saved({k: v for k, v in trained.items() if k not in dropped}), "backbone.pt")
        fresh = lenet(classes=10, seed=0).state_dict()
        assert all(torch.equal(model.state_dict()[k], fresh[k] if k in LENET_HEAD else trained[k]) for k in fresh)
        assert "not loaded: 2.2.weight, 2.2.bias (the head, not in the weights: initialized afresh" in loaded.banner()


@pytest.mark.quick
@pytest.mark.parametrize("change, says", [
    ("convnet", "0.0.weight is (16, 3, 5, 5) in the weights and (20, 3, 5, 5) in the model"),
    ("extra", "the weights hold extra.weight (2,), which the model does not have"),
    ("missing", "the weights lack 0.3.weight"),
])
def test_weights_of_another_architecture_name_the_first_tensor_that_does_not_fit(change, says):
    state = build_model("convnet", 3, 32, 10, 0).state_dict() if change == "convnet" else \
        dict(lenet(10, 7).state_dict())
    if change == "extra":
        state["extra.weight"] = torch.zeros(2)
    if change == "missing":
        del state["0.3.weight"]
    with pytest.raises(UserError) as error:
        load(lenet(10, 0), saved(state), "w.pt")
    assert str(error.value).startswith("--weights w.pt does not fit --model lenet: ") and says in str(error.value)


class Payload:
    """An object a pickle would rebuild by running code: weights_only refuses it."""


@pytest.mark.quick
@pytest.mark.parametrize("content, says", [
    (b"", "is empty"),
    (b"not torch at all", "is truncated or not a file torch.save writes (16 bytes)"),
    (saved({"w": Payload()}), "holds objects that are not plain data and was refused unread (Unsupported global"),
    (saved([torch.zeros(2)]), "holds a list, not a state dict"),
    (saved({"w": torch.zeros(2), "epoch": 3}), "is not a state dict: its entry 'epoch' is a int, not a tensor"),
    (saved({"w": torch.zeros(2)})[:-40], "is truncated or not a file torch.save writes"),
    (saved({"w": torch.zeros(2)}, legacy=True)[:-8], "is truncated or not a file torch.save writes"),
])
def test_a_file_that_is_not_a_state_dict_is_one_line(content, says):
    with pytest.raises(UserError) as error:
        load(lenet(10, 0), content, "bad.pt")
    assert str(error.value).startswith("--weights bad.pt ") and says in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.quick
def test_files_are_read_from_a_path_or_a_store_url_and_a_missing_one_is_named(tmp_path):
    import fsspec

    data = saved(lenet(10, 7).state_dict())
    (tmp_path / "w.pt").write_bytes(data)
    fsspec.filesystem("memory").pipe_file("/weights-test/w.pt", data)
    assert Source.parse(str(tmp_path / "w.pt"), "lenet").read({}, True, print) == data
    assert Source.parse("memory://weights-test/w.pt", "lenet").read({}, True, print) == data
    with pytest.raises(UserError) as error:
        Source.parse(str(tmp_path / "nope.pt"), "lenet").read({}, True, print)
    assert str(error.value).startswith(f"--weights {tmp_path / 'nope.pt'}: no such file; ")


@pytest.mark.quick
def test_a_torchvision_name_is_read_from_the_hub_cache_and_normalizes_its_way(tmp_path, monkeypatch):
    """The registry's file name under $TORCH_HOME/hub/checkpoints; on 1-channel images the RGB
    first convolution is spread over the channel and the normalization averaged over RGB."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    weights = squeezenet_weights()
    path = tmp_path / "hub" / "checkpoints" / "squeezenet1_0-b66bff10.pth"
    assert hub_path(SQUEEZENET_URL) == path
    path.parent.mkdir(parents=True)
    torch.save(weights, path)
    source = Source.parse("DEFAULT", TV)
    model = build_model(TV, 1, 32, 10, 0)
    loaded = load_into(model, source.read({}, False, print), source, 1, seed=0)
    state = model.state_dict()
    assert torch.allclose(state["features.0.weight"], spread_rgb(weights["features.0.weight"], 1))
    assert all(torch.equal(state[k], weights[k]) for k in state
               if k.startswith("features.") and k != "features.0.weight")
    assert "not loaded: classifier.1.weight, classifier.1.bias" in loaded.banner()
    assert "SqueezeNet1_0_Weights.IMAGENET1K_V1" in loaded.banner() and "mean 0.449, std 0.226" in loaded.banner()
    spec = normalized_for_weights(make_synthetic("mnist", 64, 16), loaded).spec
    assert (spec.mean, spec.std) == ((0.449,), (0.226,))


@pytest.mark.quick
def test_torchvisions_file_by_path_is_normalized_as_by_name_and_the_flag_chooses(tmp_path):
    """The registry's file given by its path (an offline cluster's download) is recognized by its
    name, or renamed by its content's sha256 (torch.hub's names carry its first hex digits), and
    normalized as the same weights by name; --normalization data | imagenet chooses otherwise; the
    banner says which."""
    weights = squeezenet_weights()
    path = tmp_path / "squeezenet1_0-b66bff10.pth"
    torch.save(weights, path)
    by_name, by_path = (load_into(build_model(TV, 3, 32, 10, 0), path.read_bytes(), Source.parse(flag, TV), 3, seed=0)
                        for flag in ("IMAGENET1K_V1", str(path)))
    assert by_path.normalization == by_name.normalization == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert "torchvision's SqueezeNet1_0_Weights.IMAGENET1K_V1 file" in by_path.banner()
    assert "images normalized with the statistics SqueezeNet1_0_Weights.IMAGENET1K_V1 was trained with" in \
        by_path.banner()
    renamed = Source.parse(str(tmp_path / "my-weights.pth"), TV)
    assert renamed.torchvision_entry("b66bff10" + "0" * 56).name == "IMAGENET1K_V1"
    assert renamed.torchvision_entry("0" * 64) is None
    data = load_into(build_model(TV, 3, 32, 10, 0), path.read_bytes(), Source.parse(str(path), TV), 3, seed=0,
                     choice="data")
    assert data.normalization is None and "the data set's statistics (--normalization data)" in data.banner()
    lenet_file = tmp_path / "lenet.pt"
    torch.save(lenet(10, 1).state_dict(), lenet_file)
    plain = load(lenet(10, 0), lenet_file.read_bytes(), str(lenet_file))
    assert plain.normalization is None and "the weights carry none of their own" in plain.banner()
    imagenet = load_into(lenet(10, 0), lenet_file.read_bytes(), Source.parse(str(lenet_file), "lenet"), 3, seed=0,
                         choice="imagenet")
    assert imagenet.normalization == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert "ImageNet's mean and std (--normalization imagenet)" in imagenet.banner()


@pytest.mark.quick
def test_the_normalization_flag_needs_weights_and_joins_the_identity_when_chosen(capsys):
    assert "normalization" not in parse("--weights", "w.pt").identity()
    assert parse("--weights", "w.pt", "--normalization", "imagenet").identity()["normalization"] == "imagenet"
    with pytest.raises(SystemExit) as ended:
        parse("--normalization", "imagenet")
    assert ended.value.code == 2 and "--normalization imagenet chooses how images are normalized for --weights" in \
        capsys.readouterr().err


@pytest.mark.quick
def test_offline_without_the_hub_file_names_the_file_its_url_and_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(UserError) as error:
        Source.parse("IMAGENET1K_V1", TV).read({}, False, print)
    folder = tmp_path / "hub" / "checkpoints"
    assert str(error.value) == (f"--weights IMAGENET1K_V1: squeezenet1_0-b66bff10.pth is not in the torch hub cache "
                                f"{folder} and --no-download is set; download {SQUEEZENET_URL} into {folder} (or set "
                                "TORCH_HOME to a folder whose hub/checkpoints holds it)")


@pytest.mark.quick
def test_a_missing_hub_file_is_downloaded_into_the_cache_with_its_hash_checked(tmp_path, monkeypatch):
    """torch.hub's downloader, from a server on 127.0.0.1 standing in for download.pytorch.org: the
    hash prefix in the file name is checked, and a file that fails it is not left in the cache."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    data = saved(lenet(10, 7).state_dict())
    good, bad = f"lenet-{hashlib.sha256(data).hexdigest()[:8]}.pth", "lenet-00000000.pth"
    for name in (good, bad):
        (tmp_path / name).write_bytes(data)
    with FileServer(tmp_path) as server:
        fetch_into_hub("DEFAULT", server.url + good, hub_path(server.url + good), True, print)
        with pytest.raises(UserError) as error:
            fetch_into_hub("DEFAULT", server.url + bad, hub_path(server.url + bad), True, print)
    assert hub_path(server.url + good).read_bytes() == data and server.gets[f"/{good}"] == 1
    assert not hub_path(server.url + bad).exists() and "downloading it failed" in str(error.value)


@pytest.mark.quick
def test_the_content_joins_the_run_identity_and_a_pin_must_match(tmp_path):
    """A changed file is another run (the default checkpoint folder follows the identity); the
    pinned form SOURCE@sha256:HEX refuses a file of other content."""
    path = tmp_path / "w.pt"
    cfgs = {}
    for seed in (1, 2):
        data = saved(lenet(10, seed).state_dict())
        cfg = parse("--model", "lenet", "--weights", str(path))
        cfgs[seed] = pinned(cfg, load(lenet(10, 0), data, str(path)))
        assert cfgs[seed].identity()["weights"] == f"{path}@sha256:{hashlib.sha256(data).hexdigest()[:16]}"
        assert cfgs[seed].checkpoint_dir.endswith(f"-{cfgs[seed].run_id}") and cfgs[seed].run_id != cfg.run_id
    assert cfgs[1].run_id != cfgs[2].run_id
    explicit = parse("--model", "lenet", "--weights", str(path), "--checkpoint-dir", str(tmp_path / "ck"))
    assert pinned(explicit, load(lenet(10, 0), data, str(path))).checkpoint_dir == str(tmp_path / "ck")
    with pytest.raises(UserError, match="its content changed since that run started from it"):
        load(lenet(10, 0), data, cfgs[1].weights)
    load(lenet(10, 0), data, cfgs[2].weights)


def test_fsdp2_and_zero1_start_from_the_weights_sharded_on_two_ranks(tmp_path):
    """One launch, five runs on 2 ranks (gloo). At an lr too small to move a weight: FSDP2 from a
    checkpoint of another run with 5 classes (the head replaced: initialized as a run without
    --weights would), ZeRO-1 from torchvision weights in the hub cache, ZeRO-1 from timm's weights in
    the Hugging Face cache (HF_HUB_OFFLINE) with --layer-decay and --backbone-lr-scale. The weights
    saved after one step are the file's; the banner names what was not loaded; the identity holds the
    hash; the timm run's checkpoint holds an optimizer group per (decay, lr scale), each at its lr,
    and the weights' pretrained data config. And FSDP2 and ZeRO-1 with timm's layer decay and a
    backbone scale, on a timm ViT (no BatchNorm), equal one process (--check-equivalence): the groups
    are the same on every rank, and ZeRO-1's slices cut across them."""
    other = tmp_path / "other.pt"
    torch.save(suite_checkpoint(lenet(classes=5, seed=7)), other)
    hub = tmp_path / "torch" / "hub" / "checkpoints" / "squeezenet1_0-b66bff10.pth"
    hub.parent.mkdir(parents=True)
    torch.save(squeezenet_weights(), hub)
    hub_cache(tmp_path / "hf-hub", "test_resnet.r160_in1k", pretrained_state("test_resnet.r160_in1k"))
    fine_tuning = ["--layer-decay", "0.8", "--backbone-lr-scale", "0.5"]
    common = ["--dataset", "synthetic", "--epochs", "1", "--max-steps", "1", "--batch-size", "16", "--lr", "1e-9",
              "--eval-batch-size", "500"]
    runs = [["train_fsdp.py", "--shard", "full", *common, "--model", "lenet", "--weights", str(other),
             "--checkpoint-dir", str(tmp_path / "ck-full"), "--log-dir", str(tmp_path / "tb-full")],
            ["train_fsdp.py", "--shard", "optimizer", *common, "--model", TV, "--weights", "DEFAULT", "--no-download",
             "--checkpoint-dir", str(tmp_path / "ck-zero"), "--log-dir", str(tmp_path / "tb-zero")],
            ["train_fsdp.py", "--shard", "optimizer", *common, "--model", "timm:test_resnet.r160_in1k", "--weights",
             "DEFAULT", *fine_tuning, "--optimizer", "adamw", "--lr", "1e-9", "--checkpoint-dir",
             str(tmp_path / "ck-timm"), "--log-dir", str(tmp_path / "tb-timm")],
            *(["train_fsdp.py", "--shard", shard, "--dataset", "synthetic", "--model", "timm:test_vit", *fine_tuning,
               "--batch-size", "16", "--check-equivalence", "2", "--checkpoint-dir", str(tmp_path / f"ck-eq-{shard}"),
               "--log-dir", str(tmp_path / f"tb-eq-{shard}")] for shard in ("full", "optimizer"))]
    env = {**child_env(), "TORCH_HOME": str(tmp_path / "torch"), "HF_HUB_CACHE": str(tmp_path / "hf-hub"),
           "HF_HUB_OFFLINE": "1"}
    result = run_script(one_launch(runs), nproc=2, env=env, timeout=400)
    assert result.returncode == 0 and not error_lines(result.stderr), result.stderr[-3000:]
    full, zero, timm_run, *equivalence = split_runs(result.stdout)

    digest = hashlib.sha256(other.read_bytes()).hexdigest()[:16]
    assert f"weights {other}@sha256:{digest} (the model of a checkpoint of this suite at step 3" in full, full
    assert "6 tensors loaded; not loaded: 2.2.weight, 2.2.bias (the head" in full, full
    state, file, fresh = latest_state(tmp_path / "ck-full"), lenet(5, 7).state_dict(), lenet(10, 0).state_dict()
    assert state["identity"]["weights"] == f"{other}@sha256:{digest}"
    # one step at lr 1e-9 moves no weight by 1e-6, whatever the CPU's rounding of the gradient
    assert all(torch.allclose(state["model"][k], file[k], atol=1e-6) for k in file if k not in LENET_HEAD)
    assert all(torch.allclose(state["model"][k], fresh[k], atol=1e-6) for k in LENET_HEAD)

    assert "(torchvision SqueezeNet1_0_Weights.IMAGENET1K_V1" in zero and "not loaded: classifier.1.weight" in zero
    assert ("images normalized with the statistics SqueezeNet1_0_Weights.IMAGENET1K_V1 was trained with, not the data "
            "set's (mean 0.485,0.456,0.406, std 0.229,0.224,0.225)") in zero, zero
    state, file = latest_state(tmp_path / "ck-zero"), squeezenet_weights()
    assert all(torch.allclose(state["model"][k], file[k], atol=1e-6) for k in file if k.startswith("features."))

    assert "timm's pretrained test_resnet.r160_in1k, a safetensors file from the Hugging Face cache" in timm_run
    assert "images normalized with timm's pretrained config of timm/test_resnet.r160_in1k" in timm_run, timm_run
    state = latest_state(tmp_path / "ck-timm")
    assert state["data"]["pretrained"]["crop_pct"] == 0.95 and state["data"]["mean"] == [0.5] * 3
    model = build_model("timm:test_resnet.r160_in1k", 3, 32, 10, 0)
    stepping = Stepping.of(parse("--model", "timm:test_resnet", *fine_tuning), model)
    groups = state["optimizer"]["param_groups"]
    assert len(groups) == len(stepping.groups()) > 2
    for group, key in zip(groups, stepping.groups()):
        assert group["params"] == stepping.members(key) and group["initial_lr"] == pytest.approx(1e-9 * key[1])
    for console in equivalence:
        verdict = EQUIVALENCE.search(console)
        assert verdict and float(verdict[1]) <= float(verdict[5]), console


@pytest.mark.quick
def test_safetensors_load_and_diverged_or_integer_weights_are_one_line(tmp_path):
    """export.py's safetensors output loads as --weights; a tensor with NaN, or integers where the
    model holds floats (a silent cast otherwise), is refused naming it."""
    from safetensors.torch import save

    model = build_model("lenet", 1, 28, 10, 0)
    state = model.state_dict()
    loaded = load_into(build_model("lenet", 1, 28, 10, 1), save(state), Source.parse("w.safetensors", "lenet"), 1, 1)
    assert "a safetensors file" in loaded.banner()
    for name, change, expected in (("nan", lambda t: t.fill_(float("nan")), "holds NaN or infinite values"),
                                   ("int", lambda t: t.long(), "is int64 where the model holds float32")):
        bad = {**state, "0.0.weight": change(state["0.0.weight"].clone())}
        buffer = io.BytesIO()
        torch.save(bad, buffer)
        with pytest.raises(UserError) as refused:
            load_into(build_model("lenet", 1, 28, 10, 1), buffer.getvalue(), Source.parse(f"{name}.pt", "lenet"), 1, 1)
        assert f"--weights {name}.pt: 0.0.weight {expected}" in str(refused.value)
