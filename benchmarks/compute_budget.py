"""ByteGrad's CPU compute budget on ONE core, with the collectives replaced by identity.

The budget (Bagua's ByteGrad on a slow link; Gan et al., VLDB 2022): quantize + average +
dequantize of a 25M-float gradient must take <= 0.1 s on one CPU core, so that the CPU work
stays small beside the link time that 8-bit codes save.

This runs the data path of ``collectives._compressed_sum_flat`` for the shard a device owns,
with the collectives removed, for n = 2 and 4 nodes:

    quantize the shard as n chunks       (quantize_blocks)
    "all_to_all" over node               identity: the n chunks are the ones just encoded
    decode n chunks, sum, re-encode      (average_requantize)
    "all_gather" over node               identity: n copies of the averaged chunk
    dequantize the n gathered chunks     (dequantize_blocks)

Each stage is also timed alone, next to two float32 copies of the same element count:
``fresh`` (``x + 1`` into a new buffer: what every XLA call does with its outputs, page faults
included) and ``in place`` (the same, donated: the DRAM/cache ceiling).

Bytes through memory per float32 element (b = block size; the floor of each stage):
  quantize     4 read + 1 written (+ 8/b header)
  average      n x 1 read (+ n x 8/b) + 1 written per element of its chunk (N/n elements)
  dequantize   1 read (+ 8/b) + 4 written

The path is timed stage by stage, each stage its own compiled program: a real all_to_all or
all_gather between them materializes its operands, which separate programs model. In one
program with identity in place of the collectives, XLA on CPU fuses the encode into every
later decode and recomputes it, which no real step does.

Usage:
  python benchmarks/compute_budget.py                     # pins itself to one core
  python benchmarks/compute_budget.py --nodes 2,4 --repeats 7 --hlo
  python benchmarks/compute_budget.py --hugepages   # GLIBC_TUNABLES=glibc.malloc.hugetlb=1
"""

import os
import sys

# Transparent huge pages for glibc's mmapped buffers: XLA allocates every output and temp
# arena afresh per call, and first-touch page faults otherwise dominate (see RESULTS.md).
# glibc reads its tunables at start-up, hence the re-exec.
if "--hugepages" in sys.argv and "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", ""):
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    os.execv(sys.executable, [sys.executable, *sys.argv])

# One core, before jax is imported: the affinity is inherited by every XLA thread.
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import argparse  # noqa: E402
import functools  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jax_bytegrad import SyncConfig  # noqa: E402
from jax_bytegrad._src.codecs import (  # noqa: E402
    Codec,
    average_requantize,
    dequantize_blocks,
    quantize_blocks,
)
from jax_bytegrad.profiling import array_shapes, hlo_instructions  # noqa: E402

BUDGET_S = 0.1
HEADER_BYTES = 8


def _timed(fn, *args, repeats):
    """(median wall s, median process CPU s, minor page faults per call) after one warm-up.

    On a shared host the wall time includes waiting for the core; the process CPU time
    (user + system, page faults included) is the work itself. Both are reported.
    """
    jax.block_until_ready(fn(*args))
    walls, cpus = [], []
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        cpu0, start = time.process_time(), time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu0)
        del out
    faults1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    return statistics.median(walls), statistics.median(cpus), (faults1 - faults0) / repeats


def _stages(n: int):
    xla = Codec(implementation="xla")

    def average(c, h):
        return average_requantize(xla, c, h, weight=1.0 / n)

    return (
        functools.partial(quantize_blocks, xla),
        average,
        functools.partial(dequantize_blocks, xla),
    )


def _pipeline(quantize, average, dequantize, n: int, block: int):
    def run(x):
        blocks = x.reshape(-1, block)
        codes, header = quantize(blocks)
        chunk = blocks.shape[0] // n
        # all_to_all over node: identity (this device receives the n chunks it encoded).
        codes, header = average(codes.reshape(n, chunk, block), header.reshape(n, chunk, 2))
        # all_gather over node: identity (n copies of the averaged chunk).
        codes = jnp.concatenate([codes] * n)
        header = jnp.concatenate([header] * n)
        return dequantize(codes, header).reshape(-1)

    return run


def _passes(hlo: str, big_elements: int) -> str:
    """Fusions of the entry computation whose operands or result hold >= big_elements values."""
    kinds = []
    for op in hlo_instructions(hlo):
        if not op.entry or op.opcode not in ("fusion", "copy", "while", "custom-call"):
            continue
        shapes = array_shapes(f"{op.shape} {op.args.split(', metadata')[0]}")
        if max((int(np.prod(dims)) for _, dims in shapes), default=0) >= big_elements:
            kinds.append(op.name if op.opcode != "while" else "while(loop over tiles)")
    return ", ".join(kinds)


def _row(name, seconds, nbytes, extra=""):
    gbs = nbytes / seconds / 1e9
    return f"| {name:34} | {seconds * 1e3:9.2f} | {nbytes / 1e6:8.1f} | {gbs:7.2f} | {extra}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=float, default=25.2e6)
    parser.add_argument("--nodes", default="2,4")
    parser.add_argument("--block-size", type=int, default=SyncConfig(bits=8).block_size)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hlo", action="store_true", help="list the big fusions of each stage")
    parser.add_argument(
        "--hugepages",
        action="store_true",
        help="re-run under GLIBC_TUNABLES=glibc.malloc.hugetlb=1",
    )
    return parser


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)

    nodes = [int(v) for v in args.nodes.split(",")]
    b = args.block_size
    granule = b * int(np.lcm.reduce(nodes))
    size = -(-int(args.elements) // granule) * granule
    hdr = HEADER_BYTES / b
    x = jax.random.normal(jax.random.key(0), (size,), jnp.float32)
    blocks = x.reshape(-1, b)

    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, affinity "
        f"{sorted(os.sched_getaffinity(0))}, XLA_FLAGS={os.environ['XLA_FLAGS'].strip()!r}, "
        f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}"
    )
    print(f"{size:,} float32 elements, block {b}, median of {args.repeats} after 1 warm-up")
    print()
    head = f"| {'stage':34} | {'median ms':>9} | {'MB floor':>8} | {'GB/s':>7} | notes"
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:]) + "|")

    fresh = jax.jit(lambda a: a + 1.0)
    t, cpu, faults = _timed(fresh, x, repeats=args.repeats)  # noqa: F841
    print(
        _row(
            "copy f32, fresh output",
            t,
            8 * size,
            f"cpu {cpu * 1e3:.1f} ms, {faults:.0f} faults/call",
        )
    )
    copy_gbs = 8 * size / t / 1e9
    inplace = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    y = inplace(jnp.zeros_like(x))
    jax.block_until_ready(y)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        y = jax.block_until_ready(inplace(y))
        times.append(time.perf_counter() - start)
    t_in = statistics.median(times)
    print(_row("copy f32, in place (donated)", t_in, 8 * size, "DRAM/cache ceiling"))
    del y

    results = {}
    for n in nodes:
        chunk = blocks.shape[0] // n
        floors = {
            "quantize": size * (4 + 1 + hdr),
            "average": size * (1 + hdr) + size / n * (1 + hdr),
            "dequantize": size * (1 + hdr + 4),
        }
        quantize, average, dequantize = _stages(n)
        jq, ja, jd = jax.jit(quantize), jax.jit(average), jax.jit(dequantize)
        codes, header = jq(blocks)
        c3, h3 = codes.reshape(n, chunk, b), header.reshape(n, chunk, 2)
        ac, ah = ja(c3, h3)
        gc, gh = jnp.concatenate([ac] * n), jnp.concatenate([ah] * n)
        total = cpu_total = 0.0
        for stage, fn, fargs in (
            ("quantize", jq, (blocks,)),
            ("average", ja, (c3, h3)),
            ("dequantize", jd, (gc, gh)),
        ):
            t, cpu, faults = _timed(fn, *fargs, repeats=args.repeats)
            total += t
            cpu_total += cpu
            note = f"cpu {cpu * 1e3:.1f} ms, {faults:.0f} faults/call"
            if args.hlo:
                hlo = fn.lower(*fargs).compile().as_text()
                note += f"; big ops: {_passes(hlo, chunk * b // 2)}"
            print(_row(f"n={n} {stage}", t, floors[stage], note))
        # The path is timed stage by stage, each its own program: a real all_to_all or
        # all_gather between them materializes its operands, which is what separate
        # programs model. In one program with identity in their place, XLA on CPU fuses
        # the encode into every later decode and recomputes it, which no real step does.
        whole = jax.jit(_pipeline(quantize, average, dequantize, n, b))
        floor = sum(floors.values())
        verdict = "MEETS" if cpu_total <= BUDGET_S else "EXCEEDS"  # one core: CPU time
        print(
            _row(
                f"n={n} whole path",
                total,
                floor,
                f"{verdict} 0.1 s on cpu {cpu_total * 1e3:.1f} ms; floor at fresh-copy "
                f"{floor / copy_gbs / 1e6:.1f} ms, in-place "
                f"{floor / (8 * size / t_in) * 1e3:.1f} ms",
            )
        )
        cpu = cpu_total
        # The one-program path computes the same bits as the stages.
        same = all(
            np.array_equal(np.asarray(a), np.asarray(r))
            for a, r in zip((whole(x),), (jd(gc, gh).reshape(-1),), strict=True)
        )
        print(f"|   n={n}: one-program result bit-identical to the stages: {same}")
        results[n] = (total, cpu)
        del codes, header, c3, h3, ac, ah, gc, gh
    print()
    for n, (t, cpu) in results.items():
        print(
            f"n={n}: wall {t * 1e3:7.1f} ms, cpu {cpu * 1e3:7.1f} ms; budget "
            f"{BUDGET_S * 1e3:.0f} ms: {'met' if cpu <= BUDGET_S else 'NOT met'} (on CPU time)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
