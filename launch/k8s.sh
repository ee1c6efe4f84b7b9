#!/usr/bin/env bash
# Kubernetes: a Kubeflow PyTorchJob (training-operator) with one master and WORKERS worker pods,
# each running torchrun. The operator sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
# PET_MASTER_ADDR and PET_MASTER_PORT in every pod, which torchrun reads as its flags.
#
#   IMAGE=registry.example/dp-suite:1 DATA_PVC=cifar-data launch/k8s.sh train_ddp.py --dataset cifar10
#
# Parameters (environment):
#   IMAGE          container image with this repo at /workspace and requirements installed  (REQUIRED)
#   DATA_PVC       PersistentVolumeClaim holding the data sets, mounted at /data          (REQUIRED)
#   CKPT_PVC       PersistentVolumeClaim for checkpoints, shared by all pods (default: DATA_PVC)
#   WORKERS        worker pods besides the master (default: 1)
#   NPROC          processes per pod = GPUs per pod (default: 1)
#   JOB_NAME       (default: dp-suite)
#   MAX_RESTARTS   torchrun's restarts of the workers inside a pod (default: 3)
#   BACKOFF_LIMIT  pod restarts (restartPolicy OnFailure) before the job is marked failed (default: 3)
#   DRY_RUN=1      print the manifest without applying it
#
# Prints "# each pod runs: <the torchrun command, shell-quoted>", then the manifest, which python3's
# json module writes (JSON is YAML): the arguments reach the pods exactly as given here.
set -euo pipefail

if [[ $# -lt 1 || -z "${IMAGE:-}" || -z "${DATA_PVC:-}" ]]; then
    echo "usage: IMAGE=... DATA_PVC=... [WORKERS=N] [NPROC=N] [BACKOFF_LIMIT=N] [DRY_RUN=1] $0 SCRIPT.py [FLAGS...]" >&2
    exit 2
fi

manifest=$(python3 - "$@" <<'PY'
import json, os, re, shlex, sys

def number(name, default, least):
    value = os.environ.get(name) or default
    if not re.fullmatch(r"[0-9]+", value) or int(value) < least:
        print(f"error: {name}={value!r} is not a whole number >= {least}", file=sys.stderr)
        sys.exit(2)
    return int(value)

def quote(arg):
    """shlex.quote, but on one line: an argument with control characters becomes bash's $'...'."""
    if arg.isprintable():
        return shlex.quote(arg)
    def escape(c):
        if c in "\\'":
            return "\\" + c
        return c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 0x80 else f"\\U{ord(c):08x}"
    return "$'" + "".join(map(escape, arg)) + "'"

env = os.environ
data = env["DATA_PVC"]
job, nproc, workers = env.get("JOB_NAME") or "dp-suite", number("NPROC", "1", 1), number("WORKERS", "1", 0)
command = ["torchrun", f"--nproc_per_node={nproc}", f"--max-restarts={number('MAX_RESTARTS', '3', 0)}",
           *sys.argv[1:], "--data-dir", "/data", "--checkpoint-dir", f"/checkpoints/{job}"]

def replica(count):
    return {
        "replicas": count,
        "restartPolicy": "OnFailure",
        "template": {"spec": {
            "containers": [{
                "name": "pytorch",
                "image": env["IMAGE"],
                "workingDir": "/workspace",
                "command": command,
                "resources": {"limits": {"nvidia.com/gpu": nproc}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"},
                                 {"name": "checkpoints", "mountPath": "/checkpoints"},
                                 {"name": "shm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": data}},
                        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": env.get("CKPT_PVC") or data}},
                        {"name": "shm", "emptyDir": {"medium": "Memory"}}],
        }},
    }

manifest = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "PyTorchJob",
    "metadata": {"name": job},
    "spec": {
        "nprocPerNode": str(nproc),
        "runPolicy": {"backoffLimit": number("BACKOFF_LIMIT", "3", 0)},
        "pytorchReplicaSpecs": {"Master": replica(1), "Worker": replica(workers)},
    },
}
print("# each pod runs:", " ".join(map(quote, command)))
print(json.dumps(manifest, indent=2))
PY
)

printf '%s\n' "${manifest}"
[[ "${DRY_RUN:-0}" == 1 ]] || kubectl apply -f - <<< "${manifest#*$'\n'}"  # the JSON, after the comment line
