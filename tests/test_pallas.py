"""Kernel-only checks: the Pallas kernels reproduce the jitted reference bit for bit.

The reference is compared under ``jax.jit`` because that is how the library runs it: XLA
rewrites a division by a constant into a multiplication by its reciprocal and fuses the
header arithmetic, so an eagerly run reference can differ from its own jitted form by an ulp.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_equal

from jax_bytegrad._src import codecs as _codecs
from jax_bytegrad._src.codecs import Codec
from jax_bytegrad._src.codecs import grid as _grid
from jax_bytegrad._src.codecs import pallas as _pallas
from jax_bytegrad._src.codecs import reference as _reference
from jax_bytegrad._src.codecs import selection as _selection

SM90_GPU = _pallas.is_supported()  # where the compiled Mosaic GPU kernels can run
COMPILED = pytest.mark.skipif(
    not SM90_GPU, reason="compiled Mosaic GPU kernels need an NVIDIA GPU of sm_90 or newer"
)
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=COMPILED)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]
# (num_blocks, block_size, tiles): a tile that divides the blocks, one that does not (the
# plan halves the rows), an odd block count (one padded block), and a single block.
LAYOUTS = [
    (8, 128, _pallas._Tiles(elements_per_program=512)),
    (12, 256, _pallas._Tiles(elements_per_program=2048)),
    (5, 128, _pallas._Tiles(elements_per_program=1024)),
    (1, 512, _pallas._Tiles()),
]
LAYOUT_IDS = ["even", "halved", "odd", "single"]
BITS = [pytest.param(8, id="8bit"), pytest.param(4, id="4bit")]
# Every layout in float32, and the 16-bit loads on the two layouts that tile unevenly (halved
# rows, a padded block): the dtype and the tiling are separate paths in the kernels, so their
# full cross product only repeated these.
DTYPE_LAYOUTS = [
    (layout, jnp.float32, f"{name}-f32") for layout, name in zip(LAYOUTS, LAYOUT_IDS, strict=True)
]
DTYPE_LAYOUTS += [
    (LAYOUTS[i], dtype, f"{LAYOUT_IDS[i]}-{dtype_id}")
    for dtype, dtype_id in zip(DTYPES[1:], DTYPE_IDS[1:], strict=True)
    for i in (1, 2)
]


def by_mode(cases):
    """pytest params of ``cases``, tuples of values, an id and whether to interpret the case:
    every case compiled on a GPU, where Mosaic lowers each one separately, and the marked ones
    in the interpreter, where one case of each path is enough. The last value is ``interpret``.
    """
    params = [pytest.param(*c[:-2], True, id=f"{c[-2]}-interpret") for c in cases if c[-1]]
    params += [pytest.param(*c[:-2], False, id=f"{c[-2]}-compiled", marks=COMPILED) for c in cases]
    return params


def rounding_id(stochastic):
    return "stochastic" if stochastic else "nearest"


# Interpreted: every layout with nearest rounding in float32, and stochastic rounding on the
# two layouts that tile unevenly, where its uniforms are padded and tiled as x is, in every
# dtype. Stochastic rounding adds the uniforms before the floor whatever the dtype, and the
# kernel sees only its tile's rows (_plan picks them on the host), so the rest repeated these.
CODEC_CASES = [
    (
        layout,
        dtype,
        stochastic,
        f"{name}-{rounding_id(stochastic)}",
        layout in LAYOUTS[1:3] if stochastic else dtype == jnp.float32,
    )
    for layout, dtype, name in DTYPE_LAYOUTS
    for stochastic in (False, True)
]
# Interpreted, each layout with one chunk count: the chunks are a leading dimension the kernel
# sums over, apart from the tiling of the blocks.
AVERAGE_CASES = [
    (*layout, n, stochastic, f"{name}-{n}-{rounding_id(stochastic)}", n == interpreted_n)
    for layout, name, interpreted_n in zip(LAYOUTS[:3], LAYOUT_IDS[:3], [2, 4, 2], strict=True)
    for n in (2, 4)
    for stochastic in (False, True)
]

_ref_quantize = jax.jit(_reference.quantize_blocks, static_argnames="codec")
_ref_dequantize = jax.jit(_reference.dequantize_blocks, static_argnames="codec")
_ref_average = jax.jit(_reference.average_requantize, static_argnames=("codec", "weight"))


def _widen(block_size, bits):
    """A layout's block size at ``bits``: 4-bit blocks hold two rows of 128 packed bytes."""
    return block_size * 8 // bits


def _roundtrip(x, bits, interpret):
    """The kernels' codes and header of ``x`` at the default tile, and their decoded values."""
    encoded = _pallas.quantize_blocks(Codec(bits=bits), x, interpret=interpret)
    return encoded, _pallas.dequantize_blocks(Codec(bits=bits), *encoded, interpret=interpret)


def _blocks(num_blocks, block_size, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_blocks, block_size)) * rng.uniform(0.01, 100.0, (num_blocks, 1))
    x[0, :3] = 0.0  # an exact zero in a mixed-sign block
    if num_blocks > 2:
        x[1] = 2.5  # a constant block
        x[2] = np.abs(x[2]) + 10.0  # an all-positive block: zero point below the range
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    ("layout", "dtype", "stochastic", "interpret"),
    by_mode(CODEC_CASES),
)
def test_quantize_and_dequantize_match_reference(layout, dtype, stochastic, bits, interpret):
    num_blocks, block_size, tiles = layout
    block_size = _widen(block_size, bits)
    x = _blocks(num_blocks, block_size, dtype, seed=num_blocks)
    key = jax.random.key(7) if stochastic else None
    codec = Codec(bits=bits, stochastic=stochastic)
    got = _pallas.quantize_blocks(codec, x, key, interpret=interpret, tiles=tiles)
    want = _ref_quantize(codec, x, key)
    assert want[0].shape == (num_blocks, block_size * bits // 8)
    assert_trees_all_equal(got, want)
    decoded = _pallas.dequantize_blocks(codec, *want, interpret=interpret, tiles=tiles)
    assert_trees_all_equal(decoded, _ref_dequantize(codec, *want))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    ("num_blocks", "block_size", "tiles", "n", "stochastic", "interpret"),
    by_mode(AVERAGE_CASES),
)
def test_average_requantize_matches_reference(
    num_blocks, block_size, tiles, n, stochastic, bits, interpret
):
    block_size = _widen(block_size, bits)
    chunks = [
        _ref_quantize(Codec(bits=bits), _blocks(num_blocks, block_size, jnp.float32, seed=s))
        for s in range(n)
    ]
    codes = jnp.stack([c for c, _ in chunks])
    header = jnp.stack([h for _, h in chunks])
    key = jax.random.key(3) if stochastic else None
    codec = Codec(bits=bits, stochastic=stochastic)
    got = _pallas.average_requantize(
        codec, codes, header, key, weight=1.0 / n, interpret=interpret, tiles=tiles
    )
    want = _ref_average(codec, codes, header, key, weight=1.0 / n)
    assert_trees_all_equal(got, want)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("bits", BITS)
def test_non_finite_blocks_decode_to_nan(bits, interpret):
    x = _blocks(4, _widen(128, bits), jnp.float32, seed=1)
    x = x.at[0, 5].set(jnp.nan).at[2, 0].set(jnp.inf).at[3, 7].set(-jnp.inf)
    encoded, decoded = _roundtrip(x, bits, interpret)
    assert_trees_all_equal(encoded, _ref_quantize(Codec(bits=bits), x))
    decoded = np.asarray(decoded)
    assert np.isnan(decoded[[0, 2, 3]]).all()
    assert np.isfinite(decoded[1]).all()


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("bits", BITS)
def test_extreme_magnitudes_stay_finite(bits, interpret):
    big = float(np.finfo(np.float32).max)
    block_size = _widen(128, bits)
    x = jnp.asarray(np.linspace(-big, big, 2 * block_size, dtype=np.float32).reshape(2, -1))
    encoded, decoded = _roundtrip(x, bits, interpret)
    assert_trees_all_equal(encoded, _ref_quantize(Codec(bits=bits), x))
    assert np.isfinite(np.asarray(decoded)).all()


@pytest.mark.parametrize("bits", BITS)
def test_empty_input(bits):
    block_size = _widen(128, bits)
    (codes, header), decoded = _roundtrip(jnp.zeros((0, block_size)), bits, interpret=True)
    assert codes.shape == (0, 128) and codes.dtype == jnp.uint8
    assert header.shape == (0, 2) and header.dtype == jnp.float32
    assert decoded.shape == (0, block_size)


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "rows", "padded"),
    [(8, 1024, 8, 8), (12, 1024, 4, 12), (7, 1024, 2, 8), (1, 4096, 2, 2), (4096, 128, 64, 4096)],
)
def test_plan_rows_divide_padded_blocks(num_blocks, block_size, rows, padded):
    assert _pallas._plan(num_blocks, block_size, _pallas._Tiles()) == (rows, padded)


def test_floor_and_ceil_spellings_are_exact():
    v = jnp.asarray(
        [-2.5, -1.5, -0.7, -0.5, -0.3, -0.0, 0.0, 0.3, 0.5, 0.7, 1.5, 2.5, 2.0**23, -(2.0**23)]
        + [2.0**24 + 2, 8388607.5, -8388607.5, jnp.inf, -jnp.inf],
        jnp.float32,
    )
    for mine, theirs in [(_pallas._floor, jnp.floor), (_pallas._ceil, jnp.ceil)]:
        got, want = np.asarray(mine(v)), np.asarray(theirs(v))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    nan = np.asarray(_pallas._floor(jnp.asarray([jnp.nan], jnp.float32)))
    assert np.isnan(nan).all()


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_the_mosaic_spelling_of_the_grid_gives_the_same_bits(stochastic):
    """grid.py's one rule, with the ops Mosaic GPU lowers (pallas._MOSAIC) and with jnp's."""
    big = float(np.finfo(np.float32).max)
    pairs = [
        (-1.0, 1.0), (0.0, 0.0), (2.5, 2.5), (-3e38, 3e38), (-big, big), (1000.0, 1000.0001),
        (1e-30, 2e-30), (-7.25, -0.5), (0.3, 9.0), (-jnp.inf, 1.0), (0.0, jnp.inf),
        (jnp.nan, 1.0), (-0.0, 0.0),
    ]  # fmt: skip
    lo, hi = (jnp.asarray(v, jnp.float32) for v in zip(*pairs, strict=True))
    for levels in (_grid.max_code(8), _grid.max_code(4)):
        mine = jax.jit(
            lambda lo, hi, levels=levels: _grid.grid(
                lo, hi, levels=levels, stochastic=stochastic, spelling=_pallas._MOSAIC
            )
        )(lo, hi)
        theirs = jax.jit(
            lambda lo, hi, levels=levels: _grid.grid(lo, hi, levels=levels, stochastic=stochastic)
        )(lo, hi)
        for a, b in zip(mine, theirs, strict=True):  # bits: NaN and the sign of zero too
            np.testing.assert_array_equal(
                np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)
            )


def test_four_bit_pack_and_unpack_cover_every_byte():
    codes = jnp.arange(256, dtype=jnp.uint8).reshape(2, 128)
    low, high = _pallas._unpack(codes, 4)
    np.testing.assert_array_equal(np.asarray(low), np.arange(256).reshape(2, 128) & 15)
    np.testing.assert_array_equal(np.asarray(high), np.arange(256).reshape(2, 128) >> 4)
    packed = _pallas._pack([low, high], 4)
    assert packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(codes))


# The kernels implementation=None checks first on a GPU; "interpret" shows that the check
# accepts kernels that follow the reference, "compiled" that the GPU's kernels pass it.
CHECKED_KERNELS = [
    kernel
    for bits in (8, 4)
    for kernel in (
        _selection.Kernel("quantize_blocks", Codec(bits), 1024),
        _selection.Kernel("quantize_blocks", Codec(bits, stochastic=True), 512, dtype="bfloat16"),
        _selection.Kernel("dequantize_blocks", Codec(bits), 2048),
        _selection.Kernel("average_requantize", Codec(bits), 1024, chunks=2, weight=0.5),
        _selection.Kernel(
            "average_requantize", Codec(bits, stochastic=True), 256, chunks=4, weight=0.25
        ),
    )
]
# Interpreted, each op and rounding at one width, the widths alternating: the check's example
# and its comparison follow the op and the rounding; the width changes only the packing, which
# the tests above compare bit for bit in both widths.
INTERPRETED_WIDTH = {
    ("quantize_blocks", False): 8,
    ("quantize_blocks", True): 4,
    ("dequantize_blocks", False): 8,
    ("average_requantize", False): 4,
    ("average_requantize", True): 8,
}


@pytest.mark.parametrize(
    ("kernel", "interpret"),
    by_mode(
        [
            (
                k,
                str(k).replace(" ", ""),
                INTERPRETED_WIDTH[k.op, k.codec.stochastic] == k.codec.bits,
            )
            for k in CHECKED_KERNELS
        ]
    ),
)
def test_kernels_pass_the_automatic_check(kernel, interpret, monkeypatch):
    if interpret:
        registered = _codecs.REGISTRY[kernel.op]
        monkeypatch.setitem(registered, "pallas", registered["pallas_interpret"])
        # The bound is for a GPU's compile; the interpreter's took over 20 s on a loaded
        # 2-core machine.
        monkeypatch.setattr(_selection, "CHECK_TIMEOUT_S", 600.0)
    assert _selection.check(kernel, jax.devices()[0]) is None


def test_is_supported_is_false_off_gpu():
    if jax.default_backend() != "gpu":
        assert not _pallas.is_supported()
