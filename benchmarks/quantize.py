"""Throughput of block-wise 8-bit quantize, dequantize and the fused average, per implementation.

Prints one table: median time and GB/s for each op, size and available implementation
(``xla`` always, ``pallas`` when a supported GPU is present), next to the device's measured
copy bandwidth (one large elementwise pass, bytes read + written) and the ratio to it.

Bytes counted per element of float32 input, with b = block_size:
  quantize            4 B read + 1 B written + 8 / b B of header written
  dequantize          1 B + 8 / b B read + 4 B written
  average (n chunks)  n * (1 + 8 / b) B read + (1 + 8 / b) B written

``--block-sizes`` sweeps the block size (throughput and header overhead per block size) so
the default block size can be chosen from data.

Usage:
  python benchmarks/quantize.py                         # CPU-friendly: 1M, 4M, 16M elements
  python benchmarks/quantize.py --sizes 1M,16M,64M,256M  # 256M float32 needs ~1 GiB in, ~4 GiB
                                                         # in all for the n=4 average: use a GPU
  python benchmarks/quantize.py --block-sizes 256,512,1024,2048,4096 --sizes 16M
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jax_bytegrad import _pallas, _reference  # noqa: E402

HEADER_BYTES = 8


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    factor = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
    return int(text.rstrip("KMG")) * factor


def _time(fn, *args, repeats: int) -> float:
    """Median wall-clock seconds of fn(*args) after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copy_bandwidth(size: int, repeats: int) -> float:
    """GB/s of one elementwise float32 pass (read + write), the memory-bound ceiling."""
    x = jnp.arange(size, dtype=jnp.float32)
    # A bare copy can be elided by XLA; adding 1 keeps one read and one write per element.
    fn = jax.jit(lambda a: a + 1.0)
    return 2 * 4 * size / _time(fn, x, repeats=repeats) / 1e9


def _ops(impl: str, block_size: int):
    if impl == "xla":
        quantize = jax.jit(_reference.quantize_blocks)
        dequantize = jax.jit(_reference.dequantize_blocks)

        def average(weight):
            return jax.jit(lambda c, h: _reference.average_requantize(c, h, weight=weight))

    else:

        def quantize(x):
            return _pallas.quantize_blocks(x)

        def dequantize(c, h):
            return _pallas.dequantize_blocks(c, h)

        def average(weight):
            return lambda c, h: _pallas.average_requantize(c, h, weight=weight)

    return quantize, dequantize, average


def _bench_size(size, block_size, impls, repeats, chunks):
    num_blocks = size // block_size
    x = jax.random.normal(jax.random.key(0), (num_blocks, block_size), jnp.float32)
    hdr = HEADER_BYTES / block_size
    rows = []
    for impl in impls:
        quantize, dequantize, average = _ops(impl, block_size)
        codes, header = jax.block_until_ready(quantize(x))
        t = _time(quantize, x, repeats=repeats)
        rows.append((impl, "quantize", size, block_size, t, size * (4 + 1 + hdr)))
        t = _time(dequantize, codes, header, repeats=repeats)
        rows.append((impl, "dequantize", size, block_size, t, size * (1 + hdr + 4)))
        for n in chunks:
            many_codes = jnp.stack([codes] * n)
            many_header = jnp.stack([header] * n)
            t = _time(average(1.0 / n), many_codes, many_header, repeats=repeats)
            rows.append((impl, f"average n={n}", size, block_size, t, size * (1 + hdr) * (n + 1)))
            del many_codes, many_header
        del codes, header
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,4M,16M", help="elements, e.g. 1M,16M,256M")
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument(
        "--block-sizes", default="", help="sweep block sizes instead, e.g. 256,512,1024,2048,4096"
    )
    parser.add_argument("--chunks", default="2,4", help="chunk counts n for the fused average")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    block_sizes = (
        [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else [args.block_size]
    )
    chunks = [int(n) for n in args.chunks.split(",") if n]
    impls = ["xla"] + (["pallas"] if _pallas.is_supported() else [])

    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"implementations: {', '.join(impls)}")
    print("copy = one float32 elementwise pass of the same element count (read + write)")
    print()
    header = (
        f"| {'impl':6} | {'op':12} | {'elements':>8} | {'block':>5} | {'header %':>8} "
        f"| {'median ms':>9} | {'GB/s':>7} | {'copy GB/s':>9} | {'/ copy':>6} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for size in sizes:
        copy_gbs = _copy_bandwidth(size, args.repeats)
        for block_size in block_sizes:
            for impl, op, n, b, t, nbytes in _bench_size(
                size, block_size, impls, args.repeats, chunks
            ):
                gbs = nbytes / t / 1e9
                overhead = 100.0 * HEADER_BYTES / b  # header bytes per code byte
                print(
                    f"| {impl:6} | {op:12} | {n >> 20:>7}M | {b:>5} | {overhead:>7.2f}% "
                    f"| {t * 1e3:>9.2f} | {gbs:>7.2f} | {copy_gbs:>9.2f} | {gbs / copy_gbs:>6.2f} |"
                )
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    raise SystemExit(main())
