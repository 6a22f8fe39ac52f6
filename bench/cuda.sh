#!/usr/bin/env bash
# The GPU checks in one go: the `cuda` tests, bench/gpu_decode.py (decode at the memory bound:
# resident with CUDA graphs, tiered, transformers, HBM and PCIe bounds), the same tiered with
# compact expert codecs (bf16, fp8, int8, mxfp4, mxfp4 kept 4-bit in tier 1), this machine's
# simulator profile (`freetoken simulate --profile-here`), resident MXFP4
# experts held 4-bit (--compact), then bench/offload.py with tier 1 in GPU memory.
#   bash bench/cuda.sh [OUT_DIR]        (needs the package installed and a CUDA GPU; ~12-15 min)
# FT_GPU_DECODE_ARGS passes options to gpu_decode.py (e.g. "--layers 4 --budgets 0.25,1.0" to halve
# its time); FT_SKIP_OFFLOAD=1 skips the offload benchmark, FT_SKIP_COMPACT=1 the --compact run.
# Within 15 minutes of device time (machine start included): FT_SKIP_OFFLOAD=1 and
# FT_GPU_DECODE_ARGS="--layers 4 --budgets 0.25,1.0".
# Logs and the benchmark's JSON land in OUT_DIR (default: bench-cuda-out/). The benchmark's files
# go to FT_BENCH_DIR, default a folder beside this checkout: /tmp is often RAM (tmpfs), where
# O_DIRECT fails and dropping the page cache does not empty it, so tier 3 would not be a disk.
set -u
out=${1:-bench-cuda-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export FT_BENCH_DIR=${FT_BENCH_DIR:-$PWD/.bench-tmp}
mkdir -p "$FT_BENCH_DIR"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
    df -h /tmp "$FT_BENCH_DIR"
    nproc; free -g
} 2>&1 | tee "$out/machine.txt"
timeout "${FT_TEST_TIMEOUT:-300}" python3 -m pytest -q -s -m cuda -p no:cacheprovider tests/ \
    2>&1 | tee "$out/cuda_tests.log"
# This GPU machine measured as a simulator profile (issue 33: a measured one beside the built-in
# h200 figures; ~10 s), at Qwen3-30B-A3B's row length.
timeout 120 python3 -m freetoken_agents.cli simulate --profile-here --model qwen3-30b-a3b \
    --scratch-dir "$FT_BENCH_DIR" --out "$out/profile_here.toml" 2>&1 | tee "$out/profile_here.log"
# shellcheck disable=SC2086  # FT_GPU_DECODE_ARGS is a list of options
timeout "${FT_GPU_DECODE_TIMEOUT:-540}" python3 bench/gpu_decode.py ${FT_GPU_DECODE_ARGS:-} \
    --json "$out/gpu_decode.json" 2>&1 | tee "$out/gpu_decode.log"
# Compact experts over the link (issue 21): each codec tiered at a quarter of the expert bytes.
# shellcheck disable=SC2086
timeout "${FT_GPU_QUANT_TIMEOUT:-360}" python3 bench/gpu_decode.py \
    ${FT_GPU_QUANT_ARGS:---tiered-only --layers 4 --budgets 0.25 --quant bf16,fp8,int8,mxfp4,mxfp4:compact} \
    --json "$out/gpu_quant.json" 2>&1 | tee "$out/gpu_quant.log"
# MXFP4 experts held 4-bit on the GPU (expert_quant="compact", the GEMV kernel) vs bf16 resident.
if [ "${FT_SKIP_COMPACT:-0}" != 1 ]; then
    timeout "${FT_GPU_COMPACT_TIMEOUT:-240}" python3 bench/gpu_decode.py --tiered-only --budgets '' \
        --layers 4 --compact --json "$out/gpu_compact.json" 2>&1 | tee "$out/gpu_compact.log"
fi
if [ "${FT_SKIP_OFFLOAD:-0}" != 1 ]; then
    timeout "${FT_BENCH_TIMEOUT:-420}" python3 bench/offload.py --device cuda --sweep \
        --json "$out/offload_cuda.json" 2>&1 | tee "$out/offload_cuda.log"
fi
rm -rf "$FT_BENCH_DIR"
