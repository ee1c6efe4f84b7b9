"""launch/slurm.sbatch under a real Slurm: munged, slurmctld and slurmd on this host (a module
fixture writes their configuration and starts them), the job submitted with sbatch and stopped as
the issue reproduced a proctrack/cgroup cluster's stop: SIGTERM to every process of the job (as
`scontrol listpids` lists them, srun first), then scancel. srun answers its own SIGTERM by
SIGKILLing its step at once, so the script must not run torchrun under srun on one node. The stop
saves at the step the ranks agreed on, and the same sbatch command resumes there and finishes."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.conftest import ROOT, free_port, latest_checkpoint, latest_state, saved_position
from tests.gates import Gate
from tests.test_launchers import launcher_env

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
SBIN = os.pathsep.join(("/usr/sbin", "/sbin"))  # the daemons' folder, on root's PATH or not
# Steps of tens of ms (global batch 256): the ranks agree on a stop within 10 steps (StopRequest.CHECK_EVERY),
# far longer than srun takes to SIGKILL its step, as with a real model (at batch 32, 5 ms steps, one stop
# and its 10 ms save beat srun's SIGKILL). The stopped job is held after step HELD (tests/gates.py) until
# its workers took the TERM: it stops after step HELD + 1 on a host of any speed.
STEPS_PER_EPOCH = 39  # synthetic mnist: 10,000 images, global batch 256 at world 2
EPOCHS = 5
HELD = 10  # a multiple of StopRequest.CHECK_EVERY
HOLD = f"all@{HELD}"
RUN = ["tests/patched.py", f"gate={HOLD}", "train_ddp.py", "--dataset", "synthetic", "--synthetic-shape", "mnist",
       "--model", "lenet", "--batch-size", "256", "--epochs", str(EPOCHS)]
PAUSE_BEFORE_SCANCEL_S = 2.0  # a cluster's scancel follows its TERM to every process
STOP_LINE = re.compile(r"^stopped by SIGTERM after step (\d+) .*; checkpoint (\S+); ", re.M)


@dataclass(frozen=True)
class Cluster:
    env: dict[str, str]  # SLURM_CONF: the commands find this cluster, not one of the host's
    proctrack: str
    cpus: int

    def run(self, *command: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        """A Slurm command for this cluster, from the repository's root (where sbatch finds the script
        and the job the training scripts), with `env` added to its environment; check: it must succeed."""
        done = subprocess.run(command, cwd=ROOT, env={**self.env, **env}, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 or not check, f"{' '.join(command)}: exit {done.returncode}\n{done.stderr}"
        return done


def slurm_conf(folder: Path, proctrack: str, cpus: int) -> str:
    return "\n".join([
        "ClusterName=dpsuite", "SlurmctldHost=localhost", "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",  # beside any other Slurm on this host
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={folder / 'munge.socket'}",
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'slurmd.log'}",
        f"ProctrackType={proctrack}", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2", "KillWait=30",
        f"NodeName=localhost CPUs={cpus} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""])


def within(seconds: float, ready: Callable[[], bool]) -> bool:
    """Whether ready() came true within `seconds` (asked every 0.5 s)."""
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)  # a poll with a deadline
    return True


@contextlib.contextmanager
def daemons(folder: Path, proctrack: str) -> Iterator[Cluster | None]:
    """munged, slurmctld and slurmd in the foreground (their pids are ours to end), configured in
    `folder`; the cluster once its node is idle, or None if slurmd could not start with `proctrack`."""
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    # the CPUs of the machine, as `getconf _NPROCESSORS_ONLN` counts them (nproc honours OMP_NUM_THREADS)
    cpus = os.sysconf("SC_NPROCESSORS_ONLN")
    (folder / "slurm.conf").write_text(slurm_conf(folder, proctrack, cpus))
    (folder / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")  # without the file, proctrack/cgroup fails to load
    cluster = Cluster(launcher_env(SLURM_CONF=str(folder / "slurm.conf")), proctrack, cpus)
    commands = [["munged", "--foreground", "--force", f"--socket={folder / 'munge.socket'}", f"--key-file={key}",
                 f"--pid-file={folder / 'munged.pid'}", f"--seed-file={folder / 'munged.seed'}",
                 f"--log-file={folder / 'munged.log'}"],
                ["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", "localhost"]]
    started: list[subprocess.Popen] = []
    try:
        with open(folder / "daemons.out", "w") as out:
            for command in commands:
                started.append(subprocess.Popen([shutil.which(command[0], path=SBIN), *command[1:]], env=cluster.env,
                                                stdout=out, stderr=out))
                if command[0] == "munged":
                    assert within(30, (folder / "munge.socket").exists), (folder / "daemons.out").read_text()
        slurmd = started[-1]
        assert within(30, lambda: slurmd.poll() is not None or node_state(cluster) == "idle"), \
            (folder / "daemons.out").read_text()
        # slurmd starts whatever the proctrack plugin; a step loads it: one that fails drains the node
        yield cluster if slurmd.poll() is None and cluster.run("srun", "--quiet", "true", check=False).returncode == 0 \
            else None
    finally:
        for daemon in reversed(started):
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()


def node_state(cluster: Cluster) -> str:
    return cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[Cluster]:
    """proctrack/cgroup, as clusters run it, where this host's cgroups allow it; else proctrack/linuxproc."""
    path = f"{os.environ.get('PATH', '')}{os.pathsep}{SBIN}"
    missing = [name for name in PROGRAMS if not shutil.which(name, path=path)]
    if missing:
        pytest.skip(f"slurm-wlm not installed ({', '.join(missing)} not found): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("slurmd starts jobs as their users: it runs as root, and this test is not root")
    for proctrack in ("proctrack/cgroup", "proctrack/linuxproc"):
        folder = tmp_path_factory.mktemp(proctrack.replace("/", "-"))
        with daemons(folder, proctrack) as cluster:
            if cluster:
                yield cluster
                return
        logs = [folder / name for name in ("daemons.out", "slurmd.log") if (folder / name).exists()]
        print(f"\nno job step ran with {proctrack}:\n" + "\n".join(log.read_text()[-1500:] for log in logs))
    pytest.fail("no job step ran with either proctrack plugin (logs above)")


@dataclass(frozen=True)
class Job:
    id: str
    out: Path  # its output file

    def log(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""


def submit(cluster: Cluster, tmp: Path, name: str, gate: Gate) -> Job:
    """launch/slurm.sbatch from the repository's root, as a user submits it, on this cluster's one
    node: the flags replace the script's #SBATCH lines (2 nodes, 4 GPUs and 16 CPUs each) with what
    this node has, and NPROC=2 runs two CPU processes, held after step HELD until `gate` releases them."""
    out = tmp / f"{name}.out"
    job = cluster.run("sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={cluster.cpus}",
                      "--time=10", f"--output={out}", "launch/slurm.sbatch", *RUN, "--checkpoint-dir",
                      str(tmp / "ckpt"), "--log-dir", str(tmp / "tb"), NPROC="2", **gate.env())
    return Job(job.stdout.strip(), out)


def ended(cluster: Cluster, job: Job) -> bool:
    """Whether Slurm no longer lists the job as pending, running or completing. (squeue, not
    `sbatch --wait`: that one asks at growing intervals, and took 14 s longer here.)"""
    return not cluster.run("squeue", "-h", "-j", job.id, check=False).stdout.strip()


def state_at_the_end(cluster: Cluster, job: Job) -> str:
    """COMPLETED, FAILED, CANCELLED...: the job's state once it has ended (within 240 s)."""
    assert within(240, lambda: ended(cluster, job)), f"job {job.id} still runs after 240 s:\n{job.log()[-3000:]}"
    return re.search(r"JobState=(\w+)", cluster.run("scontrol", "show", "job", job.id).stdout)[1]


def stop_as_proctrack_cgroup_does(cluster: Cluster, job: str, gate: Gate) -> float:
    """SIGTERM to every process of the job (the batch script, srun, torchrun, the workers), held at
    HOLD and released once both workers took it, then, after a pause, scancel. Returns the time of the
    SIGTERM (time.time(): a file's mtime is compared to it)."""
    listed = cluster.run("scontrol", "listpids", job).stdout.splitlines()[1:]  # below its header: PID JOBID ...
    sent = time.time()
    for pid in dict.fromkeys(int(line.split()[0]) for line in listed):  # in the listed order, once each
        with contextlib.suppress(ProcessLookupError):  # a process that ended since the listing
            os.kill(pid, signal.SIGTERM)
    gate.signalled(HOLD, processes=2)
    gate.release(HOLD)
    time.sleep(PAUSE_BEFORE_SCANCEL_S)  # not a point in training: the cluster's own pause (KillWait) before scancel
    cluster.run("scancel", job, check=False)  # the job may have ended already
    return sent


def test_a_job_stopped_like_proctrack_cgroup_saves_and_the_same_command_resumes(slurm, tmp_path):
    started = time.monotonic()
    gate = Gate(tmp_path / "gates")
    job = submit(slurm, tmp_path, "stopped", gate)
    gate.held(HOLD, processes=2)
    sent = stop_as_proctrack_cgroup_does(slurm, job.id, gate)
    state, log = state_at_the_end(slurm, job), job.log()
    stopped = STOP_LINE.findall(log)
    assert len(stopped) == 1, f"job {job.id} ({state}) saved nothing:\n{log[-3000:]}"
    step, path = int(stopped[0][0]), Path(stopped[0][1])
    assert step == HELD + 1, log[-3000:]  # the TERM came while the job was held after step HELD
    assert latest_checkpoint(tmp_path / "ckpt") == path and latest_state(tmp_path / "ckpt")["global_step"] == step
    save_s = path.stat().st_mtime - sent

    job = submit(slurm, tmp_path, "resumed", gate)  # the gate is open: released above
    state, log = state_at_the_end(slurm, job), job.log()
    epoch, in_epoch = saved_position(step, STEPS_PER_EPOCH)
    assert f"resumed from {path}: epoch {epoch + 1}, step {in_epoch} " in log, log[-3000:]
    assert state == "COMPLETED", log[-3000:]
    assert latest_state(tmp_path / "ckpt")["global_step"] == EPOCHS * STEPS_PER_EPOCH
    print(f"\nslurm ({slurm.proctrack}): TERM to every process of the job, scancel {PAUSE_BEFORE_SCANCEL_S:g} s later: "
          f"saved after step {step}, {save_s:.2f} s after the TERM; resubmitted: resumed at epoch {epoch + 1}, "
          f"step {in_epoch}, finished at step {EPOCHS * STEPS_PER_EPOCH}; {time.monotonic() - started:.1f} s in all")
