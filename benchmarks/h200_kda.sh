#!/usr/bin/env bash
# One device call: KDA side by side (our tiers, fla chunk_kda, jax-linear-attention) on the H200.
# Usage: bash benchmarks/h200_kda.sh [IMPLS]; records to $OUT/kda_h200.json, log to $OUT/kda.log.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
impls=${1:-mosaic_gpu,mosaic_gpu_bwd_intra,fla,chunked,jla_mosaic_gpu}
python3 -m benchmarks.kda --impls=$impls --reps=10 --out=$OUT/kda_h200.json 2>&1 | tee $OUT/kda.log | grep -v "^I1\|^W1\|^  \|Traceback\|^$"
