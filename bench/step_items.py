"""What each item of a training step costs, timed alone: the memory format and SGD kernel of the
plain step, per-step reseeding, a host read of the tallies, and the round trips (gloo, and the
shared-memory transport) that a stop flag, step metrics and the gradients cost at W=2.

    python bench/step_items.py            # convnet, 32 images, one thread; then 2 processes for the collectives
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.data import make_synthetic  # noqa: E402
from common.models import build_model  # noqa: E402


def ms_per_call(f: Callable[[], object], calls: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        f()
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return 1000 * (time.perf_counter() - start) / calls


def plain_step_ms(memory_format: torch.memory_format, foreach: bool) -> float:
    data = make_synthetic("mnist")
    model = build_model("convnet", data.spec.channels, data.spec.size, 10, 0).to(memory_format=memory_format)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4, foreach=foreach)
    x = torch.randn(32, 1, 28, 28).contiguous(memory_format=memory_format)
    y = torch.randint(0, 10, (32,))

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return ms_per_call(step, 150)


def one_process() -> None:
    torch.set_num_threads(1)
    print("| item | ms |\n|---|---|")
    print(f"| plain step, contiguous, for-loop SGD | {plain_step_ms(torch.contiguous_format, False):.2f} |")
    print(f"| plain step, contiguous, foreach SGD | {plain_step_ms(torch.contiguous_format, True):.2f} |")
    print(f"| plain step, channels_last, foreach SGD | {plain_step_ms(torch.channels_last, True):.2f} |")
    print(f"| `torch.manual_seed` (a reseed per step) | {ms_per_call(lambda: torch.manual_seed(12345)):.3f} |")
    tally = torch.zeros(2)
    print(f"| a host read of the loss/accuracy tally (`.item()`) | {ms_per_call(lambda: (tally + 1).sum().item()):.3f} |")


def collectives() -> None:
    import torch.distributed as dist

    from common.distributed import DistContext, open_transport

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shm, _ = open_transport(DistContext(rank, world, rank, world, torch.device("cpu"), "gloo"), "shm", 60)
    flag, metrics = torch.zeros(1, dtype=torch.int32), torch.zeros(6, dtype=torch.float64)
    grads = torch.zeros(sum(p.numel() for p in build_model("convnet", 1, 28, 10, 0).parameters()))
    rows = [("a 1-int all_reduce (the stop flag)", flag), ("a 6-double all_reduce (one step's metrics)", metrics),
            (f"the gradients' all_reduce ({grads.numel() * 4 / 1000:.0f} KB)", grads)]
    for label, tensor in rows:
        for wire, all_reduce in (("gloo", dist.all_reduce), ("shm", lambda t: shm.all_reduce(t).wait())):
            dist.barrier()
            ms = ms_per_call(lambda: all_reduce(tensor), 300, 30)
            if rank == 0:
                print(f"| W=2, {wire}: {label} | {ms:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        collectives()
    else:
        one_process()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        __file__], env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
