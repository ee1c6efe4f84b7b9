"""A pytest plugin that counts every process a test launches (torchrun, Python, anything else) and
its seconds, and prints at the end of the run the totals, the launches per file and the ten most
expensive tests. Launches are the suite's cost (each one imports torch, about 3-9 s), so this is
the table to read before adding a test: a new behaviour should ride on an existing launch.

Works under pytest-xdist too: each worker sends its records to the controller."""
from __future__ import annotations

import json
import os
import subprocess
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

_current_test = "(collection)"
_launches: list["Launch"] = []
_test_seconds: dict[str, float] = defaultdict(float)
_running: dict[int, subprocess.Popen] = {}  # launches not yet seen to end, by id of their record


@dataclass
class Launch:
    test: str
    kind: str
    start: float
    end: float | None = None
    argv: list[str] = field(default_factory=list)
    left_running: bool = False  # still running when its test ended

    @property
    def seconds(self) -> float:
        return (self.end or time.monotonic()) - self.start


LAUNCH_FOLDER = str(Path(__file__).resolve().parent.parent / "launch") + os.sep


def launch_kind(argv: list[str]) -> str:
    """torchrun (the agent and its ranks are one launch), a launcher script of launch/, python, or
    other. Every argument is looked at, so `bash -c "torchrun ..."` or `ip netns exec NS bash
    launch/x.sh` count as what they start."""
    words = " ".join(argv).split()
    if any("torch.distributed.run" in w or Path(w).name == "torchrun" for w in words):
        return "torchrun"
    if any(w.startswith(("launch/", LAUNCH_FOLDER)) for w in words):
        return "launcher"
    if words and "python" in Path(words[0]).name:
        return "python"
    return "other"


def _argv(args) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        args = [args]
    return [os.fsdecode(a) for a in args]


XDIST_WORKER = "exec(eval(sys.stdin.readline()))"  # how execnet starts a pytest-xdist worker
_original_init = subprocess.Popen.__init__
_original_exit = subprocess.Popen._handle_exitstatus


def _recording_init(self, args, *rest, **kwargs):
    try:
        argv = _argv(args)
        if not any(XDIST_WORKER in a for a in argv):  # pytest-xdist's own workers are not the tests' launches
            self._launch = Launch(_current_test, launch_kind(argv), time.monotonic(), argv=argv[:6])
            _launches.append(self._launch)
            _running[id(self._launch)] = self
    except Exception:  # counting must never change what Popen does
        pass
    _original_init(self, args, *rest, **kwargs)


def _recording_exit(self, *args, **kwargs):
    launch = getattr(self, "_launch", None)
    if launch is not None and launch.end is None:
        launch.end = time.monotonic()
        _running.pop(id(launch), None)
    return _original_exit(self, *args, **kwargs)


def pytest_addoption(parser) -> None:
    parser.addoption("--launches-json", metavar="PATH",
                     help="also write every launch (test, kind, seconds, argv) to PATH")


def pytest_configure(config) -> None:
    subprocess.Popen.__init__ = _recording_init
    subprocess.Popen._handle_exitstatus = _recording_exit


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current_test
    _current_test = item.nodeid
    yield
    for launch in _launches:  # a process never waited on counts until its test ends
        if launch.test == item.nodeid and launch.end is None:
            process = _running.pop(id(launch), None)
            if process is not None and process.poll() is None:
                launch.left_running = True  # another test (another worker's too) may meet it
            launch.end = launch.end or time.monotonic()
    _current_test = "(between tests)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The quick tier stays quick: a test marked `quick` may start Python processes, never torchrun."""
    result = yield
    if item.get_closest_marker("quick"):
        launched = [one for one in _launches if one.test == item.nodeid and one.kind in ("torchrun", "launcher")]
        if launched:
            pytest.fail(f"a quick test launched {' '.join(launched[0].argv)}: take the quick mark off, "
                        "or test it in-process", pytrace=False)
    return result


def pytest_runtest_logreport(report) -> None:
    _test_seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the records to the controller
        workeroutput["launches"] = json.dumps([{**asdict(one), "end": one.end or time.monotonic()}
                                               for one in _launches])


def pytest_testnodedown(node, error) -> None:
    for record in json.loads(getattr(node, "workeroutput", {}).get("launches", "[]")):
        _launches.append(Launch(**record))


def pytest_terminal_summary(terminalreporter) -> None:
    if getattr(terminalreporter.config, "workerinput", None) is not None:
        return
    if path := terminalreporter.config.getoption("--launches-json"):
        Path(path).write_text(json.dumps([{**asdict(one), "seconds": round(one.seconds, 2)} for one in _launches],
                                         indent=0))
    if not _launches:
        return
    write = terminalreporter.write_line
    terminalreporter.section("launches")
    by_kind: dict[str, list[Launch]] = defaultdict(list)
    by_file: dict[str, list[Launch]] = defaultdict(list)
    by_test: dict[str, list[Launch]] = defaultdict(list)
    for launch in _launches:
        by_kind[launch.kind].append(launch)
        by_file[launch.test.split("::")[0]].append(launch)
        by_test[launch.test].append(launch)
    total = sum(one.seconds for one in _launches)
    write(f"total: {len(_launches)} launches, {total:.0f} s of process time "
          + ", ".join(f"{k} {len(v)} ({sum(one.seconds for one in v):.0f} s)" for k, v in sorted(by_kind.items())))
    write("per file (launches, seconds):")
    for name, group in sorted(by_file.items(), key=lambda kv: -sum(one.seconds for one in kv[1])):
        write(f"  {len(group):4d} {sum(one.seconds for one in group):7.0f} s  {name}")
    for launch in (one for one in _launches if one.left_running):
        write(f"left running when its test ended: {' '.join(launch.argv)} ({launch.test})")
    write("ten most expensive tests (launches, launch seconds, test seconds):")
    ranked = sorted(by_test.items(), key=lambda kv: -sum(one.seconds for one in kv[1]))[:10]
    for name, group in ranked:
        write(f"  {len(group):4d} {sum(one.seconds for one in group):7.0f} s "
              f"{_test_seconds.get(name, 0):7.0f} s  {name}")
