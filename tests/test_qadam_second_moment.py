"""QAdam's second moment after warm-up: each named rule does what it says, and the default
does not blow up where Bagua's frozen rule does."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_all_close, assert_trees_all_equal
from test_qadam import (
    adam_step,
    assert_replicas_identical,
    init_params,
    make_batches,
    on_exact_mean_gradients,
    per_device_grads,
    qadam_state,
    run,
)

import jax_bytegrad
from jax_bytegrad import qadam

WARMUP, STEPS, LR, B1, B2, EPS = 3, 7, 1e-2, 0.9, 0.999, 1e-8


@pytest.fixture(scope="module")
def mesh():
    return jax_bytegrad.make_mesh(2, 4)


def traced(mesh, rule, batches=None, loss=None, lr=LR):
    tx = qadam(lr, warmup_steps=WARMUP, b1=B1, b2=B2, eps=EPS, second_moment=rule)
    kwargs = {} if loss is None else {"loss": loss}
    params, state, _, hist = run(mesh, tx, batches or make_batches(STEPS), trace=True, **kwargs)
    assert_replicas_identical((params, state))
    return hist


def f64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


@pytest.mark.parametrize("rule", ["momentum", "momentum_max"])
def test_v_follows_the_decoded_momentum_after_warmup(mesh, rule):
    """v = b2 v + (1 - b2) m_hat^2 from the momentum every replica decoded (max form: the
    bias-corrected v never falls), and the step's correction of v is Adam's 1 - b2^t."""
    hist = traced(mesh, rule)
    for t in range(WARMUP + 1, STEPS + 1):
        prev, state = qadam_state(hist[t - 2][1]), qadam_state(hist[t - 1][1])
        c1, keep = 1 - B1**t, (1 - B2**t) / (1 - B2 ** (t - 1))
        m_hat = jax.tree.map(lambda m, c1=c1: m / c1, f64(state.mu))
        ema = jax.tree.map(lambda v, m: B2 * v + (1 - B2) * m * m, f64(prev.nu), m_hat)
        if rule == "momentum_max":
            ema = jax.tree.map(lambda v, e, k=keep: np.maximum(v * k, e), f64(prev.nu), ema)
            # 1 - b2^t in float32 carries ~1e-5 of relative rounding at these t.
            for v, p in zip(
                jax.tree.leaves(f64(state.nu)), jax.tree.leaves(f64(prev.nu)), strict=True
            ):
                assert np.all(v / (1 - B2**t) >= p / (1 - B2 ** (t - 1)) * (1 - 1e-4))
        assert_trees_all_close(f64(state.nu), ema, rtol=1e-4, atol=1e-12)
        ours = adam_step(hist[t - 2][0], state.mu, state.nu, LR, 1 - B1**t, 1 - B2**t, EPS)
        assert_trees_all_close(hist[t - 1][0], ours, rtol=1e-5, atol=5e-5 * LR)


def recovered_gradient(prev_mu, mu):
    """``(mu - b1 prev_mu) / (1 - b1)`` in float64: the gradient two momenta imply."""
    return jax.tree.map(lambda m, p: (m - B1 * p) / (1 - B1), f64(mu), f64(prev_mu))


def test_gradient_rule_feeds_v_the_gradient_the_decoded_momenta_imply(mesh):
    """v = b2 v + (1 - b2) g_est^2, g_est from two consecutive decoded momenta, which every
    replica holds; g_est is the exact mean gradient up to the 8-bit error / (1 - b1)."""
    batches = make_batches(STEPS)
    hist = traced(mesh, "gradient", batches)
    for t in range(WARMUP + 1, STEPS + 1):
        prev, state = qadam_state(hist[t - 2][1]), qadam_state(hist[t - 1][1])
        g_est = recovered_gradient(prev.mu, state.mu)
        ema = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, f64(prev.nu), g_est)
        assert_trees_all_close(f64(state.nu), ema, rtol=1e-4, atol=1e-12)
        ours = adam_step(hist[t - 2][0], state.mu, state.nu, LR, 1 - B1**t, 1 - B2**t, EPS)
        assert_trees_all_close(hist[t - 1][0], ours, rtol=1e-5, atol=5e-5 * LR)
        # The 8-bit codes of the local momenta bound how far g_est is from the mean gradient.
        grads = jax.device_get(per_device_grads(hist[t - 2][0], batches[t - 1]))
        for name in ("w", "b"):
            local = B1 * f64(prev.mu)[name][None] + (1 - B1) * np.asarray(grads[name], np.float64)
            exact = np.asarray(grads[name], np.float64).mean(0)
            err = np.abs(g_est[name] - exact).max()
            assert 0 < err <= 4 * (local.max() - local.min()) / 255 / (1 - B1), (name, err)


def test_gradient_rule_is_adam_where_the_mean_is_exact():
    """On one node the hierarchical exchange sends nothing between nodes, so nothing is
    rounded: the recovered gradient is the mean gradient and the whole run is Adam's
    (the momentum rule's v, from m_hat^2, is far from it)."""
    one_node = jax_bytegrad.make_mesh(1, 8)
    steps = 10
    batches = make_batches(steps)
    ref = [
        (params, state[0].nu)
        for params, state in on_exact_mean_gradients(optax.adam(LR, b1=B1, b2=B2, eps=EPS), batches)
    ]
    got = {}
    for rule in ("gradient", "momentum"):
        tx = qadam(LR, warmup_steps=WARMUP, b1=B1, b2=B2, eps=EPS, second_moment=rule)
        params, state, _, hist = run(one_node, tx, batches, trace=True)
        assert_replicas_identical((params, state))
        got[rule] = hist
    for t in range(WARMUP + 1, steps + 1):
        params, state = got["gradient"][t - 1]
        assert_trees_all_close(f64(qadam_state(state).nu), f64(ref[t - 1][1]), rtol=1e-4)
        assert_trees_all_close(params, ref[t - 1][0], rtol=1e-5, atol=1e-6)
    nu_momentum = f64(qadam_state(got["momentum"][-1][1]).nu["w"])
    nu_adam = f64(ref[-1][1]["w"])
    assert np.median(np.abs(nu_momentum / nu_adam - 1)) > 0.1


def test_floor_keeps_v_frozen_and_bounds_every_step_by_the_learning_rate(mesh):
    hist = traced(mesh, "floor")
    frozen = qadam_state(hist[WARMUP - 1][1]).nu
    for t in range(WARMUP + 1, STEPS + 1):
        assert_trees_all_equal(qadam_state(hist[t - 1][1]).nu, frozen)
        for new, old in zip(
            jax.tree.leaves(hist[t - 1][0]), jax.tree.leaves(hist[t - 2][0]), strict=True
        ):
            assert np.max(np.abs(new - old)) <= LR * (1 + 1e-5)


def growing_loss(params, batch):
    """A loss whose gradient is 1000x smaller during the warm-up than after it."""
    pred = batch["x"] @ params["w"] + params["b"][None]
    return batch["scale"][0] * jnp.mean((pred - batch["y"]) ** 2)


def growing_batches():
    batches = make_batches(STEPS + 3)
    for t, batch in enumerate(batches, start=1):
        scale = 1e-3 if t <= WARMUP else 1.0
        batch["scale"] = np.full(len(batch["x"]), scale, np.float32)
    return batches


@pytest.mark.parametrize(
    "rule, bound",
    [
        ("frozen", None),
        ("momentum", 4.0),
        ("gradient", 4.0),
        ("momentum_max", 4.0),
        ("floor", 1.0 + 1e-5),
    ],
)
def test_gradients_that_grow_after_warmup(mesh, rule, bound):
    """Bagua's frozen v takes steps of ~1000 x lr here; the other rules stay near Adam's ~lr."""
    hist = traced(mesh, rule, growing_batches(), growing_loss)
    largest = max(
        np.max(np.abs(new - old)) / LR
        for t in range(WARMUP + 1, len(hist))
        for new, old in zip(
            jax.tree.leaves(hist[t][0]), jax.tree.leaves(hist[t - 1][0]), strict=True
        )
    )
    if bound is None:
        assert largest > 100
    else:
        assert largest <= bound


def test_unknown_rule_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"second_moment='adam'.*'gradient'.*'momentum'.*'frozen'"):
        qadam(1e-3, warmup_steps=10, second_moment="adam")
    with pytest.raises(ValueError, match="second_moment='bagua'"):
        jax_bytegrad.Strategy(
            "qadam", mesh=jax_bytegrad.make_mesh(1, 1), learning_rate=1e-3, warmup_steps=10,
            second_moment="bagua",
        )  # fmt: skip


@pytest.mark.parametrize("bits, default", [(8, "gradient"), (4, "momentum")], ids=["8bit", "4bit"])
def test_default_rule_is_gradient_at_8_bits_and_momentum_at_4(mesh, bits, default):
    """Strategy("qadam") and qadam() without second_moment take the rule measured best for
    their bits; "frozen" (Bagua's) stays available by name and trains differently."""
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"][None] - b["y"]) ** 2)  # noqa: E731
    batches = make_batches(WARMUP + 3)
    results = {}
    for rule in (None, "gradient", "momentum", "frozen"):
        kwargs = {} if rule is None else {"second_moment": rule}
        strategy = jax_bytegrad.Strategy(
            "qadam", mesh=mesh, learning_rate=LR, warmup_steps=WARMUP, bits=bits, **kwargs
        )
        with strategy.train_step(loss) as step:
            state = step.init(init_params())
            for batch in batches:
                state, _ = step(state, batch)
                jax.block_until_ready(state)
            results[rule] = jax.device_get(step.params(state))
    assert_trees_all_equal(results[None], results[default])
    for other in ("gradient", "momentum", "frozen"):
        if other != default:
            assert not np.array_equal(results[other]["w"], results[default]["w"]), other
    # The optax form resolves None the same way.
    tx = qadam(LR, warmup_steps=WARMUP, bits=bits)
    explicit = qadam(LR, warmup_steps=WARMUP, bits=bits, second_moment=default)
    params, _, _, _ = run(mesh, tx, batches)
    expected, _, _, _ = run(mesh, explicit, batches)
    assert_trees_all_equal(jax.device_get(params), jax.device_get(expected))


def mlp_loss(params, batch):
    h, labels = batch
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"][None])
    logits = h @ params[-1]["w"] + params[-1]["b"][None]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize("rule", ["frozen", "gradient", "momentum"])
def test_issue_mlp_on_digits_diverges_only_with_the_frozen_rule(mesh, rule):
    """Issue 34's MLP (64-256-256-10, digits / 16, batch 128, lr 1e-3, Adam's eps) with a
    4-step warm-up: Bagua's frozen v reaches NaN; the rules that follow the momenta never
    rise above the first loss and train."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    key, sizes = jax.random.key(0), (64, 256, 256, 10)
    params = [
        {
            "w": np.asarray(jax.random.normal(jax.random.fold_in(key, i), (a, b)), np.float32)
            * np.float32(np.sqrt(2.0 / a)),
            "b": np.zeros(b, np.float32),
        }
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    ]
    step = jax_bytegrad.data_parallel_step(
        mlp_loss, qadam(1e-3, warmup_steps=4, second_moment=rule), mesh
    )
    step.on_divergence = "ignore"
    state, rng, losses = step.init(params), np.random.default_rng(0), []
    for _ in range(40):
        idx = rng.integers(0, len(x), 128)
        state, metrics = step(state, (x[idx], y[idx]))
        losses.append(metrics["loss"])
    losses = np.asarray(jax.device_get(losses), np.float64)
    if rule == "frozen":
        assert not np.all(np.isfinite(losses)), losses
    else:
        assert np.all(np.isfinite(losses))
        assert losses.max() <= losses[0] * (1 + 1e-6), losses
        assert losses[-5:].mean() < 0.25 * losses[0], losses
