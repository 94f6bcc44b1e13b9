#!/usr/bin/env bash
# Training on a Cloud TPU pod slice: the same command on every worker VM through gcloud.
#
#   TPU_NAME=k3-v5p-128 ZONE=us-east5-a launch/tpu_pod.sh setup
#   TPU_NAME=k3-v5p-128 ZONE=us-east5-a launch/tpu_pod.sh train \
#       --config=experiments/configs/k3_full.py --workdir=/mnt/shared/runs/k3_full
#
# setup: copies this checkout (git archive of HEAD) to ~/k3jax on every worker and installs the
#   pinned environment there with libtpu (`jax[tpu]==0.11.2`; on a TPU VM libtpu belongs in it).
# train: runs `launch.train --distributed` on all workers at once; jax.distributed.initialize()
#   finds the coordinator, process count and index from the TPU VM metadata. Each worker loads
#   only its rows of the global batch. --workdir must be a file system every worker mounts at
#   the same path (Filestore NFS, or a gcsfuse bucket); exit status 75 on every worker after a
#   maintenance event's SIGTERM: run `train` again with the same flags to resume.
# Optional: PROJECT (gcloud --project), REMOTE_DIR (default k3jax), PYTHON312 (default python3.12).
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE to the TPU zone}"
REMOTE_DIR=${REMOTE_DIR:-k3jax}
PYTHON312=${PYTHON312:-python3.12}
GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE" --worker=all)
if [ -n "${PROJECT:-}" ]; then WHERE+=(--project="$PROJECT"); fi

on_all_workers() {
  "${GCLOUD[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --command="$1"
}

command=${1:-}
shift || true
case "$command" in
  setup)
    archive=$(mktemp --suffix=.tar.gz)
    trap 'rm -f "$archive"' EXIT
    git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$archive" HEAD
    "${GCLOUD[@]}" scp "$archive" "$TPU_NAME:k3jax.tar.gz" "${WHERE[@]}"
    on_all_workers "set -e; mkdir -p $REMOTE_DIR; tar -xzf k3jax.tar.gz -C $REMOTE_DIR; \
cd $REMOTE_DIR; $PYTHON312 -m venv .venv; .venv/bin/pip install -q --upgrade pip; \
.venv/bin/pip install -q -r requirements.txt 'jax[tpu]==0.11.2'; \
.venv/bin/pip install -q --no-deps -e ."
    ;;
  train)
    [ "$#" -gt 0 ] || { echo "error: train needs launch.train flags (--config, --workdir)" >&2; exit 2; }
    on_all_workers "cd $REMOTE_DIR && .venv/bin/python -m launch.train --distributed $(printf '%q ' "$@")"
    ;;
  *)
    echo "usage: TPU_NAME=... ZONE=... $0 setup | train LAUNCH_TRAIN_FLAGS..." >&2
    exit 2
    ;;
esac
