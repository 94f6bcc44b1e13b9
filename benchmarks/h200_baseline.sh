#!/usr/bin/env bash
# The H200 runs behind BENCHMARKS.md, in sections that each fit one device call (<= 600 s).
# Run from the repo root on the H200 with .whl carried; logs and JSON records go to $OUT.
#
#   bash benchmarks/h200_baseline.sh ceilings kda_tests   # ~9 min: probe, ceilings, kernel tests
#   bash benchmarks/h200_baseline.sh kda                   # ~8 min: KDA parts, ours vs fla (H 32, 96)
#   bash benchmarks/h200_baseline.sh kda_quick             # ~7 min: H=32 vs fla, then kernel_intra backward
#                                                          # tests (KDA_QUICK_TEST_S seconds, default 300)
#   bash benchmarks/h200_baseline.sh kda_ptxas             # ~1 min: registers / spills of each KDA kernel
#   bash benchmarks/h200_baseline.sh kda_trace             # ~1 min: XLA trace of fwd+bwd, time per kernel
#   bash benchmarks/h200_baseline.sh kda_accuracy          # ~3 min: outputs, gradients vs fp64 (ours, fla)
#   bash benchmarks/h200_baseline.sh gpu_tests             # <= 9 min: every Hopper-only kernel test file
#                                                          # but KDA's (grouped GEMMs, decode attention,
#                                                          # MXFP4, fused gate/up, top-k, attention)
#   bash benchmarks/h200_baseline.sh moe train             # ~8 min: MoE layer per tier, k3_small step
#   bash benchmarks/h200_baseline.sh moe_trace             # ~4 min: top-k; traces of MoE layer, routing
#   bash benchmarks/h200_baseline.sh moe_gemm              # ~3 min: grouped GEMMs vs torch at the K3 shapes
#   bash benchmarks/h200_baseline.sh moe_kernels           # ~5 min: ragged_dot GPU tests, quick tile sweeps
#   bash benchmarks/h200_baseline.sh moe_tgmm              # ~4 min: d_rhs quick sweep at the 3 K3 shapes,
#                                                          # then where d_rhs's time goes (tgmm_costs)
#   bash benchmarks/h200_baseline.sh moe_gmm_tiles         # ~7 min: ragged_dot GPU tests, fwd/d_lhs quick
#                                                          # sweeps (with/without tile_pipeline) at the 3 K3
#                                                          # shapes and k3_small, tgmm_costs (balance)
#   bash benchmarks/h200_baseline.sh moe_gmm_costs         # ~2 min: where gmm's (fwd) time goes
#   bash benchmarks/h200_baseline.sh moe_fused             # ~4 min: fused gate/up GPU tests, its timing,
#                                                          # MoE layer per choice with traces
#   bash benchmarks/h200_baseline.sh train_parts           # ~6 min: the k3_small step, its compile by
#                                                          # phase and compiler event, device time by part
#   bash benchmarks/h200_baseline.sh train_compile         # ~3 min: the step's compile under the
#                                                          # profiler, its trace in $OUT
#   bash benchmarks/h200_baseline.sh train_prebuild        # ~7 min: the prebuild's GPU test, the step
#                                                          # compiled cold without, then with the
#                                                          # Mosaic GPU kernels prebuilt
#   bash benchmarks/h200_baseline.sh train_trace           # ~7 min: XLA trace of two k3_small steps
#   bash benchmarks/h200_baseline.sh lm_head               # ~2 min: LM head + CE fwd+bwd, dense vs
#                                                          # blockwise per block size, largest ops
#   bash benchmarks/h200_baseline.sh muon                  # ~1 min: per-head Muon's orthogonalize
#                                                          # against Newton-Schulz per block group
#   bash benchmarks/h200_baseline.sh train_cache           # <= 8 min: the step's compile through JAX's
#                                                          # persistent cache, cold then warm
#   bash benchmarks/h200_baseline.sh attention             # ~4 min: attention GPU tests, ours vs cuDNN
#   bash benchmarks/h200_baseline.sh mxfp4                 # <= 6 min: MXFP4 matmul GPU tests, ours (and
#                                                          # its MXFP4_VARIANTS) vs bf16 XLA and the bf16
#                                                          # grouped GEMM (K3 shapes, device time)
#   bash benchmarks/h200_baseline.sh mxfp4_triton          # <= 9 min: the triton tier's GPU tests, it and
#                                                          # its candidate configs at decoding rows
#                                                          # (TRITON_CONFIGS: sets, a process each)
#   bash benchmarks/h200_baseline.sh mxfp4_ncu             # ~2 min: Nsight Compute's counters
#                                                          # of the MXFP4 kernels (grouped
#                                                          # decoding shape)
#   bash benchmarks/h200_baseline.sh mxfp4_xla             # <= 5 min: the MXFP4 xla tier vs bf16
#                                                          # XLA, default flags and XLA's fused
#                                                          # dequantization ($OUT/mxfp4_xla_*.json)
#   bash benchmarks/h200_baseline.sh moe_decode            # <= 6 min: ragged_dot GPU tests of the
#                                                          # "swapped" kernel, then the decoding
#                                                          # shapes' grouped products (ws, swapped,
#                                                          # xla, and the experts packed as MXFP4)
#   bash benchmarks/h200_baseline.sh decode_attention      # < 6 min: decode attention GPU tests, its tiers
#                                                          # vs the bytes-read floor (H 8/64, S 4k-128k)
#   DECODE_VARIANTS="hybrid all_mla" bash benchmarks/h200_baseline.sh decode
#                                                          # <= 10 min: k3_small's decode loop vs its
#                                                          # all-MLA twin (4k/32k/128k, B 1/16); a second
#                                                          # call for kda_only. One process per variant,
#                                                          # DECODE_VARIANT_S each (default 290; on
#                                                          # 2026-12-02 B 1 alone took ~120 s a variant:
#                                                          # 55-65 s of compiles per B)
#   bash benchmarks/h200_baseline.sh mxfp4_gate_up        # ~4 min: the fused MXFP4 gate/up's GPU
#                                                          # tests, its calls against the unfused
#                                                          # ones, k3_small's decode at B 16, 128k
#                                                          # with packed experts, with and without it
#   bash benchmarks/h200_baseline.sh moe_decode_configs   # ~4 min: the Triton tier's decode
#                                                          # candidates at k3_small's decode shapes
#                                                          # (grouped, fused gate/up) and defaults
#   bash benchmarks/h200_baseline.sh decode_matmul        # ~5 min: the few-rows bf16 matmul
#                                                          # kernel's GPU tests, then k3_small's
#                                                          # decode products by XLA and by it
#   bash benchmarks/h200_baseline.sh decode_kernels       # ~2 min: one traced decode loop of
#                                                          # k3_small (B 16, 128k, packed experts):
#                                                          # parts and kernels by HLO op
#   bash benchmarks/h200_baseline.sh kda_decode_tests     # ~1 min: the KDA decode kernel's tests
#   bash benchmarks/h200_baseline.sh expert_sort          # ~3 min: the Triton expert sort's GPU
#                                                          # tests, then k3_small's decode (B 16,
#                                                          # 128k, packed experts) with it, without,
#                                                          # with
#   bash benchmarks/h200_baseline.sh kda_decode           # ~8 min: the fused KDA decode step's GPU
#                                                          # tests, the op and its tile configs
#                                                          # against fla's chain, then k3_small's
#                                                          # decode (B 16, 128k, packed experts)
#                                                          # per KDA_DECODE_RUNS
#   bash benchmarks/h200_baseline.sh expert_ffn           # ~7 min: the packed experts' one-launch
#                                                          # FFN's and the one-kernel routing's GPU
#                                                          # tests, the FFN against the unfused
#                                                          # calls, k3_small's decode (B 16, 128k)
#                                                          # per EXPERT_FFN_RUNS
#   bash benchmarks/h200_baseline.sh warmup decode_ab    # warmup: ~20 s of GEMMs before timing
#   BASE_COMMIT=b4f4a80 bash benchmarks/h200_baseline.sh decode_ab
#                                                          # ~3 min: k3_small's decode (B 16, 128k,
#                                                          # packed experts) of this tree and of
#                                                          # the tree in .base (git archive of
#                                                          # BASE_COMMIT, git-ignored, carried),
#                                                          # alternated: this, base, this
#   bash benchmarks/h200_baseline.sh decode_paths         # ~3 min: k3_small decode at B 1, 4k: gathered
#                                                          # MoE decode path, with the while loop in
#                                                          # command buffers, sorted path
#   bash benchmarks/h200_baseline.sh scale_out             # <= 10 min on 2+ GPUs: k3_small trained
#                                                          # on data / expert / pipeline meshes and on
#                                                          # one GPU (SCALE_RUNS; default by GPU count),
#                                                          # $OUT/scale_out_h200.json
#   FLAGSETS="|--xla_gpu_enable_latency_hiding_scheduler=false" \
#     bash benchmarks/h200_baseline.sh train_flags        # ~3 min per set: the k3_small step per
#                                                          # XLA flag set, $OUT/train_flags_N.json
#   FLAGSETS="|--xla_gpu_enable_triton_gemm=false|;--moe_decode_experts=all" \
#     bash benchmarks/h200_baseline.sh decode_flags       # ~1.5 min a run: k3_small's decode
#                                                          # (B 16, 128k, packed experts) per run
#                                                          # of "XLA flags;decode flags",
#                                                          # $OUT/decode_flags.json
#   REMATS="none save_dots" bash benchmarks/h200_baseline.sh train_remat
#                                                          # <= 7 min per choice: the k3_small step
#                                                          # per model.remat choice (REMATS, default
#                                                          # all five), $OUT/train_remat_X.json
#
# Records name the measured commit from $K3JAX_COMMIT, else the tree's git HEAD: where the tree
# travels with an older .git, start the command with K3JAX_COMMIT=$(git rev-parse --short HEAD)
# as expanded where the tree was committed.
#
# fla's Triton autotuning takes minutes on a fresh machine. fla caches its autotune results in
# TRITON_CACHE_DIR (here .triton_cache in the repo); each run packs them into
# $OUT/triton_autotune.tgz. Unpack that into .triton_cache (git-ignored) and carry
# .triton_cache with .whl on later calls to skip the tuning.
set -uo pipefail
export TRITON_CACHE_DIR="$PWD/.triton_cache"
mkdir -p "$TRITON_CACHE_DIR"
trap '(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" -print0 \
       | tar --null -czf "$OUT/triton_autotune.tgz" -T - 2>/dev/null)' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
# k3_small's decode at the decode issue's target point: B 16, 128k, packed experts.
B16_128K="--variants=hybrid --batches=16 --contexts=131072 --noprefill --expert_format=mxfp4"

for section in "$@"; do
  case "$section" in
    ceilings)
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
      ;;
    gpu_tests)
      # 4 workers on the H200's 141 GB, 2 on an 80 GB card; the tests marked large_memory (2-16
      # GiB buffers) after them one at a time: beside other workers on an H100 they failed with
      # 4 workers (allocating 16 and 8 GiB) and with 2, alone they pass (2026-12-06, 2026-12-07).
      mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      workers=$([ "${mib:-0}" -ge 100000 ] && echo 4 || echo 2)
      files="tests/pallas_kernels/test_ragged_dot_gpu.py tests/pallas_kernels/test_decode_attention_gpu.py
        tests/pallas_kernels/test_mxfp4_matmul_gpu.py tests/pallas_kernels/test_moe_gate_up.py
        tests/pallas_kernels/test_top_k.py tests/pallas_kernels/test_attention_gpu.py
        tests/pallas_kernels/test_expert_sort.py tests/pallas_kernels/test_kda_decode.py
        tests/pallas_kernels/test_kernel_reuse.py tests/pallas_kernels/test_mosaic_gpu_prebuild_gpu.py"
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${GPU_TEST_S:-480} python3 -m pytest -q \
        -p no:cacheprovider -n ${GPU_TEST_WORKERS:-$workers} --durations=10 -m "not large_memory" \
        $files 2>&1 | tee $OUT/gpu_tests.log | tail -30
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${GPU_LARGE_TEST_S:-100} python3 -m pytest -q \
        -p no:cacheprovider -m large_memory $files 2>&1 | tee -a $OUT/gpu_tests.log | tail -3
      ;;
    kda_tests)
      KDA_TEST_ARGS="-n 4" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 450 \
        bash benchmarks/kda_kernels_gpu_test.sh 2>&1 | tee $OUT/kda_tests.log | tail -5
      ;;
    kda_quick)
      timeout 150 python3 -m benchmarks.kda --shapes=1x8192x32 --reps=10 --out=$OUT/kda_h200.json \
        --impls=mosaic_gpu,fla > $OUT/kda.log 2>&1
      grep -aE " ms |rel L2|Error" $OUT/kda.log | sort -u
      K3JAX_KDA_TEST_ON_DEVICE=1 timeout "${KDA_QUICK_TEST_S:-300}" python3 -m pytest -q \
        -p no:cacheprovider -x tests/pallas_kernels/test_kda_mosaic_gpu_bwd_intra.py \
        tests/pallas_kernels/test_kda_mosaic_gpu_bwd_cotangents.py \
        tests/pallas_kernels/test_mosaic_gpu_patterns.py \
        tests/pallas_kernels/test_kda_mosaic_gpu_bwd.py -k "intra or saved or strong or pattern or cotan" \
        2>&1 | tee $OUT/kda_tests.log | tail -4
      ;;
    kda_ptxas)
      MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/mosaic_dump timeout 150 python3 -m benchmarks.kda \
        --shapes=1x8192x32 --reps=5 --out=/tmp/kda_ptxas.json --impls=mosaic_gpu \
        > $OUT/kda_ptxas.log 2>&1
      grep -hE "Compiling|Used|spill" $OUT/kda_ptxas.log $OUT/mosaic_dump/* 2>/dev/null | head -60
      ;;
    kda_trace)
      timeout 150 python3 -m benchmarks.kda --shapes=1x8192x32 --reps=5 --out=/tmp/kda_trace.json \
        --impls=mosaic_gpu --passes=fwd+bwd --profile_dir=/tmp/kda_trace > $OUT/kda_trace.log 2>&1
      cp "$(find /tmp/kda_trace -name '*.trace.json.gz' | head -1)" $OUT/kda_trace.json.gz
      python3 -m benchmarks.trace_summary --trace=$OUT/kda_trace.json.gz --top=25
      ;;
    kda)
      timeout 150 python3 -m benchmarks.kda_parts --parts_out=$OUT/kda_parts_h200.json \
        2>&1 | tee $OUT/kda_parts.log | grep " ms"
      for shape in 1x8192x32 1x8192x96; do
        timeout 200 python3 -m benchmarks.kda --shapes=$shape --reps=10 --out=$OUT/kda_h200.json \
          --impls=mosaic_gpu,mosaic_gpu_bwd_xla,chunked,fla 2>&1 | tee -a $OUT/kda.log \
          | grep -E " ms |rel L2"
      done
      ;;
    kda_accuracy)
      timeout 300 python3 -m benchmarks.kda_accuracy --shapes=1x8192x32,1x8192x96 \
        --impls=mosaic_gpu,fla --accuracy_out=$OUT/kda_accuracy_h200.json 2>&1 \
        | tee $OUT/kda_accuracy.log | grep "rel L2"
      ;;
    moe)
      timeout 150 python3 -m benchmarks.moe_layer --out=$OUT/moe_h200.json 2>&1 \
        | tee $OUT/moe.log | grep " ms"
      ;;
    moe_kernels)
      # Two processes, each up to 45% of the memory (the K3 shapes and their fp32 references).
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 200 \
        python3 -m pytest -q -p no:cacheprovider -n 2 tests/pallas_kernels/test_ragged_dot_gpu.py \
        2>&1 | tee $OUT/ragged_dot_tests.log | tail -3
      for set in k3 k3_small; do
        timeout 150 python3 -m benchmarks.autotune_ragged_dot --quick --shapes=$set \
          --out=$OUT/autotune_$set.json > $OUT/autotune_$set.log 2>&1
        grep -A4 "best per shape" $OUT/autotune_$set.log
      done
      ;;
    moe_tgmm)
      timeout 200 python3 -m benchmarks.autotune_ragged_dot --quick --products=d_rhs --max_shapes=3 \
        --out=$OUT/autotune_tgmm.json > $OUT/autotune_tgmm.log 2>&1
      grep -E "==|TFLOP|FAIL" $OUT/autotune_tgmm.log | cut -c1-220
      timeout 200 python3 -m benchmarks.tgmm_costs --out=$OUT/tgmm_costs.json 2>&1 \
        | tee $OUT/tgmm_costs.log | grep TFLOP
      ;;
    moe_gmm_tiles)
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 200 \
        python3 -m pytest -q -p no:cacheprovider -n 2 tests/pallas_kernels/test_ragged_dot_gpu.py \
        2>&1 | tee $OUT/ragged_dot_tests.log | tail -3
      for set in k3 k3_small; do
        timeout 200 python3 -m benchmarks.autotune_ragged_dot --quick --products=fwd,d_lhs \
          --max_shapes=3 --shapes=$set --out=$OUT/autotune_gmm_$set.json \
          > $OUT/autotune_gmm_$set.log 2>&1
        grep -E "==|TFLOP|FAIL" $OUT/autotune_gmm_$set.log | cut -c1-200
      done
      timeout 150 python3 -m benchmarks.tgmm_costs --out=$OUT/tgmm_costs.json 2>&1 \
        | tee $OUT/tgmm_costs.log | grep TFLOP
      ;;
    moe_gmm_costs)
      timeout 250 python3 -m benchmarks.gmm_costs --out=$OUT/gmm_costs.json 2>&1 \
        | tee $OUT/gmm_costs.log | grep -E "TFLOP|fit"
      ;;
    moe_gemm)
      timeout 300 python3 -m benchmarks.moe_gemm --out=$OUT/moe_h200.json 2>&1 \
        | tee $OUT/moe_gemm.log | grep -E "TFLOP|x torch" | grep -v "xla_ragged\|jax_example"
      ;;
    moe_trace)
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -p no:cacheprovider \
        tests/pallas_kernels/test_top_k.py 2>&1 | tee $OUT/top_k_tests.log | tail -2
      timeout 150 python3 -m benchmarks.top_k --out=$OUT/moe_h200.json 2>&1 | grep " us"
      rm -rf /tmp/moe_trace    # a warm machine keeps the last call's traces
      timeout 200 python3 -m benchmarks.moe_layer --impls=default --out=$OUT/moe_h200.json \
        --profile_dir=/tmp/moe_trace > $OUT/moe_trace.log 2>&1
      for part in default routing; do
        cp "$(find /tmp/moe_trace/$part -name '*.trace.json.gz' | head -1)" $OUT/moe_trace_$part.json.gz
        echo "== $part"; python3 -m benchmarks.trace_summary --trace=$OUT/moe_trace_$part.json.gz --top=40 --by_hlo_op
      done
      ;;
    moe_fused)
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 200 \
        python3 -m pytest -q -p no:cacheprovider -n 2 tests/pallas_kernels/test_moe_gate_up.py \
        tests/test_latent_moe.py 2>&1 | tee $OUT/moe_gate_up_tests.log | tail -3
      timeout 120 python3 -m benchmarks.moe_gate_up --out=$OUT/moe_h200.json 2>&1 | grep " ms"
      rm -rf /tmp/moe_trace    # a warm machine keeps the last call's traces
      timeout 240 python3 -m benchmarks.moe_layer --impls=default,fused_fwd,unfused \
        --out=$OUT/moe_h200.json --profile_dir=/tmp/moe_trace > $OUT/moe_fused.log 2>&1
      grep -E " ms|routing \+" $OUT/moe_fused.log
      for part in default fused_fwd unfused routing; do
        cp "$(find /tmp/moe_trace/$part -name '*.trace.json.gz' | head -1)" $OUT/moe_trace_$part.json.gz
        echo "== $part"; python3 -m benchmarks.trace_summary --trace=$OUT/moe_trace_$part.json.gz --top=30 --by_hlo_op
      done
      ;;
    train)
      # B 2 without remat (the fastest that fits there; REMAT overrides: B 8 needs a remat,
      # REMAT=save_dots TRAIN_ARGS=--config.train.global_batch_size=8). TRAIN_ARGS: more
      # flags, e.g. --config.kernels.gate_up_train=unfused
      timeout 400 python3 -m benchmarks.train_step --config=experiments/configs/k3_small.py \
        --config.train.global_batch_size=2 --config.model.remat=${REMAT:-none} ${TRAIN_ARGS:-} \
        --out=$OUT/train_h200.json 2>&1 \
        | tee $OUT/train.log | tail -3
      ;;
    train_cache)
      # The k3_small step compiled twice through one fresh JAX persistent cache: cold, then
      # warm (what a rerun of an unchanged experiment waits with launch.train's default cache).
      rm -rf /tmp/k3jax_jax_cache
      for run in cold warm; do
        timeout 280 python3 -m benchmarks.train_step --config=experiments/configs/k3_small.py \
          --config.train.global_batch_size=2 --steps=4 --jax_cache_dir=/tmp/k3jax_jax_cache \
          --out=$OUT/train_h200.json 2>&1 | tee $OUT/train_cache_$run.log | grep "compile phases"
      done
      ;;
    train_prebuild)
      # The prebuild's GPU test, then the k3_small step compiled cold (no persistent cache) with
      # XLA building the Mosaic GPU kernels itself, then with them prebuilt in parallel.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -p no:cacheprovider \
        tests/pallas_kernels/test_mosaic_gpu_prebuild_gpu.py 2>&1 | tee $OUT/prebuild_tests.log | tail -3
      for prebuild in false true; do
        timeout 230 python3 -m benchmarks.train_step --config=experiments/configs/k3_small.py \
          --config.train.global_batch_size=2 --steps=4 \
          --config.kernels.prebuild_mosaic_gpu=$prebuild --out=$OUT/train_h200.json 2>&1 \
          | tee $OUT/train_prebuild_$prebuild.log | grep -E "compile phases|prebuilt|step_ms"
      done
      ;;
    attention)
      # The attention op's GPU tests, then ours vs cuDNN's own call (ATTN_SHAPES, ATTN_IMPLS).
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${ATTN_TEST_S:-120} python3 -m pytest -q \
        -p no:cacheprovider tests/pallas_kernels/test_attention_gpu.py 2>&1 \
        | tee $OUT/attention_tests.log | tail -4
      timeout ${ATTN_BENCH_S:-150} python3 -m benchmarks.attention --out=$OUT/attention_h200.json \
        --shapes=${ATTN_SHAPES:-2x8192x8,1x8192x32,1x8192x96} \
        --impls=${ATTN_IMPLS:-reference,xla_blockwise,cudnn,cudnn_own} 2>&1 | tee $OUT/attention.log
      ;;
    train_flags)
      # The k3_small step once per XLA flag set (FLAGSETS: sets separated by '|', "" = none):
      # compile by phase and step time, $OUT/train_flags_N.json.
      IFS='|' read -ra sets <<< "${FLAGSETS:-}"
      n=0
      for flags in "${sets[@]}"; do
        n=$((n + 1))
        echo "== XLA_FLAGS=$flags"
        XLA_FLAGS="$flags" timeout ${TRAIN_S:-400} python3 -m benchmarks.train_step \
          --config=experiments/configs/k3_small.py --config.train.global_batch_size=2 \
          ${TRAIN_ARGS:-} --out=$OUT/train_flags_$n.json 2>&1 | tee $OUT/train_flags_$n.log | tail -3
      done
      ;;
    decode_flags)
      # k3_small's decode loop (B 16, 128k, packed experts) once per run of FLAGSETS: runs
      # separated by '|', each "XLA flags;benchmarks.decode flags" (either part may be empty;
      # records carry xla_flags), $OUT/decode_flags.json.
      IFS='|' read -ra sets <<< "${FLAGSETS:-}"
      for run in "${sets[@]}"; do
        IFS=';' read -r flags args <<< "$run"
        echo "== XLA_FLAGS=$flags $args"
        XLA_FLAGS="$flags" timeout ${DECODE_AB_S:-100} python3 -m benchmarks.decode $B16_128K \
          ${DECODE_ARGS:-} $args --out=$OUT/decode_flags.json 2>&1 \
          | tee -a $OUT/decode_flags.log | grep -E "tpot|Error"
      done
      ;;
    mxfp4)
      # The MXFP4 matmul kernel's GPU tests (two processes), then its timing at the K3 shapes.
      # Records are merged shape by shape: a benchmark cut short by its timeout keeps its rows.
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout ${MXFP4_TEST_S:-150} \
        python3 -m pytest -q -p no:cacheprovider -n 2 --durations=5 \
        tests/pallas_kernels/test_mxfp4_matmul_gpu.py 2>&1 | tee $OUT/mxfp4_tests.log | tail -12
      timeout ${MXFP4_BENCH_S:-200} python3 -m benchmarks.mxfp4_matmul --out=$OUT/mxfp4_h200.json \
        --variants=${MXFP4_VARIANTS:-unswapped,swap} ${MXFP4_IMPLS:+--implementations=$MXFP4_IMPLS} \
        2>&1 | tee $OUT/mxfp4.log \
        | grep -E "device|ms|mxfp4_mosaic_gpu|declined"
      ;;
    mxfp4_triton)
      # The MXFP4 triton tier's GPU tests, then it and its candidate configs against our kernel,
      # the reference and bf16 at the decoding row counts (dense M 1 / 16, grouped M 16 / 64).
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MXFP4_TEST_S:-150} python3 -m pytest -q \
        -p no:cacheprovider --durations=5 -k triton tests/pallas_kernels/test_mxfp4_matmul_gpu.py \
        2>&1 | tee $OUT/mxfp4_triton_tests.log | tail -15
      # TRITON_CONFIGS: candidate sets separated by spaces, one process (and records file,
      # $OUT/mxfp4_h200_<i>.json) each, so that a set that fails to build loses only itself.
      i=0
      for set in ${TRITON_CONFIGS:-n32_ptx,n64_ptx,n32_shift,n64_shift,n32_ptx_k256_s16_st1,n64_ptx_k256_s16_st1}; do
        i=$((i + 1))
        timeout ${MXFP4_BENCH_S:-220} python3 -m benchmarks.mxfp4_matmul \
          --out=$OUT/mxfp4_h200_$i.json --variants= --dense_m=1,16 --grouped_m=16,64 \
          --implementations=${MXFP4_IMPLS:-mxfp4_triton,bf16_xla,bf16_ragged_dot} \
          --triton_configs=$set 2>&1 \
          | tee -a $OUT/mxfp4_triton.log | grep -E "device|ms|triton|declined|Error"
      done
      ;;
    mxfp4_ncu)
      # Nsight Compute's counters of each MXFP4 kernel at the grouped decoding shape (16 rows
      # over 8 experts, K 3584 -> N 3072; NCU_ARGS for another, benchmarks/mxfp4_ncu.py): speed
      # of light, occupancy, scheduler and warp states, memory, one launch ($OUT/mxfp4_ncu_*.txt).
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for impl in ${NCU_IMPLS:-triton mosaic_gpu}; do
        timeout ${NCU_S:-240} $ncu_bin --clock-control none -k "regex:mxfp4|mosaic" -s 2 -c 1 \
          --section SpeedOfLight --section Occupancy --section LaunchStats \
          --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
          python3 -m benchmarks.mxfp4_ncu --impl=$impl ${NCU_ARGS:-} 2>&1 \
          | tee $OUT/mxfp4_ncu_$impl.txt | grep -vE "^==PROF==|^I[0-9]{4}" | tail -90
      done
      ;;
    mxfp4_xla)
      # The MXFP4 xla tier (the weight in XLA's float4 / E8M0 types) against bf16 XLA, with the
      # default flags and with XLA's Triton GEMM fusion of a per-block dequantization.
      for run in "default|" "fused|--xla_gpu_enable_triton_gemm=true --xla_gpu_experimental_enable_subchannel_dequantisation_fusion=true"; do
        XLA_FLAGS="${run#*|}" timeout ${MXFP4_BENCH_S:-150} python3 -m benchmarks.mxfp4_matmul \
          --implementations=mxfp4_xla,bf16_xla,bf16_ragged_dot \
          --out=$OUT/mxfp4_xla_${run%%|*}.json 2>&1 | tee -a $OUT/mxfp4_xla.log \
          | grep -E "device|mxfp4_xla|Error"
      done
      ;;
    lm_head)
      timeout ${LM_HEAD_S:-200} python3 -m benchmarks.lm_head --ops ${LM_HEAD_ARGS:-} \
        --out=$OUT/lm_head_h200.json 2>&1 | tee $OUT/lm_head.log | grep -E "ms|Error"
      ;;
    muon)
      timeout ${MUON_S:-150} python3 -m benchmarks.muon_ns --out=$OUT/muon_h200.json 2>&1 \
        | tee $OUT/muon.log | grep -E "ms|TFLOP|Error"
      ;;
    moe_decode)
      # The "swapped" grouped-matmul kernel's GPU tests, then the routed experts' products at
      # decoding shapes (k3_small, K3; B 1 and 16), records merged per shape.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MOE_DECODE_TEST_S:-150} python3 -m pytest -q \
        -p no:cacheprovider --durations=5 tests/pallas_kernels/test_ragged_dot_gpu.py -k swapped \
        2>&1 | tee $OUT/moe_decode_tests.log | tail -12
      timeout ${MOE_DECODE_BENCH_S:-200} python3 -m benchmarks.moe_decode_gemm \
        --out=$OUT/moe_decode_h200.json 2>&1 | tee $OUT/moe_decode.log | grep -E "device|ms|declined"
      ;;
    mxfp4_gate_up)
      # The fused MXFP4 gate/up kernel's GPU tests; its device time per call against the
      # unfused calls at k3_small's decode shapes ($OUT/moe_decode_h200.json); k3_small's decode
      # at B 16, 128k with packed experts fused (kernels.gate_up_impl=triton, Hopper's default)
      # and unfused (xla), one process each, records merged into $OUT/decode_h200.json.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${GATE_UP_TEST_S:-120} python3 -m pytest -q \
        -p no:cacheprovider tests/pallas_kernels/test_mxfp4_matmul_gpu.py -k triton_gate_up \
        2>&1 | tee $OUT/mxfp4_gate_up_tests.log | tail -8
      timeout ${GATE_UP_GEMM_S:-150} python3 -m benchmarks.moe_decode_gemm \
        --shapes=k3_small_gate_up --out=$OUT/moe_decode_h200.json 2>&1 | grep -E "gate/up|Error"
      for impl in triton xla; do
        timeout ${GATE_UP_DECODE_S:-90} python3 -m benchmarks.decode $B16_128K \
          --gate_up_impl=$impl --out=$OUT/decode_h200.json 2>&1 \
          | tee -a $OUT/mxfp4_gate_up.log | grep -E "tpot|Error"
      done
      ;;
    scale_out)
      # benchmarks/scale_out.py: one process per run with the GPUs its mesh uses; the one-GPU
      # baselines (same per-device batch; same global batch) first. k3_small's 2 scanned units
      # allow pipeline 2 only; a pipeline's micro-batches (batch / accum) must split over the
      # data x expert shards.
      gpus=$(nvidia-smi -L | wc -l)
      case $gpus in
        2) runs="data=1;data=1,batch=4;expert=2" ;;
        4) runs="data=1,batch=4;data=1,batch=8,accum=2;pipeline=2,data=2,batch=8,accum=4" ;;
        *) runs="data=1,batch=4;data=1,batch=16,accum=4;pipeline=2,data=2,expert=2,batch=16,accum=4" ;;
      esac
      timeout ${SCALE_S:-590} python3 -m benchmarks.scale_out --runs="${SCALE_RUNS:-$runs}" \
        --run_s=${SCALE_RUN_S:-280} --out=$OUT/scale_out_h200.json 2>&1 | tee $OUT/scale_out.log
      ;;
    decode_attention)
      # The decode attention kernel's GPU tests, then every tier's device time at the decode
      # shapes; records are merged per (B, S), so a run cut short by its timeout keeps its rows.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${DECODE_TEST_S:-120} python3 -m pytest -q \
        -p no:cacheprovider --durations=5 tests/pallas_kernels/test_decode_attention_gpu.py 2>&1 \
        | tee $OUT/decode_attention_tests.log | tail -12
      timeout ${DECODE_BENCH_S:-210} python3 -m benchmarks.decode_attention \
        --out=$OUT/decode_attention_h200.json 2>&1 | tee $OUT/decode_attention.log \
        | grep -E "device|ms|declined|failed"
      ;;
    decode)
      # Prefill (chunked) and decode tokens/s, time per output token, cache bytes and the
      # bytes-moved floor per variant (benchmarks/decode.py); a process per variant, so that a
      # slow one cannot starve the others, and records merged per context.
      for variant in ${DECODE_VARIANTS:-hybrid all_mla kda_only}; do
        timeout ${DECODE_VARIANT_S:-290} python3 -m benchmarks.decode --variants=$variant \
          ${DECODE_ARGS:-} --out=$OUT/decode_h200.json 2>&1 | tee -a $OUT/decode.log \
          | grep -E "device|tpot|Error"
      done
      ;;
    decode_matmul)
      # The few-rows bf16 matmul kernel's GPU tests, then a decode step's dense products
      # (k3_small, M 16) by XLA's GEMM and by the kernel in each config,
      # $OUT/decode_matmul_h200.json.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${DECODE_MATMUL_TEST_S:-120} python3 -m pytest \
        -q -p no:cacheprovider tests/pallas_kernels/test_decode_matmul.py 2>&1 \
        | tee $OUT/decode_matmul_tests.log | tail -3
      timeout ${DECODE_MATMUL_S:-300} python3 -m benchmarks.decode_matmul \
        --out=$OUT/decode_matmul_h200.json 2>&1 | tee $OUT/decode_matmul.log \
        | grep -E "device|us|declined|Error"
      ;;
    moe_decode_configs)
      # The fused gate/up's GPU tests, then benchmarks/moe_decode_gemm.py's DECODE_CONFIGS
      # (MOE_DECODE_CONFIGS; default the short-K ones around the default n64_k64) at
      # k3_small's decode shapes (MOE_DECODE_SHAPES; default the all-experts path's): the packed
      # grouped products (rows mxfp4_<name>) and the fused gate/up (rows fused_<name>; swapped
      # tiles are not its) beside the defaults, at MOE_DECODE_BATCHES tokens (default 16: the
      # all-experts path's batch).
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${GATE_UP_TEST_S:-120} python3 -m pytest -q \
        -p no:cacheprovider tests/pallas_kernels/test_mxfp4_matmul_gpu.py -k triton_gate_up \
        2>&1 | tee $OUT/mxfp4_gate_up_tests.log | tail -3
      all=${MOE_DECODE_CONFIGS:-n64_k256,n64_k128,n64_k64,n32_k64,n128_k64_w8,n64_k64_s2,n64_k64_s3,n64_k64_w2}
      timeout ${MOE_DECODE_CONFIGS_S:-300} python3 -m benchmarks.moe_decode_gemm \
        --shapes=${MOE_DECODE_SHAPES:-k3_small_gate_up_all,k3_small_down_all} \
        --batches=${MOE_DECODE_BATCHES:-16} \
        --grouped_configs=$all --gate_up_configs=$all --out=$OUT/moe_decode_h200.json 2>&1 \
        | tee $OUT/moe_decode_configs.log | grep -E "mxfp4|gate/up|Error" | cut -c1-100
      ;;
    decode_kernels)
      # Where k3_small's decode step goes at B 16, 128k with packed experts: one traced loop,
      # its parts ($OUT/prof/hybrid_B16/parts.json, printed in $OUT/decode_kernels.log) and
      # its kernels by HLO op ($OUT/decode_kernels.txt), largest first, and how long the
      # device waited on the host's launches (the trace slows the launches); the loop's
      # optimized HLO in $OUT/decode_hlo.txt.gz.
      rm -rf /tmp/decode_hlo
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/decode_hlo --xla_dump_hlo_as_text" \
        timeout ${DECODE_KERNELS_S:-150} python3 -m benchmarks.decode $B16_128K ${KERNELS_ARGS:-} \
        --new_tokens=9 \
        --profile_dir=$OUT/prof --out=$OUT/decode_kernels.json 2>&1 \
        | tee $OUT/decode_kernels.log | grep -E "tpot|Error"
      # The loop's optimized HLO (what each fusion named in the trace holds), gzipped.
      hlo=$(ls -S /tmp/decode_hlo/*jit__decode*after_optimizations.txt 2>/dev/null | head -1)
      [ -n "$hlo" ] && gzip -c "$hlo" > $OUT/decode_hlo.txt.gz
      python3 -m benchmarks.trace_summary --trace=$OUT/prof --by_hlo_op --top=700 \
        --launch_gaps=jit__decode > $OUT/decode_kernels.txt 2>&1
      head -8 $OUT/decode_kernels.txt | cut -c1-130
      grep "launch gaps" $OUT/decode_kernels.txt
      echo "device copies (MemcpyD2D) listed: $(grep -c MemcpyD2D $OUT/decode_kernels.txt)"
      grep -A14 "by part" $OUT/decode_kernels.log
      ;;
    expert_sort)
      # The copies' counting sort (pallas_kernels/expert_sort/triton.py): its GPU tests, then the
      # decode loop with it (the default), without (--expert_sort=xla), with.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${EXPERT_SORT_TEST_S:-90} python3 -m pytest -q \
        -p no:cacheprovider tests/pallas_kernels/test_expert_sort.py 2>&1 \
        | tee $OUT/expert_sort_tests.log | tail -3
      for flag in "" --expert_sort=xla ""; do
        timeout ${DECODE_AB_S:-100} python3 -m benchmarks.decode $B16_128K $flag \
          --out=$OUT/decode_expert_sort.json 2>&1 | tee -a $OUT/decode_expert_sort.log \
          | grep -E "tpot|Error"
      done
      ;;
    kda_decode)
      # The fused KDA decode step (pallas_kernels/kda_decode/triton.py): its GPU tests (every
      # entry of triton.CONFIGS), the op against fla's chain with the CONFIGS beside the
      # default (benchmarks/kda_decode.py), then k3_small's decode loop per KDA_DECODE_RUNS
      # (benchmarks.decode flags, one process each; "|" for none).
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${KDA_DECODE_TEST_S:-150} python3 -m pytest \
        -q -p no:cacheprovider tests/pallas_kernels/test_kda_decode.py 2>&1 \
        | tee $OUT/kda_decode_tests.log | tail -3
      timeout ${KDA_DECODE_BENCH_S:-150} python3 -m benchmarks.kda_decode \
        --triton_configs=${KDA_DECODE_CONFIGS:-tile_w8,c32_w4,c32_w2} \
        --out=$OUT/kda_decode_h200.json 2>&1 | tee $OUT/kda_decode_bench.log | grep -E "us |Error"
      for flag in ${KDA_DECODE_RUNS:---kda_decode=triton --kda_decode_config=tile_w8 --kda_decode=xla}; do
        timeout ${DECODE_AB_S:-100} python3 -m benchmarks.decode $B16_128K ${flag//|/} \
          --out=$OUT/decode_kda_decode.json 2>&1 | tee -a $OUT/decode_kda_decode.log \
          | grep -E "tpot|Error"
      done
      ;;
    expert_ffn)
      # The packed experts whole in one launch (mxfp4_matmul.triton.expert_ffn) and a decode
      # step's routing and sort in one (moe_route): their GPU tests, the experts whole against
      # the unfused calls at k3_small's decode shapes (moe_decode_gemm), then k3_small's decode
      # loop per EXPERT_FFN_RUNS (benchmarks.decode flags; "," joins the flags of one run).
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${EXPERT_FFN_TEST_S:-150} python3 -m pytest \
        -q -p no:cacheprovider tests/pallas_kernels/test_mxfp4_matmul_gpu.py \
        tests/pallas_kernels/test_moe_route.py -k "expert_ffn or moe_route" 2>&1 \
        | tee $OUT/expert_ffn_tests.log | tail -3
      timeout ${EXPERT_FFN_BENCH_S:-150} python3 -m benchmarks.moe_decode_gemm \
        --shapes=k3_small_gate_up --out=$OUT/moe_decode_h200.json 2>&1 \
        | tee $OUT/moe_decode_ffn.log | grep -E "gate/up|ffn|Error"
      for flag in ${EXPERT_FFN_RUNS:---expert_ffn=fused,--moe_route=triton --expert_ffn=unfused --expert_ffn=fused}; do
        timeout ${DECODE_AB_S:-100} python3 -m benchmarks.decode $B16_128K ${flag//,/ } \
          --out=$OUT/decode_expert_ffn.json 2>&1 | tee -a $OUT/decode_expert_ffn.log \
          | grep -E "tpot|Error"
      done
      ;;
    warmup)
      # WARMUP_S seconds (default 20) of bf16 GEMMs: the first decode run on a fresh machine
      # has come out ~30% slow (and been left out); whether this removes that is to be seen.
      timeout $(( ${WARMUP_S:-20} + 30 )) python3 -c "
import time, jax, jax.numpy as jnp
x = jnp.ones((8192, 8192), jnp.bfloat16); t = time.time()
while time.time() - t < ${WARMUP_S:-20}:
  x = (x @ x) * 1e-4; x.block_until_ready()
print('warm-up done')"
      ;;
    decode_ab)
      # Before / after on one machine: run-to-run spread between machines (~3%) is as large
      # as a step's small changes. Make .base with
      #   mkdir .base && git archive $BASE_COMMIT | tar -x -C .base
      # (git-ignored), carry it, and set BASE_COMMIT.
      [ -d .base ] || { echo "decode_ab: no .base tree"; continue; }
      new="new . ${K3JAX_COMMIT:-}"
      for run in "$new" "base .base ${BASE_COMMIT:?}" "$new"; do   # name, tree, commit
        set -- $run
        (cd $2 && K3JAX_COMMIT=${3:-} PYTHONPATH=/tmp/site:$PWD timeout ${DECODE_AB_S:-100} \
          python3 -m benchmarks.decode $B16_128K --out=$OUT/decode_ab_$1.json 2>&1 \
          | tee -a $OUT/decode_ab.log | grep -E "tpot|Error")
      done
      ;;
    kda_decode_tests)
      # The KDA decode kernel's tests compiled on the GPU (larger shapes added there).
      K3JAX_KDA_TEST_ON_DEVICE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout ${KDA_DECODE_TEST_S:-150} python3 -m pytest -q -p no:cacheprovider \
        tests/pallas_kernels/test_kda_recurrent_decode.py \
        2>&1 | tee $OUT/kda_decode_tests.log | tail -3
      ;;
    decode_paths)
      # k3_small's decode at B 1, context 4096, decode only: the MoE's gathered decode path,
      # the same with XLA's command buffers extended to the while loop, then the sorted path.
      for run in "gathered|" \
          "gathered|--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL,+DYNAMIC_SLICE_FUSION" \
          "sorted|"; do
        XLA_FLAGS="${run#*|}" timeout ${DECODE_PATH_S:-70} python3 -m benchmarks.decode \
          --variants=hybrid --batches=1 --contexts=4096 --noprefill --new_tokens=65 \
          --moe_decode_experts=${run%%|*} --out=$OUT/decode_paths_h200.json 2>&1 \
          | tee -a $OUT/decode_paths.log | grep -E "tpot|compiled|Error"
      done
      ;;
    train_remat)
      for remat in ${REMATS:-none full save_dots save_mixer_out offload}; do
        echo "== model.remat=$remat"
        timeout ${REMAT_S:-400} python3 -m benchmarks.train_step --config=experiments/configs/k3_small.py \
          --config.train.global_batch_size=2 --config.model.remat=$remat ${TRAIN_ARGS:-} \
          --out=$OUT/train_remat_$remat.json 2>&1 | tee $OUT/train_remat_$remat.log | tail -3
      done
      ;;
    train_parts)
      # The k3_small step (TRAIN_ARGS) with its compile by phase and compiler events, and the
      # table of its device time by part; the record goes to $OUT/train_h200.json.
      rm -rf /tmp/train_parts /tmp/train_compile
      timeout ${TRAIN_S:-450} python3 -m benchmarks.train_step --config=experiments/configs/k3_small.py \
        --config.train.global_batch_size=2 --config.model.remat=${REMAT:-none} ${TRAIN_ARGS:-} \
        --out=$OUT/train_h200.json \
        --compile_trace_dir=/tmp/train_compile --profile_dir=/tmp/train_parts 2>&1 \
        | tee $OUT/train_parts.log | grep -vE "^\{" | tail -60
      ;;
    train_compile)
      # The k3_small step's compile under the profiler (host events of every compiler thread),
      # the trace kept as $OUT/train_compile.trace.json.gz for a timeline of the compile.
      rm -rf /tmp/train_compile
      timeout ${TRAIN_S:-300} python3 -m benchmarks.train_step --config=experiments/configs/k3_small.py \
        --config.train.global_batch_size=2 --steps=2 ${TRAIN_ARGS:-} --out=$OUT/train_compile.json \
        --compile_trace_dir=/tmp/train_compile 2>&1 | tee $OUT/train_compile.log | grep -vE "^\{" | tail -30
      cp "$(find /tmp/train_compile -name '*.trace.json.gz' | head -1)" $OUT/train_compile.trace.json.gz
      ;;
    train_trace)
      rm -rf /tmp/train_trace
      timeout 450 python3 -m benchmarks.train_step --config=experiments/configs/k3_small.py \
        --config.train.global_batch_size=2 --steps=2 --out=/tmp/train_trace.json \
        --profile_dir=/tmp/train_trace > $OUT/train_trace.log 2>&1
      cp "$(find /tmp/train_trace -name '*.trace.json.gz' | head -1)" $OUT/train_trace.json.gz
      python3 -m benchmarks.trace_summary --trace=$OUT/train_trace.json.gz --top=40
      ;;
    *)
      echo "unknown section $section (ceilings, gpu_tests, kda_tests, kda_quick, kda_ptxas, kda_trace, kda, kda_accuracy, moe,
        moe_gemm, moe_kernels, moe_tgmm, moe_gmm_tiles, moe_gmm_costs, moe_fused, moe_trace, train, train_remat, train_compile, attention, mxfp4, mxfp4_triton, mxfp4_ncu, mxfp4_xla, moe_decode, scale_out, train_cache, decode_attention, decode, decode_paths,
        decode_kernels, decode_flags, decode_matmul, expert_sort, kda_decode, expert_ffn, decode_ab, kda_decode_tests, moe_decode_configs, warmup,
        train_parts, train_trace)"; exit 2
      ;;
  esac
done
