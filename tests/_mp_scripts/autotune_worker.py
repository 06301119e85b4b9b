"""Worker for tests/test_autotune.py: ``jax_bytegrad.autotune`` on several processes.

Run it under ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 2 autotune_worker.py
OUT_DIR``. Every process tunes ByteGrad on a small MLP; process 1 sees the starting
configuration (256 KiB messages) 5 s slower than it is and has a time budget of 0 s. Agreement
means both still run every trial process 0 picks, both score each trial by the slower process
(so neither chooses the start), and both choose the same configuration. Each process writes
what it saw to ``OUT_DIR/rank<k>.json``.
"""

import json
import sys
from pathlib import Path

import numpy as np

SLOWED = {"message_bytes": 256 * 2**10}
PENALTY_S = 5.0
SPACE = {"message_bytes": [2**10, 256 * 2**10, None]}


def main(out_dir: str) -> None:
    import jax_bytegrad

    info = jax_bytegrad.initialize()
    import jax
    import optax

    from jax_bytegrad._src import autotune as autotune_module

    if info.process_id == 1:
        measure = autotune_module._run_trial

        def slowed(strategy, config, *args):
            compile_s, step_s = measure(strategy, config, *args)
            return compile_s, step_s + (PENALTY_S if config == SLOWED else 0.0)

        autotune_module._run_trial = slowed

    rng = np.random.default_rng(0)
    params = {
        "w": (rng.standard_normal((16, 32)) / 4).astype(np.float32),
        "b": np.zeros(32, np.float32),
    }

    def loss_fn(p, batch):
        return jax.numpy.mean((batch @ p["w"] + p["b"]) ** 2)

    rows = 4 * jax.local_device_count()
    batches = [
        np.random.default_rng(10 * info.process_id + i).standard_normal((rows, 16), np.float32)
        for i in range(4)
    ]
    strategy = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh())
    result = jax_bytegrad.autotune(
        strategy,
        loss_fn,
        optax.sgd(0.1),
        params,
        batches,
        space=SPACE,
        steps_per_trial=2,
        time_budget_s=0.0 if info.process_id == 1 else None,
        cache=Path(out_dir) / "cache.json",
        verbose=False,
    )
    report = {
        "config": result.config,
        "trials": [[t.config, t.step_s, t.error] for t in result.trials],
    }
    Path(out_dir, f"rank{info.process_id}.json").write_text(json.dumps(report))
    print(f"[rank {info.process_id}] OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
