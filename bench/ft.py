"""train_ft.py: what fault tolerance costs when nothing fails, and what a failure costs with it and
with checkpoint-and-restart instead. Real processes: launch/ft.sh (a Lighthouse, each group its own
torchrun), group 1's worker SIGKILLed from outside; for the comparison, train_ddp.py under torchrun
--max-restarts 1 with rank 1 SIGKILLed at the same step (tests/faults.py) and resumed from its last
checkpoint. Step times come from TensorBoard's step-level points (--log-every 1: each point's wall
time is when its step ended).

    python -m bench ft                       # convnet on 32-px synthetic images, 2 x 1 rank
    python -m bench ft --model resnet18 --steps 120
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.output.report import load_run
from tests.conftest import child_env, free_port

ROOT = Path(__file__).resolve().parent.parent
TAG = "train/loss"  # one point per step with --log-every 1


SYNTHETIC_TRAIN = 10_000  # images in --dataset synthetic's training set


def flags(model: str, steps: int, batch: int, folder: Path) -> list[str]:
    """About `steps` steps: whole epochs of the synthetic set (an evaluation between them)."""
    epochs = -(-steps // (SYNTHETIC_TRAIN // batch))
    return ["--dataset", "synthetic", "--model", model, "--batch-size", str(batch), "--epochs", str(epochs),
            "--log-every", "1", "--lr", "0.02", "--checkpoint-dir", str(folder / "ckpt"),
            "--log-dir", str(folder / "tb"), "--resume", "none"]


def step_ends(tb: Path) -> dict[int, float]:
    """Step number -> seconds since the run's first point, when that step ended."""
    return {p.step: p.seconds for p in load_run(tb).scalars.get(TAG, [])}


def steady_step_s(ends: dict[int, float], first: int, last: int) -> float:
    """The median step time between two steps (inclusive of the later one)."""
    times = [ends[s] - ends[s - 1] for s in range(first + 1, last + 1) if s in ends and s - 1 in ends]
    return statistics.median(times)


def ft_job(groups: int, training: list[str], folder: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**child_env(), "FT_PORT": str(free_port()), "FT_LOGS": str(folder / "ft-logs"), **(env or {})}
    return subprocess.Popen(["bash", "launch/ft.sh", str(groups), "1", *training], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(job: subprocess.Popen, what: str) -> str:
    out, _ = job.communicate(timeout=1800)
    if job.returncode:
        raise SystemExit(f"{what} failed:\n{out[-4000:]}")
    return out


def no_failure(model: str, steps: int, batch: int, tmp: Path) -> list[tuple[str, float]]:
    """images/s over the steady steps of a fault-free run: DDP at world 2, train_ft.py with two
    groups of one rank, and with --exact-sums."""
    rows = []
    ddp = tmp / "ddp"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train_ddp.py", *flags(model, steps, batch, ddp)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"train_ddp.py failed:\n{done.stderr[-4000:]}")
    rows.append(("train_ddp.py, world 2", batch / steady_step_s(step_ends(ddp / "tb"), 5, steps)))
    for name, extra in [("train_ft.py, 2 groups x 1", []), ("train_ft.py --exact-sums, 2 groups x 1", ["--exact-sums"])]:
        folder = tmp / name.split(",")[0].replace(" ", "")
        finished(ft_job(2, ["train_ft.py", *flags(model, steps, batch, folder), *extra], folder), name)
        rows.append((name, batch / steady_step_s(step_ends(folder / "tb" / "group0"), 5, steps)))
    return rows


def with_ft(model: str, steps: int, batch: int, kill_at: int, tmp: Path) -> dict[str, float]:
    """SIGKILL of group 1's worker once group 0 has passed `kill_at` steps; ft.sh starts it again."""
    folder = tmp / "ft-kill"
    job = ft_job(2, ["train_ft.py", *flags(model, steps, batch, folder)], folder)
    tb = folder / "tb" / "group0"
    while not (tb.exists() and max(step_ends(tb), default=0) >= kill_at):
        time.sleep(0.2)
        if job.poll() is not None:
            raise SystemExit("train_ft.py ended before the kill:\n" + job.stdout.read()[-4000:])
    agent = int((folder / "ft-logs" / "group1.pid").read_text())
    worker = next(int(p) for p in Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
                  if "train_ft.py" in Path(f"/proc/{p}/cmdline").read_text())
    os.kill(worker, signal.SIGKILL)
    killed = time.time()
    out = finished(job, "train_ft.py with a kill")
    return outage_figures(step_ends(tb), absolute_start(tb), killed, out, steps)


def absolute_start(tb: Path) -> float:
    """The wall time (time.time()) of the run's first point: load_run's seconds count from it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    return min(e.wall_time for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag))


def outage_figures(ends: dict[int, float], start: float, killed: float, out: str, steps: int) -> dict[str, float]:
    """From group 0's step ends: the next step after the kill, the step times before it, while alone
    and after the heal (the line `healed ... at step S` and the quorum lines tell the phases)."""
    at_kill = killed - start
    before = [s for s, t in ends.items() if t <= at_kill]
    next_step = min(s for s, t in ends.items() if t > at_kill)
    healed = next((int(line.split("at step ")[1].split(":")[0]) for line in out.splitlines()
                   if "healed from group" in line), None)
    healed_in = next((float(line.split(" in ")[-1].split(" s")[0]) for line in out.splitlines()
                      if "healed from group" in line), float("nan"))
    alone_end = healed if healed else steps
    return {"kill_to_next_step_s": ends[next_step] - at_kill, "steps_lost": 0 if next_step == max(before) + 1 else
            next_step - max(before) - 1, "step_s_before": steady_step_s(ends, 5, max(before)),
            "step_s_alone": steady_step_s(ends, next_step + 1, alone_end) if alone_end > next_step + 2 else float("nan"),
            "kill_to_heal_s": ends[healed] - at_kill if healed in ends else float("nan"), "heal_transfer_s": healed_in,
            "retried": out.count("is trained again on the same samples")}


def with_restarts(model: str, steps: int, batch: int, kill_at: int, save_every: int, tmp: Path) -> dict[str, float]:
    """train_ddp.py at world 2, --max-restarts 1: rank 1 SIGKILLs itself after step `kill_at`; torchrun
    restarts both ranks, which resume from the last checkpoint (--save-every-steps)."""
    folder = tmp / "ddp-kill"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "--max-restarts=1", "tests/faults.py", "ddp", "sigkill", str(kill_at),
                           *flags(model, steps, batch, folder), "--save-every-steps", str(save_every),
                           "--resume", "auto"], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"train_ddp.py with a kill failed:\n{done.stderr[-4000:]}")
    ends = step_ends(folder / "tb")  # the points after the resume replace those of the steps trained again
    resumed = (kill_at // save_every) * save_every
    return {"kill_to_next_step_s": ends[resumed + 1] - ends[kill_at], "steps_lost": kill_at - resumed,
            "kill_to_same_step_s": ends[kill_at + 1] - ends[kill_at], "step_s_before": steady_step_s(ends, 5, kill_at)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="convnet")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--kill-at", type=int, default=100, help="the step after which a group (or rank) is killed")
    p.add_argument("--save-every", type=int, default=50, help="the restart comparison's checkpoint interval")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"{args.model}, global batch {args.batch_size}, 2 x 1 rank, 1 thread each, {args.steps} steps\n")
        print("| no failure | images/s | vs DDP |\n|---|---|---|")
        rows = no_failure(args.model, min(args.steps, 200), args.batch_size, tmp)
        for name, rate in rows:
            print(f"| {name} | {rate:,.0f} | {rate / rows[0][1]:.2f} |")
        ft = with_ft(args.model, args.steps, args.batch_size, args.kill_at, tmp)
        ddp = with_restarts(args.model, args.steps, args.batch_size, args.kill_at, args.save_every, tmp)
        print(f"\nSIGKILL after about step {args.kill_at}:\n")
        print("| | train_ft.py (group 1 killed, restarted by ft.sh) | train_ddp.py + torchrun --max-restarts 1 |")
        print("|---|---|---|")
        print(f"| kill -> next committed step | {ft['kill_to_next_step_s']:.1f} s | {ddp['kill_to_next_step_s']:.1f} s |")
        print(f"| kill -> a step past the one killed | {ft['kill_to_next_step_s']:.1f} s | "
              f"{ddp['kill_to_same_step_s']:.1f} s |")
        print(f"| steps lost | {ft['steps_lost']} ({ft['retried']} step(s) trained again) | {ddp['steps_lost']} "
              f"(since the checkpoint every {args.save_every}) |")
        print(f"| step time before | {ft['step_s_before'] * 1000:.0f} ms | {ddp['step_s_before'] * 1000:.0f} ms |")
        print(f"| step time while one group is away | {ft['step_s_alone'] * 1000:.0f} ms "
              f"({ft['step_s_before'] / ft['step_s_alone']:.2f}x the throughput) | (no steps) |")
        print(f"| kill -> the restarted group healed | {ft['kill_to_heal_s']:.1f} s (state transfer "
              f"{ft['heal_transfer_s']:.2f} s) | |")


if __name__ == "__main__":
    main()
