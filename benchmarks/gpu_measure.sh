#!/usr/bin/env bash
# Issue 47's measurements in one call on a lent GPU (H100 or H200), in order of priority, each
# under its own timeout, all output in OUT_DIR/log.txt (the steps' rows also in steps.jsonl):
#   1. the compiled kernels against the reference (the tests gpu_check.sh runs, 8 processes);
#   2. the codec's throughput at 16M, 64M and 256M values, 8 and 4 bits, against a copy and XLA;
#   3. a train step on one GPU (benchmarks/gpu_step.py): time, memory, deviceless vs real;
#   4. the block-size sweep at 64M values.
# Runs with the machine's own python3 and JAX (PYTHON to change), the clone on PYTHONPATH.
# Usage: benchmarks/gpu_measure.sh OUT_DIR
set -u
out="${1:?usage: benchmarks/gpu_measure.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" JAX_PLATFORMS=cuda,cpu PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
log="$out/log.txt"

step() {  # step NAME SECONDS COMMAND...
  local name="$1" seconds="$2"
  shift 2
  echo "== $name $(date +%T): $*" | tee -a "$log"
  timeout --kill-after=5 "$seconds" "$@" >>"$log" 2>&1
  echo "== $name exit $? $(date +%T)" | tee -a "$log"
}

step env 40 bash -c "nvidia-smi; $py -c 'import sys, jax, jaxlib; print(sys.version); \
print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, jax.devices())'; \
$py -m pip list 2>/dev/null | grep -iE '^(jax|flax|optax|orbax|numpy|pytest|hypothesis)'"
XLA_PYTHON_CLIENT_PREALLOCATE=false step tests 180 "$py" -m pytest tests/test_pallas.py \
  tests/test_quantize.py -k compiled -n 8 -q -rs -p no:cacheprovider --timeout 120 \
  --tb=short --junitxml="$out/junit.xml"
grep -E "passed|failed|error" "$log" | tail -n 3
step quantize_8bit 60 "$py" benchmarks/quantize.py --bits 8 --sizes 16M,64M,256M --repeats 20
step quantize_4bit 60 "$py" benchmarks/quantize.py --bits 4 --block-size 512 --sizes 16M,64M,256M --repeats 20
model=(--dim 1024 --depth 6 --seq 512 --rows 64 --steps 20 --json "$out/steps.jsonl")
step step_allreduce 80 "$py" benchmarks/gpu_step.py --algorithm gradient_allreduce --codec "${model[@]}"
step step_bytegrad 60 "$py" benchmarks/gpu_step.py --algorithm bytegrad "${model[@]}"
step step_bytegrad4 60 "$py" benchmarks/gpu_step.py --algorithm bytegrad --bits 4 --error-feedback "${model[@]}"
step step_qadam 60 "$py" benchmarks/gpu_step.py --algorithm qadam "${model[@]}"
step sweep_8bit 45 "$py" benchmarks/quantize.py --bits 8 --block-sizes 256,512,1024,2048,4096 --sizes 64M
tail -n 60 "$log" | grep -vE "^\s*$" | tail -n 40
