"""The lean-steps issue's whole run, this tree against another checkout, interleaved: total wall
time, the epochs, the time outside them (torchrun's and the ranks' start-up and tear-down), start-up
(from a rank's interpreter start to the end of its first optimizer step, measured by
bench/first_step.py alike in both trees; the later rank's) and final test accuracy.

    git worktree add /tmp/before <older commit>
    python bench/wall.py --before /tmp/before              # 2 runs of each, interleaved
    python bench/wall.py --before /tmp/before --script train_allreduce.py --repeats 3

The run: torchrun, 2 ranks, one thread each, convnet, global batch 64, 10 epochs on a generated
4,000 / 1,000-image MNIST-format set (tests/datagen.py, the real IDX files). Repeat k runs
--seed k-1 in both trees: a tree that sums gradients in another order follows another trajectory
from the first step, so one seed's accuracy tells little; the mean over seeds, beside the spread
between seeds, does.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.datagen import write_mnist  # noqa: E402

EPOCH = re.compile(r"epoch (\d+)/\d+ .* test acc ([\d.]+)% .* ([\d.]+) s  per step")
FIRST_STEP = re.compile(r"first step ended ([\d.]+) s after start")


def one_run(tree: Path, script: str, data: Path, epochs: int, seed: int, tmp: Path) -> dict[str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "bench" / "first_step.py"), script, "--dataset", "mnist", "--data-dir", str(data),
               "--no-download", "--model", "convnet", "--batch-size", "64", "--epochs", str(epochs), "--seed", str(seed), "--log-dir", str(tmp / "tb"),
               "--checkpoint-dir", str(tmp / "ck")]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{tree}: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    epochs_found = EPOCH.findall(done.stdout)
    epochs_s = sum(float(s) for _, _, s in epochs_found)
    return {"wall": wall, "epochs": epochs_s, "outside": wall - epochs_s, "acc": float(epochs_found[-1][1]),
            "startup": max(float(s) for s in FIRST_STEP.findall(done.stderr))}  # the later rank's


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the tree to compare against")
    p.add_argument("--script", default="train_ddp.py")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_mnist(Path(tmp) / "mnist", train_size=4000, test_size=1000, gz=True)
        rows = []
        for repeat in range(a.repeats):
            for label, tree in (("before", a.before.resolve()), ("after", ROOT)):
                with tempfile.TemporaryDirectory() as run_tmp:
                    rows.append((label, repeat + 1, one_run(tree, a.script, data, a.epochs, repeat, Path(run_tmp))))
    print(f"{a.script}, W=2, convnet, global batch 64, {a.epochs} epochs, 4,000/1,000 MNIST-format images\n")
    print("| tree, run (seed) | total wall s | epochs s | outside the epochs s | start-up s (first step) | final test acc |\n"
          "|---|---|---|---|---|---|")
    for label, repeat, r in rows:
        figures = " | ".join(f"{r[key]:.1f}" for key in ("wall", "epochs", "outside"))
        print(f"| {label}, {repeat} ({repeat - 1}) | {figures} | {r['startup']:.2f} | {r['acc']:.2f}% |")
    for key in ("wall", "epochs", "outside", "startup"):
        before = [r[key] for label, _, r in rows if label == "before"]
        after = [r[key] for label, _, r in rows if label == "after"]
        ratios = ", ".join(f"{x / y:.2f}" for x, y in zip(after, before))
        print(f"\n{key}: after / before per pair: {ratios}", end="")
    for label in ("before", "after"):
        accs = [r["acc"] for tree, _, r in rows if tree == label]
        print(f"\nfinal test acc, {label}: mean {statistics.mean(accs):.2f}% over {len(accs)} seed(s), "
              f"min {min(accs):.2f}, max {max(accs):.2f}", end="")
    print()


if __name__ == "__main__":
    main()
