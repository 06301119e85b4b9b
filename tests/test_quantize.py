"""Every guarantee of quantize/dequantize, run against every implementation."""

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad._src import codecs as _codecs
from jax_bytegrad._src.codecs import (
    Codec,
    average_requantize,
    dequantize_blocks,
    quantize_blocks,
)
from jax_bytegrad._src.codecs import pallas as _pallas
from jax_bytegrad._src.codecs import selection as _selection
from jax_bytegrad._src.codecs.arrays import resolve_implementation

pytestmark = pytest.mark.usefixtures("strict_dtypes")
SM90_GPU = _pallas.is_supported()  # where the compiled Mosaic GPU kernels can run
IMPLEMENTATIONS = [
    "xla",
    "pallas_interpret",
    pytest.param(
        "pallas",
        id="compiled",
        marks=pytest.mark.skipif(
            not SM90_GPU,
            reason="compiled Mosaic GPU kernels need an NVIDIA GPU of sm_90 or newer; "
            "pallas_interpret runs the same kernel bodies here",
        ),
    ),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]
BITS = [pytest.param(8, id="8bit"), pytest.param(4, id="4bit")]
F32_MAX = float(np.finfo(np.float32).max)
AXES = ("node", "local")


def smallest_block(bits):
    """The smallest block a width accepts: 128 bytes of codes."""
    return 128 * 8 // bits


def roundtrip(x, impl, **kwargs):
    q = jax_bytegrad.quantize(x, implementation=impl, **kwargs)
    return q, jax_bytegrad.dequantize(q, implementation=impl)


def block_ranges(x, block_size):
    """Per-element (lo, hi) of the element's block, in float64."""
    flat = np.asarray(x, np.float64).reshape(-1)
    lo = np.empty_like(flat)
    hi = np.empty_like(flat)
    for start in range(0, flat.size, block_size):
        block = flat[start : start + block_size]
        lo[start : start + block_size] = block.min()
        hi[start : start + block_size] = block.max()
    return lo, hi


def half_ulp(values, dtype):
    """Half an ulp of ``dtype`` at each value: the rounding of the final cast."""
    v = np.abs(np.asarray(values, np.float64))
    info = jnp.finfo(dtype)
    exponent = np.floor(np.log2(np.maximum(v, float(info.tiny))))
    return 0.5 * 2.0 ** (exponent - info.nmant)


def assert_within_bound(x, x_hat, block_size, bits=8):
    levels = 2.0 * (2**bits - 1)
    flat = np.asarray(x, np.float64).reshape(-1)
    out = np.asarray(x_hat, np.float64).reshape(-1)
    lo, hi = block_ranges(x, block_size)
    magnitude = np.maximum(np.abs(lo), np.abs(hi))
    bound = (
        np.maximum((hi - lo) / levels, magnitude * 2.0**-24) * (1 + 2.0**-18)
        + half_ulp(out, x_hat.dtype)
        + 1e-45
    )
    err = np.abs(out - flat)
    worst = np.argmax(err - bound)
    assert np.all(err <= bound), (
        f"element {worst}: x={flat[worst]!r} x_hat={out[worst]!r} err={err[worst]!r} "
        f"bound={bound[worst]!r}"
    )


def random_input(shape, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


# Every shape in float32, and the 16-bit dtypes on a 1-D and a 3-D shape of several blocks
# with a padded tail: the dtype is the load and the final cast, apart from how the shape is
# cut into blocks, so their full cross product only repeated these.
SHAPES = {
    "1": ((1,), 128),
    "7": ((7,), 128),
    "128": ((128,), 128),
    "1000": ((1000,), 256),
    "3x1367": ((3, 1367), 1024),
    "5x2x129": ((5, 2, 129), 128),
}
SHAPE_DTYPES = [(*SHAPES[name], jnp.float32, f"{name}-f32") for name in SHAPES]
SHAPE_DTYPES += [
    (*SHAPES[name], dtype, f"{name}-{dtype_id}")
    for name in ("1000", "5x2x129")
    for dtype, dtype_id in zip(DTYPES[1:], DTYPE_IDS[1:], strict=True)
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "shape,block_size,dtype", [c[:3] for c in SHAPE_DTYPES], ids=[c[3] for c in SHAPE_DTYPES]
)
def test_nearest_error_bound(impl, dtype, shape, block_size, bits):
    block_size = max(block_size, smallest_block(bits))
    x = random_input(shape, dtype, seed=sum(shape), scale=3.0)
    q, x_hat = roundtrip(x, impl, block_size=block_size, bits=bits)
    num_blocks = -(-x.size // block_size)
    assert q.codes.shape == (num_blocks, block_size * bits // 8) and q.codes.dtype == jnp.uint8
    assert q.header.shape == (num_blocks, 2) and q.header.dtype == jnp.float32
    assert q.bits == bits and q.block_size == block_size
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert_within_bound(x, x_hat, block_size, bits)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "shape,dtype",
    [((0,), jnp.float32), ((3, 0), jnp.float32), ((3, 0), jnp.bfloat16), ((3, 0), jnp.float16)],
    ids=["0-f32", "3x0-f32", "3x0-bf16", "3x0-f16"],
)
def test_size_zero(impl, dtype, shape, bits):
    x = jnp.zeros(shape, dtype)
    q, x_hat = roundtrip(x, impl, block_size=256, bits=bits)
    assert q.codes.shape == (0, 256 * bits // 8) and q.header.shape == (0, 2)
    assert x_hat.shape == shape and x_hat.dtype == dtype


# Both roundings in float32, and each 16-bit dtype with one of them: the rounding picks the
# codes and the dtype is the load and the final cast, so their full cross product only
# repeated these.
DTYPE_ROUNDINGS = [
    pytest.param(jnp.float32, "nearest", id="nearest-f32"),
    pytest.param(jnp.float32, "stochastic", id="stochastic-f32"),
    pytest.param(jnp.bfloat16, "nearest", id="nearest-bf16"),
    pytest.param(jnp.float16, "stochastic", id="stochastic-f16"),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype,rounding", DTYPE_ROUNDINGS)
def test_constant_blocks_are_exact(impl, dtype, rounding, bits):
    # One block each: all-zero, positive, negative, huge, tiny, and an odd-sized tail.
    big = 1e38 if dtype != jnp.float16 else 6e4
    values = [0.0, 1.5, -2.75, big, -big, 3e-3, 0.1]
    block = smallest_block(bits)
    x = jnp.asarray(np.repeat(values, block)[: block * len(values) - 5], dtype)
    key = jax.random.key(1) if rounding == "stochastic" else None
    _, x_hat = roundtrip(x, impl, block_size=block, rounding=rounding, key=key, bits=bits)
    np.testing.assert_array_equal(np.asarray(x_hat), np.asarray(x))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype,rounding", DTYPE_ROUNDINGS)
def test_zero_stays_exactly_zero(impl, dtype, rounding, bits):
    rng = np.random.default_rng(3)
    values = rng.standard_normal(4096) * rng.choice([1e-3, 1.0, 1e3], 4096)
    # Blocks that are all-positive apart from zeros, all-negative apart from zeros, mixed.
    values[:1024] = np.abs(values[:1024])
    values[1024:2048] = -np.abs(values[1024:2048])
    values[rng.random(4096) < 0.4] = 0.0
    x = jnp.asarray(values, dtype)
    key = jax.random.key(2) if rounding == "stochastic" else None
    _, x_hat = roundtrip(x, impl, block_size=256, rounding=rounding, key=key, bits=bits)
    zeros = np.asarray(x) == 0
    assert zeros.sum() > 1000
    assert np.all(np.asarray(x_hat)[zeros] == 0)


def extreme_cases(dtype):
    big = float(jnp.finfo(dtype).max)
    if dtype == jnp.float16:
        return {"pm_max": [big, -big], "max_alone": [big], "pm_60000": [6e4, -6e4, 1.0]}
    return {
        "pm_3e38": [3e38, -3e38],
        "1e38_alone": [1e38],
        "pm_max": [big, -big, 0.5],
        "max_and_tiny": [big, 1e-30],
    }


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_extremes_stay_finite(impl, dtype, bits):
    block = smallest_block(bits)
    for name, values in extreme_cases(dtype).items():
        x = jnp.asarray(values, dtype)
        _, x_hat = roundtrip(x, impl, block_size=block, bits=bits)
        assert np.all(np.isfinite(np.asarray(x_hat, np.float64))), (name, x_hat)
        assert_within_bound(x, x_hat, block, bits)


# Each non-finite value in float32, and one in each 16-bit dtype: the value poisons the block's
# range after the load, whatever the dtype.
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "dtype,bad",
    [
        pytest.param(jnp.float32, np.nan, id="nan-f32"),
        pytest.param(jnp.float32, np.inf, id="inf-f32"),
        pytest.param(jnp.float32, -np.inf, id="-inf-f32"),
        pytest.param(jnp.bfloat16, np.nan, id="nan-bf16"),
        pytest.param(jnp.float16, np.inf, id="inf-f16"),
    ],
)
def test_non_finite_block_decodes_to_nan(impl, dtype, bad, bits):
    b = smallest_block(bits)
    x = np.array(random_input((3 * b,), jnp.float32, seed=5))
    x[b + 17] = bad  # poisons the middle block only
    x = jnp.asarray(x, dtype)
    _, x_hat = roundtrip(x, impl, block_size=b, bits=bits)
    out = np.asarray(x_hat, np.float64)
    assert np.all(np.isnan(out[b : 2 * b]))
    assert np.all(np.isfinite(out[:b])) and np.all(np.isfinite(out[2 * b :]))
    assert_within_bound(x[:b], x_hat[:b], b, bits)


# Both widths in float32, and each 16-bit dtype at one width: the width sets the levels and
# the packing, the dtype the load and the final cast.
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "dtype,bits",
    [
        pytest.param(jnp.float32, 8, id="f32-8bit"),
        pytest.param(jnp.float32, 4, id="f32-4bit"),
        pytest.param(jnp.bfloat16, 8, id="bf16-8bit"),
        pytest.param(jnp.float16, 4, id="f16-4bit"),
    ],
)
def test_stochastic_rounding_is_unbiased_and_bounded(impl, dtype, bits):
    num_keys = 512
    block = smallest_block(bits)
    x = random_input((200,), dtype, seed=7)
    keys = jax.random.split(jax.random.key(0), num_keys)

    @jax.jit
    def decode_all(keys):
        def one(key):
            q = jax_bytegrad.quantize(
                x,
                bits=bits,
                block_size=block,
                rounding="stochastic",
                key=key,
                implementation=impl,
            )
            return jax_bytegrad.dequantize(q, implementation=impl).astype(jnp.float32)

        return jax.lax.map(one, keys)

    samples = np.asarray(decode_all(keys), np.float64)
    xs = np.asarray(x, np.float64)
    lo, hi = block_ranges(x, block)
    step = (hi - lo) / (2**bits - 2)
    # Each draw lands on a grid point next to x (plus the cast back to the dtype).
    slack = half_ulp(samples, dtype) + 1e-7 * step
    assert np.all(np.abs(samples - xs) <= step + slack)
    # The mean converges to x: each draw has std <= step / 2; allow 6 sigma, plus the
    # dtype cast, which rounds each grid point the same way in every draw.
    tolerance = 6 * step / (2 * np.sqrt(num_keys)) + half_ulp(xs, dtype)
    assert np.all(np.abs(samples.mean(axis=0) - xs) <= tolerance)
    # Different keys really give different codes.
    assert np.mean(np.std(samples, axis=0) > 0) > 0.5


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("weight", [0.5, 1.0], ids=["mean", "sum"])
def test_average_requantize_matches_exact_average(impl, weight, bits):
    n, num_blocks, block_size = 4, 3, 256
    rng = np.random.default_rng(11)
    chunks = rng.standard_normal((n, num_blocks, block_size)).astype(np.float32)
    chunks[:, 1] *= 1e4  # blocks of very different ranges
    chunks[2, 2, :] = 0.0
    xla = Codec(bits=bits, implementation="xla")
    encoded = [quantize_blocks(xla, jnp.asarray(c)) for c in chunks]
    codes = jnp.stack([c for c, _ in encoded])
    header = jnp.stack([h for _, h in encoded])
    decoded = np.stack([np.asarray(dequantize_blocks(xla, c, h), np.float64) for c, h in encoded])
    out_codes, out_header = average_requantize(
        Codec(bits=bits, implementation=impl), codes, header, weight=weight
    )
    assert out_codes.shape == (num_blocks, block_size * bits // 8)
    assert out_codes.dtype == jnp.uint8 and out_header.shape == (num_blocks, 2)
    result = np.asarray(dequantize_blocks(xla, out_codes, out_header), np.float64)
    expected = decoded.sum(axis=0) * weight
    spread = expected.max(axis=1, keepdims=True) - expected.min(axis=1, keepdims=True)
    bound = spread / (2 * (2**bits - 1)) * (1 + 1e-5) + 1e-6 * np.abs(expected) + 1e-30
    assert np.all(np.abs(result - expected) <= bound)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", BITS)
def test_average_requantize_propagates_nan(impl, bits):
    chunk = jnp.asarray(random_input((2, smallest_block(bits)), jnp.float32, seed=3))
    xla = Codec(bits=bits, implementation="xla")
    codes, header = quantize_blocks(xla, chunk)
    bad_codes, bad_header = quantize_blocks(xla, chunk.at[0, 5].set(jnp.nan))
    out_codes, out_header = average_requantize(
        Codec(bits=bits, implementation=impl),
        jnp.stack([codes, bad_codes]),
        jnp.stack([header, bad_header]),
        weight=0.5,
    )
    out = np.asarray(dequantize_blocks(xla, out_codes, out_header))
    assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1]))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_four_bit_codes_pack_two_per_byte_as_documented(impl):
    # Values 0..15 span one 4-bit block exactly (scale 1, zero 0), so code == value.
    values = np.arange(512) * 7 % 16
    q = jax_bytegrad.quantize(
        jnp.asarray(values, jnp.float32), bits=4, block_size=256, implementation=impl
    )
    np.testing.assert_array_equal(np.asarray(q.header), [[1.0, 0.0], [1.0, 0.0]])
    blocks = values.reshape(2, 256)
    packed = blocks[:, :128] | (blocks[:, 128:] << 4)
    np.testing.assert_array_equal(np.asarray(q.codes), packed)
    assert q.nbytes == 2 * 128 + 2 * 2 * 4
    np.testing.assert_array_equal(np.asarray(jax_bytegrad.dequantize(q)), values)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_quantized_array_crosses_jit_and_is_a_pytree(impl):
    x = random_input((3, 300), jnp.bfloat16, seed=9)
    q = jax.jit(lambda v: jax_bytegrad.quantize(v, block_size=128, implementation=impl))(x)
    leaves, treedef = jax.tree.flatten(q)
    assert [leaf.dtype for leaf in leaves] == [jnp.uint8, jnp.float32]
    q2 = jax.tree.unflatten(treedef, leaves)
    assert q2.shape == (3, 300) and q2.dtype == jnp.bfloat16
    assert q.block_size == 128 and q.num_blocks == 8 and q.nbytes == 8 * 128 + 8 * 2 * 4
    out = jax.jit(lambda q: jax_bytegrad.dequantize(q, implementation=impl))(q)
    assert out.shape == (3, 300) and out.dtype == jnp.bfloat16


# --- The choice of implementation. --------------------------------------------------------


def test_default_is_xla_where_no_kernel_can_run(monkeypatch):
    def no_check(kernel, device):
        raise AssertionError(f"{kernel} was checked where no compiled kernel can run")

    monkeypatch.setattr(_pallas, "is_supported", lambda: False)
    monkeypatch.setattr(_selection, "check", no_check)
    assert resolve_implementation(None) is None  # chosen per kernel, at dispatch
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        q = jax_bytegrad.quantize(jnp.ones(300), bits=4)
        jax_bytegrad.dequantize(q)
    kernel = _selection.Kernel("quantize_blocks", Codec(), 1024)
    assert _selection.select(kernel) == "xla"


@pytest.mark.parametrize("op", list(_codecs.REGISTRY))
def test_every_op_has_its_xla_implementation_and_refuses_missing_ones(op):
    registered = _codecs.REGISTRY[op]
    assert "xla" in registered and set(registered) <= set(_codecs.IMPLEMENTATIONS)
    for name in _codecs.IMPLEMENTATIONS:
        if name in registered:
            assert _codecs.lookup(op, name) is registered[name]
        else:  # the integer wire's ops: XLA fusions only, and no silent fallback to them
            with pytest.raises(NotImplementedError, match=f"{op} is an XLA fusion"):
                _codecs.lookup(op, name)
    with pytest.raises(NotImplementedError, match=f"{op} has no implementation 'cuda'"):
        _codecs.lookup(op, "cuda")


def _integer_mean(implementation, key=None):
    """compressed_mean on the integer wire, over 2 nodes of 1 device."""
    mesh = jax_bytegrad.make_mesh(2, 1)
    sync = jax_bytegrad.SyncConfig(
        wire="allreduce",
        implementation=implementation,
        rounding="nearest" if key is None else "stochastic",
        error_feedback=True,
    )
    x = random_input((2, 2048), jnp.float32, seed=12)
    residuals = jax_bytegrad.Residuals([(jnp.zeros((2 * 2048,)), jnp.zeros((0,)))])

    def body(g, residuals, key):
        return jax_bytegrad.compressed_mean(g[0], sync=sync, key=key, residuals=residuals)[0]

    specs = (P(AXES), P(AXES), P())
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())
    return jax.jit(fn)(x, residuals, key)


@pytest.mark.parametrize("implementation", ["pallas", "pallas_interpret"])
def test_the_integer_wire_refuses_an_explicit_kernel(implementation):
    with pytest.raises(NotImplementedError, match="the integer wire .* has none"):
        _integer_mean(implementation)


def test_the_integer_wire_runs_each_op_through_the_registry(monkeypatch):
    calls = []

    def spy(op, fn):
        def traced(*args, **kwargs):
            calls.append(op)
            return fn(*args, **kwargs)

        return traced

    want = _integer_mean(None, jax.random.key(0))
    for op in ("integer_bounds", "integer_encode", "decode_factors", "integer_decode"):
        registered = _codecs.REGISTRY[op]
        monkeypatch.setitem(registered, "xla", spy(op, registered["xla"]))
    for implementation in (None, "xla"):
        calls.clear()
        got = _integer_mean(implementation, jax.random.key(0))
        assert sorted(set(calls)) == ["decode_factors", "integer_bounds", "integer_decode",
                                      "integer_encode"]  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.skipif(SM90_GPU, reason="checks the error raised where no supported GPU is")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_explicit_pallas_off_gpu_raises(jit):
    quantize = jax_bytegrad.quantize
    if jit:
        quantize = jax.jit(quantize, static_argnames="implementation")
    with pytest.raises(NotImplementedError, match="implementation='pallas' runs compiled Mosaic"):
        quantize(jnp.ones(8), implementation="pallas")
    q = jax_bytegrad.quantize(jnp.ones(8))
    with pytest.raises(NotImplementedError, match="being lowered for another platform"):
        jax_bytegrad.dequantize(q, implementation="pallas")


@pytest.fixture
def candidate(monkeypatch):
    """Makes this host look like a supported GPU whose compiled kernels are the interpreted
    ones, which the test may then break one at a time; every check starts afresh."""
    monkeypatch.setattr(_pallas, "is_supported", lambda: True)
    # A check's bound is for a GPU's compile; here it compiles the interpreter's kernels, which
    # took over 20 s on a loaded 2-core machine and fell back. The bound's own test sets it.
    monkeypatch.setattr(_selection, "CHECK_TIMEOUT_S", 600.0)
    for op in ("quantize_blocks", "dequantize_blocks", "average_requantize"):
        registered = _codecs.REGISTRY[op]
        monkeypatch.setitem(registered, "pallas", registered["pallas_interpret"])
    checked = []
    real_check = _selection.check

    def counting_check(kernel, device):
        checked.append((kernel.op, device.device_kind))
        return real_check(kernel, device)

    monkeypatch.setattr(_selection, "check", counting_check)
    _selection.clear_checks()

    def replace(**ops):
        for op, fn in ops.items():
            monkeypatch.setitem(_codecs.REGISTRY[op], "pallas", fn)

    yield replace, checked
    _selection.clear_checks()


def quantize_roundtrip(x, **kwargs):
    q = jax_bytegrad.quantize(x, block_size=256, **kwargs)
    return q, jax_bytegrad.dequantize(q, implementation=kwargs.get("implementation"))


def all_warnings(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return result, [str(w.message) for w in caught if w.category is RuntimeWarning]


@pytest.mark.parametrize("bits", BITS)
def test_automatic_choice_uses_each_kernel_that_passes_its_check(candidate, bits):
    replace, checked = candidate
    calls = []

    def spy(name):
        def op(*args, **kwargs):
            calls.append(name)
            return _codecs.REGISTRY[name]["pallas_interpret"](*args, **kwargs)

        return op

    replace(**{name: spy(name) for name in ("quantize_blocks", "dequantize_blocks")})
    x = random_input((3, 300), jnp.float32, seed=2)
    (q, x_hat), caught = all_warnings(lambda: quantize_roundtrip(x, bits=bits))
    assert caught == []
    assert [op for op, _ in checked] == ["quantize_blocks", "dequantize_blocks"]
    # Each op ran once in its check, then once for real.
    assert calls == ["quantize_blocks"] * 2 + ["dequantize_blocks"] * 2
    # The same codes as XLA; scales may differ by an ulp from the eager XLA path.
    want_q, want_x = quantize_roundtrip(x, bits=bits, implementation="xla")
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(want_q.codes))
    np.testing.assert_allclose(np.asarray(x_hat), np.asarray(want_x), rtol=2**-22)


def test_checks_run_while_the_caller_traces(candidate):
    _, checked = candidate
    x = random_input((2, 300), jnp.bfloat16, seed=3)
    key = jax.random.key(4)

    @jax.jit
    def roundtrip(x, key):
        q = jax_bytegrad.quantize(x, block_size=256, bits=4, rounding="stochastic", key=key)
        return jax_bytegrad.dequantize(q)

    x_hat, caught = all_warnings(roundtrip, x, key)
    assert caught == []
    assert [op for op, _ in checked] == ["quantize_blocks", "dequantize_blocks"]
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype


def test_a_failing_kernel_alone_falls_back_with_one_warning(candidate):
    replace, checked = candidate

    def broken(*args, **kwargs):
        raise RuntimeError("Layout inference failed to find a solution")

    replace(quantize_blocks=broken)
    x = random_input((3, 300), jnp.float32, seed=4)
    for step in range(2):
        (q, x_hat), caught = all_warnings(lambda: quantize_roundtrip(x))
        if step == 0:
            assert len(caught) == 1, caught
            assert "quantize_blocks(bits=8, block_size=256, dtype=float32" in caught[0]
            assert "Layout inference failed" in caught[0]
            assert "dequantize" not in caught[0].split(":")[1]
        else:
            assert caught == []  # decided once per process and device kind
    assert sorted(op for op, _ in checked) == ["dequantize_blocks", "quantize_blocks"]
    assert _selection.select(_selection.Kernel("quantize_blocks", Codec(), 256)) == "xla"
    assert _selection.select(_selection.Kernel("dequantize_blocks", Codec(), 256)) == "pallas"
    want_q, want_x = quantize_roundtrip(x, implementation="xla")
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(want_q.codes))
    np.testing.assert_array_equal(np.asarray(x_hat), np.asarray(want_x))
    # An explicit request never falls back: it raises the kernel's error.
    with pytest.raises(RuntimeError, match="Layout inference failed"):
        jax_bytegrad.quantize(x, implementation="pallas")


@pytest.mark.parametrize(
    "op,wrong,why",
    [
        ("dequantize_blocks", lambda out: out + 1e-3, "decoded values differ"),
        ("quantize_blocks", lambda out: (out[0] ^ 0x11, out[1]), "codes differ"),
        ("quantize_blocks", lambda out: (out[0], out[1] * 1.001), "block scales differ"),
        ("quantize_blocks", lambda out: (out[0], out[1].at[:, 1].add(2.0)), "zero points differ"),
    ],
    ids=["values", "codes", "scales", "zeros"],
)
def test_a_wrong_kernel_falls_back(candidate, op, wrong, why):
    replace, _ = candidate
    right = _codecs.REGISTRY[op]["pallas"]
    replace(**{op: lambda *args, **kwargs: wrong(right(*args, **kwargs))})
    x = random_input((2, 256), jnp.float32, seed=5)
    _, caught = all_warnings(lambda: quantize_roundtrip(x))
    assert len(caught) == 1 and f"kernel {op}(" in caught[0] and why in caught[0], caught


def test_a_slow_kernel_falls_back_after_the_time_bound(candidate, monkeypatch):
    replace, _ = candidate
    monkeypatch.setattr(_selection, "CHECK_TIMEOUT_S", 0.5)
    release = threading.Event()
    interpreted = _codecs.REGISTRY["average_requantize"]["pallas"]

    def slow(*args, **kwargs):
        release.wait()  # a layout search that would outlast the bound
        return interpreted(*args, **kwargs)

    replace(average_requantize=slow)
    x = random_input((2, 256), jnp.float32, seed=6)
    codes, header = quantize_blocks(Codec(implementation="xla"), x)
    try:
        out, caught = all_warnings(
            lambda: average_requantize(
                Codec(), jnp.stack([codes, codes]), jnp.stack([header, header]), weight=0.5
            )
        )
    finally:
        release.set()
    assert len(caught) == 1 and "average_requantize(bits=8" in caught[0], caught
    assert "did not finish within 0.5 s" in caught[0]
    want = average_requantize(
        Codec(implementation="xla"),
        jnp.stack([codes, codes]),
        jnp.stack([header, header]),
        weight=0.5,
    )
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(want[0]))


def test_checks_are_cached_per_device_kind(candidate, monkeypatch):
    replace, checked = candidate

    def broken(*args, **kwargs):
        raise RuntimeError("unsupported on this kind")

    replace(dequantize_blocks=broken)
    device = jax.devices()[0]
    x = random_input((2, 256), jnp.float32, seed=8)
    kinds = {}
    for kind in ["GPU kind A", "GPU kind A", "GPU kind B", "GPU kind A"]:
        monkeypatch.setattr(_selection, "_device_kinds", lambda kind=kind: {kind: device})
        _, caught = all_warnings(lambda: quantize_roundtrip(x))
        kinds.setdefault(kind, []).extend(caught)
    assert [len(kinds[k]) for k in kinds] == [1, 1]
    assert "on GPU kind B" in kinds["GPU kind B"][0]
    assert sorted(checked) == sorted(
        [(op, "cpu") for op in ("quantize_blocks", "dequantize_blocks")] * 2
    )
