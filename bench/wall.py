"""The lean-steps issue's whole run, this tree against another checkout, interleaved: total wall
time, the epochs, the time outside them (torchrun's and the ranks' start-up and tear-down), start-up
(from a rank's interpreter start to the end of its first optimizer step, measured alike in both
trees by this file's --probe; the later rank's) and final test accuracy.

    git worktree add /tmp/before <older commit>
    python -m bench wall --before /tmp/before              # 2 runs of each, interleaved
    python -m bench wall --before /tmp/before --script train_allreduce.py --repeats 3

The run: torchrun, 2 ranks, one thread each, convnet, global batch 64, 10 epochs on a generated
4,000 / 1,000-image MNIST-format set (tests/datagen.py, the real IDX files). Repeat k runs
--seed k-1 in both trees: a tree that sums gradients in another order follows another trajectory
from the first step, so one seed's accuracy tells little; the mean over seeds, beside the spread
between seeds, does.

--probe runs a training script of any tree as `python SCRIPT ...` would, and prints on stderr how
long after this file started the script's first optimizer step ended: start-up measured the same way
in trees that do not report it. Nothing heavy is imported before it (torch loads when the script
loads it), and the tree's own folder comes first on the path, so its `common` is the one imported.

    torchrun --standalone --nproc_per_node=2 bench/wall.py --probe train_ddp.py [flags]
"""
import time

STARTED = time.perf_counter()  # first, so the probe's clock starts with the interpreter

import argparse  # noqa: E402
import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import runpy  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOOKED_MODULE = "torch.optim.optimizer"
EPOCH = re.compile(r"epoch (\d+)/\d+ .* test acc ([\d.]+)% .* ([\d.]+) s  per step")
FIRST_STEP = re.compile(r"first step ended ([\d.]+) s after start")


class FirstStepProbe(importlib.abc.MetaPathFinder):
    """When torch's optimizer module loads, registers a hook that runs after every optimizer step."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - importlib's protocol
        if name != HOOKED_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def load_and_hook(module) -> None:  # noqa: ANN001
            load(module)
            module.register_optimizer_step_post_hook(first_step_ended)

        spec.loader.exec_module = load_and_hook
        return spec


def first_step_ended(optimizer, args, kwargs) -> None:  # noqa: ANN001
    if not getattr(first_step_ended, "said", False):
        first_step_ended.said = True
        print(f"first step ended {time.perf_counter() - STARTED:.2f} s after start", file=sys.stderr, flush=True)


def probe(script: str) -> None:
    """--probe SCRIPT [flags]: run SCRIPT (of any tree) as its own program, the probe watching."""
    script = os.path.abspath(script)
    sys.argv = sys.argv[2:]
    sys.path[0] = os.path.dirname(script)
    sys.meta_path.insert(0, FirstStepProbe())
    runpy.run_path(script, run_name="__main__")


def mnist_flags(data: Path) -> list[str]:
    return ["--dataset", "mnist", "--data-dir", str(data), "--no-download"]


def one_run(tree: Path, script: str, data_flags: list[str], epochs: int, seed: int, tmp: Path) -> dict[str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "bench" / "wall.py"), "--probe", script, *data_flags, "--model", "convnet",
               "--batch-size", "64", "--epochs", str(epochs), "--seed", str(seed),
               "--log-dir", str(tmp / "tb"), "--checkpoint-dir", str(tmp / "ck")]
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
    from tests.datagen import write_mnist  # here: the probe imports nothing heavy

    with tempfile.TemporaryDirectory() as tmp:
        data = write_mnist(Path(tmp) / "mnist", train_size=4000, test_size=1000, gz=True)
        rows = []
        for repeat in range(a.repeats):
            for label, tree in (("before", a.before.resolve()), ("after", ROOT)):
                with tempfile.TemporaryDirectory() as run_tmp:
                    rows.append((label, repeat + 1, one_run(tree, a.script, mnist_flags(data), a.epochs, repeat,
                                                             Path(run_tmp))))
    print(f"{a.script}, W=2, convnet, global batch 64, {a.epochs} epochs, 4,000/1,000 MNIST-format images\n")
    print("| tree, run (seed) | total wall s | epochs s | outside the epochs s | start-up s (first step) "
          "| final test acc |\n|---|---|---|---|---|---|")
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
    probe(sys.argv[2]) if sys.argv[1:2] == ["--probe"] else main()
