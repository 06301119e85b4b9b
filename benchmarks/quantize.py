"""Throughput and error of block-wise 8- or 4-bit quantize, dequantize and the fused average.

Prints one table: median time and GB/s for each op, size and available implementation
(``xla`` always, ``pallas`` when a supported GPU is present), next to the device's measured
copy bandwidth (one large elementwise pass, bytes read + written) and the ratio to it.

Bytes counted per element of float32 input, with b = block_size and c = bits / 8 the bytes
of code per element:
  quantize            4 B read + c B written + 8 / b B of header written
  dequantize          c B + 8 / b B read + 4 B written
  average (n chunks)  n * (c + 8 / b) B read + (c + 8 / b) B written

``--block-sizes`` sweeps the block size so the default block size can be chosen from data:
per block size, the header overhead (header bytes / code bytes), the throughput, and on the
quantize rows the nearest-rounding error, as RMS(x_hat - x) / RMS(x), on two inputs:
N(0, 1), and Student's t with 3 degrees of freedom, whose heavy tails are closer to real
gradients (one large value widens its whole block's grid).

Usage:
  python benchmarks/quantize.py                         # CPU-friendly: 1M, 4M, 16M elements
  python benchmarks/quantize.py --sizes 1M,16M,64M,256M  # 256M float32 needs ~1 GiB in, ~4 GiB
                                                         # in all for the n=4 average: use a GPU
  python benchmarks/quantize.py --block-sizes 256,512,1024,2048,4096 --sizes 16M
  python benchmarks/quantize.py --bits 4 --block-sizes 256,512,1024,2048,4096 --sizes 16M
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

from jax_bytegrad._src.codecs import (  # noqa: E402
    Codec,
    average_requantize,
    dequantize_blocks,
    quantize_blocks,
)
from jax_bytegrad._src.codecs import pallas as _pallas  # noqa: E402

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


def _ops(impl: str, bits: int):
    codec = Codec(bits=bits, implementation=impl)
    quantize = jax.jit(lambda x: quantize_blocks(codec, x))
    dequantize = jax.jit(lambda c, h: dequantize_blocks(codec, c, h))

    def average(weight):
        return jax.jit(lambda c, h: average_requantize(codec, c, h, weight=weight))

    return quantize, dequantize, average


def _relative_error(x, quantize, dequantize) -> float:
    """RMS(x_hat - x) / RMS(x) under nearest rounding, computed in float64 on the host."""
    x_hat = np.asarray(dequantize(*quantize(x)), np.float64)
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean((x_hat - x) ** 2) / np.mean(x**2)))


def _bench_size(size, block_size, bits, impls, repeats, chunks):
    num_blocks = size // block_size
    x = jax.random.normal(jax.random.key(0), (num_blocks, block_size), jnp.float32)
    heavy = jax.random.t(jax.random.key(1), 3.0, (num_blocks, block_size), jnp.float32)
    hdr = HEADER_BYTES / block_size
    code = bits / 8
    rows = []
    for impl in impls:
        quantize, dequantize, average = _ops(impl, bits)
        codes, header = jax.block_until_ready(quantize(x))
        errors = tuple(_relative_error(v, quantize, dequantize) for v in (x, heavy))
        t = _time(quantize, x, repeats=repeats)
        rows.append((impl, "quantize", size, block_size, t, size * (4 + code + hdr), errors))
        t = _time(dequantize, codes, header, repeats=repeats)
        rows.append((impl, "dequantize", size, block_size, t, size * (code + hdr + 4), None))
        for n in chunks:
            many_codes = jnp.stack([codes] * n)
            many_header = jnp.stack([header] * n)
            t = _time(average(1.0 / n), many_codes, many_header, repeats=repeats)
            nbytes = size * (code + hdr) * (n + 1)
            rows.append((impl, f"average n={n}", size, block_size, t, nbytes, None))
            del many_codes, many_header
        del codes, header
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,4M,16M", help="elements, e.g. 1M,16M,256M")
    parser.add_argument("--bits", type=int, choices=(8, 4), default=8)
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
    print(f"implementations: {', '.join(impls)}; {args.bits}-bit codes")
    print("copy = one float32 elementwise pass of the same element count (read + write)")
    print("err N / err t3 = RMS(x_hat - x) / RMS(x), nearest rounding, N(0,1) / Student t(3)")
    print()
    header = (
        f"| {'impl':6} | {'op':12} | {'elements':>8} | {'block':>5} | {'header %':>8} "
        f"| {'median ms':>9} | {'GB/s':>7} | {'copy GB/s':>9} | {'/ copy':>6} "
        f"| {'err N':>7} | {'err t3':>7} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for size in sizes:
        copy_gbs = _copy_bandwidth(size, args.repeats)
        for block_size in block_sizes:
            for impl, op, n, b, t, nbytes, errors in _bench_size(
                size, block_size, args.bits, impls, args.repeats, chunks
            ):
                gbs = nbytes / t / 1e9
                overhead = 100.0 * HEADER_BYTES / (b * args.bits / 8)  # per code byte
                err = "".join(f"| {e:>7.4f} " for e in errors) if errors else "|         " * 2
                print(
                    f"| {impl:6} | {op:12} | {n >> 20:>7}M | {b:>5} | {overhead:>7.2f}% "
                    f"| {t * 1e3:>9.2f} | {gbs:>7.2f} | {copy_gbs:>9.2f} | {gbs / copy_gbs:>6.2f} "
                    f"{err}|"
                )
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    raise SystemExit(main())
