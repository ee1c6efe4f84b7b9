"""train_ft.py: what fault tolerance costs when nothing fails, and what a failure costs with it and
with checkpoint-and-restart instead. Real processes: launch/ft.sh (a Lighthouse, each group its own
torchrun), group 1's worker SIGKILLed from outside and started again by hand AWAY seconds later;
for the comparison, train_ddp.py under torchrun --max-restarts 1 with rank 1 SIGKILLed after the
same step (tests/faults.py) and resumed from its last checkpoint. Step times come from TensorBoard's
step-level points (--log-every 1: each point's wall time is when its step ended).

    python -m bench ft                       # convnet on 32-px synthetic images, 2 x 1 rank
    python -m bench ft --model resnet18 --steps 120 --kill-at 40 --save-every 25
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.parallel.procs import children, command_line
from tests.conftest import child_env, free_port

ROOT = Path(__file__).resolve().parent.parent
TAG = "train/loss"  # one point per step with --log-every 1
SYNTHETIC_TRAIN = 10_000  # images in --dataset synthetic's training set
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def flags(model: str, steps: int, batch: int, folder: Path) -> list[str]:
    """About `steps` steps: whole epochs of the synthetic set (an evaluation between them)."""
    epochs = -(-steps // (SYNTHETIC_TRAIN // batch))
    return ["--dataset", "synthetic", "--model", model, "--batch-size", str(batch), "--epochs", str(epochs),
            "--log-every", "1", "--lr", "0.02", "--checkpoint-dir", str(folder / "ckpt"),
            "--log-dir", str(folder / "tb"), "--resume", "none"]


def step_ends(tb: Path) -> dict[int, float]:
    """Step number -> wall time (time.time()) when that step ended; {} before the first flush. `tb`:
    a run's folder, or one of its event files (one per process that wrote it)."""
    if not tb.exists():
        return {}
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.wall_time for e in acc.Scalars(TAG)} if TAG in acc.Tags()["scalars"] else {}


def median_step_s(ends: dict[int, float], first: int, last: int) -> float:
    """The median time of the steps first+1 .. last."""
    times = [ends[s] - ends[s - 1] for s in range(first + 1, last + 1) if s in ends and s - 1 in ends]
    return statistics.median(times) if times else float("nan")


def ft_env(folder: Path, **extra: str) -> dict[str, str]:
    return {**child_env(), "FT_PORT": str(free_port()), "FT_LOGS": str(folder / "ft-logs"), **extra}


def finished(process: subprocess.Popen, what: str) -> str:
    out, _ = process.communicate(timeout=1800)
    if process.returncode:
        raise SystemExit(f"{what} failed:\n{out[-4000:]}")
    return out


def no_failure(model: str, steps: int, batch: int, tmp: Path) -> list[tuple[str, float]]:
    """Global images/s over the steady steps of fault-free runs at world 2."""
    rows = []
    for name, transport in [("train_ddp.py, world 2 (shared memory)", "auto"),
                            ("train_ddp.py --transport gloo", "gloo")]:
        folder = tmp / f"ddp-{transport}"
        done = subprocess.run([*TORCHRUN, "--nproc_per_node=2", "train_ddp.py", *flags(model, steps, batch, folder),
                               "--transport", transport], cwd=ROOT, env=child_env(), capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"train_ddp.py failed:\n{done.stderr[-4000:]}")
        rows.append((name, batch / median_step_s(step_ends(folder / "tb"), 5, steps)))
    for name, extra in [("train_ft.py, 2 groups x 1", []), ("train_ft.py --quorum-every 10", ["--quorum-every", "10"]),
                        ("train_ft.py --exact-sums", ["--exact-sums"])]:
        folder = tmp / re.sub(r"\W+", "-", name)
        job = subprocess.Popen(["bash", "launch/ft.sh", "2", "1", "train_ft.py", *flags(model, steps, batch, folder),
                                *extra], cwd=ROOT, env=ft_env(folder), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        finished(job, name)
        rows.append((name, batch / median_step_s(step_ends(folder / "tb" / "group0"), 5, steps)))
    return rows


def with_ft(model: str, steps: int, batch: int, kill_at: int, away_s: float, tmp: Path) -> dict[str, float]:
    """Group 1's worker SIGKILLed once group 0 has logged `kill_at` steps (ft.sh restarts nothing:
    FT_RESTARTS=0); group 1 started again by hand `away_s` later, to heal from group 0."""
    folder = tmp / "ft-kill"
    training = ["train_ft.py", *flags(model, steps, batch, folder)]
    env = ft_env(folder, FT_RESTARTS="0")
    job = subprocess.Popen(["bash", "launch/ft.sh", "2", "1", *training], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    tb = folder / "tb" / "group0"
    while max(step_ends(tb), default=0) < kill_at:
        time.sleep(0.2)
        if job.poll() is not None:
            raise SystemExit("train_ft.py ended before the kill:\n" + job.stdout.read()[-4000:])
    agent = int((folder / "ft-logs" / "group1.pid").read_text())
    worker = next(p for p in children(agent) if "train_ft.py" in command_line(p))
    os.kill(worker, signal.SIGKILL)
    killed = time.time()
    time.sleep(away_s)
    restarted = time.time()
    again = subprocess.Popen([*TORCHRUN, "--nproc_per_node=1", *training], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env={**env, "REPLICA_GROUP_ID": "1", "FT_GROUPS": "2",
                                  "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{env['FT_PORT']}"})
    out = finished(again, "the restarted group 1") + finished(job, "train_ft.py with a kill")
    healed = re.search(r"healed from group 0 at step (\d+): .*, ([\d.]+) s from its quorum", out)
    if not healed:
        raise SystemExit("group 1 did not heal:\n" + out[-4000:])
    heal_step, ends = int(healed[1]), step_ends(tb)
    last_before = max(s for s, t in ends.items() if t <= killed)
    after = sorted(s for s, t in ends.items() if t > killed and s < heal_step)
    pause, paused_at = max((ends[s] - max(ends[s - 1], killed), s) for s in after)  # the step that waited out the loss
    return {"pause_s": pause, "paused_step": paused_at, "steps_lost": sum(s not in ends for s in range(1, max(ends))),
            "retried": out.count("is trained again on the same samples"),
            "step_s_before": median_step_s(ends, 5, last_before),
            "step_s_alone": median_step_s(ends, paused_at + 1, heal_step - 1),
            "step_s_after": median_step_s(ends, heal_step + 2, max(ends)),
            "start_to_heal_s": ends[heal_step] - restarted, "quorum_to_step_s": float(healed[2]),
            "heal_step": heal_step}


def with_restarts(model: str, steps: int, batch: int, kill_at: int, save_every: int, tmp: Path) -> dict[str, float]:
    """train_ddp.py at world 2, --max-restarts 1: rank 1 SIGKILLs itself after step `kill_at`; torchrun
    restarts both ranks, which resume from the last checkpoint (--save-every-steps)."""
    folder = tmp / "ddp-kill"
    marker = folder / "fault-at"
    folder.mkdir()
    done = subprocess.run([*TORCHRUN, "--nproc_per_node=2", "--max-restarts=1", "tests/faults.py", "ddp", "sigkill",
                           str(kill_at), *flags(model, steps, batch, folder), "--save-every-steps", str(save_every),
                           "--resume", "auto"], cwd=ROOT, env={**child_env(), "FAULT_AT_FILE": str(marker)},
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"train_ddp.py with a kill failed:\n{done.stderr[-4000:]}")
    killed = float(marker.read_text().split()[0])
    first, second = sorted((folder / "tb").glob("events.out.tfevents.*"), key=lambda f: f.stat().st_mtime)[-2:]
    before, ends = step_ends(first), step_ends(second)  # the killed attempt's points, the restarted one's
    resumed = (kill_at // save_every) * save_every
    return {"kill_to_next_step_s": ends[resumed + 1] - killed, "steps_lost": kill_at - resumed,
            "kill_to_past_it_s": ends[kill_at + 1] - killed, "step_s_before": median_step_s(before, 5, resumed)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="convnet")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--kill-at", type=int, default=130, help="the step after which a group (or rank) is killed")
    p.add_argument("--save-every", type=int, default=50, help="the restart comparison's checkpoint interval")
    p.add_argument("--away", type=float, default=5.0, help="seconds before the killed group is started again")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"{args.model}, global batch {args.batch_size}, 2 x 1 rank, 1 thread each\n")
        print("| no failure | images/s | vs DDP | vs DDP over gloo |\n|---|---|---|---|")
        rows = no_failure(args.model, min(args.steps, 200), args.batch_size, tmp)
        for name, rate in rows:
            print(f"| {name} | {rate:,.0f} | {rate / rows[0][1]:.2f} | {rate / rows[1][1]:.2f} |")
        ft = with_ft(args.model, args.steps, args.batch_size, args.kill_at, args.away, tmp)
        ddp = with_restarts(args.model, args.steps, args.batch_size, args.kill_at, args.save_every, tmp)
        print(f"\nSIGKILL after step {args.kill_at} (train_ft.py: about then):\n")
        print("| | train_ft.py (group 1 killed, started again by hand "
              f"{args.away:g} s later) | train_ddp.py + torchrun --max-restarts 1 |\n|---|---|---|")
        print(f"| the kill's pause: no step committed for | {ft['pause_s']:.1f} s (step {ft['paused_step']} waited "
              f"out the loss) | {ddp['kill_to_next_step_s']:.1f} s (then step "
              f"{args.kill_at // args.save_every * args.save_every + 1} again) |")
        print(f"| kill -> training past the step killed | {ft['pause_s']:.1f} s | {ddp['kill_to_past_it_s']:.1f} s |")
        print(f"| steps lost | {ft['steps_lost']} ({ft['retried']} step trained again) | {ddp['steps_lost']} "
              f"(a checkpoint every {args.save_every}) |")
        print(f"| step time before | {ft['step_s_before'] * 1000:.0f} ms | {ddp['step_s_before'] * 1000:.0f} ms |")
        print(f"| step time while group 1 is away | {ft['step_s_alone'] * 1000:.0f} ms "
              f"({ft['step_s_before'] / ft['step_s_alone']:.2f}x the images/s before) | no steps |")
        print(f"| group 1 started again -> healed, training | {ft['start_to_heal_s']:.1f} s (step "
              f"{ft['heal_step']}; quorum to first step {ft['quorum_to_step_s']:.2f} s) | |")
        print(f"| step time after the heal | {ft['step_s_after'] * 1000:.0f} ms | |")


if __name__ == "__main__":
    main()
