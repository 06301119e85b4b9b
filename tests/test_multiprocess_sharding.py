"""State sharded within each node, on 2 processes x 4 CPU devices over Gloo (loopback).

One launch of ``tests/_mp_scripts/shard_worker.py`` trains ``Strategy(..., shard=...)`` with
each process a node, and writes each process's view of the final state and a checkpoint of
it. Here: the two processes end bit-identical, each device holds a quarter of the optimizer
state, the runs match the same steps in this process (8 CPU devices on the same 2 x 4 mesh),
and the checkpoints restore exactly into a step of this process with another ``shard=``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import requires_gloo
from helpers import load_script
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad.checkpoint import Checkpointer

SCRIPTS = Path(__file__).parent / "_mp_scripts"
REPO = Path(__file__).parent.parent
WORKER = SCRIPTS / "shard_worker.py"
LOCAL = 4

pytestmark = [pytest.mark.slow, requires_gloo]

worker = load_script(WORKER)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """Runs the worker on 2 processes x 4 devices once; returns its output directory."""
    out_dir = tmp_path_factory.mktemp("mp_shard")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)  # the device count comes from --devices-per-proc
    proc = subprocess.run(
        [sys.executable, "-m", "jax_bytegrad.launch", "--nproc", "2", "--devices-per-proc",
         str(LOCAL), "--timeout", "440", str(WORKER), str(out_dir)],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=450, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:]
    for rank in (0, 1):
        assert f"[rank {rank}] OK" in proc.stdout, proc.stdout[-6000:]
    return out_dir


def saved(out_dir: Path, name: str, rank: int) -> list[np.ndarray]:
    """The leaves of run ``name``'s final state as process ``rank`` held them."""
    with np.load(out_dir / f"{name}_rank{rank}.npz") as f:
        return [f[f"leaf{i}"] for i in range(len(f.files))]


def state_shapes(name: str, mesh, shard):
    """``state_shapes`` of run ``name``'s step with ``shard=`` on ``mesh``: the target a
    checkpoint restores onto, with its shardings."""
    with worker.build_step(worker.RUNS[name][0], mesh, shard) as step:
        return step.state_shapes(worker.init_params())


@pytest.mark.parametrize("name", list(worker.RUNS))
def test_the_two_processes_end_bit_identical(two_process_run, name):
    ranks = [saved(two_process_run, name, rank) for rank in (0, 1)]
    initial = worker.init_params()
    leaves = jax.tree.leaves(state_shapes(name, jax_bytegrad.make_mesh(2, LOCAL), None))
    assert len(ranks[0]) == len(leaves)  # PRNG keys come as their data
    assert int(ranks[0][0]) == worker.RUNS[name][2]  # StepState.step: every step ran
    for i, (a, b) in enumerate(zip(*ranks, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} leaf {i}")
    # It trained: the first weight moved.
    w1 = next(x for x in ranks[0] if x.shape == initial["w1"].shape)
    assert not np.allclose(w1, initial["w1"])


def block_shape(shape) -> list[int]:
    """A device's block of a leaf: split along its largest dimension that LOCAL divides."""
    dim = max((d for d, n in enumerate(shape) if n % LOCAL == 0), key=lambda d: (shape[d], -d))
    return [n // LOCAL if d == dim else n for d, n in enumerate(shape)]


@pytest.mark.parametrize("name", list(worker.RUNS))
def test_each_device_holds_a_quarter_of_the_optimizer_state(two_process_run, name):
    mesh = jax_bytegrad.make_mesh(2, LOCAL)
    whole = [x.shape for x in jax.tree.leaves(state_shapes(name, mesh, None).opt_state)]
    split = {p.shape for k, p in worker.init_params().items() if k != "b2"}  # b2: 10 values
    want = [block_shape(s) if s in split else list(s) for s in whole]
    assert sum(s in split for s in whole) >= 6  # the moments of w1, b1 and w2 at least
    for rank in (0, 1):
        blocks = json.loads((two_process_run / f"{name}_rank{rank}.json").read_text())
        assert len(blocks["devices"]) == LOCAL  # this process's devices: its node
        for device, held in blocks["devices"].items():
            assert held["shapes"] == want, (rank, device)
            # Scalars (counts) are the only whole leaves besides b2's moments.
            share = held["bytes"] / blocks["whole_bytes"]
            assert 0.25 <= share < 0.26, (rank, device, share)


# The float32 sums within a node add in another order over Gloo than in one process (see
# tests/test_multiprocess.py), an ulp here and there: measured 6e-8 at most, over every leaf.
# A value that rounds to the next code in one run and not the other would move by up to an
# Adam step (about lr) in a few values; a lost or doubled gradient moves many.
ROUNDING_ATOL = 2e-6
FLIP_ATOL = 2e-2  # lr 1e-2: one Adam step, twice
FLIP_SHARE = 1e-3


@pytest.mark.parametrize("name", list(worker.RUNS))
def test_the_processes_match_one_process(two_process_run, name):
    _, state = worker.train(name, jax_bytegrad.make_mesh(2, LOCAL))
    got = saved(two_process_run, name, 0)
    for i, (a, b) in enumerate(zip(got, map(worker.whole, jax.tree.leaves(state)), strict=True)):
        off = np.abs(a - b) > ROUNDING_ATOL
        assert off.sum() <= max(1, FLIP_SHARE * off.size), (name, i, int(off.sum()), off.size)
        np.testing.assert_allclose(a, b, rtol=0, atol=FLIP_ATOL, err_msg=f"{name} leaf {i}")


@pytest.mark.parametrize(
    "name, shard",
    [
        ("bytegrad_params", None),
        ("bytegrad_params", "optimizer"),
        ("bytegrad_optimizer", "params"),
        ("qadam_params", None),
    ],
)
def test_the_checkpoint_restores_exactly_onto_another_shard_in_one_process(
    two_process_run, name, shard
):
    algorithm, _, steps = worker.RUNS[name]
    mesh = jax_bytegrad.make_mesh(2, LOCAL)
    want = saved(two_process_run, name, 0)
    with Checkpointer(two_process_run / f"ckpt_{name}", every=1) as ckpt:
        assert ckpt.steps == [steps]
        with worker.build_step(algorithm, mesh, shard) as step:
            target = step.state_shapes(worker.init_params())
            restored = ckpt.restore(steps, lambda: target, target)
            leaves = map(worker.whole, jax.tree.leaves(restored))
            for i, (a, b) in enumerate(zip(leaves, want, strict=True)):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} -> {shard}: leaf {i}")
            # Where the target says: split leaves split, for this shard= setting.
            w1 = restored.params["w1"].sharding.spec
            assert w1 == (P(None, "local") if shard == "params" else P())  # (48, 96)
            moments = [x for x in jax.tree.leaves(restored.opt_state) if x.shape == (48, 96)]
            assert moments and all(
                x.sharding.spec == (P() if shard is None else P(None, "local")) for x in moments
            )
            # And it trains on from there.
            x, y = worker.global_batch(steps)
            state, metrics = step(restored, (x, y))
            assert int(state.step) == steps + 1 and np.isfinite(float(metrics["loss"]))
