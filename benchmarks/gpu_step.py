"""One GPU: a train step's time and memory, the codec's time at the gradient's size, and the
deviceless compile of the same step against the real one.

On one GPU the mesh is 1 x 1: the sync between nodes has one member and sends nothing, so a
compressed step's time here is the library's own work around an uncompressed step. What the
codec would add where nodes exist is timed apart, at the gradient's size: the Mosaic kernels
and XLA's path, each a quantize, a two-chunk average and a dequantize (what one device runs
in a ByteGrad step), against the plain step's median.

Per ``--algorithm`` (run each in its own process: the device's peak only grows):
  - deviceless: ``gpu_mesh(1, 1, --gpu)``, compiled without the GPU, its ``memory_stats``
    and the compiled program's kernel counts (fusions, custom calls, gemm calls);
  - real: the same step on the device, compiled, its ``memory_stats`` and kernel counts,
    then ``--steps`` timed steps (median ms) and the device's ``peak_bytes_in_use``.

Model: examples/models.py's CharTransformer (``--dim``, ``--depth``, ``--seq``, ``--rows``),
float32, Adam (QAdam for ``qadam``, timed in its compressed phase).

Usage (on a GPU machine, from the clone):
  python benchmarks/gpu_step.py --algorithm gradient_allreduce --codec
  python benchmarks/gpu_step.py --algorithm bytegrad --bits 4 --error-feedback
"""

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import models  # noqa: E402
from quantize import _time as median_time  # noqa: E402  (benchmarks/quantize.py's timer)

import jax_bytegrad as jbg  # noqa: E402
from jax_bytegrad._src.codecs import (  # noqa: E402
    Codec,
    average_requantize,
    dequantize_blocks,
    quantize_blocks,
)
from jax_bytegrad._src.sync.config import DEFAULT_BLOCK_SIZES  # noqa: E402
from jax_bytegrad.sharding import gpu_mesh  # noqa: E402


def model(dim, depth, seq, seed=0):
    net = models.CharTransformer(
        256, seq_len=seq, dim=dim, depth=depth, num_heads=max(4, dim // 128), rngs=nnx.Rngs(seed)
    )
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)

    def loss_fn(params, batch):
        tokens, targets = batch
        logits = nnx.merge(graphdef, params, rest)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return params, loss_fn


def kernels(text: str) -> dict:
    """Counts in a compiled program's text: fusions, custom calls, gemm custom calls."""
    return {
        "fusions": len(re.findall(r"= \S+ fusion\(", text)),
        "custom_calls": len(re.findall(r"custom-call\(", text)),
        "gemm_calls": len(re.findall(r'custom_call_target="[^"]*(?:gemm|cublas|matmul)', text)),
        "triton_gemms": text.count("__triton_gemm"),
        "dots": len(re.findall(r"= \S+ dot\(", text)),
    }


def build(args, mesh):
    settings = {}
    if args.algorithm == "bytegrad":
        settings = {"bits": args.bits, "error_feedback": args.error_feedback}
    elif args.algorithm == "qadam":
        settings = {"learning_rate": 1e-4, "warmup_steps": 2, "bits": args.bits}
    strategy = jbg.Strategy(args.algorithm, mesh=mesh, **settings)
    return strategy, None if args.algorithm == "qadam" else optax.adam(1e-4)


def compiled(step, state, batch, phase):
    lowered = step.lower(state, batch)
    lowered = lowered[phase] if isinstance(lowered, dict) else lowered
    text = lowered.compile().as_text()
    memory = step.memory_stats(state, batch)[phase]
    return {
        "peak_gib": memory.peak_bytes / 2**30,
        "temp_gib": memory.temp_bytes / 2**30,
        "argument_gib": memory.argument_bytes / 2**30,
        **kernels(text),
    }


def codec_ms(size: int, bits: int, impl: str, repeats: int = 20) -> float:
    """Median ms of quantize + two-chunk average + dequantize of ``size`` float32 values."""
    codec = Codec(bits=bits, implementation=impl)
    block = DEFAULT_BLOCK_SIZES[bits]
    x = jax.random.normal(jax.random.key(1), (-(-size // block), block), jnp.float32)

    @jax.jit
    def round_trip(x):
        codes, header = quantize_blocks(codec, x)
        codes, header = average_requantize(
            codec, jnp.stack([codes] * 2), jnp.stack([header] * 2), weight=0.5
        )
        return dequantize_blocks(codec, codes, header)

    return 1e3 * median_time(round_trip, x, repeats=repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="gradient_allreduce")
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--error-feedback", action="store_true")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--codec", action="store_true", help="also time the codec")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device = jax.devices()[0]
    params, loss_fn = model(args.dim, args.depth, args.seq)
    size = sum(x.size for x in jax.tree.leaves(params))
    tokens = jax.random.randint(jax.random.key(2), (args.rows, args.seq + 1), 0, 256)
    batch = (tokens[:, :-1], tokens[:, 1:])
    phase = "compressed" if args.algorithm == "qadam" else "step"
    name = f"{args.algorithm} {args.bits}-bit{' + EF' if args.error_feedback else ''}"
    row = {
        "name": name,
        "device": device.device_kind,
        "jax": jax.__version__,
        "params_m": size / 1e6,
    }

    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    batch_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    strategy, optimizer = build(args, gpu_mesh(1, 1, args.gpu))
    step = strategy.train_step(loss_fn, optimizer)
    state = step.state_shapes(shapes)
    if phase == "compressed":
        state = state._replace(step=3)
    row["deviceless"] = compiled(step, state, batch_shapes, phase)

    mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("node", "local"))
    strategy, optimizer = build(args, mesh)
    step = strategy.train_step(loss_fn, optimizer)
    state = step.init(params)
    for _ in range(3 if phase == "compressed" else 1):  # QAdam: past its warm-up
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    row["real"] = compiled(step, state, batch, phase)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    row["step_ms"] = 1e3 * statistics.median(times)
    row["loss"] = float(metrics["loss"])
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use")  # None on a CPU
    row["device_peak_gib"] = peak and peak / 2**30
    if args.codec:
        row["codec_ms"] = {}
        for impl in ("pallas", "xla"):
            for bits in (8, 4):
                try:
                    row["codec_ms"][f"{impl} {bits}-bit"] = codec_ms(size, bits, impl)
                except Exception as e:  # noqa: BLE001 - recorded: the Mosaic kernels need a GPU
                    row["codec_ms"][f"{impl} {bits}-bit"] = f"{type(e).__name__}: {e}"[:200]
    print(json.dumps(row))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
