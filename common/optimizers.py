"""What the suite knows of each optimizer, in one table: its default learning rate and weight decay,
the flags it reads, and the state it keeps per parameter. config.py (defaults, flags that would be
ignored), common/train/optim.py (the optimizers themselves) and the checkpoint's size estimate read
it; a new optimizer is a row here and a builder there (optim.py checks that the two agree)."""
from __future__ import annotations

from dataclasses import dataclass

# adamw and lamb: the default peak lr per 256 images of the global batch (timm's and the papers' rule)
ADAPTIVE_LR_PER_256 = 1e-3


@dataclass(frozen=True)
class OptimizerRule:
    adaptive: bool  # per-coordinate step sizes (Adam's moments): their own lr and weight decay scale
    weight_decay: float  # the default of --weight-decay
    reads: tuple[str, ...]  # the flags it reads besides --lr and --weight-decay
    tensor_state: tuple[str, ...]  # its state tensors, each shaped like the parameter ("step" is beside them)
    # non-adaptive ones: the default lr over the data set recipe's sgd lr. LARS's trust ratio (eta 0.001)
    # shrinks each layer's step, so it starts from 10x.
    lr_scale: float = 1.0

    def default_lr(self, recipe_lr: float, recipe_batch: int, batch: int) -> float:
        """The peak lr for a global batch of `batch`, scaled linearly from the recipe's."""
        per_image = ADAPTIVE_LR_PER_256 / 256 if self.adaptive else recipe_lr / recipe_batch * self.lr_scale
        return per_image * batch

    def state_tensors(self, momentum: float) -> tuple[str, ...]:
        """What it keeps per parameter with this --momentum (plain SGD without momentum keeps none)."""
        return self.tensor_state if self.adaptive or momentum else ()


OPTIMIZERS = {
    "sgd": OptimizerRule(adaptive=False, weight_decay=5e-4, reads=("momentum",), tensor_state=("momentum_buffer",)),
    "adamw": OptimizerRule(adaptive=True, weight_decay=0.05, reads=("betas", "eps"),
                           tensor_state=("exp_avg", "exp_avg_sq")),
    "lars": OptimizerRule(adaptive=False, weight_decay=5e-4, reads=("momentum",), tensor_state=("momentum_buffer",),
                          lr_scale=10),
    "lamb": OptimizerRule(adaptive=True, weight_decay=0.05, reads=("betas", "eps"),
                          tensor_state=("exp_avg", "exp_avg_sq")),
}
