"""Data-parallel training of a Flax NNX model with jax_bytegrad, over (simulated) nodes.

On a laptop, the default run simulates 2 nodes x 4 devices with 8 CPU devices, trains a small
CNN on scikit-learn's digits with every algorithm, and prints test accuracy, the bytes each
device sends between nodes per step, and steps per second:

    python examples/train.py                                # all algorithms (--compare)
    python examples/train.py --algorithm bytegrad --steps 500
    python examples/train.py --model transformer --compare  # char LM on Python's own source

Every algorithm runs through the one entry point, ``jax_bytegrad.Strategy``, with the same
loop; ``configs.ALGORITHMS`` holds each one's arguments. ``train_and_evaluate(config)`` runs
one and returns a ``report.Result``; ``compare(config)`` runs them all; ``report`` prints
the table and draws the loss plot.
"""

import argparse
import dataclasses
import itertools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_bytegrad
from jax_bytegrad.checkpoint import Checkpointer
from jax_bytegrad.distributed import ensure_cpu_threads, report_progress
from jax_bytegrad.sharding import shard_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cached_data  # noqa: E402
import data as datasets  # noqa: E402
import models  # noqa: E402
from configs import (  # noqa: E402
    ALGORITHMS,
    BASELINE,
    CPU_DEVICES_PER_NODE,
    CPU_NODES,
    MODEL_DEFAULTS,
    RUNNABLE,
    Config,
    qadam_warning,
)
from report import Progress, Result, is_main_process, log, plot_losses, results_table  # noqa: E402

LossFn = Callable[[Any, Any], tuple[jax.Array, dict]]

__all__ = ["ALGORITHMS", "Config", "Result", "compare", "plot_losses", "results_table"]


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
    """``loss_fn(params, (inputs, targets[, mask])) -> (loss, {"accuracy": ...})``.

    Batches of variable-length sequences (``--cache``) carry a mask of the real tokens.
    """

    def loss_fn(params, batch):
        inputs, targets, *mask = batch
        logits = nnx.merge(graphdef, params, rest)(inputs)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
        if not mask:
            return losses.mean(), {"accuracy": hits.mean()}
        weight = mask[0] / jnp.maximum(mask[0].sum(), 1.0)
        return (losses * weight).sum(), {"accuracy": (hits * weight).sum()}

    return loss_fn


def window_batches(config: Config, data, batch_size: int) -> Callable[[], tuple]:
    """``next_batch``: this process's rows of the next global batch of the model's dataset
    (every process draws the same one)."""
    rng = np.random.default_rng(config.seed)

    def next_batch():
        batch = datasets.train_batch(data, rng, batch_size, config.seq_len)
        return tuple(_process_rows(x) for x in batch)

    return next_batch


def cached_batches(config: Config, mesh, batch_size: int) -> Callable[[], tuple]:
    """``next_batch`` over the standard library's functions, through ``config.cache``."""
    sources = cached_data.function_sources(config.seq_len)
    lengths = np.array([len(s) for s in sources])
    dataset = cached_data.open_dataset(config.cache, sources)

    def rows():  # this process's rows of each step's global batch, epoch after epoch
        for epoch in itertools.count():
            yield from cached_data.step_batches(
                dataset, lengths, mesh, batch_size=batch_size // mesh.size,
                load_balance=config.load_balance, seed=config.seed, epoch=epoch,
                max_len=config.seq_len,
            )  # fmt: skip

    stream = rows()
    return lambda: next(stream)


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
    batch = shard_batch(tuple(_process_rows(x) for x in (inputs, targets, weights)), mesh)

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


def make_strategy(config: Config, name: str, mesh) -> tuple[jax_bytegrad.Strategy, Any]:
    """The strategy of algorithm ``name`` with the registry's arguments, and its optimizer."""
    entry = RUNNABLE[name]
    shard = {} if config.shard is None else {"shard": config.shard}
    strategy = jax_bytegrad.Strategy(name, mesh=mesh, **entry.kwargs(config), **shard)
    optimizer = optax.adam(config.get("learning_rate")) if entry.takes_optimizer else None
    return strategy, optimizer


def build_step(config: Config, name: str, loss_fn, mesh, strategy=None) -> jax_bytegrad.TrainStep:
    """The train step of algorithm ``name`` (of ``strategy``, if given: a tuned one)."""
    default, optimizer = make_strategy(config, name, mesh)
    return (strategy or default).train_step(loss_fn, optimizer, has_aux=True)


def tune(config: Config, loss_fn, mesh, params, batches) -> jax_bytegrad.AutotuneResult | None:
    """The algorithm's strategy tuned on ``batches`` (or read from the cache in
    ``config.out_dir``), its trials written there; None for async, which has nothing to tune."""
    if config.algorithm == "async":
        return None
    strategy, optimizer = make_strategy(config, config.algorithm, mesh)
    cache = os.path.join(config.out_dir, "autotune.json")
    result = jax_bytegrad.autotune(
        strategy,
        loss_fn,
        optimizer,
        params,
        batches,
        has_aux=True,
        cache=cache,
        verbose=config.progress,
    )
    if result.trials and is_main_process():
        os.makedirs(config.out_dir, exist_ok=True)
        path = os.path.join(config.out_dir, f"autotune_{config.model}_{config.algorithm}.md")
        with open(path, "w") as f:
            f.write(f"{result.strategy!r}\n\n{result.table()}\n")
        log(f"{config.algorithm}: autotune trials in {path}")
    how = f"read {cache}" if result.from_cache else f"took {result.tuning_s:.1f} s"
    log(f"{config.algorithm}: autotune {how}; {result.strategy!r}")
    return result


def node_bytes(phases: dict, counts: dict[str, int]) -> tuple[float, float]:
    """Inter-node bytes per step after any warm-up, and averaged over the whole run.

    ``phases`` and ``counts`` are a train step's ``communication_stats`` and ``phase_counts``.
    """
    sent = {name: stats.bytes_on("node") * counts[name] for name, stats in phases.items()}
    steps = counts["step"] if "step" in counts else sum(counts.values())
    warm = counts.get("warmup", 0)
    after = sum(b for name, b in sent.items() if name != "warmup")
    return after / max(1, steps - warm), sum(sent.values()) / max(1, steps)


def baseline_node_bytes(config: Config, loss_fn, mesh, params, batch) -> float:
    """gradient_allreduce's inter-node bytes per step: its step is compiled, not run."""
    with build_step(config, BASELINE, loss_fn, mesh) as step:
        return step.communication_stats(step.init(params), batch)["step"].bytes_on("node")


def _train_loop(step, state, batch, next_batch, *, first: int, steps: int, name: str, progress,
                checkpointer=None):  # fmt: skip
    """Runs steps ``first .. steps - 1`` from ``batch``; returns the state, the losses, and the
    seconds after the first of them (which compiles)."""
    bar = Progress(steps, name, progress)
    losses, start = [], None
    for i in range(first, steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        report_progress(i + 1)  # for the launcher's --progress-timeout
        if checkpointer is not None:
            checkpointer.save(i + 1, state)  # every --checkpoint-every steps, in the background
        if i == first:
            start = time.perf_counter()
        if (i + 1) % 10 == 0 or i == steps - 1:
            bar.update(i + 1, losses[-1])
        if i < steps - 1:
            batch = next_batch()
    elapsed = time.perf_counter() - start
    bar.close()
    return state, losses, elapsed


def _resume(config: Config, state, mesh):
    """``(steps done, state, checkpointer)`` from ``config.checkpoint_dir``, or
    ``(0, state, None)`` without one."""
    if config.checkpoint_dir is None:
        return 0, state, None
    if config.algorithm not in ("gradient_allreduce", "bytegrad", "qadam"):
        raise ValueError(
            f"train: --checkpoint-dir saves replicated state; {config.algorithm!r} keeps a model "
            "per device or process (see docs/elastic.md for its rule)"
        )
    directory = os.path.join(config.checkpoint_dir, config.algorithm)
    checkpointer = Checkpointer(directory, every=config.checkpoint_every)
    # Onto the state's own shardings: with --shard, split leaves stay split.
    done, state = checkpointer.restore_or_init(lambda: state, state)
    if done:
        log(f"{config.algorithm}: resumed from the checkpoint of step {done} in {directory}")
    return done, state, checkpointer


def train_and_evaluate(config: Config, *, baseline: float | None = None) -> Result:
    """Trains ``config.model`` with ``config.algorithm`` and evaluates it on held-out data.

    Args:
      config: the run.
      baseline: gradient_allreduce's inter-node bytes per step on the same model and mesh,
        if already known; otherwise its step is compiled (not run) to measure them.

    Returns:
      A ``Result``. Every process returns the same one; only process 0 prints.

    Raises:
      ValueError: for an unknown algorithm or model, too few processes for the algorithm,
        or a batch that does not split over the devices.
    """
    if config.algorithm not in RUNNABLE:
        raise ValueError(
            f"train: unknown algorithm {config.algorithm!r}; use one of {list(RUNNABLE)}"
        )
    if config.model not in MODEL_DEFAULTS:
        raise ValueError(
            f"train: unknown model {config.model!r}; use one of {list(MODEL_DEFAULTS)}"
        )
    needed, why = RUNNABLE[config.algorithm].min_processes
    if jax.process_count() < needed:
        raise ValueError(
            f"train: {why}; run it with python -m jax_bytegrad.launch --nproc {needed} "
            f"--devices-per-proc {CPU_DEVICES_PER_NODE} examples/multihost.py "
            f"--algorithm {config.algorithm}"
        )
    mesh = resolve_mesh(config)
    if config.algorithm == "qadam" and qadam_warning(config):
        log(qadam_warning(config))
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
    params = jax.device_get(params)
    loss_fn = make_loss_fn(graphdef, rest)
    if config.cache is not None and config.model != "transformer":
        raise ValueError("train: --cache trains the transformer; pass --model transformer")

    def batch_source():
        if config.cache is None:
            return window_batches(config, data, batch_size)
        return cached_batches(config, mesh, batch_size)

    next_batch = batch_source()
    first = next_batch()
    if baseline is None:
        baseline = baseline_node_bytes(config, loss_fn, mesh, params, first)
    started, tuned = time.perf_counter(), None
    if config.autotune:  # from a batch stream of its own: training sees the same data either way
        tuned = tune(config, loss_fn, mesh, params, iter(batch_source(), None))
    with build_step(config, config.algorithm, loss_fn, mesh, tuned and tuned.strategy) as step:
        state = step.init(params)
        phases = step.communication_stats(state, first)  # compiles; runs nothing
        done, state, checkpointer = _resume(config, state, mesh)
        batch = first
        for _ in range(done):  # the data position: the same batches as a run that never stopped
            batch = next_batch()
        state, losses, elapsed = _train_loop(
            step,
            state,
            batch,
            next_batch,
            first=done,
            steps=steps,
            name=config.algorithm,
            progress=config.progress,
            checkpointer=checkpointer,
        )
        if checkpointer is not None:
            checkpointer.close()  # waits for the last save
    # After close: async's count then holds every round of the run, its last one included.
    counts = step.phase_counts(state)
    if tuned is not None:
        share = tuned.tuning_s / (time.perf_counter() - started)
        log(f"{config.algorithm}: autotune was {share:.0%} of this run's wall time")
    model_params = step.params(state)  # after close: async averages the processes' models once
    test_inputs, test_targets = datasets.test_set(data, config.seq_len)
    test_loss, test_accuracy = evaluate(
        graphdef, rest, model_params, test_inputs, test_targets, mesh
    )
    per_step, average = node_bytes(phases, counts)
    return Result(
        algorithm=config.algorithm,
        model=config.model,
        losses=losses,
        test_loss=test_loss,
        test_accuracy=test_accuracy,
        node_bytes=per_step,
        node_bytes_average=average,
        baseline_node_bytes=baseline,
        steps_per_second=(steps - 1) / elapsed if steps > 1 else float("nan"),
        num_params=models.count_params(params),
        comm_table="\n".join(f"{name}: {stats}" for name, stats in phases.items()),
    )


def shardable(name: str) -> bool:
    """Whether algorithm ``name`` can split its state within a node (``--shard``)."""
    return "shard" in jax_bytegrad.Strategy.valid_kwargs(name)


def skip_reason(config: Config, name: str) -> str | None:
    """Why ``compare`` leaves algorithm ``name`` out of this run, or None."""
    needed, why = RUNNABLE[name].min_processes
    if jax.process_count() < needed:
        return (f"it needs {needed} or more processes ({why}); examples/multihost.py under "
                "python -m jax_bytegrad.launch runs it")  # fmt: skip
    if config.shard is not None and not shardable(name):
        return f"--shard {config.shard}: it keeps its own copy of the model on every device"
    return None


def compare(config: Config, algorithms=None) -> list[Result]:
    """Runs every algorithm this many processes (and ``config.shard``) can run, on the same
    data.

    gradient_allreduce runs first: its bytes are every other algorithm's baseline.
    """
    runnable = [name for name in ALGORITHMS if skip_reason(config, name) is None]
    if algorithms is None:
        for name in ALGORITHMS:
            if name not in runnable:
                log(f"{name}: skipped, {skip_reason(config, name)}")
    names = sorted(algorithms or runnable, key=lambda name: name != BASELINE)
    results, baseline = [], None
    for name in names:
        result = train_and_evaluate(dataclasses.replace(config, algorithm=name), baseline=baseline)
        baseline = result.baseline_node_bytes
        results.append(result)
    return results


def describe(config: Config, mesh: jax.sharding.Mesh, num_params: int | None = None) -> str:
    size = "" if num_params is None else f", {num_params:,} parameters"
    shard = "" if config.shard is None else f", state sharded within each node: {config.shard}"
    return (
        f"{config.model} on {config.get('dataset')}{size}; mesh {dict(mesh.shape)} on "
        f"{jax.process_count()} process(es), {jax.default_backend()}{shard}; "
        f"{config.get('steps')} steps, global batch {config.get('batch_size')}"
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line of train.py and multihost.py."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--algorithm",
        choices=list(RUNNABLE),
        default=None,
        help="train with one algorithm; without it, --compare runs Bagua's six (async needs "
        "several processes: examples/multihost.py under python -m jax_bytegrad.launch; "
        "diloco runs by name only)",
    )
    parser.add_argument(
        "--diloco-inner-steps",
        type=int,
        default=10,
        help="diloco: H, the inner steps between two exchanges between nodes",
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
    parser.add_argument(
        "--out-dir", default="runs", help="where --compare and --autotune write (default runs/)"
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save the training state here and resume from it (with launch --max-restarts)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between saves")
    parser.add_argument(
        "--cache",
        choices=["none", "embedded", "redis"],
        default=None,
        help="transformer: train on the stdlib's functions (variable lengths) through this cache",
    )
    parser.add_argument(
        "--load-balance",
        action="store_true",
        help="with --cache: Bagua's load-balanced sampler instead of a random shard",
    )
    parser.add_argument("--seq-len", type=int, default=64, help="transformer: tokens per row")
    parser.add_argument(
        "--shard",
        choices=["optimizer", "params"],
        default=None,
        help="split the state within each node: each device keeps 1/L of the optimizer state "
        "(optimizer) or of the parameters too (params); gradient_allreduce, bytegrad, qadam",
    )
    parser.add_argument(
        "--autotune",
        action="store_true",
        help="time each algorithm's step under its message/bucket sizes and hierarchy first "
        "(cached in --out-dir/autotune.json)",
    )
    return parser  # fmt: skip


def parse_args(argv=None, *, processes: int = 1) -> argparse.Namespace:
    """The flags; a usage error (exit 2) for an algorithm that needs more than ``processes``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shard is not None and args.algorithm is not None and not shardable(args.algorithm):
        parser.error(
            f"--shard {args.shard} applies to "
            f"{', '.join(n for n in RUNNABLE if shardable(n))}; {args.algorithm} keeps its "
            "own copy of the model on every device"
        )
    if args.algorithm is not None:
        needed, why = RUNNABLE[args.algorithm].min_processes
        if processes < needed:
            parser.error(
                f"--algorithm {args.algorithm} needs {needed} or more processes ({why}), and "
                f"this is {processes}; run it under the launcher: python -m jax_bytegrad.launch "
                f"--nproc {needed} --devices-per-proc {CPU_DEVICES_PER_NODE} "
                f"examples/multihost.py --algorithm {args.algorithm}"
            )
    return args


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
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        cache=args.cache,
        load_balance=args.load_balance,
        seq_len=args.seq_len,
        shard=args.shard,
        autotune=args.autotune,
        out_dir=args.out_dir,
        diloco_inner_steps=args.diloco_inner_steps,
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
    everything = args.compare or args.algorithm is None
    results = compare(config) if everything else [train_and_evaluate(config)]
    if not everything:
        log(results[0].comm_table)
    title = describe(config, mesh, results[0].num_params)
    table = results_table(results)
    log(f"\n{title}\n\n{table}")
    if everything and is_main_process():
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
