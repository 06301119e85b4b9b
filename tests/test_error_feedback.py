"""Error feedback: the codec-level invariant, and ByteGrad with residuals in its state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bytegrad.quantization import dequantize_blocks, quantize_with_feedback

ON_GPU = jax.default_backend() == "gpu"
IMPLEMENTATIONS = [
    "xla",
    "pallas_interpret",
    pytest.param(
        "pallas",
        marks=pytest.mark.skipif(
            not ON_GPU,
            reason="compiled Pallas needs a GPU; pallas_interpret runs the same kernel here",
        ),
    ),
]
BITS = [pytest.param(8, id="8bit"), pytest.param(4, id="4bit")]


def _ulp(x: np.ndarray) -> np.ndarray:
    return np.spacing(np.abs(x).astype(np.float32)).astype(np.float64)


# --- the codec-level invariant ------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_sent_plus_new_residual_equals_input_plus_old_residual(impl, bits, stochastic):
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((6, 256)) * rng.choice([1e-3, 1.0, 1e3], (6, 1))
    x[1] = 4.0  # a constant block
    x[2, ::3] = 0.0
    old = rng.standard_normal((6, 256)) * np.abs(x).max(axis=1, keepdims=True) * 0.05
    x, old = jnp.asarray(x, jnp.float32), jnp.asarray(old, jnp.float32)
    key = jax.random.key(5) if stochastic else None
    codes, header, new = quantize_with_feedback(
        x, old, stochastic=stochastic, key=key, bits=bits, implementation=impl
    )
    sent = dequantize_blocks(codes, header, bits=bits, implementation=impl)
    lhs = np.asarray(sent + new)  # float32, as the next step will see it
    rhs = np.asarray(x + old)
    exact = np.asarray(rhs, np.float64) - np.asarray(sent, np.float64)
    representable = exact.astype(np.float32).astype(np.float64) == exact
    assert representable.mean() > 0.9  # the exact branch below is really exercised
    np.testing.assert_array_equal(lhs[representable], rhs[representable])
    # Elsewhere the residual was rounded once (half an ulp of itself) and the sum once (half
    # an ulp of the result): one ulp of the larger of the two.
    off = np.abs(lhs.astype(np.float64) - rhs.astype(np.float64))
    scale = np.maximum(np.abs(rhs), np.abs(exact))[~representable]
    assert np.all(off[~representable] <= _ulp(scale))
    assert np.max(np.abs(np.asarray(new))) > 0  # something really was carried over


@pytest.mark.parametrize("bits", BITS)
def test_feedback_cancels_the_error_of_a_repeated_input(bits):
    # With nearest rounding and no feedback, the same input makes the same error every time;
    # with feedback, the error of the running mean of what was sent shrinks like 1 / steps.
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 512)), jnp.float32)
    residual = jnp.zeros_like(x)
    sent_sum = np.zeros(x.shape)
    steps = 64
    for _ in range(steps):
        codes, header, residual = quantize_with_feedback(x, residual, bits=bits)
        sent_sum += np.asarray(dequantize_blocks(codes, header, bits=bits), np.float64)
    plain = np.asarray(
        dequantize_blocks(*quantize_with_feedback(x, jnp.zeros_like(x), bits=bits)[:2], bits=bits)
    )
    plain_error = np.abs(plain - np.asarray(x)).max()
    feedback_error = np.abs(sent_sum / steps - np.asarray(x, np.float64)).max()
    assert feedback_error < plain_error / 10, (feedback_error, plain_error)
    # Telescoping: the sum of what was sent is steps * x minus the final residual.
    np.testing.assert_allclose(
        sent_sum + np.asarray(residual), steps * np.asarray(x, np.float64), rtol=0, atol=1e-4
    )


def test_non_finite_input_poisons_only_its_own_residual_block():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 256)), jnp.float32)
    x = x.at[1, 7].set(jnp.nan)
    _, _, new = quantize_with_feedback(x, jnp.zeros_like(x), bits=4)
    new = np.asarray(new)
    assert np.isnan(new[1]).all()
    assert np.isfinite(new[[0, 2]]).all()
