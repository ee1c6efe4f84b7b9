#!/usr/bin/env bash
# Kubernetes: a Kubeflow PyTorchJob (training-operator) with one master and WORKERS worker pods,
# each running torchrun (as launch/quiet_torchrun.sh runs it). The operator sets PET_NNODES,
# PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT in every pod, which torchrun
# reads as its flags.
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
#   SECRET_NAME    Kubernetes Secret(s), comma-separated, whose keys become the containers' environment
#                  (envFrom: secretRef): the way to give credentials (see below)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds the workers get to stop (finish the step, save) after the pod
#                  is told to stop, before torchrun kills them (default: 120; torchrun's own: 30); the
#                  pods' terminationGracePeriodSeconds (Kubernetes' SIGKILL) is this + 30
#   DRY_RUN=1      print the manifest without applying it
#
# Prints "# each pod runs: <the torchrun command, shell-quoted>", then the manifest, which python3's
# json module writes (JSON is YAML): the arguments reach the pods exactly as given here.
# Every pod gets --data-dir /data --checkpoint-dir /checkpoints/JOB_NAME, placed before your flags:
# a --data-dir or --checkpoint-dir of yours comes later and wins (a local path must be on a volume).
#
# Credentials are never written into the manifest (it is kept in etcd; whoever can get the pods reads
# it): an inline --storage-options holding any, or a user:password@ URL, is refused. Put them in a
# Secret instead, e.g. the standard AWS variables, or the options' JSON under one key:
#   kubectl create secret generic dp-store --from-literal=AWS_ACCESS_KEY_ID=... \
#       --from-literal=AWS_SECRET_ACCESS_KEY=... --from-file=STORAGE_OPTIONS=options.json
#   SECRET_NAME=dp-store ... launch/k8s.sh train_ddp.py --storage-options env:STORAGE_OPTIONS ...
set -euo pipefail

if [[ $# -lt 1 || -z "${IMAGE:-}" || -z "${DATA_PVC:-}" ]]; then
    echo "usage: IMAGE=... DATA_PVC=... [WORKERS=N] [NPROC=N] [BACKOFF_LIMIT=N] [SECRET_NAME=...] [DRY_RUN=1] $0 SCRIPT.py [FLAGS...]" >&2
    exit 2
fi

manifest=$(python3 - "$(dirname "$0")/.." "$@" <<'PY'
import json, os, re, shlex, sys

sys.path.insert(0, sys.argv.pop(1))  # the repository: common/credentials.py
from common.credentials import URL_PASSWORD, credentials_in

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

def flag_of(args, i):
    """The flag whose value args[i] is (--flag VALUE or --flag=VALUE), else its place on the command line."""
    if args[i].startswith("--") and "=" in args[i]:
        return args[i].partition("=")[0]
    return args[i - 1] if i and args[i - 1].startswith("--") else f"argument {i + 2}"

def refuse_credentials(args):
    """An inline --storage-options (or a prefix of the flag: the scripts refuse it, but in the pod, from
    the manifest) with credentials in it, or a URL with a password: one line naming them, never their
    values, and the Secret way."""
    found = [f"{flag_of(args, i)} holds a URL with a password" for i, arg in enumerate(args) if URL_PASSWORD.search(arg)]
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if not (name.startswith("--st") and "--storage-options".startswith(name)):
            continue
        value = value if equals else (args[i + 1] if i + 1 < len(args) else "")
        if value.startswith(("@", "env:")):
            continue  # a file in the pod (a mounted Secret) or a variable: no value here
        try:
            if names := [where for where, _ in credentials_in(json.loads(value))]:
                found.append(f"--storage-options holds credentials ({', '.join(names)})")
        except json.JSONDecodeError:
            found.append("--storage-options is not JSON (it may hold credentials)")
    if found:
        print(f"error: {'; '.join(found)}: k8s.sh never writes credentials into the manifest (etcd keeps it; whoever "
              "can get the pods reads it); put them in a Secret and run with SECRET_NAME=<it> (envFrom: secretRef), "
              "e.g. kubectl create secret generic dp-store --from-literal=AWS_ACCESS_KEY_ID=... "
              "--from-literal=AWS_SECRET_ACCESS_KEY=... [--from-file=STORAGE_OPTIONS=options.json] and "
              "--storage-options env:STORAGE_OPTIONS", file=sys.stderr)
        sys.exit(2)

env = os.environ
data = env["DATA_PVC"]
job, nproc, workers = env.get("JOB_NAME") or "dp-suite", number("NPROC", "1", 1), number("WORKERS", "1", 0)
grace = number("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120", 0)
script, flags = sys.argv[1], sys.argv[2:]
refuse_credentials(flags)
# torchrun as launch/quiet_torchrun.sh runs it (single_node.sh's): a handled error is the workers' one line in the
# pod's log, not torchrun's failure dump after it
command = ["bash", "launch/quiet_torchrun.sh", f"--nproc_per_node={nproc}",
           f"--max-restarts={number('MAX_RESTARTS', '3', 0)}", script,
           "--data-dir", "/data", "--checkpoint-dir", f"/checkpoints/{job}", *flags]  # the user's flags win
secrets = [{"secretRef": {"name": name}} for name in (env.get("SECRET_NAME") or "").split(",") if name]

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
                "env": [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(grace)}],
                **({"envFrom": secrets} if secrets else {}),
                "resources": {"limits": {"nvidia.com/gpu": nproc}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"},
                                 {"name": "checkpoints", "mountPath": "/checkpoints"},
                                 {"name": "shm", "mountPath": "/dev/shm"}],
            }],
            # Kubernetes sends SIGKILL this long after the TERM: torchrun's grace, and 30 s for it to report.
            "terminationGracePeriodSeconds": grace + 30,
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
