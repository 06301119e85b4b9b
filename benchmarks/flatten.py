"""Bagua's fused optimizer, measured: an optax Adam step per leaf against one flat buffer.

Bagua flattens parameters, gradients and optimizer state into contiguous buffers so that the
optimizer runs as a few large kernels instead of one small kernel per layer (its paper reports
-17% epoch time on BERT-base in PyTorch). Under ``jax.jit`` XLA fuses the element-wise Adam
update across leaves itself; this script measures whether flattening still pays, on a model
with hundreds of small leaves (a weight, a bias and a norm's scale and offset per block):

    python benchmarks/flatten.py                  # 100 blocks: 400 leaves
    python benchmarks/flatten.py --blocks 300 --width 64

Three ways to run the same ``optax.adam`` step, each jitted with its inputs donated:

- ``per_leaf``: the update on the parameter pytree, as ``data_parallel_step`` runs it;
- ``flat``: params, gradients and state kept as one float32 buffer (Bagua's layout);
- ``flat_params``: params and state kept flat, the gradient arriving as a pytree and
  concatenated in the step (``Strategy(..., flatten=True)``: the loss function sees the
  params unflattened, so its gradient comes back flat through that concatenation);
- ``flatten_each_step``: a pytree in and out, flattened and split inside the step.

It prints the median time of each and the ratios to ``per_leaf``.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree


def make_params(blocks: int, width: int, seed: int = 0) -> dict:
    """``blocks`` blocks of a (width, width) weight, a bias, and a norm's scale and offset."""
    rng = np.random.default_rng(seed)
    return {
        f"block{i:04d}": {
            "w": jnp.asarray(rng.normal(size=(width, width)).astype(np.float32) / width),
            "b": jnp.zeros(width),
            "scale": jnp.ones(width),
            "offset": jnp.zeros(width),
        }
        for i in range(blocks)
    }


# Registry: name -> builder(params, tx) returning (step, args); step(*args) -> args.


def _per_leaf(params, tx):
    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), grads, state

    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)
    return jax.jit(step, donate_argnums=(0, 2)), (params, grads, tx.init(params))


def _flat(params, tx):
    return _per_leaf(ravel_pytree(params)[0], tx)


def _flatten_each_step(params, tx):
    flat, unravel = ravel_pytree(params)

    def step(params, grads, state):
        p, g = ravel_pytree(params)[0], ravel_pytree(grads)[0]
        updates, state = tx.update(g, state, p)
        return unravel(optax.apply_updates(p, updates)), grads, state

    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)
    return jax.jit(step, donate_argnums=(0, 2)), (params, grads, tx.init(flat))


def _flat_params(params, tx):
    flat, _ = ravel_pytree(params)

    def step(params, grads, state):
        g = ravel_pytree(grads)[0]
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), grads, state

    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)
    return jax.jit(step, donate_argnums=(0, 2)), (flat, grads, tx.init(flat))


CASES = {
    "per_leaf": _per_leaf,
    "flat": _flat,
    "flat_params": _flat_params,
    "flatten_each_step": _flatten_each_step,
}


def measure(build, params, *, reps: int, warmup: int = 3) -> float:
    """Median seconds of one step (inputs donated, outputs fed back), after ``warmup`` steps."""
    tx = optax.adam(1e-3)
    step, args = build(jax.tree.map(jnp.copy, params), tx)
    for _ in range(warmup):
        args = jax.block_until_ready(step(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        args = jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def report(results: dict[str, float], params) -> str:
    leaves = len(jax.tree.leaves(params))
    size = sum(x.size for x in jax.tree.leaves(params))
    lines = [
        f"optax.adam step, {leaves} leaves, {size:,} float32 parameters, "
        f"{jax.devices()[0].platform}",
        "",
        "| layout | median ms | vs per_leaf |",
        "|---|---:|---:|",
    ]
    base = results["per_leaf"]
    for name, seconds in results.items():
        lines.append(f"| {name} | {seconds * 1e3:.3f} | {seconds / base:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=100)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    params = make_params(args.blocks, args.width)
    results = {name: measure(build, params, reps=args.reps) for name, build in CASES.items()}
    print(report(results, params))


if __name__ == "__main__":
    main()
