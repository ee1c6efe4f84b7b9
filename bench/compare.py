"""Train all six strategies on the same data and settings, one after another, then write the
report (table and plots) comparing them.

    python -m bench compare                                # synthetic data, 3 epochs, world 2
    python -m bench compare --out report -- --dataset mnist --epochs 2

Flags after `--` go to every train_*.py. Runs land in OUT/runs/<strategy>, the report in OUT.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from bench.strategies import launcher
from common.output.report import write_report

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = {"ddp": "train_ddp.py", "allreduce": "train_allreduce.py", "master": "train_master.py",
              "dp": "train_dp.py", "fsdp": "train_fsdp.py", "localsgd": "train_localsgd.py"}
DEFAULT_FLAGS = ["--dataset", "synthetic", "--synthetic-shape", "mnist", "--model", "convnet", "--epochs", "6",
                 "--log-every", "10"]


def train(script: str, flags: list[str], log_dir: Path, world: int, threads: int) -> None:
    command, env = launcher(script, world, threads)
    with tempfile.TemporaryDirectory() as ckpt:
        cmd = [*command, script, *flags, "--log-dir", str(log_dir), "--checkpoint-dir", ckpt, "--resume", "none"]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("report"), help="report folder (default: %(default)s)")
    p.add_argument("--world", type=int, default=2, help="processes per strategy (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="threads per rank (default: %(default)s)")
    p.add_argument("flags", nargs="*", help="flags for every train_*.py (after --)")
    a = p.parse_args()
    flags = a.flags or DEFAULT_FLAGS
    for name, script in STRATEGIES.items():
        train(script, flags, a.out / "runs" / name, a.world, a.threads)
    for path in write_report([a.out / "runs"], a.out):
        print(f"wrote {path}")
    print((a.out / "report.md").read_text(), end="")


if __name__ == "__main__":
    main()
