"""Runs a training script of any tree as `python SCRIPT ...` would, and prints, on stderr, how long
after this interpreter started the script's first optimizer step ended: start-up measured the same
way in trees that do not report it. Nothing is imported early (torch loads when the script loads
it), and the tree's own folder comes first on the path, so its `common` is the one imported.

    torchrun --standalone --nproc_per_node=2 bench/first_step.py train_ddp.py [flags]
"""
import time

STARTED = time.perf_counter()

import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402

HOOKED_MODULE = "torch.optim.optimizer"


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


if __name__ == "__main__":
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)
    sys.meta_path.insert(0, FirstStepProbe())
    runpy.run_path(script, run_name="__main__")
