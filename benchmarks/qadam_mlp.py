"""QAdam's second-moment rules on issue 34's MLP, through the library, with compression on.

An MLP (64-256-256-10, ReLU) on scikit-learn's digits (pixels / 16, 80/20 split), global batch
128, on the simulated 2 x 4 CPU mesh. Adam is ``Strategy("gradient_allreduce",
hierarchical=True)`` with ``optax.adamw(1e-3, weight_decay=1e-4)`` (eps 1e-8); QAdam is
``Strategy("qadam", learning_rate=1e-3, warmup_steps=W, weight_decay=1e-4,
second_moment=rule)`` with the same eps, its 8-bit momentum exchange between the two nodes.
Every optimizer starts from the same parameters and sees the same batches per seed. One row
per optimizer: median final train loss (mean of the last 10 steps), against Adam's, median
test accuracy, runs that diverged (ended above half their first loss, or not finite), the
largest loss, and how many runs the train step's divergence watch warned on.

    python benchmarks/qadam_mlp.py --steps 100 --warmup-frac 0.1 0.2 0.3 --seeds 3
    python benchmarks/qadam_mlp.py --steps 1000 --warmup-frac 0.2 --seeds 2
    python benchmarks/qadam_mlp.py --rules momentum frozen --wire scatter_gather
    python benchmarks/qadam_mlp.py --rules momentum frozen --error-feedback
"""

import argparse
import os
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn import datasets  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import jax_bytegrad  # noqa: E402

SIZES = (64, 256, 256, 10)
RULES = ("gradient", "momentum", "momentum_max", "floor", "frozen")


def init(seed):
    key = jax.random.key(seed)
    params = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        w = jax.random.normal(jax.random.fold_in(key, i), (a, b)) * np.sqrt(2.0 / a)
        params.append({"w": np.asarray(w, np.float32), "b": np.zeros(b, np.float32)})
    return params


def logits(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def data():
    x, y = datasets.load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int32), test_size=0.2, random_state=0, stratify=y)


def train(strategy, optimizer, seed, steps, split):
    """(losses, test accuracy, warned) of one run."""
    xtr, xte, ytr, yte = split
    rng = np.random.default_rng(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jax_bytegrad.DivergenceWarning)
        with strategy.train_step(loss_fn, optimizer) as step:
            state = step.init(init(seed))
            losses = []
            for _ in range(steps):
                idx = rng.integers(0, len(xtr), 128)
                state, metrics = step(state, (xtr[idx], ytr[idx]))
                losses.append(metrics["loss"])
            losses = [float(x) for x in jax.device_get(losses)]
            params = step.params(state)
            for leaf in jax.tree.leaves(params):  # every replica holds the same bits
                shards = [np.asarray(s.data) for s in leaf.addressable_shards]
                same = all(np.array_equal(s, shards[0], equal_nan=True) for s in shards)
                assert same, (
                    f"replicas differ: {[float(np.abs(s - shards[0]).max()) for s in shards]}"
                )
            params = jax.device_get(params)
    accuracy = float((np.asarray(logits(params, jnp.asarray(xte))).argmax(1) == yte).mean())
    warned = any(issubclass(w.category, jax_bytegrad.DivergenceWarning) for w in caught)
    return losses, accuracy, warned


def row(label, runs, base):
    finals = [np.mean(r[0][-10:]) for r in runs]
    final = float(np.median(finals))
    diverged = sum(not f <= 0.5 * r[0][0] for f, r in zip(finals, runs, strict=True))
    worst = max(np.nanmax(np.where(np.isfinite(r[0]), r[0], np.inf)) for r in runs)
    return (
        f"| {label} | {final:.4f} | {final / base:.2f} | {np.median([r[1] for r in runs]):.1%} "
        f"| {diverged}/{len(runs)} | {worst:.3g} | {sum(r[2] for r in runs)}/{len(runs)} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup-frac", type=float, nargs="+", default=[0.2])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rules", nargs="+", default=list(RULES))
    parser.add_argument("--wire", default="auto")
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--error-feedback", action="store_true")
    args = parser.parse_args()
    mesh = jax_bytegrad.make_mesh(2, 4)
    split = data()
    adam = jax_bytegrad.Strategy("gradient_allreduce", mesh=mesh, hierarchical=True)
    adam_runs = [
        train(adam, optax.adamw(1e-3, weight_decay=1e-4), s, args.steps, split)
        for s in range(args.seeds)
    ]
    base = float(np.median([np.mean(r[0][-10:]) for r in adam_runs]))
    print(f"MLP {SIZES} on digits, {args.steps} steps, batch 128, mesh 2 x 4, eps 1e-8, "
          f"wire {args.wire}, {args.bits} bits, error feedback {args.error_feedback}, "
          f"{args.seeds} seeds")  # fmt: skip
    print("| optimizer | final train loss | / Adam's | test accuracy | diverged | largest loss "
          "| warned |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(row("adamw", adam_runs, base), flush=True)
    for frac in args.warmup_frac:
        warmup = max(1, round(frac * args.steps))
        for rule in args.rules:
            strategy = jax_bytegrad.Strategy(
                "qadam", mesh=mesh, learning_rate=1e-3, warmup_steps=warmup,
                weight_decay=1e-4, second_moment=rule, wire=args.wire, bits=args.bits,
                error_feedback=args.error_feedback,
            )  # fmt: skip
            runs = [train(strategy, None, s, args.steps, split) for s in range(args.seeds)]
            print(row(f"qadam W={warmup} ({frac:.0%}), {rule}", runs, base), flush=True)


if __name__ == "__main__":
    main()
