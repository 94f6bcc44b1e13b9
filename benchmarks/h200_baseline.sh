#!/usr/bin/env bash
# One device call: environment probe, ceilings, KDA vs fla/jla, MoE layer, k3_small train step.
# Run from the repo root on the H200 with .whl carried; logs and JSON records go to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee $OUT/env.txt
python3 -c "import jax, torch, triton; print(jax.__version__, jax.devices(), torch.__version__, triton.__version__)" 2>&1 | tee -a $OUT/env.txt
python3 - <<'PY' 2>&1 | tee $OUT/ceilings.txt
import torch, triton
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
print(f"bf16 matmul 8192^3: {2*8192**3/ms/1e9:.1f} TFLOP/s")
x = torch.empty(2**30, device="cuda", dtype=torch.uint8); y = torch.empty_like(x)
ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
print(f"d2d copy: {2*2**30/ms/1e9:.2f} TB/s (read+write)")
PY
timeout 240 python3 -m benchmarks.kda --out=$OUT/kda_h200.json 2>&1 | tee $OUT/kda.log | grep -v "^I1\|^W1" | tail -30
timeout 120 python3 -m benchmarks.moe_layer --out=$OUT/moe_h200.json 2>&1 | tee $OUT/moe.log | tail -8
timeout 200 python3 -m benchmarks.train_step --config=experiments/configs/k3_small.py --config.train.global_batch_size=2 --out=$OUT/train_h200.json 2>&1 | tee $OUT/train.log | tail -5
