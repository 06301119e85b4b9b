"""QAdam with and without second-moment refresh, against Adam, on the examples' models.

Trains the model of ``examples/train.py`` (the digits CNN or the character transformer) on
its default 2 x 4 simulated mesh, from the same initialisation and batches, with Adam over
a float32 all-reduce, QAdam as it was (frozen ``v``), and QAdam refreshing ``v`` on the
schedule ``nu_refresh_interval=k, nu_refresh_growth=g``. Prints one table: held-out loss
and accuracy, final train loss (mean of the last 10 steps), each against Adam, and the
run-average inter-node bytes per step as a fraction of gradient_allreduce's.

    python benchmarks/qadam_refresh.py --model cnn
    python benchmarks/qadam_refresh.py --model cnn --variants eps
    python benchmarks/qadam_refresh.py --model transformer --steps 200 --variants short
    python benchmarks/qadam_refresh.py --model cnn --variants rules --seeds 3

Run-average bytes: the compiled step holds both branches, so its compressed branch is the
program's inter-node bytes minus gradient_allreduce's (the float32 branch is exactly that
all-reduce); a run sends the float32 branch on ``W + refreshes`` steps and the compressed
one on the rest (``jax_bytegrad.refresh_steps`` lists the refreshes).
"""

import argparse
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import configs  # noqa: E402  (examples/configs.py)
import train as example  # noqa: E402  (examples/train.py)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One optimizer: Adam (``warmup_frac`` None) or QAdam with these settings.

    Attributes:
      warmup_frac: QAdam's warm-up as a share of the steps; None for Adam.
      eps: QAdam's eps (the example uses 1e-5; Adam keeps optax's 1e-8).
      interval: ``nu_refresh_interval``; None for no refresh.
      growth: ``nu_refresh_growth``.
      rule: ``second_moment``; "frozen" (Bagua's) is what the sets before "rules" measured.
    """

    warmup_frac: float | None = None
    eps: float = 1e-5
    interval: int | None = None
    growth: float = 2.0
    rule: str = "frozen"

    def label(self) -> str:
        if self.warmup_frac is None:
            return "adam"
        refresh = "" if self.interval is None else f", k={self.interval} g={self.growth:g}"
        rule = "" if self.rule == "frozen" else f", {self.rule}"
        return f"qadam W={self.warmup_frac:.0%}{refresh}, eps={self.eps:g}{rule}"


ADAM = Variant()
# Sets of variants; "main" holds the comparison of the issue, "eps" the eps=1e-8 question.
VARIANT_SETS = {
    "main": [
        ADAM,
        Variant(0.2),
        Variant(0.1),
        Variant(0.1, interval=5),
        Variant(0.1, interval=10),
        Variant(0.05),
        Variant(0.05, interval=5),
        Variant(0.05, interval=15, growth=1.0),
    ],
    "eps": [
        Variant(0.2, eps=1e-8),
        Variant(0.2, eps=1e-8, interval=5),
        Variant(0.2, eps=1e-8, interval=2, growth=1.0),
        Variant(0.1, eps=1e-8, interval=5),
    ],
}
VARIANT_SETS["short"] = VARIANT_SETS["main"][:5]
# The second-moment rules after warm-up, all with Adam's eps (issue 34).
VARIANT_SETS["rules"] = [
    Variant(0.2, eps=1e-8, rule="momentum"),
    Variant(0.1, eps=1e-8, rule="momentum"),
    Variant(0.3, eps=1e-8, rule="momentum"),
    Variant(0.2, eps=1e-8, rule="momentum_max"),
    Variant(0.2, eps=1e-8, rule="floor"),
    Variant(0.2, eps=1e-8),
]
VARIANT_SETS["rules_short"] = VARIANT_SETS["rules"][:3]
VARIANT_SETS["default"] = VARIANT_SETS["rules"][:1]


def full_precision_steps(variant: Variant, steps: int) -> tuple[int, int]:
    """(warm-up steps, refresh steps) of a QAdam variant within a run of ``steps``."""
    from jax_bytegrad import refresh_steps

    warmup = max(1, int(variant.warmup_frac * steps))
    if variant.interval is None:
        return warmup, 0
    return warmup, len(refresh_steps(warmup, variant.interval, variant.growth, steps))


def register(variant: Variant, steps: int) -> str:
    """Points the example's "qadam" entry at ``variant``; returns the algorithm to run."""
    if variant.warmup_frac is None:
        return "gradient_allreduce"
    warmup, _ = full_precision_steps(variant, steps)
    settings = {
        "warmup_steps": warmup,
        "eps": variant.eps,
        "second_moment": variant.rule,
        "nu_refresh_interval": variant.interval,
        "nu_refresh_growth": variant.growth,
    }
    configs.ALGORITHMS["qadam"] = configs.Algorithm(
        lambda config: {"learning_rate": config.get("learning_rate"), **settings},
        takes_optimizer=False,
    )
    return "qadam"


def diverged(losses) -> bool:
    """Ended above half its first loss, or not finite (diverged CNN runs sit at ln 10 or NaN)."""
    return not float(sum(losses[-10:]) / 10) <= 0.5 * float(losses[0])


def report(model: str, steps: int, seeds: int, variants, runs) -> str:
    """The markdown table: medians over seeds, each against Adam's (the first variant).

    ``runs[i][s]`` is variant i's ``(Result, seconds)`` for seed s.
    """
    import numpy as np

    def medians(results):
        test = float(np.median([r.test_loss for r, _ in results]))
        train = float(np.median([np.mean(r.losses[-10:]) for r, _ in results]))
        accuracy = float(np.median([r.test_accuracy for r, _ in results]))
        return test, train, accuracy

    adam_test, adam_train, _ = medians(runs[0])
    rows = [
        f"{model}, {steps} steps, mesh 2 x 4, median over {seeds} seed(s); inter-node bytes "
        "as a fraction of gradient_allreduce's",
        "",
        "| optimizer | float32 steps | test loss | vs Adam | final train loss | vs Adam "
        "| test accuracy | diverged | run-average bytes | seconds/run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, results in zip(variants, runs, strict=True):
        test, train, accuracy = medians(results)
        if variant.warmup_frac is None:
            full = "all"
        else:
            warmup, refreshes = full_precision_steps(variant, steps)
            full = f"{warmup} + {refreshes}"
        r = results[0][0]
        rows.append(
            f"| {variant.label()} | {full} | {test:.4f} | {test / adam_test - 1:+.1%} "
            f"| {train:.4f} | {train / adam_train - 1:+.1%} | {accuracy:.2%} "
            f"| {sum(diverged(r.losses) for r, _ in results)}/{len(results)} "
            f"| {r.node_bytes_average / r.baseline_node_bytes:.3f}x "
            f"| {np.median([t for _, t in results]):.0f} |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(example.MODEL_DEFAULTS), default="cnn")
    parser.add_argument("--steps", type=int, default=None, help="default: the example's")
    parser.add_argument("--variants", choices=sorted(VARIANT_SETS), default="main")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (params, batches)")
    args = parser.parse_args(argv)
    example.simulate_cpu_devices(argparse.Namespace(nodes=None, devices_per_node=None))

    config = example.Config(model=args.model, steps=args.steps, progress=False)
    steps = config.get("steps")
    variants = VARIANT_SETS[args.variants]
    if variants[0] is not ADAM:
        variants = [ADAM, *variants]
    # Adam first: its bytes are the baseline, and the table compares against its losses.
    runs, baseline = [], None
    for variant in variants:
        name = register(variant, steps)
        runs.append([])
        for seed in range(args.seeds):
            start = time.perf_counter()
            result = example.train_and_evaluate(
                dataclasses.replace(config, algorithm=name, seed=seed),
                baseline=baseline,
            )
            baseline = result.baseline_node_bytes
            seconds = time.perf_counter() - start
            runs[-1].append((result, seconds))
            print(
                f"{variant.label():>40} seed {seed}: test loss {result.test_loss:.4f}, "
                f"train loss {sum(result.losses[-10:]) / 10:.4f} ({seconds:.0f} s)",
                flush=True,
            )
    print()
    print(report(args.model, steps, args.seeds, variants, runs))


if __name__ == "__main__":
    main()
