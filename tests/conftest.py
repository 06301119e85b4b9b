"""Test configuration: 8 CPU devices and strict promotion, set before JAX initialises."""

import atexit
import os
import shutil
import sys
import tempfile

# Must run before anything imports jax: the device count is fixed at backend start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# Compiling dominates the suite's time (about 80% of a file such as test_bytegrad.py, in XLA's
# backend). LLVM's expensive passes cost about 10% of each compile here and change no bit of
# what the programs compute (checked on a trained step's params); the tests check values,
# never speed. Cheaper compiles that change bits are not used: LLVM at -O0
# (--xla_backend_optimization_level=0, 20-27% less CPU per file) breaks the low-precision
# decentralized ring's bit-identical replicas, and XLA's classic fusion emitters
# (--xla_cpu_use_fusion_emitters=false, about half again) the ring and scatter-gather wires'
# bit-for-bit match with stochastic rounding; both hold in the default build users run.
if "xla_llvm_disable_expensive_passes" not in _flags:
    _flags += " --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = _flags.strip()
# JAX's persistent compilation cache, one folder per test session (removed at exit), shared with
# the processes the tests start (they inherit the environment): many tests compile the same
# step, and each process of a multi-process test compiles what an earlier one did. An
# executable read back is the one XLA built, so no bit changes; it took test_sharding.py's CPU
# time from 125-140 s to 78-89 s here. A cache the caller names is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_bytegrad-tests-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

from jax_bytegrad.distributed import ensure_cpu_threads  # noqa: E402

# Without it, 8 CPU devices on 2 cores can deadlock in XLA's collectives (see its docstring).
ensure_cpu_threads(8)

jax.config.update("jax_numpy_rank_promotion", "raise")


# For tests that start several processes talking over Gloo. Every jaxlib the library supports
# (0.10.2 to 0.12) builds Gloo's CPU collectives for Linux (TCP) and macOS (libuv) and raises
# on other systems, where they skip; a Gloo failure at run time fails the test.
requires_gloo = pytest.mark.skipif(
    sys.platform not in ("linux", "darwin"),
    reason=f"jaxlib has Gloo CPU collectives on Linux and macOS only, not on {sys.platform}",
)


@pytest.fixture
def strict_dtypes():
    """Strict dtype promotion for tests of this library's own numerics.

    Not global: optax and Flax rely on standard promotion (optax's Adam raises a float to an
    int32 power), so strict mode is applied where the code under test is ours alone.
    """
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture(scope="session")
def train_py_default_run() -> str:
    """The stdout of ``python examples/train.py`` with no arguments, the README's command (every
    algorithm one process runs, 300 steps of the CNN): run once for test_readme, which holds it
    against the README, and test_examples, which checks that every algorithm learned."""
    from helpers import run_train

    return run_train([])
