#!/usr/bin/env bash
# Checks the compiled Mosaic GPU kernels on a GPU machine in one call of under 10 minutes.
#
# Expects: an NVIDIA GPU of compute capability >= 9.0 (H100, H200) and the newest supported
# JAX, 0.12.x with CUDA (Python >= 3.12; `pip install -e '.[test,cuda12]'` or `'.[test,cuda13]'`
# from the clone). Any JAX from 0.10.2 to 0.12.x is supported; the version is recorded.
#
# Usage: benchmarks/gpu_check.sh OUT_DIR
#   1. the environment: JAX version, devices, whether the compiled kernels can run here;
#   2. the compiled tests only: `-k compiled` in tests/test_pallas.py and tests/test_quantize.py
#      (the interpret-mode tests run on CPU in CI; here they would only cost time), stopping at
#      the first failure, with full tracebacks and a JUnit XML in OUT_DIR;
#   3. only if they all passed: the 8-bit and the 4-bit quantize benchmarks.
# Each step has its own timeout; the script exits non-zero if any step fails or times out.
set -uo pipefail
out="${1:?usage: benchmarks/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
# tests/conftest.py defaults JAX_PLATFORMS to cpu; the compiled kernels need the GPU.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a timeout, logging to OUT_DIR/NAME.txt
  local name="$1" seconds="$2"
  shift 2
  echo "== $name (timeout ${seconds}s): $*"
  timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "== $name: timed out after ${seconds}s" | tee -a "$out/$name.txt"
    echo "== $name failed (exit $rc); see $out/$name.txt"
    exit "$rc"
  fi
}

step env 30 "$py" -c '
import sys, jax
from jax_bytegrad._src.codecs import pallas
print("jax", jax.__version__, "python", sys.version.split()[0])
print("devices", jax.devices())
if not pallas.is_supported():
    sys.exit("the compiled Mosaic GPU kernels cannot run here: an NVIDIA GPU of compute "
             "capability >= 9.0 is needed, with a CUDA build of jaxlib")
print("compiled Mosaic GPU kernels: supported")
'

# -k compiled selects the "compiled" parameter of both files; every selected test must run
# (none may skip), since a skipped compiled test here would hide the very thing checked.
step tests 330 "$py" -m pytest tests/test_pallas.py tests/test_quantize.py -k compiled \
  -x --tb=long -q -rs -p no:cacheprovider --junitxml="$out/junit.xml"
step skips 15 "$py" -c '
import sys, xml.etree.ElementTree as ET
suite = next(ET.parse(sys.argv[1]).getroot().iter("testsuite"))
ran, skipped = int(suite.get("tests")), int(suite.get("skipped"))
print(f"{ran} compiled tests, {skipped} skipped")
sys.exit(1 if skipped or not ran else 0)
' "$out/junit.xml"

step bench_8bit 90 "$py" benchmarks/quantize.py --bits 8 --block-size 1024 --sizes 16M,64M
step bench_4bit 90 "$py" benchmarks/quantize.py --bits 4 --block-size 512 --sizes 16M,64M
echo "== all steps passed; logs and junit.xml in $out"
