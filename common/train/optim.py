"""Optimizers (SGD, AdamW, LARS, LAMB) and learning-rate schedules of the recipes.

Each optimizer steps "pieces": a whole parameter on most strategies, the part of a parameter that
falls in this rank's slice under ZeRO-1, a shard under FSDP2. A piece knows its parameter (its
position in model.parameters()), so the weight-decay mask and LARS/LAMB's per-parameter norms come
out the same however a parameter is cut: the pieces' squared norms are summed over ranks first.

The optimizer's groups come from a Stepping, one per model and the same on every rank whatever
pieces it holds: a group per (decays, lr scale), decayed ones first. Without --layer-decay and
--backbone-lr-scale that is two groups (decayed, then not), as checkpoints of earlier runs hold.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn

from common.optimizers import OPTIMIZERS
from common.timm_models import layer_scales
from common.weights import head_keys

if TYPE_CHECKING:
    from common.config import Config

SCHEDULES = ("onecycle", "cosine", "constant", "step")  # --schedule
ONECYCLE_START = 0.04  # the one-cycle warm-up rises from 1/25 of the peak lr
WARMUP_START = 0.01  # other schedules warm up from 1/100 of it (torchvision's lr_warmup_decay)
LARS_TRUST = 0.001  # eta of the LARS paper (You et al. 2017): the trust in ||w|| / ||g||


def add_optimizer_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flags of the optimizer (OPTIMIZERS) and of make_scheduler's schedule."""
    add = group.add_argument
    add("--optimizer", default="sgd", choices=OPTIMIZERS,
        help="sgd (nesterov momentum), adamw, lars (SGD with layer-wise trust ratios) or lamb (AdamW with them), "
             "for large batches (default: %(default)s)")
    add("--lr", type=float, default=None, help="peak learning rate (default: per data set and optimizer, scaled "
                                               "linearly with --batch-size)")
    add("--momentum", type=float, default=0.9, help="momentum of sgd and lars (default: %(default)s)")
    add("--betas", type=floats, default=(0.9, 0.999), metavar="B1,B2",
        help="adamw and lamb's moment decays (default: 0.9,0.999)")
    add("--eps", type=float, default=1e-8, help="adamw and lamb's epsilon (default: %(default)s)")
    add("--weight-decay", type=float, default=None,
        help="decoupled for adamw and lamb (default: " + ", ".join(f"{r.weight_decay:g} for {name}" for name, r in
                                                                    OPTIMIZERS.items()) + ")")
    add("--decay-norm-and-bias", action="store_true",
        help="decay every parameter; by default norm layers' weights and all biases get no weight decay (the "
             "torchvision and timm references' practice; before it, this suite decayed everything)")
    add("--layer-decay", type=float, default=0.0, metavar="D",
        help="fine-tuning a timm:NAME model: layer-wise lr decay, each parameter's lr x D ** (depth from the head), "
             "timm's grouping by depth (BEiT's rule; 0.65-0.75 are usual for ViTs) (0: off)")
    add("--backbone-lr-scale", type=float, default=1.0, metavar="F",
        help="fine-tuning: every parameter but the classifier head trains at F x the lr (with --layer-decay's "
             "factor); 0 freezes the backbone (a linear probe), a value < 1 gives the head a higher lr than the "
             "backbone (default: %(default)s)")
    add("--schedule", default="onecycle", choices=SCHEDULES,
        help="lr schedule: onecycle, cosine, constant, or step (x --gamma at each of --milestones) "
             "(default: %(default)s)")
    add("--warmup", type=float, default=None, metavar="N",
        help="steps of linear warm-up from 1/100 of the peak lr, or a fraction of the run when < 1 (default: 0.25 "
             "for onecycle, else 0)")
    add("--extend-to", type=int, default=0, metavar="N",
        help="train a finished run of this command on to epoch N: a new segment of the schedule over the added "
             "epochs (--schedule again, its warm-up included; step keeps the lr the run ended at), from the run's "
             "last checkpoint, saved as a run of its own beside it (0: no extension)")
    add("--min-lr", type=float, default=0.0, help="the lr that onecycle and cosine end at (default: %(default)s)")
    add("--milestones", type=ints, default=(), metavar="E1,E2,...",
        help="with --schedule step: the epochs after which the lr is multiplied by --gamma")
    add("--gamma", type=float, default=0.1, help="with --schedule step: the factor at each milestone (default: "
                                                  "%(default)s)")


def check_optimizer_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The rules of add_optimizer_flags' flags (resolve_defaults first: --lr and --weight-decay set)."""
    if not 0 < a.lr < math.inf:
        p.error(f"--lr must be > 0 and finite (got {a.lr})")
    if a.extend_to and a.extend_to <= a.epochs:
        p.error(f"--extend-to {a.extend_to} must be more than --epochs {a.epochs}: the epoch the extension trains "
                "the finished run on to")
    if len(a.betas) != 2 or not all(0 <= b < 1 for b in a.betas):
        p.error(f"--betas takes two decays in [0, 1) as B1,B2 (got {','.join(map(str, a.betas))})")
    if not (0 < a.eps < math.inf and 0 <= a.weight_decay < math.inf and 0 <= a.momentum < 1):
        p.error(f"--eps must be > 0, --weight-decay >= 0 (both finite) and --momentum in [0, 1) (got {a.eps}, "
                f"{a.weight_decay}, {a.momentum})")
    if not (0 <= a.warmup < math.inf and 0 <= a.min_lr < a.lr and 0 < a.gamma < math.inf):
        p.error(f"--warmup must be >= 0 (steps, or a fraction of the run when < 1), --min-lr in [0, --lr {a.lr:g}) "
                f"and --gamma > 0 (got {a.warmup:g}, {a.min_lr:g}, {a.gamma:g})")
    if (a.schedule == "step") != bool(a.milestones):
        p.error("--schedule step and --milestones E1,E2,... go together: the epochs after which the lr drops")
    if list(a.milestones) != sorted(set(a.milestones)) or any(not 0 < m < a.epochs for m in a.milestones):
        p.error(f"--milestones {','.join(map(str, a.milestones))}: increasing epochs between 1 and --epochs - 1 "
                f"({a.epochs - 1})")
    _refuse_unused(p, a)
    ranges = (("--layer-decay", a.layer_decay, 0 <= a.layer_decay <= 1, "in (0, 1], or 0 for off"),
              ("--backbone-lr-scale", a.backbone_lr_scale, 0 <= a.backbone_lr_scale < math.inf, ">= 0 and finite"))
    for flag, value, valid, bounds in ranges:
        if not valid:
            p.error(f"{flag} must be {bounds} (got {value:g})")


def _refuse_unused(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """A setting the chosen optimizer or schedule does not read is a mistake to say, not to ignore."""
    defaults = {action.dest: action.default for action in p._actions}
    changed = {dest for dest in ("betas", "eps", "momentum", "gamma", "min_lr") if getattr(a, dest) != defaults[dest]}
    reads = OPTIMIZERS[a.optimizer].reads
    unused = {"betas": "betas" not in reads, "eps": "eps" not in reads, "momentum": "momentum" not in reads,
              "gamma": a.schedule != "step", "min_lr": a.schedule not in ("onecycle", "cosine")}
    readers = "; ".join(f"--{flag}: {', '.join(n for n, r in OPTIMIZERS.items() if flag in r.reads)}"
                        for flag in ("betas", "eps", "momentum"))
    if wasted := sorted(dest for dest in changed if unused[dest]):
        p.error(f"{', '.join('--' + d.replace('_', '-') for d in wasted)} {'has' if len(wasted) == 1 else 'have'} no "
                f"effect with --optimizer {a.optimizer} --schedule {a.schedule} ({readers}; --gamma: step; "
                "--min-lr: onecycle, cosine); drop it or choose what reads it")


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(","))


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


@dataclass(frozen=True)
class Piece:
    """What one optimizer entry steps: a tensor (a parameter, a view into ZeRO-1's flat slice, an
    FSDP2 shard) and the position of its parameter in model.parameters()."""

    tensor: torch.Tensor
    owner: int


def decays(param: torch.Tensor, cfg: Config) -> bool:
    """Norm layers' weights and every bias are the 1-D parameters: no decay (timm's rule) unless
    --decay-norm-and-bias."""
    return cfg.decay_norm_and_bias or param.ndim > 1


def whole_pieces(params: Iterable[torch.Tensor]) -> list[Piece]:
    return [Piece(p, i) for i, p in enumerate(params)]


Key = tuple[bool, float]  # a group: (decays, lr scale)


@dataclass(frozen=True)
class Stepping:
    """How each parameter is stepped, by its position in model.parameters(): whether it decays, and
    its lr as a multiple of --lr (--layer-decay's factor times --backbone-lr-scale's)."""

    decays: tuple[bool, ...]
    scales: tuple[float, ...]

    @classmethod
    def of(cls, cfg: Config, model: nn.Module) -> Stepping:
        """From the plain model, or one whose parameters keep their names (FSDP2's)."""
        params = [p for _, p in model.named_parameters()]  # model.parameters()'s order
        return cls(tuple(decays(p, cfg) for p in params), lr_scales(cfg, model))

    def key(self, owner: int) -> Key:
        return self.decays[owner], self.scales[owner]

    def groups(self) -> list[Key]:
        """Decayed first, then not; within each, the higher lr first. Every rank the same list."""
        return [(flag, scale) for flag in (True, False) for scale in sorted(set(self.scales), reverse=True)]

    def members(self, key: Key) -> list[int]:
        """The positions of the parameters in a group, as one process's optimizer lists them."""
        return [i for i in range(len(self.decays)) if self.key(i) == key]


def lr_scales(cfg: Config, model: nn.Module) -> tuple[float, ...]:
    """Each parameter's lr over --lr: timm's layer-wise decay, times --backbone-lr-scale for every
    parameter outside the classifier head (the layer that makes the logits, as --weights finds it)."""
    names = [name for name, _ in model.named_parameters()]
    scales = layer_scales(model, cfg.layer_decay) if cfg.layer_decay else dict.fromkeys(names, 1.0)
    head = head_keys(model)
    return tuple(scales[name] * (1.0 if name in head else cfg.backbone_lr_scale) for name in names)


Reduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks that share the parameters, in place


def make_optimizer(cfg: Config, pieces: Sequence[Piece], stepping: Stepping, reduce: Reduce | None = None,
                   ) -> torch.optim.Optimizer:
    """stepping.groups() on every strategy, each at its lr (any may be empty: a model without 1-D
    parameters, a ZeRO-1 slice of conv weights only). reduce: where pieces are parts of parameters,
    LARS and LAMB sum their per-parameter squares with it."""
    groups = [{"params": [p.tensor for p in pieces if stepping.key(p.owner) == (flag, scale)],
               "weight_decay": cfg.weight_decay if flag else 0.0, "adapt": flag, "lr": cfg.lr * scale}
              for flag, scale in stepping.groups()]
    owners = {id(p.tensor): p.owner for p in pieces}
    device = local(pieces[0].tensor).device if pieces else torch.device("cpu")
    return BUILDERS[cfg.optimizer](cfg, groups, owners, len(stepping.decays), device, reduce)


def tensor_state(cfg: Config) -> tuple[str, ...]:
    """The optimizer's state tensors, each shaped like its parameter (common/optimizers.py)."""
    return OPTIMIZERS[cfg.optimizer].tensor_state


def strip(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch's own optimizers take no 'adapt' entry (only LARS and LAMB adapt)."""
    return [{k: v for k, v in g.items() if k != "adapt"} for g in groups]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard); the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


class Layerwise(torch.optim.Optimizer):
    """LARS and LAMB: each parameter's update is scaled by a trust ratio of two norms over the
    WHOLE parameter. Pieces add their squares into a (parameters x 2) table that `reduce` sums over
    ranks before the ratios are taken; every rank calls it at every step, pieces or not.
    Groups with adapt=False (norm weights and biases, unless decayed) step without the ratio."""

    def __init__(self, groups: list[dict[str, Any]], owners: dict[int, int], count: int, device: torch.device,
                 reduce: Reduce | None, **defaults: Any) -> None:
        super().__init__(groups, defaults)
        self.owners, self.count, self.device, self.reduce = owners, count, device, reduce

    def direction(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The vector whose norm is compared with the weights' (updating the state it needs)."""
        raise NotImplementedError

    def ratio(self, w_norm: torch.Tensor, d_norm: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, p: torch.Tensor, d: torch.Tensor, ratio: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        entries = [(p, group, self.direction(p, group)) for group in self.param_groups for p in group["params"]
                   if p.grad is not None]
        squares = torch.zeros(self.count, 2, dtype=torch.float64, device=self.device)
        for p, _, d in entries:
            squares[self.owners[id(p)]] += torch.stack([local(p).double().square().sum(), d.double().square().sum()])
        if self.reduce is not None:
            self.reduce(squares)
        norms = squares.sqrt()
        for p, group, d in entries:
            w_norm, d_norm = norms[self.owners[id(p)]]
            one = torch.ones((), dtype=torch.float64, device=w_norm.device)
            ratio = torch.where((w_norm > 0) & (d_norm > 0), self.ratio(w_norm, d_norm, group), one) \
                if group["adapt"] else one
            self.apply(p, d, ratio.to(d.dtype), group)


class LARS(Layerwise):
    """SGD whose step for each layer is scaled to eta * ||w|| / (||g|| + wd ||w||) (You et al. 2017),
    then Nesterov momentum, as SGD's."""

    def __init__(self, groups: list[dict[str, Any]], owners: dict[int, int], count: int, device: torch.device,
                 reduce: Reduce | None, lr: float, momentum: float) -> None:
        super().__init__(groups, owners, count, device, reduce, lr=lr, momentum=momentum, weight_decay=0.0)

    def direction(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        return local(p.grad)

    def ratio(self, w_norm: torch.Tensor, d_norm: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        return LARS_TRUST * w_norm / (d_norm + group["weight_decay"] * w_norm)

    def apply(self, p: torch.Tensor, d: torch.Tensor, ratio: torch.Tensor, group: dict[str, Any]) -> None:
        update = (d + group["weight_decay"] * local(p)) * ratio
        if group["momentum"]:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
                local(state["momentum_buffer"]).copy_(update)
            else:
                local(state["momentum_buffer"]).mul_(group["momentum"]).add_(update)
            update = update + group["momentum"] * local(state["momentum_buffer"])  # Nesterov
        local(p).sub_(update * group["lr"])


class LAMB(Layerwise):
    """AdamW's bias-corrected update u = m / (sqrt(v) + eps) + wd w, scaled per layer to ||w|| / ||u||
    (You et al. 2019, timm's Lamb without its built-in gradient clipping: --clip-grad-norm does that)."""

    def __init__(self, groups: list[dict[str, Any]], owners: dict[int, int], count: int, device: torch.device,
                 reduce: Reduce | None, lr: float, betas: tuple[float, float], eps: float) -> None:
        super().__init__(groups, owners, count, device, reduce, lr=lr, betas=betas, eps=eps, weight_decay=0.0)

    def direction(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        (b1, b2), g = group["betas"], local(p.grad)
        state["step"] += 1
        m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        step = state["step"].item()
        adam = (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + group["eps"])
        return adam + group["weight_decay"] * local(p)

    def ratio(self, w_norm: torch.Tensor, d_norm: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        return w_norm / d_norm

    def apply(self, p: torch.Tensor, d: torch.Tensor, ratio: torch.Tensor, group: dict[str, Any]) -> None:
        local(p).sub_(d * (ratio * group["lr"]))


# ---------------------------------------------------------------- checkpoints at any world size

def to_positions(state: dict[str, Any], order: Sequence[int]) -> dict[str, Any]:
    """An optimizer's state_dict re-keyed by each parameter's position in model.parameters() (order[i]:
    the position of the optimizer's i-th entry), the form every checkpoint holds."""
    return {"state": {order[i]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}


def from_positions(state: dict[str, Any], order: Sequence[int]) -> dict[str, Any]:
    """The inverse of to_positions: a checkpoint's state in an optimizer's own numbering."""
    own = {position: i for i, position in enumerate(order)}
    return {"state": {own[int(p)]: value for p, value in state["state"].items()},
            "param_groups": [{**g, "params": [own[int(p)] for p in g["params"]]} for g in state["param_groups"]]}


def entry_order(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[int]:
    """Each optimizer entry's position in `params`, in the optimizer's own numbering."""
    position = {id(p): i for i, p in enumerate(params)}
    return [position[id(p)] for group in optimizer.param_groups for p in group["params"]]


# ---------------------------------------------------------------- schedules

def warmup_steps(cfg: Config, total: int) -> float:
    return cfg.warmup if cfg.warmup >= 1 else cfg.warmup * total


def lr_factor(cfg: Config, step: int, total: int, steps_per_epoch: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` of `total`.

    onecycle: linear rise from 1/25 of the peak over the warm-up (25% of the steps by default), then
    cosine to --min-lr. The others rise linearly from 1/100 over --warmup steps, then: cosine to
    --min-lr over the rest, constant, or step (x --gamma after each of --milestones epochs).
    """
    step = min(step, total)
    warm = warmup_steps(cfg, total)
    floor = cfg.min_lr / cfg.lr
    if step < warm:
        start = ONECYCLE_START if cfg.schedule == "onecycle" else WARMUP_START
        return start + (1 - start) * step / warm
    if cfg.schedule in ("onecycle", "cosine"):
        progress = (step - warm) / max(total - warm, 1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "step":
        return cfg.gamma ** sum(step >= m * steps_per_epoch for m in cfg.milestones)
    return 1.0


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
                   ) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step. A pure function of the step, so a checkpoint stores only the
    step count. With --extend-to, the steps after --epochs follow a segment of their own."""
    total = cfg.epochs * steps_per_epoch
    if not cfg.extend_to:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step, total, steps_per_epoch))
    segment = replace(cfg, epochs=cfg.extend_to - cfg.epochs, extend_to=0)
    added = segment.epochs * steps_per_epoch
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: extended_lr_factor(cfg, segment, step, total, added, steps_per_epoch))


def extended_lr_factor(cfg: Config, segment: Config, step: int, total: int, added: int, steps_per_epoch: int) -> float:
    """--extend-to: the run's schedule up to its end, then the same schedule again over the added
    epochs (a warm restart: warm-up, peak, decay); --schedule step keeps the factor it ended at (its
    milestones are the run's epochs)."""
    if step < total or cfg.schedule == "step":
        return lr_factor(cfg, step, total, steps_per_epoch)
    return lr_factor(segment, step - total, added, steps_per_epoch)


# The optimizers of common/optimizers.py's table, built over two groups of pieces (decayed, then not).
BUILDERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda cfg, groups, *_: torch.optim.SGD(strip(groups), lr=cfg.lr, momentum=cfg.momentum,
                                                   nesterov=cfg.momentum > 0),
    "adamw": lambda cfg, groups, *_: torch.optim.AdamW(strip(groups), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps),
    "lars": lambda cfg, groups, *where: LARS(groups, *where, lr=cfg.lr, momentum=cfg.momentum),
    "lamb": lambda cfg, groups, *where: LAMB(groups, *where, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps),
}
assert BUILDERS.keys() == OPTIMIZERS.keys(), "an optimizer of common/optimizers.py without a builder, or the reverse"
