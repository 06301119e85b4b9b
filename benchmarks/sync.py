"""Per-step gradient sync on 8 CPU devices: float32 all-reduce, bf16 all-reduce, ByteGrad.

Compares, for each gradient size, inside one ``jax.shard_map`` over a ("node", "local") mesh:

  fp32      ``full_precision_mean`` (what ``gradient_allreduce()`` runs): one float32 psum
  bf16      psum of the bfloat16-cast gradient, cast back and divided: 2 bytes per value
  bytegrad  ``compressed_mean`` (hierarchical): float32 within a node, 8-bit codes between

Inputs are per-device random gradients, sharded P(("node", "local")) along a leading device
axis. Each row gives the median wall time of a synchronous step, its ratio to fp32 measured
in the same run, and the bytes each device sends per step between nodes and within nodes,
read from the compiled HLO by ``jax_bytegrad.profiling.communication_stats``.

On one CPU host the 8 "devices" share its memory and cores: the "network" is memcpy, so these
timings show compute overhead (quantize, average, dequantize) against memory-speed
collectives, not link savings. The bytes columns are what a real link would carry.

Usage:
  python benchmarks/sync.py --sizes 1M,4M,16M,64M --mesh 2,4 --repeats 5
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax_bytegrad  # noqa: E402
from jax_bytegrad.profiling import communication_stats  # noqa: E402

AXES = ("node", "local")


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    factor = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
    return int(text.rstrip("KMG")) * factor


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _bytes(fn, arg, mesh) -> dict[str, float]:
    stats = communication_stats(fn, arg, mesh=mesh)
    return {"node": stats.bytes_on("node"), "local": stats.bytes_on("local")}


def _methods(mesh):
    n, local = mesh.shape["node"], mesh.shape["local"]

    def fp32(g):
        return jax_bytegrad.full_precision_mean(g[0])

    def bf16(g):
        total = jax.lax.psum(g[0].astype(jnp.bfloat16), AXES)
        return total.astype(jnp.float32) / jnp.float32(n * local)

    def bytegrad(g):
        return jax_bytegrad.compressed_mean(g[0])

    out = {}
    for name, f in (("fp32", fp32), ("bf16", bf16), ("bytegrad", bytegrad)):
        out[name] = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXES), out_specs=P()))
    return out


def _median_time(fn, arg, repeats: int) -> float:
    jax.block_until_ready(fn(arg))
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M", help="parameters per device")
    parser.add_argument("--mesh", default="2,4", help="nodes,devices per node")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    n, local = (int(v) for v in args.mesh.split(","))
    mesh = jax_bytegrad.make_mesh(n, local)
    methods = _methods(mesh)
    sharding = NamedSharding(mesh, P(AXES))
    print(
        f"jax {jax.__version__}, {len(jax.devices())} CPU devices on {os.cpu_count()} cores, "
        f"mesh node={n} x local={local}; median of {args.repeats} steps after 2 warm-ups; "
        f"bytes sent per device per step from jax_bytegrad.profiling.communication_stats"
    )
    print()
    head = (
        f"| {'params':>6} | {'method':8} | {'median ms':>9} | {'/ fp32':>6} "
        f"| {'between nodes':>13} | {'within nodes':>13} | {'node / fp32':>11} |"
    )
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for size_text in args.sizes.split(","):
        size = _parse_size(size_text)
        grads = jax.device_put(
            jax.random.normal(jax.random.key(size), (n * local, size), jnp.float32), sharding
        )
        rows = []
        for name, fn in methods.items():
            t = _median_time(fn, grads, args.repeats)
            rows.append((name, t, _bytes(fn, grads, mesh)))
        base_t, base_b = rows[0][1], rows[0][2]
        for name, t, b in rows:
            ratio = b["node"] / base_b["node"] if base_b["node"] else float("nan")
            print(
                f"| {size_text:>6} | {name:8} | {t * 1e3:9.2f} | {t / base_t:6.2f} "
                f"| {_fmt_bytes(b['node']):>13} | {_fmt_bytes(b['local']):>13} | {ratio:11.3f} |"
            )
        del grads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
