"""Pallas GPU kernels for block-wise 8- and 4-bit min-max quantization (backend: Mosaic GPU).

Follows the min-max uint8 codec of Bagua's ByteGrad (Gan et al., "Bagua: Scaling up
Distributed Learning with System Relaxations", VLDB 2022). ``_reference.py`` owns the
semantics; each kernel here computes the same formulas in the same order, so the codes and
headers match the reference bit for bit on the same input (and the same PRNG key: the
stochastic-rounding uniforms are drawn with ``jax.random.uniform(key, shape, float32)``
outside the kernel and streamed in).

Backend: **Mosaic GPU**, launched with ``plgpu.kernel`` and an ``plgpu.emit_pipeline`` per
program. Why:

* JAX 0.11 deprecated the Triton backend of Pallas ("will be removed in a future version";
  the changelog points GPU users to Mosaic GPU), so a Triton kernel would not survive the
  JAX 0.12 the project must keep working on.
* JAX 0.10.2 deprecated ``pl.pallas_call`` on Mosaic GPU in favour of ``plgpu.kernel``, so
  the compiled path uses ``plgpu.kernel`` directly.
* Mosaic GPU needs Hopper or newer (compute capability >= 9.0); the lent machines are H100
  and H200. ``is_supported()`` checks exactly that.

``plgpu.kernel`` has no interpret mode on CPU, so the kernel *bodies* are backend-neutral
functions of block refs, and two small launchers run them: ``pl.pallas_call(...,
interpret=True)`` on any backend (the tests), and ``plgpu.kernel`` + ``plgpu.emit_pipeline``
(TMA copies of each program's tile into shared memory and back) on the GPU. The body only
uses operations that Mosaic GPU lowers in its lane semantics: ``floor``, ``ceil`` and
``isfinite`` are spelled with ``round`` (half to even), comparisons and ``abs``; each spelling
is exact, so results do not change.

Layout: each block of ``block_size`` values is viewed as ``(block_size // 128, 128)`` (a free
reshape) so that no copy has a dimension longer than the 256 elements a TMA box allows. A
program owns ``rows`` consecutive blocks (``_Tiles``); it walks them one at a time, loads the
block once into registers, reduces min and max there, and writes codes plus the two header
floats. The header leaves the kernel as a flat ``(2 * num_blocks,)`` float32 array (TMA needs
16-byte rows; a ``(rows, 2)`` tile has 8) and is reshaped to ``(num_blocks, 2)`` for free.
At 4 bits a block's codes are packed into ``(block_size // 256, 128)`` bytes: row r of the
first half of the block goes to the low nibbles of row r, row r of the second half to the high
nibbles, which is ``_reference``'s packing (value j with value j + block_size // 2) spelled in
whole rows. When no power of two >= 2 divides the block count, the inputs are padded by one
block, and the padding is dropped from the outputs (a copy, for odd block counts only).

Memory traffic per element: quantize reads 4 B (2 B for bfloat16/float16) and writes 1 B
(plus 4 B of uniforms for stochastic rounding); dequantize reads 1 B and writes 4 B;
average_requantize reads n B and writes 1 B; headers add 8 B per block each way. At 4 bits
every code byte above is half a byte.

Float rounding: on CPU (interpret mode) codes and headers equal the *jitted* reference
exactly; the tests check that. Under ``jax.jit`` XLA rewrites ``hi / 255`` into
``hi * (1 / 255)`` and may contract multiply-adds into FMAs, so even the eager and jitted
reference can differ by an ulp in a scale. The compiled Mosaic GPU kernel divides with IEEE
``div.rn`` and rounds each operation, so against XLA on the GPU a scale may differ by an ulp,
and a value within one float rounding of a code boundary may get a code one apart: codes may
differ by at most 1 there. Both are the documented semantics up to float rounding.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

# Mirrors _reference: keeps |zero| <= 2**23 so that code - zero is an exact float32 integer.
_SCALE_FLOOR = 2.0**-23
_F32_MAX = float(np.finfo(np.float32).max)
# Lanes per row of a block: the 128 threads of a warpgroup, and <= the 256-element TMA box.
_LANES = 128
_GRID_AXIS = "programs"
_MIN_COMPUTE_CAPABILITY = 9.0  # Mosaic GPU: Hopper and newer.


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """Tile choice: how many blocks one program (CUDA block) owns.

    Attributes:
      elements_per_program: target values per program; rows = this // block_size. 8192
        float32 values are 32 KiB of shared memory in, 8 KiB of codes out: small enough
        for several programs per SM to hide each other's copy latency.
      min_rows: at least 2 blocks, so a header tile is >= 16 bytes (a TMA requirement).
      max_rows: at most 128 blocks, so a header tile (2 * rows floats) fits a TMA box.
    """

    elements_per_program: int = 8192
    min_rows: int = 2
    max_rows: int = 128

    def target_rows(self, block_size: int) -> int:
        rows = self.elements_per_program // block_size
        return max(self.min_rows, min(self.max_rows, rows))


_DEFAULT_TILES = _Tiles()


def is_supported() -> bool:
    """Whether compiled Mosaic GPU kernels can run on the default backend.

    True only on an NVIDIA GPU of compute capability >= 9.0 (Hopper or newer) with the
    Mosaic GPU Pallas backend importable.
    """
    if jax.default_backend() != "gpu":
        return False
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError:
        return False
    device = jax.devices()[0]
    try:
        capability = float(getattr(device, "compute_capability", ""))
    except ValueError:  # e.g. "gfx950" on ROCm, which Mosaic GPU does not target.
        return False
    return capability >= _MIN_COMPUTE_CAPABILITY


# --- Exact spellings of floor, ceil and isfinite in ops that Mosaic GPU lowers. ---------


def _floor(v):
    # round() is exact; where it went up, the floor is one below (exact for |v| < 2**23,
    # and above that v is already an integer so nothing is subtracted). NaN stays NaN.
    r = jnp.round(v)
    return jnp.where(r > v, r - 1.0, r)


def _ceil(v):
    # -floor(-v) keeps jnp.ceil's sign of zero: ceil(-0.5) is -0.0.
    return -_floor(-v)


def _isfinite(v):
    return jnp.abs(v) <= _F32_MAX


# --- Kernel bodies: the _reference formulas, one block (row) at a time. -----------------


def _max_code(bits: int) -> float:
    return float(2**bits - 1)


def _pack(codes, bits: int):
    """(R, 128) codes -> (R * bits // 8, 128) bytes: first half of rows low, second high."""
    if bits == 8:
        return codes
    half = codes.shape[0] // 2
    return codes[:half] | (codes[half:] << 4)


def _unpack(codes, bits: int):
    if bits == 8:
        return codes
    return jnp.concatenate([codes & 15, codes >> 4], axis=0)


def _scale_and_zero(lo, hi, stochastic: bool, bits: int):
    levels = _max_code(bits) - 1.0 if stochastic else _max_code(bits)
    magnitude = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    scale = jnp.maximum(hi / levels - lo / levels, magnitude * _SCALE_FLOOR)
    inv_scale = jnp.where(scale > 0, 1.0 / scale, 0.0)
    shift = -lo * inv_scale
    zero = _ceil(shift) if stochastic else jnp.round(shift)
    constant = hi == lo
    scale = jnp.where(constant, lo, scale)
    zero = jnp.where(constant, -1.0, zero)
    finite = _isfinite(lo) & _isfinite(hi)
    scale = jnp.where(finite, scale, jnp.nan)
    zero = jnp.where(finite, zero, 0.0)
    inv_scale = jnp.where(finite & ~constant, inv_scale, 0.0)
    return scale, zero, inv_scale


def _encode_block(x, u, stochastic: bool, bits: int):
    """Quantizes one float32 block held in registers; returns (packed codes, scale, zero)."""
    lo = jnp.min(x)
    hi = jnp.max(x)
    scale, zero, inv_scale = _scale_and_zero(lo, hi, stochastic, bits)
    y = x * inv_scale
    if stochastic:
        floor = _floor(y)
        y = floor + (u < y - floor).astype(jnp.float32)
    else:
        y = jnp.round(y)
    y = jnp.where(jnp.isnan(y), 0.0, y)
    codes = jnp.clip(y + zero, 0.0, _max_code(bits)).astype(jnp.uint8)
    return _pack(codes, bits), scale, zero


def _decode_block(codes, scale, zero, bits: int):
    x = (_unpack(codes, bits).astype(jnp.float32) - zero) * scale
    return jnp.clip(x, -_F32_MAX, _F32_MAX)


def _encode_row(i, x, u_ref, codes_ref, header_ref, stochastic: bool, bits: int) -> None:
    """Encodes block ``x`` into row ``i``: its codes, then its scale and zero in the header."""
    u = u_ref[i] if stochastic else None
    codes, scale, zero = _encode_block(x, u, stochastic, bits)
    codes_ref[i] = codes
    header_ref[2 * i] = scale
    header_ref[2 * i + 1] = zero


def _quantize_kernel(*refs, stochastic: bool, bits: int):
    if stochastic:
        x_ref, u_ref, codes_ref, header_ref = refs
    else:
        (x_ref, codes_ref, header_ref), u_ref = refs, None

    def body(i, carry):
        x = x_ref[i].astype(jnp.float32)
        _encode_row(i, x, u_ref, codes_ref, header_ref, stochastic, bits)
        return carry

    lax.fori_loop(0, x_ref.shape[0], body, 0)


def _dequantize_kernel(codes_ref, header_ref, out_ref, *, bits: int):
    def body(i, carry):
        out_ref[i] = _decode_block(codes_ref[i], header_ref[2 * i], header_ref[2 * i + 1], bits)
        return carry

    lax.fori_loop(0, codes_ref.shape[0], body, 0)


def _average_requantize_kernel(*refs, weight: float, stochastic: bool, bits: int):
    if stochastic:
        codes_ref, header_ref, u_ref, out_codes_ref, out_header_ref = refs
    else:
        (codes_ref, header_ref, out_codes_ref, out_header_ref), u_ref = refs, None
    n = codes_ref.shape[0]
    weight = np.float32(weight)

    def body(i, carry):
        # The weight is folded into each chunk's scale, as in _reference, and the chunks
        # are added in order 0..n-1, so the float32 sum rounds the same way.
        total = None
        for c in range(n):
            scale = header_ref[c, 2 * i] * weight
            part = _decode_block(codes_ref[c, i], scale, header_ref[c, 2 * i + 1], bits)
            total = part if total is None else total + part
        _encode_row(i, total, u_ref, out_codes_ref, out_header_ref, stochastic, bits)
        return carry

    lax.fori_loop(0, out_codes_ref.shape[0], body, 0)


# --- Launchers: the same body through pallas_call (interpret) or plgpu.kernel (GPU). -----


def _launch(kernel, *, grid, in_specs, out_specs, out_shape, interpret):
    """Runs ``kernel`` over a 1-D grid of programs, one tile of blocks per program."""
    if interpret:
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=(grid,),
            in_specs=in_specs,
            out_specs=out_specs,
            interpret=True,
        )
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def program(*gmem_refs):
        # Each program copies its tile into shared memory (TMA), runs the body, and copies
        # the results back: one pipeline step per program; programs run in parallel.
        index = lax.axis_index(_GRID_AXIS)

        def at_program(spec):
            return pl.BlockSpec(spec.block_shape, lambda *_: spec.index_map(index))

        plgpu.emit_pipeline(
            lambda _, *tile_refs: kernel(*tile_refs),
            grid=(),
            in_specs=[at_program(s) for s in in_specs],
            out_specs=[at_program(s) for s in out_specs],
        )(*gmem_refs)

    return plgpu.kernel(program, out_type=out_shape, grid=(grid,), grid_names=(_GRID_AXIS,))


def _plan(num_blocks: int, block_size: int, tiles: _Tiles) -> tuple[int, int]:
    """Returns (rows per program, padded block count) with rows dividing the padded count."""
    rows = tiles.target_rows(block_size)
    while rows > tiles.min_rows and num_blocks % rows:
        rows //= 2
    padded = -(-num_blocks // rows) * rows
    return rows, padded


def _pad_blocks(a: jax.Array, padded: int, axis: int) -> jax.Array:
    extra = padded - a.shape[axis]
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def _tile_spec(rows: int, block_size: int, lead: int | None = None) -> pl.BlockSpec:
    lanes = (block_size // _LANES, _LANES)
    if lead is None:
        return pl.BlockSpec((rows, *lanes), lambda g: (g, 0, 0))
    return pl.BlockSpec((lead, rows, *lanes), lambda g: (0, g, 0, 0))


def _header_spec(rows: int, lead: int | None = None) -> pl.BlockSpec:
    if lead is None:
        return pl.BlockSpec((2 * rows,), lambda g: (g,))
    return pl.BlockSpec((lead, 2 * rows), lambda g: (0, g))


def _as_lanes(a: jax.Array) -> jax.Array:
    return a.reshape(*a.shape[:-1], a.shape[-1] // _LANES, _LANES)


def _encode_launch(kernel, inputs, in_specs, *, code_width, rows, padded, num_blocks, interpret):
    """Launches a kernel that writes codes and headers; drops the padding blocks."""
    codes, header = _launch(
        kernel,
        grid=padded // rows,
        in_specs=in_specs,
        out_specs=[_tile_spec(rows, code_width), _header_spec(rows)],
        out_shape=[
            jax.ShapeDtypeStruct((padded, code_width // _LANES, _LANES), jnp.uint8),
            jax.ShapeDtypeStruct((2 * padded,), jnp.float32),
        ],
        interpret=interpret,
    )(*inputs)
    codes = codes.reshape(padded, code_width)[:num_blocks]
    return codes, header.reshape(padded, 2)[:num_blocks]


@functools.partial(jax.jit, static_argnames=("stochastic", "bits", "interpret", "tiles"))
def _quantize(x, u, *, stochastic, bits, interpret, tiles):
    num_blocks, block_size = x.shape
    rows, padded = _plan(num_blocks, block_size, tiles)
    inputs = [_as_lanes(_pad_blocks(x, padded, 0))]
    if stochastic:
        inputs.append(_as_lanes(_pad_blocks(u, padded, 0)))
    return _encode_launch(
        functools.partial(_quantize_kernel, stochastic=stochastic, bits=bits),
        inputs,
        [_tile_spec(rows, block_size)] * len(inputs),
        code_width=block_size * bits // 8,
        rows=rows,
        padded=padded,
        num_blocks=num_blocks,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("bits", "interpret", "tiles"))
def _dequantize(codes, header, *, bits, interpret, tiles):
    num_blocks, code_width = codes.shape
    block_size = code_width * 8 // bits
    rows, padded = _plan(num_blocks, block_size, tiles)
    out = _launch(
        functools.partial(_dequantize_kernel, bits=bits),
        grid=padded // rows,
        in_specs=[_tile_spec(rows, code_width), _header_spec(rows)],
        out_specs=[_tile_spec(rows, block_size)],
        out_shape=[jax.ShapeDtypeStruct((padded, block_size // _LANES, _LANES), jnp.float32)],
        interpret=interpret,
    )(_as_lanes(_pad_blocks(codes, padded, 0)), _pad_blocks(header, padded, 0).reshape(-1))[0]
    return out.reshape(padded, block_size)[:num_blocks]


@functools.partial(jax.jit, static_argnames=("weight", "stochastic", "bits", "interpret", "tiles"))
def _average_requantize(codes, header, u, *, weight, stochastic, bits, interpret, tiles):
    n, num_blocks, code_width = codes.shape
    block_size = code_width * 8 // bits
    rows, padded = _plan(num_blocks, block_size, tiles)
    inputs = [
        _as_lanes(_pad_blocks(codes, padded, 1)),
        _pad_blocks(header, padded, 1).reshape(n, 2 * padded),
    ]
    in_specs = [_tile_spec(rows, code_width, lead=n), _header_spec(rows, lead=n)]
    if stochastic:
        inputs.append(_as_lanes(_pad_blocks(u, padded, 0)))
        in_specs.append(_tile_spec(rows, block_size))
    return _encode_launch(
        functools.partial(
            _average_requantize_kernel, weight=weight, stochastic=stochastic, bits=bits
        ),
        inputs,
        in_specs,
        code_width=code_width,
        rows=rows,
        padded=padded,
        num_blocks=num_blocks,
        interpret=interpret,
    )


def _uniforms(key, shape):
    # The exact draw _reference makes, so stochastic codes match it bit for bit.
    return jax.random.uniform(key, shape, jnp.float32)


def quantize_blocks(
    x: jax.Array,
    *,
    stochastic: bool = False,
    key: jax.Array | None = None,
    bits: int = 8,
    interpret: bool = False,
    tiles: _Tiles = _DEFAULT_TILES,
) -> tuple[jax.Array, jax.Array]:
    """Quantizes rows of ``x`` (num_blocks, block_size); see ``_reference.quantize_blocks``."""
    num_blocks, block_size = x.shape
    if num_blocks == 0:
        return (
            jnp.zeros((0, block_size * bits // 8), jnp.uint8),
            jnp.zeros((0, 2), jnp.float32),
        )
    u = _uniforms(key, x.shape) if stochastic else None
    return _quantize(x, u, stochastic=stochastic, bits=bits, interpret=interpret, tiles=tiles)


def dequantize_blocks(
    codes: jax.Array,
    header: jax.Array,
    *,
    bits: int = 8,
    interpret: bool = False,
    tiles: _Tiles = _DEFAULT_TILES,
) -> jax.Array:
    """Decodes (num_blocks, block_size * bits // 8) codes to float32; see ``_reference``."""
    if codes.shape[0] == 0:
        return jnp.zeros((0, codes.shape[1] * 8 // bits), jnp.float32)
    return _dequantize(codes, header, bits=bits, interpret=interpret, tiles=tiles)


def average_requantize(
    codes: jax.Array,
    header: jax.Array,
    *,
    weight: float,
    stochastic: bool = False,
    key: jax.Array | None = None,
    bits: int = 8,
    interpret: bool = False,
    tiles: _Tiles = _DEFAULT_TILES,
) -> tuple[jax.Array, jax.Array]:
    """One fused pass: decode n chunks, weighted float32 sum, re-encode.

    See ``_reference.average_requantize``; ``codes`` is (n, num_blocks, block_size * bits // 8)
    and ``header`` (n, num_blocks, 2).
    """
    _, num_blocks, code_width = codes.shape
    if num_blocks == 0:
        return (
            jnp.zeros((0, code_width), jnp.uint8),
            jnp.zeros((0, 2), jnp.float32),
        )
    u = _uniforms(key, (num_blocks, code_width * 8 // bits)) if stochastic else None
    return _average_requantize(
        codes,
        header,
        u,
        weight=float(weight),
        stochastic=stochastic,
        bits=bits,
        interpret=interpret,
        tiles=tiles,
    )
