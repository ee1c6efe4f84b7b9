#!/usr/bin/env bash
# Kubernetes: a Kubeflow PyTorchJob (training-operator) with one master and WORKERS worker pods,
# each running torchrun. The operator sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
# PET_MASTER_ADDR and PET_MASTER_PORT in every pod, which torchrun reads as its flags.
#
#   IMAGE=registry.example/dp-suite:1 DATA_PVC=cifar-data launch/k8s.sh train_ddp.py --dataset cifar10
#
# Parameters (environment):
#   IMAGE       container image with this repo at /workspace and requirements installed  (REQUIRED)
#   DATA_PVC    PersistentVolumeClaim holding the data sets, mounted at /data          (REQUIRED)
#   CKPT_PVC    PersistentVolumeClaim for checkpoints, shared by all pods (default: DATA_PVC)
#   WORKERS     worker pods besides the master (default: 1)
#   NPROC       processes per pod = GPUs per pod (default: 1)
#   JOB_NAME    (default: dp-suite)
#   DRY_RUN=1   print the manifest without applying it
set -euo pipefail

if [[ $# -lt 1 || -z "${IMAGE:-}" || -z "${DATA_PVC:-}" ]]; then
    echo "usage: IMAGE=... DATA_PVC=... [WORKERS=N] [NPROC=N] [DRY_RUN=1] $0 SCRIPT.py [FLAGS...]" >&2
    exit 2
fi

job=${JOB_NAME:-dp-suite}
nproc=${NPROC:-1}
args=("$@" --data-dir /data --checkpoint-dir /checkpoints/"$job")
command="torchrun --nproc_per_node=${nproc} --max-restarts=${MAX_RESTARTS:-3} ${args[*]}"
echo "# each pod runs: ${command}"

replica() {  # $1: Master or Worker, $2: replicas
    cat <<YAML
    $1:
      replicas: $2
      restartPolicy: OnFailure
      template:
        spec:
          containers:
            - name: pytorch
              image: ${IMAGE}
              workingDir: /workspace
              command: [$(printf '"%s", ' ${command} | sed 's/, $//')]
              resources:
                limits:
                  nvidia.com/gpu: ${nproc}
              volumeMounts:
                - {name: data, mountPath: /data}
                - {name: checkpoints, mountPath: /checkpoints}
                - {name: shm, mountPath: /dev/shm}
          volumes:
            - name: data
              persistentVolumeClaim: {claimName: ${DATA_PVC}}
            - name: checkpoints
              persistentVolumeClaim: {claimName: ${CKPT_PVC:-${DATA_PVC}}}
            - name: shm
              emptyDir: {medium: Memory}
YAML
}

manifest=$(cat <<YAML
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: ${job}
spec:
  nprocPerNode: "${nproc}"
  pytorchReplicaSpecs:
$(replica Master 1)
$(replica Worker "${WORKERS:-1}")
YAML
)

echo "${manifest}"
[[ "${DRY_RUN:-0}" == 1 ]] || kubectl apply -f - <<< "${manifest}"
