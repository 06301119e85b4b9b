"""Worker for tests/test_multiprocess_sharding.py: state sharded within each node over Gloo.

Run it under ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 shard_worker.py
OUT_DIR``. Each process is a node of 4 devices and feeds its own rows of every global batch.
For each run of ``RUNS`` it trains ``Strategy(algorithm, shard=...)`` from the same
parameters, then writes, from what its own devices hold (``addressable_shards``):

- ``OUT_DIR/<run>_rank<k>.npz``: every leaf of the final ``StepState``, whole (leaf i as
  ``leaf<i>``), assembled from the blocks of this process's devices;
- ``OUT_DIR/<run>_rank<k>.json``: per device, the shapes of its blocks of the optimizer
  state and their bytes, and the bytes of the whole optimizer state;

and saves the state with ``jax_bytegrad.checkpoint.Checkpointer`` under
``OUT_DIR/ckpt_<run>`` (every process writes its part).

``train``, ``RUNS`` and ``init_params`` are imported by the test, which runs the same steps in
one process and restores the checkpoints there.
"""

import json
import sys
from pathlib import Path

import numpy as np

IN_DIM, HIDDEN, OUT_DIM = 48, 96, 10
GLOBAL_BATCH = 64
QADAM_WARMUP = 2
# name -> (algorithm, shard, steps): shorter than the run, QAdam's warm-up lets both of its
# phases run.
RUNS = {
    "bytegrad_optimizer": ("bytegrad", "optimizer", 6),
    "bytegrad_params": ("bytegrad", "params", 6),
    "qadam_params": ("qadam", "params", 5),
}


def init_params() -> dict[str, np.ndarray]:
    """w1, b1 and w2 split over 4 devices along their first dimension; b2 (10) stays whole."""
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.standard_normal((IN_DIM, HIDDEN)) / np.sqrt(IN_DIM)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.standard_normal((HIDDEN, OUT_DIM)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(OUT_DIM, np.float32),
    }


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, IN_DIM)).astype(np.float32)
    y = rng.integers(0, OUT_DIM, GLOBAL_BATCH).astype(np.int32)
    return x, y


def loss_fn(params, batch):
    import jax
    import optax

    x, y = batch
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
    logits = h @ params["w2"] + params["b2"][None]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def build_step(algorithm: str, mesh, shard: str | None):
    """The train step of ``algorithm`` with ``shard=`` on ``mesh``; a context manager, as
    ``Strategy.train_step`` returns it."""
    import optax

    import jax_bytegrad

    if algorithm == "qadam":
        strategy = jax_bytegrad.Strategy(
            "qadam", mesh=mesh, shard=shard, learning_rate=1e-2, warmup_steps=QADAM_WARMUP
        )
        return strategy.train_step(loss_fn, None)
    strategy = jax_bytegrad.Strategy(algorithm, mesh=mesh, shard=shard)
    return strategy.train_step(loss_fn, optax.adam(1e-2))


def whole(x) -> np.ndarray:
    """Leaf ``x`` of a train state as one numpy array, from this process's devices' blocks;
    every device's copy of a block it shares with another must be the same."""
    import jax

    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    out = np.zeros(x.shape, x.dtype)
    seen = {}
    for shard in x.addressable_shards:
        data = np.asarray(shard.data)
        key = tuple((s.start, s.stop) for s in shard.index)
        if key in seen:
            np.testing.assert_array_equal(data, seen[key], err_msg="copies of a block differ")
        seen[key] = data
        out[shard.index] = data
    return out


def block_bytes(opt_state) -> dict:
    """Per device of this process: the shapes and bytes of its blocks of the optimizer state,
    and the bytes of the whole optimizer state."""
    import jax

    leaves = [x for x in jax.tree.leaves(opt_state) if isinstance(x, jax.Array)]
    devices = {}
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            entry = devices.setdefault(str(shard.device.id), {"shapes": [], "bytes": 0})
            entry["shapes"].append(list(shard.data.shape))
            entry["bytes"] += shard.data.nbytes
    return {"devices": devices, "whole_bytes": sum(x.nbytes for x in leaves)}


def train(name: str, mesh, rank: int = 0, nproc: int = 1):
    """Runs the steps of ``name`` on ``mesh``, each process feeding its own rows; returns the
    step (closed) and its final state."""
    import jax_bytegrad

    algorithm, shard, steps = RUNS[name]
    rows = GLOBAL_BATCH // nproc
    with build_step(algorithm, mesh, shard) as step:
        state = step.init(init_params())
        for t in range(steps):
            x, y = global_batch(t)
            mine = (x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
            state, _ = step(state, jax_bytegrad.sharding.shard_batch(mine, mesh))
    return step, state


def main(out_dir: str) -> int:
    from jax_bytegrad import initialize

    info = initialize()  # before any JAX computation
    import jax

    import jax_bytegrad
    from jax_bytegrad.checkpoint import Checkpointer

    mesh = jax_bytegrad.make_mesh()
    assert dict(mesh.shape) == {"node": 2, "local": 4}, mesh.shape
    out = Path(out_dir)
    for name, (_, _, steps) in RUNS.items():
        _, state = train(name, mesh, info.process_id, info.num_processes)
        leaves = {f"leaf{i}": whole(x) for i, x in enumerate(jax.tree.leaves(state))}
        np.savez(out / f"{name}_rank{info.process_id}.npz", **leaves)
        blocks = block_bytes(state.opt_state)
        (out / f"{name}_rank{info.process_id}.json").write_text(json.dumps(blocks))
        with Checkpointer(out / f"ckpt_{name}", every=1) as ckpt:
            ckpt.save(steps, state)
            ckpt.wait()
        print(f"{name}: wrote the state and its checkpoint", flush=True)
    jax.distributed.shutdown()
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
