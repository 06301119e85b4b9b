"""DiLoCo's inner step against a bare train step, in one process: what the inner step costs.

On a mesh of (2, 1) CPU devices (two nodes of one device, as the namespace hosts of
benchmarks/network.py), times, taking turns step by step:
- the bare step: forward, backward, Adam, in a jitted ``shard_map``, the params and Adam state
  carried and donated, each node's copy on a leading row axis (as DiLoCo keeps them), the
  optimizer updating either the row's slice (``x[0]``, then ``x[None]`` back) or the rows as
  they are (``jax.vmap``);
- ``Strategy("diloco")``'s inner step (H large, so that every timed step is an inner one).
It prints each one's median and the ``copy`` instructions XLA:CPU compiled into it. The figures
are in benchmarks/RESULTS.md, "DiLoCo", "Time between namespace hosts".

``--exchange`` times instead what an outer exchange costs the host's CPU, link aside: DiLoCo at
H = 10 with ``delay=0`` at 4 bits + error feedback, 8 bits and float32, the median step that
ends the H steps (it carries the exchange and the outer step) less the median inner step
(RESULTS.md, "The exchange in the background").

    python benchmarks/diloco_inner.py --params 2000000 --steps 40
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 taskset -c 0 \
        python benchmarks/diloco_inner.py --exchange --steps 60   # one core, as --pin
"""

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _mlp import mlp_batch, mlp_init, mlp_loss  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_bytegrad  # noqa: E402
from jax_bytegrad.sharding import shard_batch  # noqa: E402

AXES = ("node", "local")


def bare_step(mesh, params, batch, *, sliced: bool):
    """``(run, compiled text)``: the bare step, its optimizer on the row's slice or the rows."""
    tx = optax.adam(1e-4)

    def body(p, s, b):
        g = jax.grad(mlp_loss)(
            jax.lax.pcast(jax.tree.map(lambda x: x[0], p), "local", to="varying"), b
        )
        g = jax.lax.pmean(g, "local")
        if sliced:
            p, s = jax.tree.map(lambda x: x[0], (p, s))
            u, s = tx.update(g, s, p)
            return jax.tree.map(lambda x: x[None], (optax.apply_updates(p, u), s))
        u, s = jax.vmap(tx.update)(jax.tree.map(lambda x: x[None], g), s, p)
        return optax.apply_updates(p, u), s

    specs = (P("node"), P("node"))
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(*specs, P(AXES)), out_specs=specs),
        donate_argnums=(0, 1),
    )
    rows = lambda t: jax.tree.map(lambda x: np.stack([np.asarray(x)] * 2), t)  # noqa: E731
    place = NamedSharding(mesh, P("node"))
    cell = list(jax.device_put((rows(params), rows(tx.init(params))), place))
    text = fn.lower(*cell, batch).compile().as_text()

    def run():
        cell[:] = fn(*cell, batch)
        return cell[0]

    return run, text


def diloco_step(mesh, params, batch):
    strategy = jax_bytegrad.Strategy("diloco", mesh=mesh, inner_steps=10**6)
    step = strategy.train_step(mlp_loss, optax.adam(1e-4))
    cell = [step.init(params)]
    text = step.lower(cell[0], batch).compile().as_text()

    def run():
        cell[0], _ = step(cell[0], batch)
        return cell[0].params

    return run, text


EXCHANGES = {
    "8-bit": {"bits": 8},
    "4-bit + error feedback": {"bits": 4, "error_feedback": True},
    "float32": {"bits": 32},
}


def exchange_step_ms(mesh, params, batch, steps: int, **settings) -> tuple[float, float]:
    """(median inner step, median step that ends the H = 10 steps and carries the exchange)."""
    strategy = jax_bytegrad.Strategy(
        "diloco", mesh=mesh, inner_steps=10, delay=0, donate=True, **settings
    )
    with strategy.train_step(mlp_loss, optax.adam(1e-4)) as step:
        state, times = step.init(params), []
        for _ in range(20 + steps):  # two periods untimed: every program compiled
            start = time.perf_counter()
            state, _ = step(state, batch)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - start)
    times = 1e3 * np.asarray(times[20:])
    ends = np.arange(9, len(times), 10)  # the 10th, 20th, ... timed step ends a period
    return float(np.median(np.delete(times, ends))), float(np.median(times[ends]))


def exchange_costs(mesh, params, batch, steps: int) -> None:
    """Prints, per outer exchange, the median step with the exchange less the median inner step."""
    # The process's first DiLoCo step ran its inner steps twice as slowly as every later one
    # (31 against 16 ms at 2M parameters): page faults on the fresh mappings glibc's malloc
    # makes until its mmap threshold has risen (runtime/hugepages.py; with GLIBC_TUNABLES=
    # glibc.malloc.hugetlb=1, as the launcher sets it, 20 against 17 ms). So one untimed run
    # first; without the tunable the next setting's inner steps still ran slow in some runs.
    exchange_step_ms(mesh, params, batch, steps, **EXCHANGES["8-bit"])
    print("| outer exchange | inner step ms | step with the exchange ms | exchange ms |")
    print("|---|---:|---:|---:|")
    for label, settings in EXCHANGES.items():
        inner, outer = exchange_step_ms(mesh, params, batch, steps, **settings)
        print(f"| {label} | {inner:.1f} | {outer:.1f} | {outer - inner:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=2_000_000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--exchange", action="store_true", help="time the outer exchanges")
    args = parser.parse_args()
    mesh = jax_bytegrad.make_mesh(2, 1)
    params = mlp_init(args.params)
    batch = shard_batch(mlp_batch(np.random.default_rng(0), 64), mesh)
    if args.exchange:
        print(f"{args.params} parameters, mesh (2, 1), H = 10, delay 0, {args.steps} steps each")
        return exchange_costs(mesh, params, batch, args.steps)
    ops = {
        "bare, optimizer on the row's slice": bare_step(mesh, params, batch, sliced=True),
        "bare, optimizer on the rows (vmap)": bare_step(mesh, params, batch, sliced=False),
        "Strategy('diloco') inner step": diloco_step(mesh, params, batch),
    }
    for run, _ in ops.values():
        for _ in range(3):
            jax.block_until_ready(run())
    times = {name: [] for name in ops}
    for _ in range(args.steps):
        for name, (run, _) in ops.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - start)
    print(f"{args.params} parameters, mesh (2, 1), donated, {args.steps} steps each, taking turns")
    print("| step | median ms | copies |\n|---|---:|---:|")
    for name, (_, text) in ops.items():
        print(f"| {name} | {1e3 * np.median(times[name]):.1f} | {text.count(' copy(')} |")


if __name__ == "__main__":
    main()
