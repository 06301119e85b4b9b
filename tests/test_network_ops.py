"""The sharded train steps of benchmarks/network.py's registry, built and run in one process on
a 2 x 2 mesh (the benchmark runs them on namespace hosts; this checks what it would time)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import _mlp  # noqa: E402
import _network_ops  # noqa: E402
import _network_report  # noqa: E402

import jax_bytegrad  # noqa: E402

NUM_PARAMS = 17_000  # an MLP of width 8: every leaf splits over 2 devices


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_the_sharded_train_steps_run_and_split_their_state(shard):
    assert _mlp.mlp_width(NUM_PARAMS) == 8
    mesh = jax_bytegrad.make_mesh(2, 2)
    fn, args = _network_ops.OPS[f"train_bytegrad_shard_{shard}"](mesh, NUM_PARAMS)
    state, metrics = fn(*args)
    assert np.isfinite(float(metrics["loss"]))
    mu = state.opt_state[1][0].mu["w1"]  # chain(bytegrad, adam): Adam's first moment
    assert mu.addressable_shards[0].data.shape[0] == mu.shape[0] // 2
    params = state.params["w1"].addressable_shards[0].data.shape[0]
    assert params == (mu.shape[0] // 2 if shard == "params" else mu.shape[0])
    # Each op is registered with its bytes on the wire, for the ring bound: ByteGrad's.
    name = f"train_bytegrad_shard_{shard}"
    assert (
        _network_ops.WIRE_BYTES_PER_PARAM[name]
        == _network_ops.WIRE_BYTES_PER_PARAM["train_bytegrad"]
    )


def test_the_table_names_the_devices_per_host():
    row = {"hosts": 2, "devices": 2, "mbit": 1000.0, "delay_ms": None, "op": "train_local",
           "median_ms": 100.0, "tx_mb": 1.0, "bound_ms": None, "ratio": None}  # fmt: skip
    assert "| 2 x 2 | 1 Gbit/s | train_local | 100.0 |" in _network_report.table([row])
    del row["devices"]  # a row of a --json file written before the option
    assert "| 2 | 1 Gbit/s | train_local |" in _network_report.table([row])


def test_the_table_gives_the_cpu_seconds_per_step_where_measured():
    row = {"hosts": 2, "mbit": 100.0, "delay_ms": None, "op": "psum_f32", "median_ms": 169.3,
           "tx_mb": 2.0, "bound_ms": 160.0, "ratio": 1.0, "cpu_ms": 14.8}  # fmt: skip
    assert _network_report.table([row]).endswith("| 160 | 14.8 |")
    del row["cpu_ms"]  # a row of a --json file written before it was measured
    assert _network_report.table([row]).endswith("| 160 |  |")
