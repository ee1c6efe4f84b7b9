"""--profile: torch.profiler over a few steps after warm-up, one Chrome/Perfetto trace per rank next
to the TensorBoard run, and the top operators on rank 0's console.

Open a trace in https://ui.perfetto.dev or chrome://tracing. The hand-written strategies mark
their gradient traffic ("sync: launch bucket N", "sync: wait for buckets"); DDP's shows as its
reducer's all_reduce on the communication thread; docs/recipes.md (--profile) says what overlap
looks like.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from common.output.logger import NullLogger
from common.storage import is_url

WAIT, WARMUP, ACTIVE = 5, 2, 4  # steps skipped (first-step costs, DDP's bucket rebuild), warmed up, traced


def add_profiling_flags(group: argparse._ArgumentGroup) -> None:
    """The training scripts' flag of StepProfiler."""
    group.add_argument("--profile", action="store_true",
                       help="trace a few steps after warm-up with torch.profiler: one Chrome/Perfetto trace per rank "
                            "next to the TensorBoard run, and the top operators on the console")


def trace_folder(log_dir: str, run_id: str) -> Path:
    """Next to the TensorBoard run; a local folder when the run is in an object store."""
    return Path(f"traces/{run_id}") if is_url(log_dir) else Path(log_dir) / "traces"


class StepProfiler:
    def __init__(self, folder: Path, rank: int, device: torch.device, log: NullLogger) -> None:
        self.folder, self.rank, self.log = folder, rank, log
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        self.profiler = profile(activities=activities, on_trace_ready=self._ready,
                                schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1))
        self.profiler.start()

    def _ready(self, prof: profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        self.log.info(f"profile of {ACTIVE} steps after {WAIT + WARMUP}: {path} (one per rank); top operators:\n"
                      + prof.key_averages().table(sort_by=self.sort_by, row_limit=10))

    def step(self) -> None:
        self.profiler.step()

    def stop(self) -> None:
        self.profiler.stop()


class NoProfiler:
    def step(self) -> None:
        pass

    def stop(self) -> None:
        pass
