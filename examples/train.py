"""Data-parallel training of a Flax NNX model with jax_bytegrad, over (simulated) nodes.

On a laptop, the default run simulates 2 nodes x 4 devices with 8 CPU devices, trains a small
CNN on scikit-learn's digits with every algorithm, and prints test accuracy, the bytes each
device sends between nodes per step, and steps per second:

    python examples/train.py                                # all algorithms (--compare)
    python examples/train.py --algorithm bytegrad --steps 500
    python examples/train.py --model transformer --compare  # char LM on Python's own source

An algorithm is one entry of ``ALGORITHMS``: a function from the config, the loss function and
the mesh to a ``TrainStep``. ``train_and_evaluate(config)`` runs one of them and returns a
``Result``; ``compare(config)`` runs them all and writes a loss plot and a markdown table.
"""

import argparse
import dataclasses
import functools
import os
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad.decentralized import (
    consensus_params,
    decentralized_step,
    low_precision_decentralized_step,
)
from jax_bytegrad.distributed import ensure_cpu_threads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data as datasets  # noqa: E402
import models  # noqa: E402

# Simulated layout on CPU: the smallest one where both the "node" and the "local" hop exist.
CPU_NODES, CPU_DEVICES_PER_NODE = 2, 4

MODEL_DEFAULTS = {
    "cnn": {"dataset": "digits", "steps": 300, "batch_size": 128, "learning_rate": 1e-3},
    "transformer": {"dataset": "pysource", "steps": 300, "batch_size": 64, "learning_rate": 2e-3},
}


@dataclasses.dataclass(frozen=True)
class Config:
    """What to train, how, and on which mesh.

    Attributes:
      algorithm: a key of ``ALGORITHMS``.
      model: ``"cnn"`` (digits) or ``"transformer"`` (character LM on Python source).
      steps: training steps; None for the model's default.
      batch_size: global batch, a multiple of the device count; None for the default.
      learning_rate: Adam's learning rate; None for the model's default.
      seq_len: characters per transformer example.
      nodes: mesh rows ("node" axis); None: processes, or 2 simulated nodes on CPU.
      devices_per_node: mesh columns ("local" axis); None: devices per process, or 4 on CPU.
      qadam_warmup_fraction: share of the steps QAdam runs as float32 Adam.
      qadam_eps: QAdam's eps (see ``_qadam``).
      seed: seeds the parameters and the batches.
      progress: draw a progress bar (process 0 only).
    """

    algorithm: str = "bytegrad"
    model: str = "cnn"
    steps: int | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    seq_len: int = 64
    nodes: int | None = None
    devices_per_node: int | None = None
    qadam_warmup_fraction: float = 0.2
    qadam_eps: float = 1e-5
    seed: int = 0
    progress: bool = True

    def get(self, name: str):
        """The field, or the model's default where it is None."""
        value = getattr(self, name, None)
        return MODEL_DEFAULTS[self.model][name] if value is None else value


class TrainStep(NamedTuple):
    """An algorithm, ready to run.

    Attributes:
      init: ``params -> state``: everything the step carries (parameters included).
      step: ``(state, batch) -> (state, loss, aux)`` over the mesh, with ``.lower`` (for
        ``communication_stats``). ``loss`` is the mean over devices, or one entry per device.
      params: ``state -> params``: the model to evaluate, replicated.
      warmup_steps: leading steps that run a float32 all-reduce instead of the compressed
        exchange (QAdam). Both phases sit in one compiled program, so their bytes are told
        apart by subtracting gradient_allreduce's.
    """

    init: Callable[[Any], Any]
    step: Callable[..., Any]
    params: Callable[[Any], Any]
    warmup_steps: int = 0


LossFn = Callable[[Any, Any], tuple[jax.Array, dict]]
ALGORITHMS: dict[str, Callable[[Config, LossFn, jax.sharding.Mesh], TrainStep]] = {}


def register(name: str):
    """Adds an algorithm builder ``(config, loss_fn, mesh) -> TrainStep`` under ``name``."""

    def add(build):
        ALGORITHMS[name] = build
        return build

    return add


def _optax(tx: optax.GradientTransformation, loss_fn, mesh, warmup_steps: int = 0) -> TrainStep:
    """Replicated parameters, and an optimizer that synchronizes the gradients itself."""
    dp_step = jax_bytegrad.data_parallel_step(loss_fn, tx, mesh, has_aux=True)
    init_opt = jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        params, opt_state, loss, aux = dp_step(*state, batch)
        return (params, opt_state), loss, aux

    return TrainStep(lambda p: (p, init_opt(p)), step, lambda state: state[0], warmup_steps)


def _decentralized(train) -> TrainStep:
    """Per-device parameters (stacked on a device axis), evaluated at their mean."""
    return TrainStep(train.init, train.step, lambda state: consensus_params(state.params))


@register("gradient_allreduce")
def _gradient_allreduce(config: Config, loss_fn, mesh) -> TrainStep:
    # Hierarchical: each device sends 1/L of the gradient between nodes, the strongest
    # float32 baseline. Bagua's default (False) would count 4x more inter-node bytes here.
    sync = jax_bytegrad.gradient_allreduce(hierarchical=True)
    return _optax(optax.chain(sync, optax.adam(config.get("learning_rate"))), loss_fn, mesh)


@register("bytegrad")
def _bytegrad(config: Config, loss_fn, mesh) -> TrainStep:
    sync = jax_bytegrad.bytegrad()
    return _optax(optax.chain(sync, optax.adam(config.get("learning_rate"))), loss_fn, mesh)


@register("qadam")
def _qadam(config: Config, loss_fn, mesh) -> TrainStep:
    warmup = max(1, int(config.qadam_warmup_fraction * config.get("steps")))
    # eps 1e-5, not Adam's 1e-8: after warm-up the second moment is frozen, and weights that
    # got almost no gradient in the 60 warm-up steps keep it near zero; their first real
    # gradient is then divided by about eps (the CNN diverges with 1e-8 or 1e-6, even on one
    # device where nothing is quantized).
    tx = jax_bytegrad.qadam(config.get("learning_rate"), warmup_steps=warmup, eps=config.qadam_eps)
    return _optax(tx, loss_fn, mesh, warmup)


@register("decentralized")
def _decentralized_sgd(config: Config, loss_fn, mesh) -> TrainStep:
    tx = optax.adam(config.get("learning_rate"))
    return _decentralized(decentralized_step(loss_fn, tx, mesh, has_aux=True))


@register("low_precision_decentralized")
def _low_precision_decentralized(config: Config, loss_fn, mesh) -> TrainStep:
    tx = optax.adam(config.get("learning_rate"))
    train = low_precision_decentralized_step(loss_fn, tx, mesh, has_aux=True)
    return _decentralized(train)


@dataclasses.dataclass
class Result:
    """What one run measured.

    Attributes:
      algorithm: the algorithm's name.
      model: the model's name.
      losses: training loss of every step (mean over devices).
      test_loss: mean cross-entropy on the held-out set, in nats.
      test_accuracy: accuracy on the held-out set (next-character accuracy for text).
      node_bytes: bytes each device sends between nodes per step (after any warm-up).
      node_bytes_average: the same, averaged over the run (QAdam's warm-up included).
      baseline_node_bytes: gradient_allreduce's, on the same model and mesh.
      steps_per_second: after the first (compiling) step.
      num_params: model size.
      comm_table: ``communication_stats`` of the compiled step, printable.
    """

    algorithm: str
    model: str
    losses: list[float]
    test_loss: float
    test_accuracy: float
    node_bytes: float
    node_bytes_average: float
    baseline_node_bytes: float
    steps_per_second: float
    num_params: int
    comm_table: str

    @property
    def bytes_ratio(self) -> float:
        """Inter-node bytes per step against gradient_allreduce's."""
        return self.node_bytes / self.baseline_node_bytes


def is_main_process() -> bool:
    return jax.process_index() == 0


def log(*args, **kwargs) -> None:
    """print, on process 0 only."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


class Progress:
    """A plain-stdout progress bar with the loss; a few lines instead when not on a terminal."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label = total, label
        self.enabled = enabled and is_main_process()
        self.tty = sys.stdout.isatty()
        self.next_line = 0

    def update(self, done: int, loss: float) -> None:
        if not self.enabled:
            return
        if self.tty:
            filled = int(30 * done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            print(f"\r{self.label:>18} [{bar}] {done}/{self.total} loss {loss:.4f}", end="")
            sys.stdout.flush()
        elif done >= self.next_line or done == self.total:
            print(f"{self.label:>18} step {done:>5}/{self.total} loss {loss:.4f}", flush=True)
            self.next_line = done + max(1, self.total // 4)

    def close(self) -> None:
        if self.enabled and self.tty:
            print()


def resolve_mesh(config: Config) -> jax.sharding.Mesh:
    """The ("node", "local") mesh: processes x their devices, or 2 x 4 simulated on CPU."""
    nodes, per_node = config.nodes, config.devices_per_node
    if jax.process_count() == 1 and nodes is None and per_node is None:
        if jax.default_backend() == "cpu":
            if jax.device_count() < CPU_NODES * CPU_DEVICES_PER_NODE:
                return jax_bytegrad.make_mesh()  # one process, not simulating: one node
            nodes, per_node = CPU_NODES, CPU_DEVICES_PER_NODE
        elif jax.device_count() % 2 == 0:
            nodes = 2  # one host of GPUs: split it in two so the "node" hop exists
    return jax_bytegrad.make_mesh(nodes, per_node)


def make_loss_fn(graphdef, rest) -> LossFn:
    """``loss_fn(params, (inputs, targets)) -> (loss, {"accuracy": ...})`` for either model."""

    def loss_fn(params, batch):
        inputs, targets = batch
        logits = nnx.merge(graphdef, params, rest)(inputs)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        accuracy = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32).mean()
        return loss, {"accuracy": accuracy}

    return loss_fn


def _process_rows(array: np.ndarray) -> np.ndarray:
    """This process's share of a global batch, in process order (what shard_batch expects)."""
    per_process = len(array) // jax.process_count()
    start = jax.process_index() * per_process
    return array[start : start + per_process]


def evaluate(graphdef, rest, params, inputs, targets, mesh) -> tuple[float, float]:
    """Mean test loss and accuracy, the test set split over all devices (padding masked)."""
    devices = mesh.size
    n = len(inputs)
    pad = -n % devices
    weights = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
    inputs = np.concatenate([inputs, np.zeros((pad, *inputs.shape[1:]), inputs.dtype)])
    targets = np.concatenate([targets, np.zeros((pad, *targets.shape[1:]), targets.dtype)])
    batch = jax_bytegrad.shard_batch(
        tuple(_process_rows(x) for x in (inputs, targets, weights)), mesh
    )

    @jax.jit
    def metrics(params, batch):
        x, y, w = batch
        logits = nnx.merge(graphdef, params, rest)(x)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        correct = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
        w = w.reshape(w.shape + (1,) * (losses.ndim - 1))
        w = jnp.broadcast_to(w, losses.shape)
        return jnp.sum(losses * w) / jnp.sum(w), jnp.sum(correct * w) / jnp.sum(w)

    loss, accuracy = metrics(params, batch)
    return float(loss), float(accuracy)


_mean = jax.jit(jnp.mean)


def _node_stats(train: TrainStep, state, batch, mesh):
    """Communication of the compiled step (``step.lower`` compiles; nothing runs)."""
    return jax_bytegrad.communication_stats(train.step.lower(state, batch).compile(), mesh=mesh)


def _train_loop(step, state, batch, next_batch, *, steps: int, name: str, progress: bool):
    """Runs ``steps`` steps from ``batch``; returns the state, each loss, the seconds after step 1.

    Reading the loss every step keeps one step in flight: queueing many steps of collectives
    on a few CPU cores can stall XLA:CPU's rendezvous (see docs/qadam.md).
    """
    bar = Progress(steps, name, progress)
    losses, start = [], None
    for i in range(steps):
        state, loss, _ = step(state, batch)
        losses.append(float(loss if loss.ndim == 0 else _mean(loss)))
        if i == 0:
            start = time.perf_counter()  # time from the second step: the first compiles
        if (i + 1) % 10 == 0 or i == steps - 1:
            bar.update(i + 1, losses[-1])
        if i < steps - 1:
            batch = next_batch()
    elapsed = time.perf_counter() - start
    bar.close()
    return state, losses, elapsed


ASYNC = "async"


def _train_async(config, data, graphdef, rest, host_params, loss_fn, mesh, rng, baseline) -> Result:
    """Bagua's async model averaging: local steps, the model averaged across processes.

    Each process trains on its own rows with gradients averaged over its own devices; a
    background thread averages the model over processes every 200 ms. Its traffic between
    nodes is that averaging (a float32 all-reduce of the model per round), counted here from
    the rounds that actually ran, spread over the steps.
    """
    processes = jax.process_count()
    if processes == 1:
        raise ValueError(
            "train: async model averaging averages the model across processes; run it with "
            "python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 "
            "examples/multihost.py --algorithm async"
        )
    steps, batch_size = config.get("steps"), config.get("batch_size")
    tx = optax.adam(config.get("learning_rate"))
    avg = jax_bytegrad.async_model_average(loss_fn, tx, mesh, sync_interval_ms=200, has_aux=True)

    def step(state, batch):
        params, opt_state, loss, aux = avg.step(*state, batch)
        return (params, opt_state), loss, aux

    def next_rows():
        batch = datasets.train_batch(data, rng, batch_size, config.seq_len)
        return tuple(_process_rows(x) for x in batch)

    (params, _), losses, elapsed = _train_loop(
        step,
        avg.init(host_params),
        next_rows(),
        next_rows,
        steps=steps,
        name=ASYNC,
        progress=config.progress,
    )
    avg.abort()
    params = avg.average_now(params)  # one last exact average: the model to evaluate
    rounds = avg.round_stats.rounds
    num_params = models.count_params(host_params)
    per_round = 2 * (processes - 1) / processes * 4 * num_params
    node_bytes = rounds * per_round / steps
    test_inputs, test_targets = datasets.test_set(data, config.seq_len)
    params = jax_bytegrad.replicate(jax.device_get(params), mesh)
    test_loss, test_accuracy = evaluate(graphdef, rest, params, test_inputs, test_targets, mesh)
    return Result(
        algorithm=ASYNC,
        model=config.model,
        losses=losses,
        test_loss=test_loss,
        test_accuracy=test_accuracy,
        node_bytes=node_bytes,
        node_bytes_average=node_bytes,
        baseline_node_bytes=baseline,
        steps_per_second=(steps - 1) / elapsed if steps > 1 else float("nan"),
        num_params=num_params,
        comm_table=f"async: {rounds} background averaging rounds over {processes} processes, "
        f"{per_round / 2**20:.2f} MiB sent per process per round",
    )


def train_and_evaluate(config: Config, *, baseline_node_bytes: float | None = None) -> Result:
    """Trains ``config.model`` with ``config.algorithm`` and evaluates it on held-out data.

    Args:
      config: the run.
      baseline_node_bytes: gradient_allreduce's inter-node bytes per step on the same model
        and mesh, if already known; otherwise its step is compiled (not run) to measure them.

    Returns:
      A ``Result``. Every process returns the same one; only process 0 prints.

    Raises:
      ValueError: for an unknown algorithm or model, or a batch that does not split over
        the devices.
    """
    if config.algorithm not in (*ALGORITHMS, ASYNC):
        raise ValueError(
            f"train: unknown algorithm {config.algorithm!r}; use one of "
            f"{sorted([*ALGORITHMS, ASYNC])}"
        )
    if config.model not in MODEL_DEFAULTS:
        raise ValueError(
            f"train: unknown model {config.model!r}; use one of {list(MODEL_DEFAULTS)}"
        )
    mesh = resolve_mesh(config)
    steps, batch_size = config.get("steps"), config.get("batch_size")
    if batch_size % mesh.size:
        raise ValueError(
            f"train: batch_size={batch_size} does not split over the {mesh.size} devices of a "
            f"{dict(mesh.shape)} mesh; pass a multiple of {mesh.size}"
        )
    data = datasets.load(config.get("dataset"))
    model = models.create(
        config.model, num_classes=data.num_classes, seq_len=config.seq_len, seed=config.seed
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    num_params = models.count_params(params)
    host_params = jax.device_get(params)
    params = jax_bytegrad.replicate(host_params, mesh)
    loss_fn = make_loss_fn(graphdef, rest)

    def init_state(build):
        train = build(config, loss_fn, mesh)
        return train, train.init(params)

    rng = np.random.default_rng(config.seed)

    def next_batch():
        batch = datasets.train_batch(data, rng, batch_size, config.seq_len)
        return jax_bytegrad.shard_batch(tuple(_process_rows(x) for x in batch), mesh)

    batch = next_batch()
    if config.algorithm == ASYNC:
        if baseline_node_bytes is None:
            base, base_state = init_state(ALGORITHMS["gradient_allreduce"])
            baseline_node_bytes = _node_stats(base, base_state, batch, mesh).bytes_on("node")
        return _train_async(
            config, data, graphdef, rest, host_params, loss_fn, mesh, rng, baseline_node_bytes
        )
    train, state = init_state(ALGORITHMS[config.algorithm])
    stats = _node_stats(train, state, batch, mesh)
    total_node_bytes = stats.bytes_on("node")
    if baseline_node_bytes is None:
        if config.algorithm == "gradient_allreduce":
            baseline_node_bytes = total_node_bytes
        else:
            base, base_state = init_state(ALGORITHMS["gradient_allreduce"])
            base_stats = _node_stats(base, base_state, batch, mesh)
            baseline_node_bytes = base_stats.bytes_on("node")
    node_bytes, average = total_node_bytes, total_node_bytes
    if train.warmup_steps:
        node_bytes = total_node_bytes - baseline_node_bytes
        warm = min(train.warmup_steps, steps)
        average = (warm * baseline_node_bytes + (steps - warm) * node_bytes) / steps

    state, losses, elapsed = _train_loop(
        train.step,
        state,
        batch,
        next_batch,
        steps=steps,
        name=config.algorithm,
        progress=config.progress,
    )

    test_inputs, test_targets = datasets.test_set(data, config.seq_len)
    params = train.params(state)
    test_loss, test_accuracy = evaluate(graphdef, rest, params, test_inputs, test_targets, mesh)
    return Result(
        algorithm=config.algorithm,
        model=config.model,
        losses=losses,
        test_loss=test_loss,
        test_accuracy=test_accuracy,
        node_bytes=node_bytes,
        node_bytes_average=average,
        baseline_node_bytes=baseline_node_bytes,
        steps_per_second=(steps - 1) / elapsed if steps > 1 else float("nan"),
        num_params=num_params,
        comm_table=str(stats),
    )


def compare(config: Config, algorithms=None) -> list[Result]:
    """Runs every algorithm (gradient_allreduce first, as the baseline) on the same data."""
    default = [*ALGORITHMS, ASYNC] if jax.process_count() > 1 else list(ALGORITHMS)
    names = list(algorithms or default)
    names.sort(key=lambda name: name != "gradient_allreduce")
    results, baseline = [], None
    for name in names:
        result = train_and_evaluate(
            dataclasses.replace(config, algorithm=name), baseline_node_bytes=baseline
        )
        baseline = result.baseline_node_bytes
        results.append(result)
    return results


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def results_table(results: list[Result]) -> str:
    """A markdown table of the results: quality, inter-node bytes, and speed."""
    rows = [
        "| algorithm | test accuracy | test loss | final train loss | inter-node bytes/step "
        "| vs gradient_allreduce | run average | steps/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        final = float(np.mean(r.losses[-10:]))
        rows.append(
            f"| {r.algorithm} | {r.test_accuracy:.2%} | {r.test_loss:.4f} | {final:.4f} "
            f"| {_kib(r.node_bytes)} | {r.bytes_ratio:.3f}x ({1 - r.bytes_ratio:.1%} saved) "
            f"| {r.node_bytes_average / r.baseline_node_bytes:.3f}x | {r.steps_per_second:.1f} |"
        )
    return "\n".join(rows)


def describe(config: Config, mesh: jax.sharding.Mesh, num_params: int | None = None) -> str:
    size = "" if num_params is None else f", {num_params:,} parameters"
    return (
        f"{config.model} on {config.get('dataset')}{size}; mesh {dict(mesh.shape)} on "
        f"{jax.process_count()} process(es), {jax.default_backend()}; "
        f"{config.get('steps')} steps, global batch {config.get('batch_size')}"
    )


def plot_losses(results: list[Result], path: str, title: str) -> None:
    """Writes the training-loss curves (smoothed over 10 steps) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        losses = np.asarray(r.losses)
        width = min(10, len(losses))
        smooth = np.convolve(losses, np.ones(width) / width, mode="valid")
        ax.plot(np.arange(width, len(losses) + 1), smooth, label=r.algorithm)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_yscale("log")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--algorithm",
        choices=sorted([*ALGORITHMS, ASYNC]),
        default=None,
        help="train with one algorithm; without it, --compare runs them all",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run every algorithm, write a loss plot and a table to --out-dir",
    )
    parser.add_argument("--model", choices=sorted(MODEL_DEFAULTS), default="cnn")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument(
        "--nodes",
        type=int,
        default=None,
        help=f"mesh rows (default: processes, or {CPU_NODES} simulated on CPU)",
    )
    parser.add_argument(
        "--devices-per-node",
        type=int,
        default=None,
        help=f"mesh columns (default: devices per process, or {CPU_DEVICES_PER_NODE} on CPU)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="runs", help="where --compare writes (default runs/)")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)  # fmt: skip


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(
        algorithm=args.algorithm or "bytegrad",
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        nodes=args.nodes,
        devices_per_node=args.devices_per_node,
        seed=args.seed,
        progress=not args.no_progress,
    )


def simulate_cpu_devices(args: argparse.Namespace) -> None:
    """Asks XLA for one CPU device per simulated device; must run before JAX starts."""
    if "JAX_BYTEGRAD_NUM_PROCESSES" in os.environ:
        return  # launched as one of several processes: initialize() sets the devices
    count = (args.nodes or CPU_NODES) * (args.devices_per_node or CPU_DEVICES_PER_NODE)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    ensure_cpu_threads(count)


def run(args: argparse.Namespace) -> list[Result]:
    """Runs what the flags ask and prints the results table (process 0 only)."""
    config = config_from_args(args)
    mesh = resolve_mesh(config)
    log(describe(config, mesh))
    if args.compare or args.algorithm is None:
        results = compare(config)
    else:
        results = [train_and_evaluate(config)]
        log(results[0].comm_table)
    title = describe(config, mesh, results[0].num_params)
    table = results_table(results)
    log(f"\n{title}\n\n{table}")
    if (args.compare or args.algorithm is None) and is_main_process():
        os.makedirs(args.out_dir, exist_ok=True)
        png = os.path.join(args.out_dir, f"{config.model}_loss.png")
        md = os.path.join(args.out_dir, f"{config.model}_results.md")
        plot_losses(results, png, title)
        with open(md, "w") as f:
            f.write(f"{title}\n\n{table}\n\n![loss curves]({os.path.basename(png)})\n")
        log(f"\nwrote {png} and {md}")
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    simulate_cpu_devices(args)
    run(args)


if __name__ == "__main__":
    main()
