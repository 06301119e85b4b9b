"""Worker for tests/test_diloco_background.py: DiLoCo's exchange in the background over Gloo.

Run it under ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 1 diloco_worker.py
OUT_DIR STEPS``: one device per process, the layout where the exchange's program (on the
step's dispatch thread) and the inner steps (on the caller's thread) run at once. Each process
feeds its own rows of every global batch, trains ``CONFIG`` for STEPS steps, and writes the
global params and its node's params to ``OUT_DIR/rank<k>.npz``, and after 6 steps, with two
exchanges in flight, a checkpoint to ``OUT_DIR/ckpt``. The step's thread must be gone once the
step is closed.

`train`, `CONFIG` and `init_params` (the pipelined worker's) are used by the test, which runs
the same steps in one process.
"""

import sys
import threading
from pathlib import Path

import numpy as np

# The model, its parameters and each process's rows: the pipelined step's worker's.
sys.path.insert(0, str(Path(__file__).parent))
from pipelined_worker import batch, init_params, loss_fn  # noqa: E402

# H = 4 in 2 fragments, each exchange beside the next 3 inner steps: fragment 1 starts while
# fragment 0 is in flight, and step 4 lands one and starts the other.
CONFIG = dict(inner_steps=4, fragments=2, delay=3, background=True, bits=4, error_feedback=True)


def _first_shard(x) -> np.ndarray:
    return np.asarray(x.addressable_shards[0].data)


def train(mesh, steps: int, rank: int = 0, nproc: int = 1, checkpoints=None):
    """After ``steps`` steps: the global params (``global/<name>``) and, per node this process
    holds, that node's params (``node<n>/<name>``). With ``checkpoints`` (a directory), the
    state after 6 steps is saved there."""
    import optax

    import jax_bytegrad
    from jax_bytegrad.checkpoint import Checkpointer

    strategy = jax_bytegrad.Strategy("diloco", mesh=mesh, **CONFIG)
    # Made before the loop, as users do: its constructor starts with a barrier between the
    # processes, a collective that must not meet an exchange in flight.
    ckpt = None if checkpoints is None else Checkpointer(checkpoints, every=6)
    with strategy.train_step(loss_fn, optax.adam(1e-2)) as step:
        state = step.init(init_params())
        for t in range(steps):
            state, metrics = step(state, batch(t, rank, nproc))
            if ckpt is not None:
                # After 6 steps both exchanges are in flight: the save's barrier must wait
                # for them (Checkpointer.save does).
                ckpt.save(t + 1, state)
        assert np.isfinite(float(metrics["loss"]))
        out = {f"global/{k}": _first_shard(v) for k, v in step.params(state).items()}
        for name, leaf in state.params.items():
            for shard in leaf.addressable_shards:
                node = shard.index[0].start or 0
                out[f"node{node}/{name}"] = np.asarray(shard.data)[0]
    if ckpt is not None:
        ckpt.close()
    assert not step._dispatcher.alive
    assert "diloco-exchange" not in [t.name for t in threading.enumerate()]
    return out


def main(out_dir: str, steps: int) -> int:
    from jax_bytegrad import initialize

    info = initialize()  # before any JAX computation
    import jax

    import jax_bytegrad

    mesh = jax_bytegrad.make_mesh()
    assert mesh.shape["node"] == info.num_processes, mesh.shape
    out = train(mesh, steps, info.process_id, info.num_processes, Path(out_dir) / "ckpt")
    np.savez(Path(out_dir) / f"rank{info.process_id}.npz", **out)
    jax.distributed.shutdown()
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
