"""Benchmark: ``jax_bytegrad.autotune`` against an exhaustive sweep, on shaped links.

Builds K namespace hosts on one bridge (`_netns`) with every link at ``--rate``, runs one JAX
process per host (one CPU device each, mesh (K, 1), Gloo between them) and, on the network
benchmark's 25.2M-parameter MLP (`network.py`), with ByteGrad + Adam:

1. sweeps the whole space (every message size x every distinct bucket grouping): the
   exhaustive best;
2. runs ``autotune`` with its default trial budget, which searches this space one setting
   at a time;
3. times the train step with the library's defaults, the autotuned configuration and the
   exhaustive best, taking turns step by step, and reports the medians.

``--no-sweep`` skips 1 and 3: only ``autotune`` (``--max-trials`` of them), whose table also
times the uncompressed step (gradient_allreduce + Adam) and says whether compression pays on
the link.

Usage (root; without root it says so and exits 0)::

    python benchmarks/autotune.py --hosts 2,4 --rate 1gbit
    python benchmarks/autotune.py --hosts 2 --rate 10gbit --no-sweep --max-trials 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _mlp import mlp_batch, mlp_init, mlp_loss  # noqa: E402
from _network_report import parse_rate  # noqa: E402

STEPS_PER_TRIAL, WARMUP = 5, 1
ROWS_PER_HOST = 16


# Worker: one per host --------------------------------------------------------------------------


def _batches(n: int, rank: int):
    rng = np.random.default_rng(1 + rank)
    return [mlp_batch(rng, ROWS_PER_HOST) for _ in range(n)]


def _time_in_turns(strategies: dict, params, batches, steps: int) -> dict[str, list[float]]:
    """Each strategy's step times (slowest process), the strategies taking turns step by step."""
    import jax
    import optax
    from jax.experimental import multihost_utils

    built = {}
    for name, strategy in strategies.items():
        step = strategy.train_step(mlp_loss, optax.adam(1e-4))
        state = step.init(params)
        for batch in batches[:2]:  # compile, warm up
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        built[name] = [step, state]
    times = {name: [] for name in strategies}
    for i in range(steps):
        for name, cell in built.items():
            multihost_utils.sync_global_devices(f"{name}-{i}")
            t0 = time.perf_counter()
            cell[1], _ = cell[0](cell[1], batches[i % len(batches)])
            jax.block_until_ready(cell[1])
            times[name].append(time.perf_counter() - t0)
    for step, _ in built.values():
        step.close()
    return {
        name: np.asarray(multihost_utils.process_allgather(np.asarray(t))).max(axis=0).tolist()
        for name, t in times.items()
    }


def _worker(args) -> int:
    import jax_bytegrad

    info = jax_bytegrad.initialize()
    import jax
    import optax

    params = mlp_init(args.num_params)
    batches = _batches(1 + WARMUP + STEPS_PER_TRIAL, info.process_id)
    strategy = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh())
    tune = dict(steps_per_trial=STEPS_PER_TRIAL, warmup_steps=WARMUP, verbose=True)
    if args.no_sweep:
        tuned = jax_bytegrad.autotune(
            strategy, mlp_loss, optax.adam(1e-4), params, batches,
            max_trials=args.max_trials, **tune,
        )  # fmt: skip
        if info.process_id == 0:
            Path(args.out).write_text(
                json.dumps({"tuned_table": tuned.table(), "speedup": tuned.speedup,
                            "trials": len(tuned.trials), "tuning_s": tuned.tuning_s})
            )  # fmt: skip
        jax.distributed.shutdown()
        return 0
    swept = jax_bytegrad.autotune(
        strategy, mlp_loss, optax.adam(1e-4), params, batches, max_trials=1000, **tune
    )
    tuned = jax_bytegrad.autotune(
        strategy, mlp_loss, optax.adam(1e-4), params, batches, max_trials=args.max_trials, **tune
    )
    final = _time_in_turns(
        {"default": strategy, "autotuned": tuned.strategy, "exhaustive best": swept.strategy},
        params,
        batches,
        args.steps,
    )
    if info.process_id == 0:
        result = {
            "final": final,
            "configs": {
                "default": swept.start,
                "autotuned": tuned.config,
                "exhaustive best": swept.config,
            },
            "tuning_s": {"autotuned": tuned.tuning_s, "exhaustive": swept.tuning_s},
            "trials": {"autotuned": len(tuned.trials), "exhaustive": len(swept.trials)},
            "sweep_table": swept.table(),
            "tuned_table": tuned.table(),
        }
        Path(args.out).write_text(json.dumps(result))
    jax.distributed.shutdown()
    return 0


# Driver ----------------------------------------------------------------------------------------


def _run(cluster, args, out: Path) -> dict:
    worker = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out),
        "--num-params", str(args.num_params), "--steps", str(args.steps),
        "--max-trials", str(args.max_trials), *(["--no-sweep"] if args.no_sweep else []),
    ]  # fmt: skip
    code = cluster.launch(worker, timeout=args.timeout)
    if code != 0:
        raise SystemExit(code)
    return json.loads(out.read_text())


def _report(hosts: int, rate: str, result: dict) -> str:
    if "final" not in result:  # --no-sweep
        return "\n".join([
            f"### {hosts} hosts, {rate}", "",
            f"autotune: {result['trials']} trials in {result['tuning_s']:.0f} s; the uncompressed "
            f"step's time over the chosen compressed one's: {result['speedup']:.2f}x", "",
            result["tuned_table"],
        ])  # fmt: skip

    def label(config):
        return " ".join(f"{k}={v}" for k, v in config.items())

    lines = [
        f"### {hosts} hosts, {rate}",
        "",
        "| configuration | settings | step ms (median) | vs default |",
        "|---|---|---:|---:|",
    ]
    base = statistics.median(result["final"]["default"])
    for name, times in result["final"].items():
        med = statistics.median(times)
        lines.append(
            f"| {name} | {label(result['configs'][name])} | {1e3 * med:.1f} | {med / base:.3f}x |"
        )
    lines += [
        "",
        f"Tuning: autotune {result['trials']['autotuned']} trials in "
        f"{result['tuning_s']['autotuned']:.0f} s; exhaustive sweep "
        f"{result['trials']['exhaustive']} trials in {result['tuning_s']['exhaustive']:.0f} s.",
        "",
        "Exhaustive sweep:",
        "",
        result["sweep_table"],
        "",
        "Autotune's trials:",
        "",
        result["tuned_table"],
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", default="2,4", help="comma-separated host counts")
    parser.add_argument("--rate", default="1gbit", help="link rate of every host")
    parser.add_argument("--num-params", type=int, default=25_200_000)
    parser.add_argument("--steps", type=int, default=7, help="final timed steps per config")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per host count")
    parser.add_argument("--max-trials", type=int, default=16, help="autotune's trial budget")
    parser.add_argument(
        "--no-sweep", action="store_true", help="only autotune, with the uncompressed step beside"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)

    import _netns

    if not _netns.have_root():
        print("autotune benchmark: needs root (and ip, tc, unshare) for namespace hosts; skipped")
        return 0
    reports, results = [], {}
    try:
        for k in [int(h) for h in args.hosts.split(",") if h]:
            with _netns.Cluster(k) as cluster, tempfile.TemporaryDirectory() as tmp:
                cluster.shape(parse_rate(args.rate), None)
                print(f"== {k} hosts, {args.rate}", flush=True)
                results[k] = _run(cluster, args, Path(tmp) / "result.json")
                reports.append(_report(k, args.rate, results[k]))
                print(reports[-1], flush=True)
    finally:
        _netns.cleanup()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
