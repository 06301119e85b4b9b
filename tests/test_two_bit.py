"""The 2-bit codec: its round trip and packing against numpy, and the algorithms that send it
(ByteGrad with error feedback, QAdam, DiLoCo's outer exchange) on a 2 x 4 mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_bit_identical

import jax_bytegrad
from jax_bytegrad._src import codecs
from jax_bytegrad._src.codecs import Codec, quantize_with_feedback

NODES, LOCAL = 2, 4
BLOCK = 512


# --- the codec against numpy ----------------------------------------------------------


def numpy_grid(x: np.ndarray, block_size: int):
    """Each block's scale and zero point for 2-bit nearest rounding (``codecs/grid.py``'s rule)
    in float32 numpy."""
    blocks = x.astype(np.float32).reshape(-1, block_size)
    lo = blocks.min(axis=1, keepdims=True)
    hi = blocks.max(axis=1, keepdims=True)
    three = np.float32(3)
    scale = np.maximum(hi / three - lo / three, np.maximum(-lo, hi) * np.float32(2**-23))
    return scale, np.round(-lo / scale)


def numpy_codes(x: np.ndarray, scale: np.ndarray, zero: np.ndarray):
    """The codes in [0, 3] of ``x``'s blocks on the grid ``scale``, ``zero``, and their
    decoded values."""
    blocks = x.astype(np.float32).reshape(scale.shape[0], -1)
    codes = np.clip(np.round(blocks * (np.float32(1) / scale)) + zero, 0, 3)
    return codes.astype(np.uint8), (codes - zero) * scale


def numpy_pack(codes: np.ndarray) -> np.ndarray:
    """Four codes per byte: byte j holds code j + i * block_size / 4 at bit 2 i."""
    quarter = codes.shape[-1] // 4
    parts = [
        codes[:, i * quarter : (i + 1) * quarter].astype(np.uint8) << (2 * i) for i in range(4)
    ]
    return parts[0] | parts[1] | parts[2] | parts[3]


def test_round_trip_matches_numpy():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4 * BLOCK) * rng.choice([1e-3, 1.0, 50.0], 4 * BLOCK)).astype(
        np.float32
    )
    q = jax_bytegrad.quantize(jnp.asarray(x), bits=2, block_size=BLOCK)
    scale, zero = numpy_grid(x, BLOCK)
    header = np.asarray(q.header)
    # XLA divides by 3 as a product with 1 / 3: the scale may be an ulp apart.
    np.testing.assert_allclose(header[:, :1], scale, rtol=2**-22)
    np.testing.assert_array_equal(header[:, 1:], zero)
    # On the codec's own grid, the codes and the decoded values are numpy's, bit for bit.
    codes, decoded = numpy_codes(x, header[:, :1], header[:, 1:])
    assert q.codes.shape == (4, BLOCK // 4) and q.codes.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(q.codes), numpy_pack(codes))
    np.testing.assert_array_equal(np.asarray(jax_bytegrad.dequantize(q)), decoded.reshape(-1))
    # Nearest rounding errs by at most half a step, (hi - lo) / 6, per block.
    blocks = x.reshape(4, -1)
    bound = (blocks.max(1) - blocks.min(1))[:, None] / 6 * (1 + 2**-18)
    assert np.all(np.abs(decoded - blocks) <= bound)


def test_codes_pack_four_per_byte_as_documented():
    # Values 0..3 span a block exactly (scale 1, zero 0): each code is its value.
    values = np.arange(2 * BLOCK) * 7 % 4
    q = jax_bytegrad.quantize(jnp.asarray(values, jnp.float32), bits=2, block_size=BLOCK)
    np.testing.assert_array_equal(np.asarray(q.header), [[1.0, 0.0], [1.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(q.codes), numpy_pack(values.reshape(2, BLOCK)))
    assert q.nbytes == 2 * BLOCK // 4 + 2 * 2 * 4
    np.testing.assert_array_equal(np.asarray(jax_bytegrad.dequantize(q)), values)


def test_constant_zero_and_non_finite_blocks():
    x = np.zeros((3, BLOCK), np.float32)
    x[0] = -2.5  # a constant block decodes exactly
    x[1, ::3] = np.linspace(-1.0, 2.0, x[1, ::3].size)  # zeros stay exactly zero
    x[2, 7] = np.nan  # a non-finite block decodes to NaN
    out = np.asarray(jax_bytegrad.dequantize(jax_bytegrad.quantize(jnp.asarray(x), bits=2)))
    out = out.reshape(3, BLOCK)
    np.testing.assert_array_equal(out[0], x[0])
    assert np.all(out[1][x[1] == 0] == 0)
    assert np.all(np.isnan(out[2]))


def test_stochastic_rounding_is_unbiased():
    x = jnp.asarray(np.random.default_rng(1).standard_normal(BLOCK), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 2000)

    def decoded(key):
        q = jax_bytegrad.quantize(x, bits=2, rounding="stochastic", key=key)
        return jax_bytegrad.dequantize(q)

    mean = np.asarray(jax.jit(jax.vmap(decoded))(keys)).mean(axis=0)
    step = float(x.max() - x.min()) / 2  # D = L - 1 = 2 steps
    assert np.abs(mean - np.asarray(x)).max() < 0.1 * step


def test_error_feedback_telescopes():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, BLOCK)), jnp.float32)
    residual, sent, steps = jnp.zeros_like(x), np.zeros(x.shape), 64
    codec = Codec(bits=2)
    for _ in range(steps):
        codes, header, residual = quantize_with_feedback(codec, x, residual)
        sent += np.asarray(codec.dequantize_blocks(codes, header), np.float64)
    np.testing.assert_allclose(sent + np.asarray(residual), steps * np.asarray(x), atol=1e-3)
    assert np.abs(sent / steps - np.asarray(x)).max() < 0.05


def test_no_kernel_and_the_xla_reference_for_none():
    for implementation in ("pallas", "pallas_interpret"):
        with pytest.raises(NotImplementedError, match="2-bit codes have no Pallas kernels"):
            Codec(bits=2, implementation=implementation)
        with pytest.raises(NotImplementedError, match="no Pallas kernels"):
            jax_bytegrad.quantize(jnp.ones(BLOCK), bits=2, implementation=implementation)
    assert (
        codecs.resolve("quantize_blocks", Codec(bits=2), jnp.ones((1, BLOCK)))
        is (codecs.REGISTRY["quantize_blocks"]["xla"])
    )
    with pytest.raises(ValueError, match="bits must be one of 8, 4, 2, got 1"):
        Codec(bits=1)


def test_the_wire_is_scatter_gather_and_allreduce_is_refused():
    sync = jax_bytegrad.SyncConfig(bits=2)
    assert sync.group(2, 4).wire == sync.group(4, 2).wire == "scatter_gather"
    assert jax_bytegrad.SyncConfig(bits=2, wire="ring").group(2, 4).wire == "ring"
    with pytest.raises(ValueError, match="2-bit codes sum over at most 1 device.*scatter_gather"):
        jax_bytegrad.SyncConfig(bits=2, wire="allreduce")
    with pytest.raises(ValueError, match="2-bit codes"):
        jax_bytegrad.Strategy(
            "bytegrad", mesh=jax_bytegrad.make_mesh(2, 4), bits=2, wire="allreduce"
        )


# --- the algorithms on 2 x 4 CPU devices ----------------------------------------------


def params0():
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(16, 64)) * 0.3).astype(np.float32),
        "b1": np.zeros(64, np.float32),
        "w2": (rng.normal(size=(64, 4)) * 0.3).astype(np.float32),
    }


def loss_fn(params, batch):
    x, y = batch
    logits = jnp.tanh(x @ params["w1"] + params["b1"][None]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(16, 4)).astype(np.float32)
    out = []
    for _ in range(n):
        x = rng.normal(size=(64, 16)).astype(np.float32)
        out.append((x, np.argmax(x @ teacher, -1).astype(np.int32)))
    return out


def train(strategy, optimizer, steps):
    """The losses of ``steps`` steps, and the last state."""
    data = batches(steps)
    losses = []
    with strategy.train_step(loss_fn, optimizer) as step:
        state = step.init(params0())
        for batch in data:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return np.asarray(losses), state


def mesh():
    return jax_bytegrad.make_mesh(NODES, LOCAL)


def test_bytegrad_at_two_bits_with_error_feedback_trains_as_float32_does():
    steps = 60
    two, state = train(
        jax_bytegrad.Strategy("bytegrad", mesh=mesh(), bits=2, error_feedback=True),
        optax.sgd(0.2, momentum=0.9),
        steps,
    )
    exact, _ = train(
        jax_bytegrad.Strategy("gradient_allreduce", mesh=mesh(), hierarchical=True),
        optax.sgd(0.2, momentum=0.9),
        steps,
    )
    assert two[-10:].mean() < 0.5 * two[:5].mean()
    assert two[-10:].mean() < 1.1 * exact[-10:].mean() + 0.02, (two[-10:], exact[-10:])
    assert_replicas_bit_identical(state.params)


def test_bytegrad_at_two_bits_sends_a_quarter_of_the_eight_bit_bytes():
    # Compiled, not run: a 262k-parameter layer, so block headers and padding weigh as in a
    # real model.
    params = {"w": jax.ShapeDtypeStruct((256, 1024), jnp.float32)}
    batch = jax.ShapeDtypeStruct((NODES * LOCAL, 256), jnp.float32)

    def loss(p, x):
        return jnp.mean((x @ p["w"]) ** 2)

    def node_bytes(**kwargs):
        s = jax_bytegrad.Strategy("bytegrad", mesh=mesh(), **kwargs)
        with s.train_step(loss, optax.sgd(0.1)) as step:
            (stats,) = step.communication_stats(step.state_shapes(params), batch).values()
        return stats.bytes_on("node")

    eight = node_bytes(bits=8)
    two = node_bytes(bits=2, error_feedback=True)
    assert 0.24 < two / eight < 0.28, two / eight


def test_qadam_at_two_bits_with_error_feedback_trains():
    losses, state = train(
        jax_bytegrad.Strategy(
            "qadam", mesh=mesh(), learning_rate=1e-2, warmup_steps=5, bits=2, error_feedback=True
        ),
        None,
        40,
    )
    assert np.all(np.isfinite(losses)) and losses[-5:].mean() < 0.6 * losses[:5].mean()
    assert_replicas_bit_identical(state.params)


def test_diloco_outer_exchange_at_two_bits_with_error_feedback_runs():
    steps, h = 40, 5
    s = jax_bytegrad.Strategy("diloco", mesh=mesh(), inner_steps=h, bits=2, error_feedback=True)
    losses, state = train(s, optax.adam(1e-2), steps)
    exact, _ = train(
        jax_bytegrad.Strategy("diloco", mesh=mesh(), inner_steps=h, bits=32),
        optax.adam(1e-2),
        steps,
    )
    assert np.all(np.isfinite(losses)) and losses[-5:].mean() < 0.6 * losses[:5].mean()
    assert losses[-5:].mean() < 1.1 * exact[-5:].mean() + 0.02, (losses[-5:], exact[-5:])
    assert_replicas_bit_identical(state.extra["global_params"], NODES * LOCAL)
    # What the 2-bit codes left unsent is carried to the next outer step.
    assert any(np.any(np.asarray(r) != 0) for r in jax.tree.leaves(state.extra["residuals"]))
