"""Worker for tests/test_multiprocess_pipelined.py: the pipelined ByteGrad step over Gloo.

Run it under ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc D
pipelined_worker.py OUT_DIR STEPS [load] [CONFIG ...]``. Each process feeds its own rows of
every global batch. For each config of ``CONFIGS`` (or those named) it trains
``data_parallel_step`` with ``optax.chain(bytegrad(...), adam)`` and ``pipelined_step`` with
the same settings, from the same parameters, on the same batches, and checks that both give
the same state bit for bit (params, PRNG key, residuals, Adam's moments) and the same
metrics, and that every device of the process holds the same params. It writes the
pipelined params to ``OUT_DIR/<config>_rank<k>.npz``.

Then a loop of the user's raises in the middle of the pipelined steps: the error reaches the
worker, the step's thread stops, and the next step built afterwards still trains (no
collective was left in flight).

With ``load``, each process runs a busy loop beside the ``STEPS`` steps of each config and
step kind (``_load.busy_loop``), once a step on a state then thrown away has compiled them.

`train` and `CONFIGS` are imported by the test, which runs the same steps in one process.
"""

import contextlib
import sys
import threading
from pathlib import Path

import numpy as np

IN_DIM, HIDDEN, OUT_DIM = 48, 96, 10
GLOBAL_BATCH = 32
# name -> SyncConfig settings. Small blocks and buckets: several buckets, leaves cut into
# several pieces, each its own exchange.
SMALL = dict(block_size=128, bucket_bytes=8192, message_bytes=1024)
CONFIGS = {
    "ar_ef_stochastic": dict(wire="allreduce", error_feedback=True, rounding="stochastic"),
    "sg_ef": dict(wire="scatter_gather", error_feedback=True),
    "sg_flat": dict(wire="scatter_gather", hierarchical=False, rounding="stochastic"),
}


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.standard_normal((IN_DIM, HIDDEN)) / np.sqrt(IN_DIM)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.standard_normal((HIDDEN, OUT_DIM)) / np.sqrt(HIDDEN)).astype(np.float32),
    }


def batch(step: int, rank: int, nproc: int):
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, IN_DIM)).astype(np.float32)
    y = rng.integers(0, OUT_DIM, GLOBAL_BATCH).astype(np.int32)
    rows = GLOBAL_BATCH // nproc
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def loss_fn(params, batch):
    import jax
    import optax

    x, y = batch
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
    logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _leaves(tree):
    import jax
    import jax.numpy as jnp

    out = []
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf.addressable_shards[0].data))
    return out


def train(
    name: str, mesh, steps: int, rank: int = 0, nproc: int = 1, *, check: bool = True, load=None
):
    """The pipelined step's params after ``steps`` steps (on this process's first device);
    with ``check``, also the one-program step's, compared bit for bit. With ``load`` (a
    context manager), the steps run inside it, after a step on a state then thrown away
    compiled their programs."""
    import jax
    import optax

    import jax_bytegrad

    settings = {**SMALL, **CONFIGS[name]}
    sync = jax_bytegrad.SyncConfig(**settings)
    tx = optax.chain(jax_bytegrad.bytegrad(mesh=mesh, **settings), optax.adam(1e-2))
    piped = jax_bytegrad.pipelined_step(loss_fn, optax.adam(1e-2), mesh, sync=sync)
    steps_of = {"pipelined": piped}
    if check:
        steps_of["one"] = jax_bytegrad.data_parallel_step(loss_fn, tx, mesh)
    out = {}
    for kind, step in steps_of.items():
        with step:
            if load is not None:
                step(step.init(init_params()), batch(0, rank, nproc))
            state = step.init(init_params())
            with load() if load is not None else contextlib.nullcontext():
                for t in range(steps):
                    state, metrics = step(state, batch(t, rank, nproc))
                jax.block_until_ready((state.params, metrics))
            for leaf in jax.tree.leaves(state.params):
                shards = [np.asarray(s.data) for s in leaf.addressable_shards]
                for other in shards[1:]:
                    np.testing.assert_array_equal(other, shards[0], err_msg=f"{name} {kind}")
            out[kind] = (state, metrics)
    if check:
        (piped, piped_metrics), (one, one_metrics) = out["pipelined"], out["one"]
        got = _leaves((piped.params, piped.opt_state, piped_metrics))
        want = _leaves((one.params, one.opt_state, one_metrics))
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: leaf {i} differs")
    state = out["pipelined"][0]
    return {k: np.asarray(v.addressable_shards[0].data) for k, v in state.params.items()}


def users_loop_raises(mesh, rank: int, nproc: int) -> None:
    """The user's error mid-loop: it reaches the caller, the thread stops, and a new step
    trains after it."""
    import optax

    import jax_bytegrad

    sync = jax_bytegrad.SyncConfig(wire="allreduce", **SMALL)
    try:
        with jax_bytegrad.pipelined_step(loss_fn, optax.sgd(0.1), mesh, sync=sync) as step:
            state = step.init(init_params())
            for t in range(4):
                state, _ = step(state, batch(t, rank, nproc))
                if t == 1:
                    raise KeyError("the user's own error")
    except KeyError:
        pass
    else:
        raise AssertionError("the user's error did not reach the caller")
    assert not step._wire.alive
    assert "pipelined_step-wire" not in [t.name for t in threading.enumerate()]
    with jax_bytegrad.pipelined_step(loss_fn, optax.sgd(0.1), mesh, sync=sync) as step:
        state = step.init(init_params())
        for t in range(2):
            state, metrics = step(state, batch(t, rank, nproc))
        assert np.isfinite(float(metrics["loss"]))


def main(out_dir: str, steps: int, load: bool, names: list[str]) -> int:
    from _load import busy_loop

    from jax_bytegrad import initialize

    info = initialize()  # before any JAX computation
    import jax

    import jax_bytegrad

    mesh = jax_bytegrad.make_mesh()
    assert mesh.shape["node"] == info.num_processes, mesh.shape
    for name in names:
        params = train(name, mesh, steps, info.process_id, info.num_processes,
                       load=busy_loop if load else None)  # fmt: skip
        np.savez(Path(out_dir) / f"{name}_rank{info.process_id}.npz", **params)
        print(f"{name}: the pipelined step gave the one-program step's bits", flush=True)
    users_loop_raises(mesh, info.process_id, info.num_processes)
    print("the user's error stopped the loop and left nothing in flight", flush=True)
    jax.distributed.shutdown()
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    rest = sys.argv[3:]
    sys.exit(main(sys.argv[1], int(sys.argv[2]), "load" in rest,
                  [n for n in rest if n != "load"] or list(CONFIGS)))  # fmt: skip
