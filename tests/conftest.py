"""Test configuration: 8 CPU devices and strict promotion, set before JAX initialises."""

import os
import sys

# Must run before anything imports jax: the device count is fixed at backend start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
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


def assert_trees_all_close(actual, expected, *, rtol=0.0, atol=0.0):
    """Asserts two pytrees have the same structure and leaves that agree within tolerance."""
    actual_leaves, actual_def = jax.tree.flatten(actual)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert actual_def == expected_def, f"tree structures differ: {actual_def} vs {expected_def}"
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        a = np.asarray(a)
        e = np.asarray(e)
        assert a.shape == e.shape, f"shapes differ: {a.shape} vs {e.shape}"
        assert a.dtype == e.dtype, f"dtypes differ: {a.dtype} vs {e.dtype}"
        np.testing.assert_allclose(
            a.astype(np.float64) if a.dtype.kind == "V" or "bfloat16" in str(a.dtype) else a,
            e.astype(np.float64) if e.dtype.kind == "V" or "bfloat16" in str(e.dtype) else e,
            rtol=rtol,
            atol=atol,
        )


def assert_trees_all_equal(actual, expected):
    """Asserts two pytrees are bit-identical."""
    assert_trees_all_close(actual, expected, rtol=0.0, atol=0.0)
