"""bfloat16 gradients: the bytes each sync sends, and float32 against bfloat16 within the node.

A bfloat16 user's own all-reduce (``jax.lax.psum``, PyTorch DDP) sends bfloat16, so that is
what ByteGrad's savings are measured against here. Within the node ByteGrad can sum a
bfloat16 gradient as float32 (as the library did before) or as bfloat16 (half the bytes); its
codes between nodes are the same either way. Three parts (``--part``, default all):

  bytes  Bytes per device per step within and between nodes, read by ``communication_stats``
         from the compiled train step of one of the examples' models (``examples/models.py``)
         with bfloat16 parameters: on the 2 x 4 CPU mesh (XLA:CPU runs bfloat16 collectives
         in float32, so its figures show float32), and, where JAX's CUDA plugin is installed
         (Python 3.12, ``pip install -e '.[cuda12]'``), for 2 x 4 and 2 x 8 deviceless H100s
         (``sharding.gpu_mesh``), what XLA:GPU runs.
  error  The relative error (L2, against the float64 mean) of one sync of real bfloat16
         gradients of the model at initialization, one global batch split over 2 x L
         devices. ByteGrad's node sums are formed three ways: in float32, rounded once to
         bfloat16 (what XLA:CPU's bfloat16 reduce-scatter gives), and rounded to bfloat16
         after every hop of a ring (what NCCL's ring reduce-scatter of bfloat16 gives: L - 1
         roundings); each is then sent between nodes by the library's own wire
         (``compressed_mean`` on a 2 x 1 mesh, one device per node holding its node's sum).
         The library's own 2 x 4 step gives the first two rows itself, as a check. A
         bfloat16 all-reduce's errors (one rounding; a ring over all the devices) are the
         baseline, and "bf16 floor" is the float64 mean rounded to bfloat16, the error of
         any bfloat16 result.
  train  Test accuracy and loss of the model trained with bfloat16 parameters and Adam from
         the same initialization and batches once per variant (``TRAIN``), on 2 x 4 CPU
         devices: gradient_allreduce in float32 and in bfloat16, and ByteGrad with float32
         and with bfloat16 within the node.

    python benchmarks/bfloat16.py --part bytes                          # CPU; GPU with the plugin
    python benchmarks/bfloat16.py --part error --seeds 0,1,2
    python benchmarks/bfloat16.py --part train --steps 300 --seeds 0,1,2
    python benchmarks/bfloat16.py --part train --model transformer --steps 600 --seeds 0

ByteGrad "float32 in node" casts the gradient to float32 before ``bytegrad()`` and its mean
back to bfloat16 after: the library's own path for a float32 gradient, and what it ran for
bfloat16 ones before their buckets stayed bfloat16. With one process and no ``XLA_FLAGS``,
this script asks XLA for 8 host devices before JAX starts.
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
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import data as datasets  # noqa: E402
import models  # noqa: E402
from bits_convergence import batches  # noqa: E402
from configs import Config  # noqa: E402

import jax_bytegrad  # noqa: E402
from jax_bytegrad.distributed import ensure_cpu_threads  # noqa: E402
from jax_bytegrad.sharding import gpu_mesh  # noqa: E402

AXES = ("node", "local")
BF16 = jnp.bfloat16


# The variants: name -> sync transform(s) to put before Adam ----------------------------------


def _cast(dtype):
    """An optax transformation that casts the updates to ``dtype``."""
    return optax.stateless(
        lambda updates, params=None: jax.tree.map(lambda g: g.astype(dtype), updates)
    )


def _bytegrad_float32(**kwargs):
    """ByteGrad on a float32 copy of the gradient, its mean cast back to bfloat16."""
    return optax.chain(_cast(jnp.float32), jax_bytegrad.bytegrad(**kwargs), _cast(BF16))


TRAIN = {
    "gradient_allreduce float32": lambda: jax_bytegrad.gradient_allreduce(
        hierarchical=True, reduce_dtype=jnp.float32
    ),
    "gradient_allreduce bf16": lambda: jax_bytegrad.gradient_allreduce(hierarchical=True),
    "bytegrad float32 in node": _bytegrad_float32,
    "bytegrad bf16 in node": jax_bytegrad.bytegrad,
}
BYTES = {
    "gradient_allreduce flat, float32": lambda: jax_bytegrad.gradient_allreduce(
        reduce_dtype=jnp.float32
    ),
    "gradient_allreduce flat, bf16": jax_bytegrad.gradient_allreduce,
    **TRAIN,
    "bytegrad 4-bit, float32 in node": lambda: _bytegrad_float32(bits=4),
    "bytegrad 4-bit, bf16 in node": lambda: jax_bytegrad.bytegrad(bits=4),
}
BASELINE = "gradient_allreduce bf16"


# The model, in bfloat16 -------------------------------------------------------------------


def model(name: str, seed: int):
    """``(params, loss_fn, predict, data, config)``: the examples' model ``name`` with
    bfloat16 parameters, computing in bfloat16, its loss in float32."""
    config = Config(model=name, seed=seed)
    data = datasets.load(config.get("dataset"))
    net = models.create(name, num_classes=data.num_classes, seq_len=config.seq_len, seed=seed)
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)
    params = jax.tree.map(lambda x: x.astype(BF16), params)
    rest = jax.tree.map(
        lambda x: x.astype(BF16) if jnp.issubdtype(x.dtype, jnp.floating) else x, rest
    )

    def predict(params, inputs):
        if jnp.issubdtype(inputs.dtype, jnp.floating):
            inputs = inputs.astype(BF16)
        return nnx.merge(graphdef, params, rest)(inputs).astype(jnp.float32)

    def loss_fn(params, batch):
        inputs, targets = batch
        logits = predict(params, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return params, loss_fn, predict, data, config


def _step(loss_fn, sync, mesh, learning_rate: float):
    return jax_bytegrad.data_parallel_step(
        loss_fn, optax.chain(sync, optax.adam(learning_rate)), mesh
    )


# Part 1: bytes ------------------------------------------------------------------------------


def node_and_local_bytes(name: str, model_name: str, mesh) -> tuple[float, float, str]:
    """(bytes per device per step between nodes, within the node, the dtypes of the step's
    large collectives) of variant ``name``'s compiled train step on ``mesh``."""
    params, loss_fn, _, data, config = model(model_name, 0)
    step = _step(loss_fn, BYTES[name](), mesh, config.get("learning_rate"))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches(config, data)())
    stats = step.communication_stats(step.state_shapes(params), batch)["step"]
    # The gradient's collectives, not the loss's mean or the wire's block bounds.
    large = max(row.payload_bytes for row in stats.rows) / 10
    rows = sorted(f"{r.kind} {r.axes} {r.dtype}" for r in stats.rows if r.payload_bytes >= large)
    return stats.bytes_on("node"), stats.bytes_on("local"), "; ".join(rows)


def bytes_report(model_name: str, meshes: dict) -> str:
    lines = []
    for where, mesh in meshes.items():
        rows = {name: node_and_local_bytes(name, model_name, mesh) for name in BYTES}
        base_node, base_local, _ = rows[BASELINE]
        lines += [
            f"\n{where}: bytes per device per step ({model_name}, bfloat16 parameters)\n",
            "| variant | between nodes | vs bf16 all-reduce | within node | vs bf16 all-reduce "
            "| its large collectives |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for name, (node, local, large) in rows.items():
            lines.append(
                f"| {name} | {node / 1e3:.1f} kB | {node / base_node:.3f}x | {local / 1e3:.1f} kB "
                f"| {local / base_local:.3f}x | {large} |"
            )
    return "\n".join(lines)


def meshes_for_bytes() -> dict:
    meshes = {"CPU 2 x 4 (XLA:CPU)": jax_bytegrad.make_mesh(2, 4)}
    try:
        meshes["H100 2 x 4 (deviceless)"] = gpu_mesh(2, 4)
        meshes["H100 2 x 8 (deviceless)"] = gpu_mesh(2, 8)
    except RuntimeError as error:
        print(f"no GPU figures: {error}")
    return meshes


# Part 2: the error of one sync --------------------------------------------------------------


def device_gradients(model_name: str, seed: int, devices: int) -> np.ndarray:
    """(devices, N) float32 array of each device's bfloat16 gradient (flat), its share of one
    global batch of the model at initialization."""
    params, loss_fn, _, data, config = model(model_name, seed)
    inputs, targets = batches(config, data)()
    shards = jax.tree.map(lambda x: x.reshape(devices, -1, *x.shape[1:]), (inputs, targets))
    grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, shards)
    flat = [np.asarray(g, np.float32).reshape(devices, -1) for g in jax.tree.leaves(grads)]
    return np.concatenate(flat, axis=1)


def _bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (to nearest even), as float32."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def ring_sum(g: np.ndarray) -> np.ndarray:
    """The sum over axis 0 as a ring reduce-scatter of bfloat16 forms it: each hop adds its
    own values in float32 and rounds the partial sum to bfloat16 before passing it on."""
    total = g[0]
    for row in g[1:]:
        total = _bf16(total + row)
    return total


def between_nodes(node_sums: np.ndarray) -> np.ndarray:
    """The sum of the nodes' sums (nodes, N) as ByteGrad's wire sends it: ``compressed_mean``
    on a mesh of one device per node, each holding its node's sum."""
    nodes = node_sums.shape[0]
    mesh = jax_bytegrad.make_mesh(nodes, 1)
    fn = jax.jit(
        jax.shard_map(
            lambda x: jax_bytegrad.compressed_mean(x[0], average=False),
            mesh=mesh,
            in_specs=P(AXES),
            out_specs=P(),
        )
    )
    x = jax.device_put(node_sums, jax.NamedSharding(mesh, P(AXES)))
    return np.asarray(fn(x), np.float64)


def library_mean(g: np.ndarray, dtype) -> np.ndarray:
    """ByteGrad's mean of the 2 x 4 devices' gradients ``g`` (8, N) given as ``dtype``: the
    library's own step, within the node in that dtype."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    fn = jax.jit(
        jax.shard_map(
            lambda x: jax_bytegrad.compressed_mean(x[0]), mesh=mesh, in_specs=P(AXES), out_specs=P()
        )
    )
    x = jax.device_put(jnp.asarray(g, dtype), jax.NamedSharding(mesh, P(AXES)))
    return np.asarray(fn(x).astype(jnp.float32), np.float64)


def sync_means(g: np.ndarray, local: int) -> dict[str, np.ndarray]:
    """Each way to average ``g`` (2 L, N) that the error part compares, in float64 (each
    rounded to bfloat16 later, as the gradient's dtype makes every result)."""
    devices = g.shape[0]
    exact = g.astype(np.float64).mean(axis=0)
    nodes = g.reshape(2, local, -1)
    sums = {
        "float32": nodes.sum(axis=1, dtype=np.float32),
        "bf16, one rounding": _bf16(nodes.sum(axis=1, dtype=np.float32)),
        "bf16, ring (L - 1 roundings)": np.stack([ring_sum(n) for n in nodes]),
    }
    out = {
        "exact": exact,
        "bf16 all-reduce, one rounding": _bf16(g.sum(axis=0, dtype=np.float32)) / devices,
        f"bf16 all-reduce, ring over {devices}": ring_sum(g) / devices,
    }
    for name, node_sums in sums.items():
        out[f"bytegrad, node sums in {name}"] = between_nodes(node_sums) / devices
    if local == 4:
        out["library 2 x 4: bytegrad float32 in node"] = library_mean(g, jnp.float32)
        out["library 2 x 4: bytegrad bf16 in node"] = library_mean(g, BF16)
    return out


def sync_errors(g: np.ndarray, local: int) -> dict[str, tuple[float, float]]:
    """Per way to average ``g``: its relative L2 error against the float64 mean, and its
    relative L2 distance from ByteGrad's mean of float32 node sums (NaN for the others)."""
    means = sync_means(g, local)
    exact = means.pop("exact")
    reference = _bf16(means["bytegrad, node sums in float32"])
    norm = np.linalg.norm(exact)
    out = {
        "bf16 floor (the exact mean in bf16)": (np.linalg.norm(_bf16(exact) - exact) / norm, np.nan)
    }
    for name, mean in means.items():
        mean = _bf16(mean)
        apart = np.linalg.norm(mean - reference) / norm if "bytegrad" in name else np.nan
        out[name] = (float(np.linalg.norm(mean - exact) / norm), float(apart))
    return out


def error_report(model_name: str, seeds: list[int]) -> str:
    lines = []
    for local in (4, 8):
        runs = [sync_errors(device_gradients(model_name, s, 2 * local), local) for s in seeds]
        lines += [
            f"\n2 x {local}: one sync's mean ({model_name}, bfloat16 gradients at "
            f"initialization, seeds {', '.join(map(str, seeds))}), relative L2\n",
            "| mean | error (per seed) | from float32 node sums' bytegrad mean |",
            "|---|---|---|",
        ]
        for name in runs[0]:
            errors, apart = (np.array(c) for c in zip(*(run[name] for run in runs), strict=True))
            per_seed = ", ".join(f"{v:.3e}" for v in errors)
            far = "-" if np.isnan(apart).all() else f"{np.mean(apart):.2e}"
            lines.append(f"| {name} | {np.mean(errors):.3e} ({per_seed}) | {far} |")
    return "\n".join(lines)


# Part 3: training ---------------------------------------------------------------------------


def train(name: str, model_name: str, steps: int, seed: int, mesh) -> tuple[float, ...]:
    """(test accuracy, test loss, mean train loss of the last 20 steps) of variant ``name``."""
    params, loss_fn, predict, data, config = model(model_name, seed)
    step = _step(loss_fn, TRAIN[name](), mesh, config.get("learning_rate"))
    next_batch = batches(config, data)
    state, losses = step.init(params), []
    for _ in range(steps):
        state, metrics = step(state, next_batch())
        losses.append(float(metrics["loss"]))
    step.close()
    params = jax.tree.map(np.asarray, jax.device_get(step.params(state)))

    @jax.jit
    def evaluate(params, inputs, targets):
        logits = predict(params, inputs)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32)), loss

    accuracy, loss = evaluate(params, *datasets.test_set(data, config.seq_len))
    return float(accuracy), float(loss), float(np.mean(losses[-20:]))


def train_report(model_name: str, steps: int, seeds: list[int]) -> str:
    mesh = jax_bytegrad.make_mesh(2, 4)
    lines = [
        f"| variant ({model_name}, {steps} steps) | test accuracy (per seed) | test loss "
        "(per seed) | train loss (last 20) |",
        "|---|---|---|---|",
    ]
    for name in TRAIN:
        runs = []
        for seed in seeds:
            start = time.perf_counter()
            runs.append(train(name, model_name, steps, seed, mesh))
            print(f"{name} seed {seed}: {runs[-1]} in {time.perf_counter() - start:.0f} s")
        acc, loss, train_loss = (np.mean(c) for c in zip(*runs, strict=True))
        accs = ", ".join(f"{100 * r[0]:.2f}" for r in runs)
        losses = ", ".join(f"{r[1]:.4f}" for r in runs)
        lines.append(
            f"| {name} | {100 * acc:.2f}% ({accs}) | {loss:.4f} ({losses}) | {train_loss:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "bytes", "error", "train"), default="all")
    parser.add_argument("--model", choices=("cnn", "transformer"), default="cnn")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1,2")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    ensure_cpu_threads(8)
    print(f"JAX {jax.__version__}, Python {sys.version.split()[0]}")
    if args.part in ("all", "bytes"):
        print(bytes_report(args.model, meshes_for_bytes()))
    if args.part in ("all", "error"):
        print(error_report(args.model, seeds))
    if args.part in ("all", "train"):
        print(train_report(args.model, args.steps, seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
