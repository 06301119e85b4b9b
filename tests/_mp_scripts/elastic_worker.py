"""Worker for tests/test_elastic.py: training that checkpoints, dies on purpose, and resumes.

Run it under ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 [--max-restarts N]
elastic_worker.py OUT_DIR --algorithms bytegrad [--kill-step S | --stop-step S]``. For each
algorithm it resumes from ``OUT_DIR/<algorithm>/`` (`Checkpointer.restore_or_init`), trains the
small MLP of train_worker.py to ``STEPS`` steps on the deterministic global batches of
train_worker.py, saving every ``EVERY`` steps, and writes the final parameters as seen on its
first device to ``OUT_DIR/<algorithm>_rank<k>.npz``.

On the first attempt (`jax_bytegrad.distributed.restart_count` 0) rank ``--fail-rank`` kills
itself with SIGKILL right after step ``--kill-step`` (and after starting that step's save, if
it has one), or stops itself with SIGSTOP after step ``--stop-step`` (once the last save is
finalized), and with ``--outage S`` is continued S seconds later by a child process of its own:
silent meanwhile, no heartbeat and no collective, as behind a network partition that heals.
``--heartbeat-timeout N`` is passed to `jax_bytegrad.initialize`. With ``--kill-always`` it
kills itself on every attempt. A list, ``--kill-step 4,2,4``, kills once in each algorithm:
on attempt k, in the k-th algorithm, after the k-th step listed; with one restart per step
listed, one run then restarts into each algorithm's checkpoints in turn. Each extra argument
lands on the command line, where the test finds the processes of its run by ``--marker``.

With ``--heartbeat S`` a thread also marks the progress file as fresh every S seconds, from
the start, keeping the step the training loop last reported: start-up and compilation, however
slow on a loaded machine, then never count as a hang under the launcher's
``--progress-timeout``, and only a stopped process (whose threads all stop) does.

`train` is also imported by the test, which resumes the saved state in one process.
"""

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "train_worker", Path(__file__).with_name("train_worker.py")
)
train_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_worker)

STEPS = 6
EVERY = 2
QADAM_WARMUP = 3  # the switch to compressed momenta comes after the checkpoint of step 2
ALGORITHMS = (
    "gradient_allreduce", "bytegrad", "bytegrad_flat", "qadam", "diloco", "diloco_background"
)  # fmt: skip
# DiLoCo's exchange is due after step 3 and runs inside step 4 (delay 1): the checkpoint of
# step 2 holds an open period, and a restart from it crosses the exchange with its residuals.
# In the background (delay 2) it starts after step 3 and lands in step 5: the checkpoint of
# step 4 holds it in flight.
DILOCO = {
    "diloco": {"inner_steps": 3, "bits": 4, "error_feedback": True},
    "diloco_background": {
        "inner_steps": 3, "bits": 4, "error_feedback": True, "background": True, "delay": 2
    },
}  # fmt: skip


def optimizer(name: str, mesh):
    import optax

    import jax_bytegrad

    if name == "gradient_allreduce":
        return optax.chain(jax_bytegrad.gradient_allreduce(), optax.sgd(0.1, momentum=0.9))
    if name == "qadam":
        return jax_bytegrad.qadam(1e-2, warmup_steps=QADAM_WARMUP)
    return train_worker.optimizer(name, mesh)


def init_state(name: str, mesh):
    params = train_worker.init_params()
    return {"params": params, "opt_state": optimizer(name, mesh).init(params)}


def train(name, mesh, ckpt_dir, *, rank=0, nproc=1, on_step=None, keep=STEPS):
    """Resumes `name` from `ckpt_dir` (or starts), trains to STEPS; returns (start step, params).

    `on_step(step, checkpointer)` runs after each step and its save.
    """
    import jax

    import jax_bytegrad
    from jax_bytegrad.checkpoint import Checkpointer

    if name in DILOCO:
        return _train_diloco(name, mesh, ckpt_dir, rank=rank, nproc=nproc, on_step=on_step,
                             keep=keep)  # fmt: skip
    tx = optimizer(name, mesh)
    step_fn = jax_bytegrad.data_parallel_step(train_worker.loss_fn, tx, mesh, donate=False)
    rows = train_worker.GLOBAL_BATCH // nproc
    with Checkpointer(ckpt_dir, every=EVERY, keep=keep) as ckpt:
        start, state = ckpt.restore_or_init(lambda: init_state(name, mesh), mesh)
        print(f"{name}: starts at step {start}", flush=True)
        step = start
        while step < STEPS:
            x, y = train_worker.global_batch(step)  # the data position is the step
            mine = (x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
            train = jax_bytegrad.StepState(step, state["params"], state["opt_state"], {})
            train, metrics = step_fn(train, jax_bytegrad.sharding.shard_batch(mine, mesh))
            state, loss = {"params": train.params, "opt_state": train.opt_state}, metrics["loss"]
            step += 1
            jax_bytegrad.distributed.report_progress(step)
            print(f"{name}: step {step} loss {float(loss):.6f}", flush=True)
            ckpt.save(step, state)
            if on_step is not None:
                on_step(step, ckpt)
    params = {k: np.asarray(v.addressable_shards[0].data) for k, v in state["params"].items()}
    jax.block_until_ready(state)
    return start, params


def _train_diloco(name, mesh, ckpt_dir, *, rank, nproc, on_step, keep):
    """``train`` for ``Strategy("diloco")``: its whole ``StepState`` is the checkpoint."""
    import jax
    import optax

    import jax_bytegrad
    from jax_bytegrad.checkpoint import Checkpointer

    strategy = jax_bytegrad.Strategy("diloco", mesh=mesh, **DILOCO[name])
    params = train_worker.init_params()
    rows = train_worker.GLOBAL_BATCH // nproc
    with (
        strategy.train_step(train_worker.loss_fn, optax.adam(1e-2)) as step_fn,
        Checkpointer(ckpt_dir, every=EVERY, keep=keep) as ckpt,
    ):
        start, state = ckpt.restore_or_init(
            lambda: step_fn.init(params), step_fn.state_shapes(params)
        )
        print(f"{name}: starts at step {start}", flush=True)
        step = start
        while step < STEPS:
            x, y = train_worker.global_batch(step)
            mine = (x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
            state, metrics = step_fn(state, mine)
            step += 1
            jax_bytegrad.distributed.report_progress(step)
            print(f"{name}: step {step} loss {float(metrics['loss']):.6f}", flush=True)
            ckpt.save(step, state)
            if on_step is not None:
                on_step(step, ckpt)
        model = step_fn.params(state)
        params = {k: np.asarray(v.addressable_shards[0].data) for k, v in model.items()}
        jax.block_until_ready(state)
    return start, params


def start_heartbeat(interval: float) -> None:
    """Touches the launcher's progress file every `interval` seconds, leaving its step as is."""
    path = Path(os.environ["JAX_BYTEGRAD_PROGRESS_FILE"])

    def beat():
        while True:
            path.touch()  # creates it empty at first: "before its first step"
            time.sleep(interval)

    threading.Thread(target=beat, daemon=True).start()


def main(argv) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--kill-step", default="", help="a step, or one per algorithm: 4,2")
    parser.add_argument("--kill-always", action="store_true")
    parser.add_argument("--stop-step", type=int, default=None)
    parser.add_argument("--outage", type=float, default=None)
    parser.add_argument("--heartbeat-timeout", type=int, default=100)
    parser.add_argument("--heartbeat", type=float, default=None)
    parser.add_argument("--marker", default="")
    args = parser.parse_args(argv)
    if args.heartbeat is not None:
        start_heartbeat(args.heartbeat)

    from jax_bytegrad import initialize
    from jax_bytegrad.distributed import restart_count

    info = initialize(heartbeat_timeout_seconds=args.heartbeat_timeout)  # before any JAX
    import jax

    import jax_bytegrad

    mesh = jax_bytegrad.make_mesh()
    attempt = restart_count()
    first = attempt == 0 or args.kill_always
    kill_steps = [int(s) for s in args.kill_step.split(",") if s]
    training = [0]  # the index of the algorithm that on_step hears from

    def on_step(step, ckpt):
        if info.process_id != args.fail_rank:
            return
        k = training[0]
        if k < len(kill_steps) and step == kill_steps[k] and (attempt == k or args.kill_always):
            print(f"killing myself after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if first and step == args.stop_step:
            ckpt.wait()  # so that what a hang loses is the steps since the last checkpoint
            print(f"stopping myself after step {step}", flush=True)
            if args.outage is not None:  # in this process's group: the launcher stops it too
                wake = f"time.sleep({args.outage}); os.kill({os.getpid()}, signal.SIGCONT)"
                subprocess.Popen([sys.executable, "-c", "import os, signal, time; " + wake])
            os.kill(os.getpid(), signal.SIGSTOP)

    out = Path(args.out_dir)
    for k, name in enumerate(args.algorithms.split(",")):
        training[0] = k
        _, params = train(
            name,
            mesh,
            out / name,
            rank=info.process_id,
            nproc=info.num_processes,
            on_step=on_step,
        )
        np.savez(out / f"{name}_rank{info.process_id}.npz", **params)
    jax.distributed.shutdown()
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
