"""Tests for asynchronous model averaging (jax_bytegrad/async_averaging.py)."""

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_bytegrad
from jax_bytegrad.experimental import async_model_average

ROOT = Path(__file__).resolve().parents[1]


def _loss(w, b):
    return jnp.mean((b * w[None]) ** 2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"peer_selection_mode": "shift_one"}, "peer_selection_mode"),
        ({"sync_interval_ms": -1}, "sync_interval_ms"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"node_axis": "nodes"}, "'nodes'"),
    ],
    ids=["mode", "interval", "warmup", "axis"],
)
def test_validates_at_build_time(kwargs, match):
    with pytest.raises(ValueError, match=match):
        async_model_average(_loss, optax.sgd(0.1), jax_bytegrad.make_mesh(1, 1), **kwargs)


def test_single_process_thread_starts_stops_and_resumes():
    avg = async_model_average(
        _loss, optax.sgd(0.1), jax_bytegrad.make_mesh(1, 4), sync_interval_ms=1
    )
    state = avg.init(jnp.ones(4))
    for _ in range(5):
        state, _ = avg.step(state, jnp.ones((8, 4)))
    assert avg.round_stats.running
    avg.abort()
    assert not avg.round_stats.running and avg.round_stats.rounds > 0
    avg.resume()
    assert avg.round_stats.running
    avg.close()
    avg.close()  # idempotent
    assert not avg.round_stats.running
    w = avg.params(state)  # one process: the mean is itself
    assert w.shape == (4,)
    np.testing.assert_allclose(np.asarray(w), np.asarray(state.params), rtol=1e-6)


def _dict_loss(p, b):
    return _loss(p["w"], b) + jnp.sum(p["b"] ** 2)


def test_averaging_traffic_is_the_whole_model_before_any_step():
    # communication_stats right after init, before the thread has a snapshot: one round is a
    # float32 all-reduce of every parameter.
    with async_model_average(_dict_loss, optax.sgd(0.1), jax_bytegrad.make_mesh(1, 2)) as avg:
        state = avg.init({"w": jnp.ones(4), "b": jnp.ones((3, 5))})
        averaging = avg.communication_stats(state, jnp.ones((4, 4)))["averaging"]
    assert averaging.total_payload_bytes == 4 * (4 + 15) + 4  # the model, and the stop flag


@pytest.mark.slow
def test_two_processes_average_converge_and_stop_cleanly():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # each process gets its device count from the launcher
    proc = subprocess.run(
        [sys.executable, "-m", "jax_bytegrad.launch", "--nproc", "2", "--devices-per-proc", "2",
         "--timeout", "240", str(ROOT / "tests" / "_mp_scripts" / "async_worker.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("round math OK") == 2, out[-4000:]
    assert out.count("] OK") == 2, out[-4000:]
    print("\n".join(line for line in out.splitlines() if "async=" in line))
