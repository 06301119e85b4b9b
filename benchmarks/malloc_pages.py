"""Why CPU workers need glibc's huge pages, measured in isolation: page faults per call.

XLA:CPU allocates every output and temporary buffer afresh at each call. glibc serves
allocations above its mmap threshold (dynamic, at most 32 MiB) with a fresh ``mmap`` and
unmaps them at ``free``, so each call faults in a buffer's worth of new 4 KiB pages. This
runs, in a fresh process per malloc setting:

- ``op``: a jitted ``x * 2 + 1`` over a float32 vector (16 MB and 100 MB): one fresh output;
- ``step``: a ByteGrad ``data_parallel_step`` of the 25.2M-parameter MLP of benchmarks/_mlp.py
  on a 2 x 1 mesh of 2 CPU devices in one process (compressed between the two "nodes"),
  parameters and optimizer state donated as in a user's loop;

and reports the median time and minor page faults (``getrusage``) per call, and the peak RSS of
the process (each part runs in its own).

Settings (the registry below):
- ``default``: glibc's malloc as it starts;
- ``hugetlb``: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (what ``python -m
  jax_bytegrad.launch`` sets): large mappings get transparent huge pages;
- ``mallopt``: what a running process could do instead (``jax_bytegrad.initialize`` runs after
  glibc read its tunables): ``mallopt(M_MMAP_MAX, 0)`` and ``M_TRIM_THRESHOLD`` = 2 GiB, so
  that freed memory stays in malloc's heaps for reuse;
- ``mallopt_one_arena``: the same and ``M_ARENA_MAX = 1``, so that XLA's threads share the
  main heap, which (unlike a thread's 64 MiB heaps) grows to any size.

Usage:
  python benchmarks/malloc_pages.py [--repeats 15] [--settings default,hugetlb,...]
"""

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
PARTS = ("op16", "op100", "step")
STEP_PARAMS = 25_200_000

# Registry: setting -> (environment additions, mallopt calls made before JAX loads).
SETTINGS = {
    "default": ({}, ()),
    "hugetlb": ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, ()),
    "mallopt": ({}, ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))),
    "mallopt_one_arena": (
        {},
        ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_ARENA_MAX, 1)),
    ),
}


# Worker: one setting, in its own process --------------------------------------------------------


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _measure(call, repeats: int) -> dict:
    """Median ms and page faults of `call()`, which blocks until its result exists."""
    for _ in range(3):
        call()
    times, faults = [], []
    for _ in range(repeats):
        f0, t0 = _faults(), time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - t0))
        faults.append(_faults() - f0)
    return {"ms": statistics.median(times), "faults": int(statistics.median(faults))}


def worker(setting: str, part: str, repeats: int) -> dict:
    """Runs one part (``op16``, ``op100`` or ``step``) under one setting; its figures."""
    libc = ctypes.CDLL("libc.so.6")
    for option, value in SETTINGS[setting][1]:
        if libc.mallopt(option, value) != 1:
            raise RuntimeError(f"mallopt({option}, {value}) failed")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jax_bytegrad

    sys.path.insert(0, str(Path(__file__).parent))
    from _mlp import mlp_batch, mlp_init, mlp_loss

    if part.startswith("op"):
        op = jax.jit(lambda x: x * 2.0 + 1.0)
        x = jnp.ones(int(part[2:]) * 250_000, jnp.float32)
        result = _measure(lambda: op(x).block_until_ready(), repeats)
    else:
        mesh = jax_bytegrad.make_mesh(2, 1)
        tx = optax.chain(jax_bytegrad.bytegrad(), optax.sgd(1e-3))
        step = jax_bytegrad.data_parallel_step(mlp_loss, tx, mesh)
        state = [step.init(mlp_init(STEP_PARAMS))]
        batch = jax_bytegrad.sharding.shard_batch(mlp_batch(np.random.default_rng(0), 32), mesh)

        def train_step():
            state[0], metrics = step(state[0], batch)
            metrics["loss"].block_until_ready()

        result = _measure(train_step, repeats)
    result["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return result


# Report -----------------------------------------------------------------------------------------


def report(results: dict) -> str:
    head = "| setting | " + " | ".join(f"{p}: ms, faults, peak RSS MiB" for p in PARTS) + " |"
    lines = [head, "|---|" + "---:|" * len(PARTS)]
    for setting, by_part in results.items():
        cells = [f"{r['ms']:.1f}, {r['faults']:,}, {r['rss']:,}" for r in by_part.values()]
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(*args.worker, args.repeats)))
        return
    results = {}
    for setting in args.settings.split(","):
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        env.update(SETTINGS[setting][0])
        repo = str(Path(__file__).parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
        results[setting] = {}
        for part in PARTS:
            repeats = args.repeats if part.startswith("op") else max(3, args.repeats // 3)
            command = [sys.executable, __file__, "--worker", setting, part]
            out = subprocess.run(
                [*command, "--repeats", str(repeats)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[setting][part] = json.loads(out.strip().splitlines()[-1])
            print(setting, part, results[setting][part], file=sys.stderr, flush=True)
    print(report(results))


if __name__ == "__main__":
    main()
