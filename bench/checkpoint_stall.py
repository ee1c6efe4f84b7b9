"""How long a checkpoint save pauses training, next to how long writing it takes, for an object
store (moto's S3 server on 127.0.0.1, started here) and a local folder. Real train_ddp.py runs at
world 2; the figures come from the runs' TensorBoard scalars time/checkpoint_stall_s (the pause)
and time/checkpoint_s (serialize + upload, on rank 0's writer thread).

    python -m bench checkpoint_stall                   # ResNet-18 (~90 MB checkpoints)
    python -m bench checkpoint_stall --model convnet

Mid-epoch saves only: the run's last save waits for its write by design (nothing may be lost).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.strategies import launcher
from common.output.report import load_run
from tests.conftest import free_port
from tests.s3server import S3Server

ROOT = Path(__file__).resolve().parent.parent
SAVE_EVERY = 2


def figures(checkpoint_dir: str, model: str, steps: int, env: dict[str, str], tmp: Path) -> tuple[list, list]:
    """(stall seconds, write seconds) of each mid-epoch save of one run."""
    command, base_env = launcher("train_ddp.py", 2, 1)
    flags = ["--dataset", "synthetic", "--model", model, "--batch-size", "16", "--epochs", "1", "--max-steps",
             str(steps), "--save-every-steps", str(SAVE_EVERY), "--log-every", "1", "--resume", "none",
             "--checkpoint-dir", checkpoint_dir, "--log-dir", str(tmp / "tb")]
    done = subprocess.run([*command, "train_ddp.py", *flags], cwd=ROOT, env={**base_env, **env}, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"train_ddp.py {' '.join(flags)} failed:\n{done.stderr[-3000:]}")
    scalars = load_run(tmp / "tb").scalars
    mid_epoch = lambda tag: [p.value for p in scalars[tag] if p.step < steps]  # noqa: E731
    return mid_epoch("time/checkpoint_stall_s"), mid_epoch("time/checkpoint_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--steps", type=int, default=8, help="steps of the run; a save every %d" % SAVE_EVERY)
    args = p.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's per-request lines
    server = S3Server(free_port())
    server.start()
    try:
        server.client().create_bucket(Bucket="ckpt")
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for place, url, env in [("s3 (local moto)", "s3://ckpt/stall", server.env()),
                                    ("local disk", f"{tmp}/ckpt", {})]:
                (Path(tmp) / place).mkdir()
                stalls, writes = figures(url, args.model, args.steps, env, Path(tmp) / place)
                rows.append((place, stalls, writes))
    finally:
        server.stop()
    print(f"\n{args.model}, world 2, mid-epoch saves (seconds, median and range):")
    print("| checkpoint dir | saves | training paused | write (serialize + upload) | pause / write |")
    print("|---|---|---|---|---|")
    for place, stalls, writes in rows:
        pause, write = statistics.median(stalls), statistics.median(writes)
        print(f"| {place} | {len(stalls)} | {pause:.3f} ({min(stalls):.3f}-{max(stalls):.3f}) | "
              f"{write:.3f} ({min(writes):.3f}-{max(writes):.3f}) | {pause / write:.2f} |")


if __name__ == "__main__":
    main()
