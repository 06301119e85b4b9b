"""``shard="full"`` against ``shard=None`` on a small Llama-style decoder, 8 CPU devices:
the loss each reaches, how far the weights the forward computes on are from the master
weights at each step, and the bytes each device sends between nodes per step.

The model is ``_llama.py``'s (4 layers of width 64, a byte vocabulary, each layer under
``jax.checkpoint`` in a ``lax.scan``, marked with ``exchange_in_loop`` inside the checkpoint),
trained on windows of a standard-library module's bytes, float32 AdamW after the sync.

The weights' error is what ``shard="full"`` adds to ByteGrad's: each step the forward computes
on every device's blocks coded to 8 bits (min-max per block of the sync's block size, nearest
rounding) and decoded (``sync/across_nodes.gather_weights``). Here it is read from the
params of each step, as ``|decoded - master| / |master|`` (Frobenius) over every split leaf.

Usage:
  python benchmarks/full_sharding.py                       # 300 steps, seed 0
  python benchmarks/full_sharding.py --steps 100 --seeds 0,1
  python benchmarks/full_sharding.py --runs bytegrad_4bit_ef   # 4-bit codes, error feedback
  python benchmarks/full_sharding.py --runs bytegrad_2bit_ef --nodes 4   # 4 x 2 devices
"""

import argparse
import inspect
import sys
import textwrap
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _llama  # noqa: E402

import jax_bytegrad as jbg  # noqa: E402
from jax_bytegrad._src.codecs import dequantize_blocks, quantize_blocks  # noqa: E402
from jax_bytegrad._src.sharding.rule import split_dim  # noqa: E402
from jax_bytegrad._src.sync import across_nodes  # noqa: E402

SHAPE = _llama.Shape(layers=4, dim=64, ffn=128, heads=4, vocab=256)
SEQ, ROWS = 32, 16
RUNS = {
    "gradient_allreduce": ("gradient_allreduce", {"hierarchical": True}),
    "bytegrad": ("bytegrad", {}),
    "bytegrad_4bit_ef": ("bytegrad", {"bits": 4, "error_feedback": True}),
    "bytegrad_4bit_ef_integer": (
        "bytegrad",
        {"bits": 4, "error_feedback": True, "wire": "allreduce"},
    ),
    "bytegrad_2bit_ef": ("bytegrad", {"bits": 2, "error_feedback": True}),
}


def batches(steps: int, seed: int) -> list[np.ndarray]:
    with open(inspect.getsourcefile(textwrap), "rb") as f:
        text = np.frombuffer(f.read(), np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(text) - SEQ - 1, size=(steps, ROWS))
    return [np.stack([text[s : s + SEQ + 1] for s in row]) for row in starts]


def weights_error(params, parts: int, config: jbg.SyncConfig) -> float:
    """The relative error of the weights a ``shard="full"`` forward computes on: each leaf's
    blocks over ``parts`` devices coded and decoded as ``gather_weights`` does."""
    codec, size = across_nodes.weight_codec(config), config.block_size
    num = den = 0.0
    for leaf in jax.tree.leaves(params):
        leaf = np.asarray(leaf, np.float32)
        dim = split_dim(leaf.shape, parts)
        if dim is None:
            continue
        for block in np.split(leaf, parts, axis=dim):
            flat = np.pad(block.reshape(-1), (0, -block.size % size)).reshape(-1, size)
            codes, header = quantize_blocks(codec, jnp.asarray(flat))
            decoded = np.asarray(dequantize_blocks(codec, codes, header)).reshape(-1)
            decoded = decoded[: block.size].reshape(block.shape)
            num += float(np.sum((decoded - block) ** 2))
            den += float(np.sum(block**2))
    return float(np.sqrt(num / den))


def run(name: str, shard, steps: int, seed: int, every: int, nodes: int = 2) -> dict:
    algorithm, settings = RUNS[name]
    mesh = jbg.make_mesh(nodes, 8 // nodes)
    params = jax.device_get(_llama.init(SHAPE, jax.random.key(seed), scan=True))
    loss = _llama.loss_fn(SHAPE, scan=True, mark="inside")
    strategy = jbg.Strategy(algorithm, mesh=mesh, shard=shard, **settings)
    losses, errors = [], []
    with strategy.train_step(loss, optax.adamw(3e-3)) as step:
        state = step.init(params)
        data = batches(steps, seed)
        for i, batch in enumerate(data):
            if shard == "full" and algorithm == "bytegrad" and i % every == 0:
                config = jbg.SyncConfig(bits=settings.get("bits", 8))
                errors.append(weights_error(step.params(state), 8, config))
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        node = step.communication_stats(state, data[0])["step"].bytes_on("node")
    return {"losses": losses, "errors": errors, "node_bytes": node}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--every", type=int, default=50, help="steps between weight errors")
    parser.add_argument("--runs", default=",".join(RUNS), help="which of " + ", ".join(RUNS))
    parser.add_argument("--nodes", type=int, default=2, choices=(2, 4, 8), help="of 8 devices")
    args = parser.parse_args()
    mesh = f"{args.nodes} x {8 // args.nodes}"
    print(f"JAX {jax.__version__}; {mesh} CPU devices; {SHAPE}; {args.steps} steps")
    print(
        f"{'algorithm':18s} {'seed':>4s} {'loss None':>10s} {'loss full':>10s} {'ratio':>7s} "
        f"{'B/node None':>12s} {'B/node full':>12s} weights error (every {args.every} steps)"
    )
    for seed in map(int, args.seeds.split(",")):
        for name in args.runs.split(","):
            base = run(name, None, args.steps, seed, args.every, args.nodes)
            full = run(name, "full", args.steps, seed, args.every, args.nodes)
            tail = lambda r: float(np.mean(r["losses"][-10:]))  # noqa: E731
            errors = " ".join(f"{e:.2e}" for e in full["errors"]) or "-"
            print(
                f"{name:18s} {seed:4d} {tail(base):10.4f} {tail(full):10.4f} "
                f"{tail(full) / tail(base):7.4f} {base['node_bytes']:12,.0f} "
                f"{full['node_bytes']:12,.0f} {errors}",
                flush=True,
            )


if __name__ == "__main__":
    main()
