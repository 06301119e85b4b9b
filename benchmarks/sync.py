"""Per-step gradient sync on 8 CPU devices: float32 all-reduce, bf16 all-reduce, ByteGrad.

Compares, for each gradient size, inside one ``jax.shard_map`` over a ("node", "local") mesh:

  fp32      ``full_precision_mean`` (what ``gradient_allreduce()`` runs): one float32 psum
  bf16      psum of the bfloat16-cast gradient, cast back and divided: 2 bytes per value
  bytegrad  ``compressed_mean`` (hierarchical): float32 within a node, 8-bit codes between

Inputs are per-device random gradients, sharded P(("node", "local")) along a leading device
axis. Each row gives the median wall time of a synchronous step, its ratio to fp32 measured
in the same run, and the bytes each device sends per step between nodes and within nodes,
read from the compiled HLO by ``communication_stats``.

On one CPU host the 8 "devices" share its memory and cores: the "network" is memcpy, so these
timings show compute overhead (quantize, average, dequantize) against memory-speed
collectives, not link savings. The bytes columns are what a real link would carry.

``--wire allreduce`` (or ``ring``) adds a row for ``compressed_mean`` with that wire.

``--codec`` instead times the codec's pieces on ONE core (the process pins itself and asks XLA
for one thread): for a gradient of ``--codec-size`` values (25.2M by default), the
scatter-gather wire's quantize and decode, the uniforms of stochastic rounding from each PRNG
implementation and from the integer wire's hash, and the integer wire's own passes (block
bounds, quantize, decode of the sum, with and without error feedback), the decode fused
into an optimizer pass over a square leaf, as a train step runs it: with the grid computed
in the same program (recomputed per value) and with the decode factors read as data, and
the integer wire's whole sync of one bucket at 8 and 4 bits (its gradient donated). Median
wall and CPU time per call; CPU time is the work itself on a shared host.

``--accuracy`` measures the error of the mean of each wire, not its time: on g nodes of one
device (g = 2 to 32), ``||mean - exact|| / ||exact||`` for the scatter-gather wire at 8 and 4
bits and the integer wire at its width for g (uint8 up to 8 nodes, uint16 beyond; nibbles at 2),
and what uint8 would give past 8 nodes (the width forced), on two gradient models: independent
per node, and 80% shared (correlation 0.8 between nodes).

Usage:
  python benchmarks/sync.py --sizes 1M,4M,16M,64M --mesh 2,4 --repeats 5 --wire allreduce
  python benchmarks/sync.py --codec --repeats 7
  python benchmarks/sync.py --accuracy
"""

import os
import sys

if "--accuracy" in sys.argv:
    # One device per node, up to 32 nodes; 4 threads per device keep 32 devices' collectives
    # from starving each other on a small host (jax_bytegrad.distributed.ensure_cpu_threads).
    os.environ.setdefault("NPROC", "128")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=32"
    )
elif "--codec" in sys.argv:
    # One core, before jax is imported: the affinity is inherited by every XLA thread.
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )
else:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
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


def _methods(mesh, wire=None):
    n, local = mesh.shape["node"], mesh.shape["local"]

    def fp32(g):
        return jax_bytegrad.full_precision_mean(g[0])

    def bf16(g):
        total = jax.lax.psum(g[0].astype(jnp.bfloat16), AXES)
        return total.astype(jnp.float32) / jnp.float32(n * local)

    def bytegrad(g):
        return jax_bytegrad.compressed_mean(g[0])

    methods = [("fp32", fp32), ("bf16", bf16), ("bytegrad", bytegrad)]
    if wire:
        methods.append(
            (
                wire,
                lambda g: jax_bytegrad.compressed_mean(
                    g[0], sync=jax_bytegrad.SyncConfig(wire=wire)
                ),
            )
        )
    out = {}
    for name, f in methods:
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


# The codec's pieces on one core -------------------------------------------------------------


def _timed(fn, *args, repeats: int) -> tuple[float, float]:
    """(median wall s, median process CPU s) per call, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    walls, cpus = [], []
    for _ in range(repeats):
        cpu0, start = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu0)
    return statistics.median(walls), statistics.median(cpus)


def _codec_pieces(size: int) -> dict:
    """Name -> (jitted fn, args) for each timed piece, on one device's `size` values."""
    from jax_bytegrad._src.codecs import Codec, dequantize_blocks, integer, quantize_blocks
    from jax_bytegrad._src.sync import wire as wire_lib
    from jax_bytegrad._src.sync.config import plan_sync

    nearest, stochastic = Codec(implementation="xla"), Codec(stochastic=True, implementation="xla")
    quantize = functools.partial(quantize_blocks, nearest)
    dequantize = functools.partial(dequantize_blocks, nearest)

    block = jax_bytegrad.SyncConfig(bits=8).block_size
    size = -(-size // block) * block
    x = jax.random.normal(jax.random.key(0), (size // block, block), jnp.float32)
    codes, header = jax.jit(quantize)(x)
    keys = {impl: jax.random.key(1, impl=impl) for impl in ("threefry2x32", "rbg", "unsafe_rbg")}
    width = integer.allreduce_width(8, 2)
    block_bounds = functools.partial(integer.integer_bounds, nearest, block_size=block)
    bounds = jax.jit(block_bounds)(x)
    grid = jax.jit(functools.partial(integer.grid, levels=width.levels, stochastic=True))(bounds)
    seed = jnp.asarray([1234567, 89101112], jnp.uint32)

    def index(shape):
        rows = jax.lax.broadcasted_iota(jnp.uint32, shape, 0) * np.uint32(shape[1])
        return rows + jax.lax.broadcasted_iota(jnp.uint32, shape, 1)

    def ar_encode(x, grid, uniforms):
        scale, zero, inv = grid
        return integer.encode(x, scale, zero, inv, width.levels, uniforms).astype(jnp.uint8)

    def ar_feedback(x, grid, uniforms):
        scale, zero, inv = grid
        codes = integer.encode(x, scale, zero, inv, width.levels, uniforms)
        return codes.astype(jnp.uint8), x - (codes - zero) * scale

    def ar_decode(total, grid):
        scale, zero, _ = grid
        offset = np.int32(2) * zero.astype(jnp.int32)
        return (total.astype(jnp.int32) - offset).astype(jnp.float32) * (scale * 0.5)

    pieces = {
        "sg quantize (nearest)": (jax.jit(quantize), (x,)),
        "sg dequantize": (jax.jit(dequantize), (codes, header)),
        "sg quantize (stochastic, threefry)": (
            jax.jit(lambda x, k: quantize_blocks(stochastic, x, k)),
            (x, keys["threefry2x32"]),
        ),
    }
    for impl, key in keys.items():
        pieces[f"uniforms: jax.random.uniform, {impl}"] = (
            jax.jit(lambda k: jax.random.uniform(k, x.shape, jnp.float32)),
            (key,),
        )
    pieces["uniforms: integer hash dither"] = (
        jax.jit(lambda s: integer.dither(s, index(x.shape))),
        (seed,),
    )
    pieces["ar block bounds"] = (jax.jit(block_bounds), (x,))
    pieces["ar quantize (nearest)"] = (
        jax.jit(lambda x, g: ar_encode(x, g, None)),
        (x, grid),
    )
    pieces["ar quantize (stochastic, hash)"] = (
        jax.jit(lambda x, g, s: ar_encode(x, g, integer.dither(s, index(x.shape)))),
        (x, grid, seed),
    )
    pieces["ar quantize + residual (stochastic, hash)"] = (
        jax.jit(lambda x, g, s: ar_feedback(x, g, integer.dither(s, index(x.shape)))),
        (x, grid, seed),
    )
    pieces["ar decode of the sum"] = (jax.jit(ar_decode), (codes, grid))

    # The decode fused into one Adam moment pass over a square leaf (its rows are not whole
    # blocks), as in a train step: factors recomputed per value, or read as data.
    side = math.isqrt(size)
    moment = jnp.ones((side, side), jnp.float32)
    factor_args = dict(width=width, group_size=2, weight=0.5)

    def moment_pass(mu, total, factors):
        mean = integer.integer_decode(nearest, total, factors, width=width)[: side * side]
        return 0.9 * mu + 0.1 * mean.reshape(side, side)

    pieces["ar decode in an Adam pass, factors computed in it"] = (
        jax.jit(
            lambda mu, t, b: moment_pass(mu, t, integer.decode_factors(nearest, b, **factor_args))
        ),
        (moment, codes, bounds),
    )
    pieces["ar decode in an Adam pass, factors as data"] = (
        jax.jit(moment_pass),
        (
            moment,
            codes,
            jax.jit(functools.partial(integer.decode_factors, nearest, **factor_args))(bounds),
        ),
    )

    # The whole integer sync of one bucket as one device of two runs it (on one device here,
    # so the psum is a copy), its gradient donated and the mean carried into the next call,
    # as a train step reuses its buffers.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("node",))
    for bits in (8, 4):
        # The plan of a bucket of two nodes, its group the one "node" axis of this mesh.
        plan = plan_sync(
            jax_bytegrad.SyncConfig(bits=bits, wire="allreduce"),
            [x.reshape(-1)], (2, 1), "cpu", weight=0.5,
        ).buckets[0]  # fmt: skip
        plan = dataclasses.replace(plan, group=dataclasses.replace(plan.group, axis="node"))

        def sync(g, plan=plan):
            mean, _ = wire_lib.sum_shard(g, plan, key=None, residual=None)
            return mean

        sync = jax.jit(
            jax.shard_map(sync, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False),
            donate_argnums=0,
        )
        pieces[f"ar sync of one bucket, {bits}-bit, donated"] = (_carried(sync, x.reshape(-1)), ())
    return pieces


def _carried(fn, x):
    """A call of ``fn`` on what its last call returned (``x`` first): for a ``fn`` that
    donates its argument."""
    held = [jnp.array(x)]

    def call():
        held[0] = fn(held[0])
        return held[0]

    return call


def _codec_costs(size: int, repeats: int) -> int:
    print(
        f"jax {jax.__version__}, one core (affinity {sorted(os.sched_getaffinity(0))}), "
        f"{size / 1e6:g}M float32 values, median of {repeats} after one warm-up; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print()
    print("| piece | wall ms | CPU ms |")
    print("|---|---:|---:|")
    for name, (fn, args) in _codec_pieces(size).items():
        wall, cpu = _timed(fn, *args, repeats=repeats)
        print(f"| {name} | {1e3 * wall:.1f} | {1e3 * cpu:.1f} |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


# The error of the mean, per wire --------------------------------------------------------------


def _relative_error(nodes: int, x: np.ndarray, **kwargs) -> float:
    mesh = jax_bytegrad.make_mesh(nodes, 1)
    fn = jax.jit(
        jax.shard_map(
            lambda g: jax_bytegrad.compressed_mean(
                g[0], **kwargs, sync=jax_bytegrad.SyncConfig(bucket_bytes=None)
            ),
            mesh=mesh,
            in_specs=P(AXES),
            out_specs=P(),
        )
    )
    got = np.asarray(fn(jax.device_put(x, NamedSharding(mesh, P(AXES)))), np.float64)
    exact = x.astype(np.float64).mean(0)
    return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))


def _accuracy(size: int = 64 * 1024) -> int:
    from jax_bytegrad._src.codecs import integer

    print(
        f"jax {jax.__version__}; {size} values per node, nodes of one device, nearest rounding; "
        "||mean - exact|| / ||exact||"
    )
    print()
    print(
        "| nodes | gradients | scatter-gather 8-bit | integer wire (width, levels) | vs SG 8 "
        "| uint8 forced (levels) | scatter-gather 4-bit | integer 4-bit (levels) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for nodes in (2, 4, 8, 16, 32):
        for label, shared in (("independent", 0.0), ("80% shared", 0.8)):
            common = rng.standard_normal(size)
            x = shared * common + np.sqrt(1 - shared**2) * rng.standard_normal((nodes, size))
            x = x.astype(np.float32)
            sg8 = _relative_error(nodes, x)
            sg4 = _relative_error(nodes, x, bits=4)
            width = integer.allreduce_width(8, nodes)
            ar8 = _relative_error(nodes, x, wire="allreduce")
            forced = ""
            if width.bits == 16:
                saved = dict(integer.MAX_GROUP)
                integer.MAX_GROUP[8] = nodes  # what uint8 would give: 255 // nodes levels
                try:
                    forced = f"{_relative_error(nodes, x, wire='allreduce'):.4f} ({255 // nodes})"
                finally:
                    integer.MAX_GROUP.update(saved)
            ar4 = ""
            if nodes <= integer.MAX_GROUP[4]:
                levels4 = integer.allreduce_width(4, nodes).levels
                ar4 = f"{_relative_error(nodes, x, wire='allreduce', bits=4):.4f} ({levels4})"
            print(
                f"| {nodes} | {label} | {sg8:.4f} | {ar8:.4f} (uint{width.bits}, {width.levels}) "
                f"| {ar8 / sg8:.2f}x | {forced} | {sg4:.4f} | {ar4} |",
                flush=True,
            )
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M", help="parameters per device")
    parser.add_argument("--mesh", default="2,4", help="nodes,devices per node")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wire", choices=("allreduce", "ring"), default=None)
    parser.add_argument("--codec", action="store_true", help="time the codec on one core")
    parser.add_argument("--codec-size", type=int, default=25_200_000)
    parser.add_argument("--accuracy", action="store_true", help="error of the mean per wire")
    args = parser.parse_args(argv)
    if args.codec:
        return _codec_costs(args.codec_size, args.repeats)
    if args.accuracy:
        return _accuracy()

    n, local = (int(v) for v in args.mesh.split(","))
    mesh = jax_bytegrad.make_mesh(n, local)
    methods = _methods(mesh, args.wire)
    sharding = NamedSharding(mesh, P(AXES))
    print(
        f"jax {jax.__version__}, {len(jax.devices())} CPU devices on {os.cpu_count()} cores, "
        f"mesh node={n} x local={local}; median of {args.repeats} steps after 2 warm-ups; "
        f"bytes sent per device per step from communication_stats"
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
