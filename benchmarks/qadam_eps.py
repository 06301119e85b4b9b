"""QAdam's eps on short runs of the digits CNN: which settings spike or diverge.

Trains ``examples/train.py``'s QAdam (20% float32 warm-up) on the simulated CPU mesh for each
eps, seed and wire, and prints one row per run: test accuracy and the largest training loss
seen. A run whose largest loss is above its first (about 2.3, chance) spiked; one that ends
near chance diverged. Two settings, as the example's tests run them:

    python benchmarks/qadam_eps.py                                  # 50 steps, 2 x 4, batch 128
    python benchmarks/qadam_eps.py --steps 150 --mesh 2x2 --batch-size 32 --seeds 3

The frozen second moment of weights that got almost no gradient in the warm-up stays near 0,
and eps alone then bounds their step (docs/qadam.md, "When a refresh helps").
"""

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import configs  # noqa: E402  (examples/configs.py)
import train  # noqa: E402  (examples/train.py)


def run(wire: str, seed: int, eps: float, args) -> tuple[float, float]:
    """(test accuracy, largest training loss) of one QAdam run over ``wire``."""
    entry = configs.ALGORITHMS["qadam"]
    configs.ALGORITHMS["qadam"] = dataclasses.replace(
        entry, kwargs=lambda config: {**entry.kwargs(config), "wire": wire}
    )
    try:
        nodes, per_node = (int(n) for n in args.mesh.split("x"))
        config = train.Config(
            algorithm="qadam", model="cnn", steps=args.steps, batch_size=args.batch_size,
            nodes=nodes, devices_per_node=per_node, seed=seed, qadam_eps=eps, progress=False,
        )  # fmt: skip
        result = train.train_and_evaluate(config)
    finally:
        configs.ALGORITHMS["qadam"] = entry
    return result.test_accuracy, max(result.losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--mesh", default="2x4", help="nodes x devices per node")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-5, 1e-4])
    parser.add_argument("--wires", nargs="+", default=["scatter_gather", "allreduce"])
    args = parser.parse_args()
    print(f"qadam on the digits CNN, {args.steps} steps, mesh {args.mesh}, batch {args.batch_size}")
    print("| eps | seed | wire | test accuracy | largest train loss |")
    print("|---:|---:|---|---:|---:|")
    for eps in args.eps:
        for seed in range(args.seeds):
            for wire in args.wires:
                accuracy, worst = run(wire, seed, eps, args)
                print(f"| {eps:g} | {seed} | {wire} | {accuracy:.1%} | {worst:.2f} |", flush=True)


if __name__ == "__main__":
    main()
