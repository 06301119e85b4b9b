"""Pallas kernels for block-wise 8- and 4-bit min-max quantization, compiled by Mosaic GPU.

Follows the min-max uint8 codec of Bagua's ByteGrad (Gan et al., "Bagua: Scaling up
Distributed Learning with System Relaxations", VLDB 2022). ``reference.py`` owns the
semantics; each kernel here computes the same formulas in the same order (the grid rule is
``grid.py``'s, spelled as Mosaic GPU lowers it: ``_MOSAIC``), so in interpret mode the codes
and headers equal the jitted reference bit for bit (the tests check it). Each public function
takes the reference's arguments: a ``codecs.Codec``, the arrays, and the key. The
stochastic-rounding uniforms are drawn with ``jax.random.uniform(key, shape, float32)``
outside the kernel, as the reference draws them, and streamed in.

Backend: Mosaic GPU, launched with ``plgpu.kernel`` and one ``plgpu.emit_pipeline`` per
program (TMA copies of the program's tile into shared memory and back). The lowering
semantics are pinned to Warpgroup: it is the default from JAX 0.11 and lowers these kernels
on every supported JAX, where the Lane semantics of JAX 0.10 reject TMA copies of fewer than
128 bytes (a small header tile). Mosaic GPU needs an NVIDIA GPU of compute capability >= 9.0
(Hopper or newer); ``is_supported()`` checks exactly that.

``plgpu.kernel`` has no interpret mode for TMA pipelines, so the kernel bodies are functions
of block refs, and two small launchers run them: ``pl.pallas_call(..., interpret=True)`` on
any backend (the tests), and ``plgpu.kernel`` on the GPU. The compiled launcher sits in a
``lax.platform_dependent`` whose only branch is CUDA: it lowers for CUDA from any host (AOT
lowering and ``jax.export`` work on a CPU machine), and lowering it for any other platform
raises ``NotImplementedError``.

What Mosaic GPU lowers shapes the bodies:

* No ``floor``, ``ceil`` or ``isfinite`` lowering: they are spelled with ``round`` (half to
  even), comparisons and ``abs``; each spelling is exact.
* A value in registers is never sliced or concatenated (``vector.extract`` and
  ``vector_concat`` need a tiled layout, and a block loaded from shared memory has a strided
  one). The two halves of a 4-bit block are loaded and stored through their own ref slices.
* No shifts on 8-bit integers: 4-bit codes are packed as ``low + 16 * high`` and unpacked
  with a floor, in float32, where every value involved is a small exact integer.

Layout: each block of ``block_size`` values is viewed as ``(block_size // 128, 128)`` (a free
reshape) so that no copy has a dimension longer than the 256 elements a TMA box allows. A
program owns ``rows`` consecutive blocks (``_Tiles``); it walks them one at a time, loads the
block into registers, reduces min and max there, and writes codes plus the two header
floats. The header leaves the kernel as a flat ``(2 * num_blocks,)`` float32 array (TMA needs
16-byte rows; a ``(rows, 2)`` tile has 8) and is reshaped to ``(num_blocks, 2)`` for free.
At 4 bits a block's codes are ``(block_size // 256, 128)`` bytes: row r of the first half of
the block goes to the low nibbles of row r, row r of the second half to the high nibbles,
which is the reference's packing (value j with value j + block_size // 2) in whole rows.
When no power of two >= 2 divides the block count, the inputs are padded by one block, and
the padding is dropped from the outputs (a copy, for odd block counts only).

Float rounding: under ``jax.jit`` XLA rewrites ``hi / 255`` into ``hi * (1 / 255)`` and may
contract multiply-adds, so even the eager and jitted reference can differ by an ulp in a
scale. The compiled kernel divides with IEEE ``div.rn`` and rounds each operation, so against
XLA on a GPU a scale may differ by an ulp, and a value within one float rounding of a code
boundary may get a code one apart. Both are the documented semantics up to float rounding;
the per-kernel check in ``selection.py`` allows exactly that much.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_bytegrad._src.codecs import grid as _grid

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
    return jnp.abs(v) <= _grid.F32_MAX


# The grid rule of grid.py, as Mosaic GPU lowers it.
_MOSAIC = _grid.Spelling(floor=_floor, ceil=_ceil, isfinite=_isfinite)


# --- Kernel bodies: the reference formulas, one block (row of the tile) at a time. --------


def _parts(block_rows: int, bits: int) -> list[slice]:
    """Row ranges of a block whose codes share bytes: all rows at 8 bits, two halves at 4.

    Each part is loaded and stored through its own ref slice, so no value in registers is
    ever sliced or concatenated.
    """
    if bits == 8:
        return [slice(None)]
    half = block_rows // 2
    return [slice(0, half), slice(half, block_rows)]


def _pack(codes, bits: int):
    """Float32 codes of each part -> uint8 bytes: the first half's code in the low nibble."""
    if bits == 8:
        return codes[0].astype(jnp.uint8)
    low, high = codes
    # Exact on small integers, and free of the 8-bit integer shifts Mosaic GPU rejects.
    return (low + 16.0 * high).astype(jnp.uint8)


def _unpack(codes, bits: int):
    """uint8 bytes -> float32 codes of each part; the inverse of ``_pack``."""
    codes = codes.astype(jnp.float32)
    if bits == 8:
        return [codes]
    high = _floor(codes * (1.0 / 16.0))
    return [codes - 16.0 * high, high]


def _codes(x, u, zero, inv_scale, bits: int):
    return _grid.codes(x * inv_scale, zero, _grid.max_code(bits), u, _MOSAIC.floor)


def _encode_row(i, values, u_ref, codes_ref, header_ref, codec) -> None:
    """Encodes block ``i``, given as float32 ``values`` of its parts, into row ``i``."""
    bits, stochastic = codec.bits, codec.stochastic
    lo = functools.reduce(jnp.minimum, [jnp.min(v) for v in values])
    hi = functools.reduce(jnp.maximum, [jnp.max(v) for v in values])
    scale, zero, inv_scale = _grid.grid(
        lo, hi, levels=_grid.max_code(bits), stochastic=stochastic, spelling=_MOSAIC
    )
    parts = _parts(codes_ref.shape[1] * 8 // bits, bits)
    codes = [
        _codes(v, u_ref[i, part] if stochastic else None, zero, inv_scale, bits)
        for v, part in zip(values, parts, strict=True)
    ]
    codes_ref[i] = _pack(codes, bits)
    header_ref[2 * i] = scale
    header_ref[2 * i + 1] = zero


def _quantize_kernel(*refs, codec):
    if codec.stochastic:
        x_ref, u_ref, codes_ref, header_ref = refs
    else:
        (x_ref, codes_ref, header_ref), u_ref = refs, None
    parts = _parts(x_ref.shape[1], codec.bits)

    def body(i, carry):
        values = [x_ref[i, part].astype(jnp.float32) for part in parts]
        _encode_row(i, values, u_ref, codes_ref, header_ref, codec)
        return carry

    lax.fori_loop(0, x_ref.shape[0], body, 0)


def _dequantize_kernel(codes_ref, header_ref, out_ref, *, codec):
    parts = _parts(out_ref.shape[1], codec.bits)

    def body(i, carry):
        scale, zero = header_ref[2 * i], header_ref[2 * i + 1]
        for part, codes in zip(parts, _unpack(codes_ref[i], codec.bits), strict=True):
            out_ref[i, part] = _grid.decode(codes, zero, scale)
        return carry

    lax.fori_loop(0, codes_ref.shape[0], body, 0)


def _average_requantize_kernel(*refs, codec, weight: float):
    if codec.stochastic:
        codes_ref, header_ref, u_ref, out_codes_ref, out_header_ref = refs
    else:
        (codes_ref, header_ref, out_codes_ref, out_header_ref), u_ref = refs, None
    n = codes_ref.shape[0]
    weight = np.float32(weight)

    def body(i, carry):
        # The weight is folded into each chunk's scale, as in the reference, and the chunks
        # are added in order 0..n-1, so the float32 sum rounds the same way.
        totals = None
        for c in range(n):
            scale = header_ref[c, 2 * i] * weight
            zero = header_ref[c, 2 * i + 1]
            codes = _unpack(codes_ref[c, i], codec.bits)
            values = [_grid.decode(part, zero, scale) for part in codes]
            if totals is not None:
                values = [t + v for t, v in zip(totals, values, strict=True)]
            totals = values
        _encode_row(i, totals, u_ref, out_codes_ref, out_header_ref, codec)
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

    compiled = plgpu.kernel(
        program,
        out_type=out_shape,
        grid=(grid,),
        grid_names=(_GRID_AXIS,),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )

    def refused(*_):
        flag = _cuda_only_p.bind()
        return [jnp.broadcast_to(flag.astype(s.dtype), s.shape) for s in out_shape]

    return lambda *args: lax.platform_dependent(*args, cuda=compiled, default=refused)


# Stands in for the kernel on every platform but CUDA: it traces like any op, and lowering
# it raises, so implementation="pallas" fails clearly where it would run, and only there.
_cuda_only_p = Primitive("jax_bytegrad_mosaic_gpu_kernel_needs_cuda")
_cuda_only_p.def_abstract_eval(lambda: jax.core.ShapedArray((), jnp.float32))


def _refuse_lowering(ctx):
    del ctx
    raise NotImplementedError(
        "jax_bytegrad: implementation='pallas' runs compiled Mosaic GPU kernels, which need "
        "an NVIDIA GPU of compute capability >= 9.0 (Hopper or newer), but this computation "
        "is being lowered for another platform. Pass implementation='xla' (or None for the "
        "best available), or 'pallas_interpret' to run the kernel in the Pallas interpreter"
    )


mlir.register_lowering(_cuda_only_p, _refuse_lowering)


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


def _no_blocks(code_width: int):
    return jnp.zeros((0, code_width), jnp.uint8), jnp.zeros((0, 2), jnp.float32)


def _uniforms(codec, key, shape: tuple[int, int]):
    # The exact draw the reference makes, so stochastic codes match it bit for bit.
    return jax.random.uniform(key, shape, jnp.float32) if codec.stochastic else None


# The public functions take the reference's arguments: a ``codecs.Codec`` (bits, rounding),
# the arrays and key, and average_requantize's weight; then how to run (``interpret``, ``tiles``).
_STATIC = ("codec", "interpret", "tiles")


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantize_blocks(codec, x, key=None, *, interpret=False, tiles=_DEFAULT_TILES):
    """``reference.quantize_blocks`` of ``x`` (num_blocks, block_size), as a kernel."""
    num_blocks, block_size = x.shape
    code_width = block_size * codec.bits // 8
    if num_blocks == 0:
        return _no_blocks(code_width)
    rows, padded = _plan(num_blocks, block_size, tiles)
    u = _uniforms(codec, key, x.shape)
    inputs = [_as_lanes(_pad_blocks(a, padded, 0)) for a in (x, u) if a is not None]
    return _encode_launch(
        functools.partial(_quantize_kernel, codec=codec),
        inputs,
        [_tile_spec(rows, block_size)] * len(inputs),
        code_width=code_width,
        rows=rows,
        padded=padded,
        num_blocks=num_blocks,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def dequantize_blocks(codec, codes, header, *, interpret=False, tiles=_DEFAULT_TILES):
    """``reference.dequantize_blocks``: (num_blocks, block_size * bits // 8) codes to float32."""
    num_blocks, code_width = codes.shape
    block_size = code_width * 8 // codec.bits
    if num_blocks == 0:
        return jnp.zeros((0, block_size), jnp.float32)
    rows, padded = _plan(num_blocks, block_size, tiles)
    out = _launch(
        functools.partial(_dequantize_kernel, codec=codec),
        grid=padded // rows,
        in_specs=[_tile_spec(rows, code_width), _header_spec(rows)],
        out_specs=[_tile_spec(rows, block_size)],
        out_shape=[jax.ShapeDtypeStruct((padded, block_size // _LANES, _LANES), jnp.float32)],
        interpret=interpret,
    )(_as_lanes(_pad_blocks(codes, padded, 0)), _pad_blocks(header, padded, 0).reshape(-1))[0]
    return out.reshape(padded, block_size)[:num_blocks]


@functools.partial(jax.jit, static_argnames=(*_STATIC, "weight"))
def average_requantize(
    codec, codes, header, key=None, *, weight, interpret=False, tiles=_DEFAULT_TILES
):
    """``reference.average_requantize`` in one fused pass: decode, weighted sum, re-encode.

    ``codes`` is (n, num_blocks, block_size * bits // 8) and ``header`` (n, num_blocks, 2).
    """
    n, num_blocks, code_width = codes.shape
    if num_blocks == 0:
        return _no_blocks(code_width)
    block_size = code_width * 8 // codec.bits
    rows, padded = _plan(num_blocks, block_size, tiles)
    inputs = [
        _as_lanes(_pad_blocks(codes, padded, 1)),
        _pad_blocks(header, padded, 1).reshape(n, 2 * padded),
    ]
    in_specs = [_tile_spec(rows, code_width, lead=n), _header_spec(rows, lead=n)]
    if codec.stochastic:
        u = _uniforms(codec, key, (num_blocks, block_size))
        inputs.append(_as_lanes(_pad_blocks(u, padded, 0)))
        in_specs.append(_tile_spec(rows, block_size))
    return _encode_launch(
        functools.partial(_average_requantize_kernel, codec=codec, weight=weight),
        inputs,
        in_specs,
        code_width=code_width,
        rows=rows,
        padded=padded,
        num_blocks=num_blocks,
        interpret=interpret,
    )
