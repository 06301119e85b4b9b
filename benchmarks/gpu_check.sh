#!/usr/bin/env bash
# Validates the compiled Mosaic GPU kernels on a GPU machine (sm_90+, JAX 0.11.x cuda).
# Usage: benchmarks/gpu_check.sh OUT_DIR
# Runs the compiled-Pallas tests (tests/test_pallas.py, tests/test_quantize.py) and the
# quantize benchmark and the block-size sweep, writing logs to OUT_DIR.
set -uo pipefail
out="${1:?usage: benchmarks/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
# The test conftest defaults JAX_PLATFORMS to cpu; the compiled kernels need the GPU.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
"$py" -c "import jax; from jax_bytegrad import _pallas; print(jax.__version__, jax.devices(), 'pallas supported:', _pallas.is_supported())" \
  2>&1 | tee "$out/env.txt"
"$py" -m pytest tests/test_pallas.py tests/test_quantize.py -q -rs 2>&1 | tee "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}
"$py" benchmarks/quantize.py --sizes 1M,16M,64M,256M 2>&1 | tee "$out/bench.txt"
"$py" benchmarks/quantize.py --sizes 64M --block-sizes 256,512,1024,2048,4096 --chunks 2 \
  2>&1 | tee "$out/bench_block_sizes.txt"
exit "$tests_rc"
