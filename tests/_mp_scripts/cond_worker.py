"""Worker for tests/test_multiprocess.py: collectives inside ``lax.cond`` across processes.

``qadam()`` as one optax transformation holds both of its phases in one program: a float32
all-reduce in one branch of a ``lax.cond`` and the 8-bit exchange in the other. With a warm-up
of 3 steps and a second-moment refresh every 2 steps after it, the branch taken flips every
step or two. Every process runs ``STEPS`` steps and checks that both processes hold the same
parameters; a deadlock in XLA:CPU's collectives would leave the launcher's timeout to end it.
Each process runs a busy loop beside the steps after the first (``_load.busy_loop``), which
compiles the one program: both cores are loaded while the collectives run.
"""

import contextlib
import sys

from jax_bytegrad import initialize

initialize()  # before any JAX computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _gather import process_rows  # noqa: E402
from _load import busy_loop  # noqa: E402

import jax_bytegrad  # noqa: E402

STEPS = 40


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def main() -> int:
    rank, nproc = jax.process_index(), jax.process_count()
    mesh = jax_bytegrad.make_mesh()
    tx = jax_bytegrad.qadam(1e-2, warmup_steps=3, nu_refresh_interval=2, nu_refresh_growth=1.0)
    step = jax_bytegrad.data_parallel_step(loss_fn, tx, mesh)
    rng = np.random.default_rng(0)
    state = step.init(
        {
            "w1": rng.standard_normal((32, 64)).astype(np.float32) / 6,
            "w2": rng.standard_normal((64, 4)).astype(np.float32) / 8,
        }
    )
    rows = 64 // nproc
    loaded = contextlib.ExitStack()
    with loaded:
        for t in range(STEPS):
            data = np.random.default_rng(t)
            x = data.standard_normal((64, 32)).astype(np.float32)
            y = data.standard_normal((64, 4)).astype(np.float32)
            mine = (x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
            state, metrics = step(state, mine)
            float(metrics["loss"])  # wait for it: one step in flight
            if t == 0:
                loaded.enter_context(busy_loop())
    flat = np.concatenate([np.ravel(np.asarray(v.addressable_shards[0].data))
                           for v in jax.tree.leaves(state.params)])  # fmt: skip
    both = process_rows(flat, mesh)
    np.testing.assert_array_equal(both[0], both[-1])
    count = int(np.asarray(state.opt_state[0].count.addressable_shards[0].data))
    assert count == STEPS, count
    print(f"[rank {rank}] cond OK after {STEPS} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
