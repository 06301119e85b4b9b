"""Helpers shared by the tests: tree comparisons, replica checks, small training data,
scripts loaded by path, the launcher and examples/train.py run in a subprocess, and the mark
of tests that compile for GPUs that are not here."""

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bytegrad.sharding import gpu_mesh

REPO = Path(__file__).parent.parent


@functools.cache
def gpu_plugin_error() -> str | None:
    try:
        gpu_mesh(1, 1)
    except RuntimeError as error:
        return str(error)
    return None


def needs_gpu_plugin(covered_by: str = ""):
    """Skips a test that compiles for deviceless GPUs (``gpu_mesh``) where JAX's CUDA plugin
    is missing; ``covered_by`` says which CPU tests check the same logic."""
    reason = "compiling for GPUs needs JAX's CUDA plugin: pip install -e '.[cuda12]' (Python 3.12)"
    return pytest.mark.skipif(
        gpu_plugin_error() is not None, reason=reason + (f"; {covered_by}" if covered_by else "")
    )


def run_launcher(*args: str, env: dict | None = None, timeout: float) -> tuple[int, str]:
    """Runs ``python -m jax_bytegrad.launch *args`` from the repository, with ``env`` (this
    process's environment by default) and the repository on ``PYTHONPATH``; returns its exit
    code and its output, stdout and stderr together. ``timeout`` is a hang guard only."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "jax_bytegrad.launch", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        text=True,
    )
    return proc.returncode, proc.stdout


def run_train(args: list[str]) -> str:
    """The stdout of ``python examples/train.py ARGS``, as a user runs it from a clean shell
    (not this suite's XLA_FLAGS), in a fresh directory: its files go to ``runs/`` there."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env["JAX_PLATFORMS"] = "cpu"  # a GPU plugin without a GPU would print its error first
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(
            [sys.executable, str(REPO / "examples" / "train.py"), *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"train.py {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}")
    return proc.stdout


def table_rows(table: str) -> dict[str, dict[str, str]]:
    """``{algorithm: {column: cell}}`` of a markdown results table (the lines of ``table``
    that start with ``|``: ``examples/report.py``'s ``results_table``)."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[cells["algorithm"]] = cells
    return rows


def processes_with(marker: str) -> list[int]:
    """Ids of the live processes whose command line contains ``marker`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # it exited while we looked
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def classification_batches(steps: int, rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` batches of ``rows`` float32 rows of 64 features, each labelled by the largest
    of its first 10 features: data a small classifier learns in a few steps."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(steps * rows, 64)).astype(np.float32)
    y = x[:, :10].argmax(-1)
    return [(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) for i in range(steps)]


def load_script(path: Path):
    """A script that is not a package module (a worker, an example), imported by its path."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def assert_replicas_bit_identical(tree, devices: int | None = None):
    """Asserts every leaf holds the same bits on every addressable device (PRNG keys too)."""
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        if devices is not None:
            assert len(shards) == devices
        for other in shards[1:]:
            np.testing.assert_array_equal(other, shards[0])


_COMPILES = [0]


def _count_compile(event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class JitStep:
    """``data_parallel_step``'s sharded form under one ``jax.jit`` of the test's own.

    ``step(params, opt_state, batch) -> (params, opt_state, loss[, aux])`` on placed params
    and state and a sharded batch, nothing donated; ``compiles`` counts the programs XLA
    built during its calls (a phase switch that recompiled would show here).
    """

    def __init__(self, loss_fn, tx, mesh, *, has_aux: bool = False):
        import jax_bytegrad

        self._step = jax_bytegrad.data_parallel_step(loss_fn, tx, mesh, has_aux=has_aux)
        self._jitted = None
        self.compiles = 0

    def _fn(self, opt_state):
        if self._jitted is None:
            self._jitted = jax.jit(self._step.sharded(opt_state))
        return self._jitted

    def __call__(self, params, opt_state, batch):
        before = _COMPILES[0]
        out = self._fn(opt_state)(params, opt_state, batch)
        jax.block_until_ready(out)
        self.compiles += _COMPILES[0] - before
        return out

    def lower(self, params, opt_state, batch):
        return self._fn(opt_state).lower(params, opt_state, batch)
