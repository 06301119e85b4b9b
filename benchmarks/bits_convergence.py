"""Test accuracy and loss with 8-, 4- and 2-bit ByteGrad and QAdam, with and without error
feedback.

Trains one of the examples' models (``examples/models.py``: ``--model cnn`` on scikit-learn's
digits, ``--model transformer``, the character transformer on Python source) from the same
initialisation and the same batches once per variant, on a 2 x 4 mesh of ("node", "local") CPU
devices (``--mesh 4x2`` or ``8x1`` for more nodes), with each model's default batch size and
learning rate (``examples/configs.py``). Prints one markdown table: final test accuracy and
loss, and the bytes each device sends between nodes per step, read by ``communication_stats``
from the compiled step, with their ratio to gradient_allreduce's. The variants (``VARIANTS``)
are gradient_allreduce (float32, hierarchical: the strongest baseline) and ByteGrad at 8 and 4
bits, each with and without error feedback, all followed by Adam; and QAdam (the examples'
settings: 20% float32 warm-up, eps 1e-5) at 8 bits, 4 bits and 4 bits with error feedback; and
ByteGrad and QAdam on the integer all-reduce wire (``wire="allreduce"``). QAdam's bytes are
those of a step after warm-up.

    python benchmarks/bits_convergence.py --steps 300 --seeds 0,1
    python benchmarks/bits_convergence.py --model transformer --steps 600

With one process and no ``XLA_FLAGS``, this script asks XLA for 8 host devices before JAX
starts.
"""

import argparse
import os
import sys
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import data as datasets  # noqa: E402
import models  # noqa: E402
from configs import ALGORITHMS, CPU_DEVICES_PER_NODE, CPU_NODES, Config  # noqa: E402

import jax_bytegrad  # noqa: E402
from jax_bytegrad import qadam  # noqa: E402
from jax_bytegrad.distributed import ensure_cpu_threads  # noqa: E402
from jax_bytegrad.profiling import communication_stats  # noqa: E402
from jax_bytegrad.sharding import replicate, shard_batch, shard_state, state_specs  # noqa: E402

AXES = ("node", "local")
MODELS = ("cnn", "transformer")


def _allreduce(mesh, config: Config):
    sync = jax_bytegrad.gradient_allreduce(hierarchical=True)
    return optax.chain(sync, optax.adam(config.get("learning_rate")))


def _bytegrad(bits: int, error_feedback: bool, wire: str = "scatter_gather"):
    def build(mesh, config: Config):
        sync = jax_bytegrad.bytegrad(bits=bits, error_feedback=error_feedback, mesh=mesh, wire=wire)
        return optax.chain(sync, optax.adam(config.get("learning_rate")))

    return build


def _qadam(bits: int, error_feedback: bool, wire: str = "scatter_gather"):
    def build(mesh, config: Config):
        kwargs = ALGORITHMS["qadam"].kwargs(config)  # the examples' QAdam settings
        return qadam(**kwargs, bits=bits, error_feedback=error_feedback, mesh=mesh, wire=wire)

    return build


# name -> optimizer builder(mesh, config).
VARIANTS = {
    "gradient_allreduce": _allreduce,
    "bytegrad 8-bit": _bytegrad(8, False),
    "bytegrad 8-bit + EF": _bytegrad(8, True),
    "bytegrad 4-bit": _bytegrad(4, False),
    "bytegrad 4-bit + EF": _bytegrad(4, True),
    # Four levels per block, four codes per byte: with error feedback only.
    "bytegrad 2-bit + EF": _bytegrad(2, True),
    "qadam 8-bit": _qadam(8, False),
    "qadam 4-bit": _qadam(4, False),
    "qadam 4-bit + EF": _qadam(4, True),
    "qadam 2-bit + EF": _qadam(2, True),
    # The integer all-reduce wire (wire="allreduce"): 255 // nodes levels per node.
    "bytegrad allreduce 8-bit": _bytegrad(8, False, "allreduce"),
    "bytegrad allreduce 8-bit + EF": _bytegrad(8, True, "allreduce"),
    "qadam allreduce 8-bit": _qadam(8, False, "allreduce"),
}


def make_step(loss_fn, tx, mesh, state):
    """A jitted data-parallel step whose optimizer state may hold per-device residuals."""
    specs = state_specs(state)

    def per_device(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, AXES, to="varying"), batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXES)

    return jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), specs, P(AXES)),
            out_specs=(P(), specs, P()),
        )
    )


def batches(config: Config, data):
    """``next_batch() -> (inputs, targets)``: the global batches of a run, drawn from its seed."""
    rng = np.random.default_rng(config.seed)
    size = config.get("batch_size")
    if config.model == "cnn":
        # Images without replacement within a batch (the digits rows of RESULTS.md as measured).
        def next_batch():
            rows = rng.choice(len(data.train_targets), size, replace=False)
            return data.train_inputs[rows], data.train_targets[rows]

        return next_batch
    return lambda: datasets.train_batch(data, rng, size, config.seq_len)


def node_bytes_per_step(stats, *, after_warmup: bool) -> float:
    """Inter-node bytes per device of a step; with ``after_warmup``, of QAdam's after warm-up.

    QAdam's program holds both phases; its warm-up is the one float32 all-reduce over the
    node axis alone (the loss mean spans both axes), left out with ``after_warmup``.
    """
    warmup = sum(
        row.bytes_sent
        for row in stats.rows
        if after_warmup and row.kind == "all-reduce" and row.axes == "node" and row.dtype == "f32"
    )
    return stats.bytes_on("node") - warmup


def train(
    name: str, *, model: str, steps: int, seed: int, mesh
) -> tuple[float, float, float, float]:
    """Trains one variant.

    Returns:
      (test accuracy, test loss, mean train loss of the last 20 steps, inter-node bytes per
      device per step; for gradient_allreduce its float32 all-reduce, for QAdam a step
      after warm-up).
    """
    config = Config(model=model, steps=steps, seed=seed)
    data = datasets.load(config.get("dataset"))
    net = models.create(model, num_classes=data.num_classes, seq_len=config.seq_len, seed=seed)
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)

    def loss_fn(params, batch):
        inputs, targets = batch
        logits = nnx.merge(graphdef, params, rest)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    tx = VARIANTS[name](mesh, config)
    state = shard_state(tx.init(params), mesh)
    params = replicate(params, mesh)
    step = make_step(loss_fn, tx, mesh, state)
    next_batch = batches(config, data)
    batch = shard_batch(next_batch(), mesh)
    stats = communication_stats(step, params, state, batch, mesh=mesh)
    losses = []
    for t in range(steps):
        if t:
            batch = shard_batch(next_batch(), mesh)
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))  # one step in flight: see docs/qadam.md

    @jax.jit
    def metrics(params, inputs, targets):
        logits = nnx.merge(graphdef, params, rest)(inputs)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32)), loss

    params = jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), params)
    accuracy, loss = metrics(params, *datasets.test_set(data, config.seq_len))
    return (
        float(accuracy),
        float(loss),
        float(np.mean(losses[-20:])),
        node_bytes_per_step(stats, after_warmup=name.startswith("qadam")),
    )


def report(results: dict[str, list[tuple[float, float, float, float]]], steps: int) -> str:
    """One markdown row per variant: means over seeds, accuracies per seed in brackets."""
    baseline = results["gradient_allreduce"][0][3] if "gradient_allreduce" in results else None
    lines = [
        f"| variant ({steps} steps) | test accuracy (per seed) | test loss "
        "| train loss (last 20) | node bytes / step | vs gradient_allreduce |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        acc, loss, train_loss, node_bytes = (np.mean(c) for c in zip(*runs, strict=True))
        per_seed = ", ".join(f"{100 * r[0]:.2f}" for r in runs)
        ratio = f"{node_bytes / baseline:.3f}x" if baseline else "-"
        lines.append(
            f"| {name} | {100 * acc:.2f}% ({per_seed}) | {loss:.4f} | {train_loss:.4f} "
            f"| {node_bytes / 1e3:.1f} kB | {ratio} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="cnn")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    parser.add_argument(
        "--mesh",
        default=f"{CPU_NODES}x{CPU_DEVICES_PER_NODE}",
        help="nodes x devices per node of the 8 CPU devices, e.g. 4x2 or 8x1",
    )
    args = parser.parse_args(argv)
    nodes, per_node = (int(v) for v in args.mesh.split("x"))
    ensure_cpu_threads(nodes * per_node)
    mesh = jax_bytegrad.make_mesh(nodes, per_node)
    names = [n.strip() for n in args.variants.split(",")]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise ValueError(f"bits_convergence: unknown variants {unknown}; use {list(VARIANTS)}")
    results = {}
    for name in names:
        results[name] = []
        for seed in (int(s) for s in args.seeds.split(",")):
            start = time.perf_counter()
            run = train(name, model=args.model, steps=args.steps, seed=seed, mesh=mesh)
            results[name].append(run)
            acc = results[name][-1][0]
            print(f"{name} seed {seed}: {100 * acc:.2f}% in {time.perf_counter() - start:.0f} s")
    print()
    print(report(results, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
