"""Worker for tests/test_multiprocess.py: ByteGrad and QAdam train steps on several processes.

Run it under ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 train_worker.py
OUT_DIR``. Each process feeds its own half of every global batch
(`jax_bytegrad.sharding.shard_batch`), starts from the same replicated parameters
(`jax_bytegrad.sharding.replicate`), trains a small MLP with each algorithm, and writes the
final parameters as seen on its own devices to ``OUT_DIR/<algorithm>_rank<k>.npz``.

`train` is also imported by the test, which runs the same steps in one process on a 2 x 4 mesh of
8 CPU devices and compares.
"""

import sys
from pathlib import Path

import numpy as np

IN_DIM, HIDDEN, OUT_DIM = 48, 96, 10
GLOBAL_BATCH = 64
# name -> steps. "bytegrad_128" is hierarchical 8-bit ByteGrad with 128-value blocks (the
# default blocks take the same path, only longer). "bytegrad_flat" is ByteGrad with
# hierarchical=False: no float32 sum between devices at all, only codes exchanged and
# averaged in a fixed order. "bytegrad_128" and "bytegrad_128_split" differ only in the
# message size between nodes (one per peer, or one 128-value block per message), which must
# not change a bit. "bytegrad4_ef_flat" is the flat
# one with 4-bit codes and error feedback, whose residuals are per-device state;
# "bytegrad4_ef" and "qadam4_ef" are hierarchical ByteGrad and QAdam with 4-bit codes and
# error feedback, over 20 steps.
ALGORITHMS = {
    "bytegrad_flat": 4,
    "qadam": 5,
    "bytegrad_128": 4,
    "bytegrad_128_split": 4,
    "bytegrad4_ef_flat": 4,
    "bytegrad4_ef": 20,
    "qadam4_ef": 20,
}
QADAM_WARMUP = 2  # shorter than the run, so both phases run


def init_params() -> dict[str, np.ndarray]:
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


def optimizer(name: str, mesh):
    import optax

    import jax_bytegrad
    from jax_bytegrad import qadam

    if name == "bytegrad":
        return optax.chain(jax_bytegrad.bytegrad(), optax.sgd(0.1, momentum=0.9))
    if name == "bytegrad_flat":
        return optax.chain(jax_bytegrad.bytegrad(hierarchical=False), optax.sgd(0.1, momentum=0.9))
    if name == "bytegrad4_ef_flat":
        sync = jax_bytegrad.bytegrad(
            bits=4, error_feedback=True, mesh=mesh, hierarchical=False, block_size=256
        )
        return optax.chain(sync, optax.sgd(0.1, momentum=0.9))
    if name == "bytegrad4_ef":
        sync = jax_bytegrad.bytegrad(bits=4, error_feedback=True, mesh=mesh, block_size=256)
        return optax.chain(sync, optax.sgd(0.1, momentum=0.9))
    if name == "qadam":
        return qadam(1e-2, warmup_steps=QADAM_WARMUP)
    if name == "qadam4_ef":
        return qadam(
            1e-2, warmup_steps=QADAM_WARMUP, bits=4, error_feedback=True, mesh=mesh, block_size=256
        )
    if name in ("bytegrad_128", "bytegrad_128_split"):
        message_bytes = 128 if name.endswith("split") else None
        sync = jax_bytegrad.bytegrad(block_size=128, message_bytes=message_bytes)
        return optax.chain(sync, optax.sgd(0.1, momentum=0.9))
    raise ValueError(f"train_worker: unknown algorithm {name!r}; use one of {sorted(ALGORITHMS)}")


def train(name: str, mesh, rank: int = 0, nproc: int = 1) -> dict[str, np.ndarray]:
    """Runs the steps of `name` on `mesh`; returns the params on this process's first device.

    Also checks, after every step, that every device of this process holds the same parameters.
    """
    import jax

    import jax_bytegrad

    # qadam() as one optax transformation: both phases in one program, its collectives inside
    # a lax.cond, across processes (the step builders pick phases on the host instead).
    step = jax_bytegrad.data_parallel_step(loss_fn, optimizer(name, mesh), mesh)
    state = step.init(init_params())  # error feedback's residuals are placed per device here
    rows = GLOBAL_BATCH // nproc
    for t in range(ALGORITHMS[name]):
        x, y = global_batch(t)
        mine = (x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
        state, _ = step(state, jax_bytegrad.sharding.shard_batch(mine, mesh))
        p, s = state.params, state.opt_state
        out = {}
        for k, leaf in p.items():
            shards = [np.asarray(sh.data) for sh in leaf.addressable_shards]
            for other in shards[1:]:
                np.testing.assert_array_equal(other, shards[0], err_msg=f"{name} step {t} {k}")
            out[k] = shards[0]
    if name.startswith("qadam"):
        count = int(np.asarray(s[0].count.addressable_shards[0].data))
        assert count == ALGORITHMS[name] > QADAM_WARMUP, count
    jax.block_until_ready(p)
    return out


def main(out_dir: str) -> int:
    from jax_bytegrad import initialize

    info = initialize()  # before any JAX computation
    import jax

    import jax_bytegrad

    mesh = jax_bytegrad.make_mesh()
    assert mesh.shape["node"] == info.num_processes, mesh.shape
    for name in ALGORITHMS:
        params = train(name, mesh, info.process_id, info.num_processes)
        np.savez(Path(out_dir) / f"{name}_rank{info.process_id}.npz", **params)
        print(f"{name}: wrote params", flush=True)
    jax.distributed.shutdown()
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
