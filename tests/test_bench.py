"""The benchmarks' one entry: `python -m bench` lists every benchmark, runs one by name, refuses an
unknown one in a line, and `python -m bench gpu` says in a line that it needs CUDA where there is none."""
from __future__ import annotations

import subprocess
import sys

import pytest

from bench.__main__ import BENCHMARKS
from tests.conftest import ROOT, child_env


def bench(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, env={**child_env(), **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.quick
def test_the_list_names_every_benchmark_with_what_it_measures():
    listed = bench()
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line and not line.startswith(" ")}
    assert set(lines) == set(BENCHMARKS)
    assert all(len(line.split()) > 3 for line in lines.values())
    helpers = {"__init__", "__main__", "references", "costmodel", "calibration"}
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")} - helpers
    assert modules == set(BENCHMARKS), "every module of bench/ is a listed benchmark (references, costmodel, " \
                                       "calibration: their helpers)"


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_runs_by_name(name):
    helped = bench(name, "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith(f"usage: python -m bench {name}")


@pytest.mark.quick
def test_an_unknown_benchmark_is_one_line_and_exit_2():
    refused = bench("no-such-bench")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]
    assert "no-such-bench" in refused.stderr and "strategies" in refused.stderr


@pytest.mark.quick
def test_the_gpu_check_without_cuda_says_so_in_one_line():
    refused = bench("gpu", CUDA_VISIBLE_DEVICES="")
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()], refused.stderr
    assert refused.stderr.startswith("error: no CUDA device here")
