"""Error feedback: the codec-level invariant, and ByteGrad with residuals in its state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from test_quantize import BITS, IMPLEMENTATIONS

import jax_bytegrad
from jax_bytegrad._src.codecs import Codec, dequantize_blocks, quantize_with_feedback
from jax_bytegrad.profiling import communication_stats
from jax_bytegrad.sharding import replicate, shard_batch, shard_state, state_specs


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
    codec = Codec(bits=bits, stochastic=stochastic, implementation=impl)
    codes, header, new = quantize_with_feedback(codec, x, old, key)
    sent = dequantize_blocks(codec, codes, header)
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
    codec = Codec(bits=bits, implementation="xla")
    for _ in range(steps):
        codes, header, residual = quantize_with_feedback(codec, x, residual)
        sent_sum += np.asarray(dequantize_blocks(codec, codes, header), np.float64)
    plain = np.asarray(
        dequantize_blocks(codec, *quantize_with_feedback(codec, x, jnp.zeros_like(x))[:2])
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
    _, _, new = quantize_with_feedback(Codec(bits=4, implementation="xla"), x, jnp.zeros_like(x))
    new = np.asarray(new)
    assert np.isnan(new[1]).all()
    assert np.isfinite(new[[0, 2]]).all()


# --- ByteGrad with error feedback on a 2 x 4 mesh --------------------------------------

AXES = ("node", "local")
IN_DIM, HIDDEN, OUT_DIM, BATCH = 32, 64, 10, 64


def init_params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.standard_normal((IN_DIM, HIDDEN)) / np.sqrt(IN_DIM), jnp.float32),
        "b1": jnp.zeros(HIDDEN, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((HIDDEN, OUT_DIM)) / np.sqrt(HIDDEN), jnp.float32),
    }


def batch(step):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((BATCH, IN_DIM)).astype(np.float32)
    return x, rng.integers(0, OUT_DIM, BATCH).astype(np.int32)


def loss_fn(params, batch):
    x, y = batch
    logits = jax.nn.relu(x @ params["w1"] + params["b1"][None]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_step(tx, mesh, state):
    specs = state_specs(state)

    def per_device(params, state, batch):
        grads = jax.grad(loss_fn)(jax.lax.pcast(params, AXES, to="varying"), batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), specs, P(AXES)), out_specs=(P(), specs))
    )


def run(tx, mesh, steps, params=None, state=None, first=0):
    params = replicate(init_params(), mesh) if params is None else params
    state = shard_state(tx.init(init_params()), mesh) if state is None else state
    step = make_step(tx, mesh, state)
    for t in range(first, first + steps):
        params, state = step(params, state, shard_batch(batch(t), mesh))
        yield params, state


def device_copies(tree):
    """Every leaf as the list of what each device holds (PRNG keys as their key data)."""
    out = []
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append([np.asarray(shard.data) for shard in leaf.addressable_shards])
    return out


def assert_same_on_every_device(tree, copies):
    """``tree`` holds, device by device, exactly ``copies`` (from ``device_copies``)."""
    for got, want in zip(device_copies(tree), copies, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="module")
def mesh():
    return jax_bytegrad.make_mesh(2, 4)


@pytest.mark.parametrize("bits", BITS)
def test_replicas_stay_bit_identical_over_20_steps(mesh, bits):
    tx = optax.chain(
        jax_bytegrad.bytegrad(
            bits=bits, error_feedback=True, mesh=mesh, block_size=256, wire="scatter_gather"
        ),
        optax.sgd(0.1, momentum=0.9),
    )
    for params, state in run(tx, mesh, 20):  # noqa: B007 - the last state is checked below
        for copies in device_copies(params):
            for other in copies[1:]:
                np.testing.assert_array_equal(other, copies[0])
    residuals = jax.tree.leaves(state[0].residuals)
    assert residuals and all(np.any(np.asarray(r) != 0) for r in residuals)
    # Each device keeps its own residual, not a copy of another's (a device whose share of
    # the bucket is all padding keeps zeros).
    send = [row for row in np.asarray(state[0].residuals[0][0]).reshape(8, -1) if row.any()]
    assert len(send) >= 4 and len({row.tobytes() for row in send}) == len(send)


def test_error_feedback_changes_the_trajectory_and_tracks_float32_closer(mesh):
    def final(sync):
        *_, (params, _) = run(optax.chain(sync, optax.sgd(0.1)), mesh, 10)
        return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(params)])

    exact = final(jax_bytegrad.gradient_allreduce(hierarchical=True))
    plain = final(jax_bytegrad.bytegrad(bits=4, block_size=256))
    feedback = final(jax_bytegrad.bytegrad(bits=4, block_size=256, error_feedback=True, mesh=mesh))
    assert not np.array_equal(plain, feedback)
    assert np.abs(feedback - exact).max() < np.abs(plain - exact).max()


def test_checkpoint_restores_residuals_and_continues_bit_exactly(mesh, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = optax.chain(
        jax_bytegrad.bytegrad(bits=4, error_feedback=True, mesh=mesh, block_size=256),
        optax.adam(1e-2),
    )
    *_, straight = run(tx, mesh, 6)
    *_, (params, state) = run(tx, mesh, 3)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"params": params, "opt_state": state})
        ckptr.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": state})
    saved = device_copies(state)
    del params, state
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, abstract)
    # Every device gets its own residual back, not another device's.
    assert_same_on_every_device(restored["opt_state"], saved)
    *_, resumed = run(tx, mesh, 3, restored["params"], restored["opt_state"], first=3)
    assert_same_on_every_device(resumed, device_copies(straight))


@pytest.mark.parametrize(("bits", "limit"), [(8, 0.26), (4, 0.135)], ids=["8bit", "4bit"])
def test_inter_node_bytes_against_gradient_allreduce(mesh, bits, limit):
    params = {"w": jnp.zeros((1000, 1000), jnp.float32), "b": jnp.zeros(1000, jnp.float32)}
    grads = jax.ShapeDtypeStruct((8, *params["w"].shape), jnp.float32)

    def node_bytes(sync):
        tx = optax.chain(sync, optax.sgd(0.1))
        state = shard_state(tx.init(params), mesh)
        specs = state_specs(state)

        def per_device(state, g):
            updates, state = tx.update({"w": g[0], "b": g[0, 0]}, state)
            return updates, state

        fn = jax.jit(
            jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P(AXES)), out_specs=(P(), specs))
        )
        return communication_stats(fn, state, grads, mesh=mesh).bytes_on("node")

    baseline = node_bytes(jax_bytegrad.gradient_allreduce(hierarchical=True))
    for error_feedback in (False, True):
        sync = jax_bytegrad.bytegrad(bits=bits, error_feedback=error_feedback, mesh=mesh)
        ratio = node_bytes(sync) / baseline
        assert bits / 32 < ratio <= limit, (error_feedback, ratio)


def test_data_parallel_step_and_strategy_carry_the_residuals(mesh):
    """The library's own steps keep each device's residual and match a hand-written step."""
    tx = optax.chain(
        jax_bytegrad.bytegrad(bits=4, error_feedback=True, mesh=mesh, block_size=256),
        optax.sgd(0.1, momentum=0.9),
    )
    *_, (want_params, want_state) = run(tx, mesh, 6)

    step = jax_bytegrad.data_parallel_step(loss_fn, tx, mesh)
    train_state = step.init(init_params())
    for t in range(6):
        train_state, _ = step(train_state, shard_batch(batch(t), mesh))
    assert_same_on_every_device(train_state.params, device_copies(want_params))
    assert_same_on_every_device(train_state.opt_state, device_copies(want_state))

    strategy = jax_bytegrad.Strategy(
        "bytegrad", mesh=mesh, bits=4, error_feedback=True, block_size=256
    )
    train = strategy.train_step(loss_fn, optax.sgd(0.1, momentum=0.9))
    train_state = train.init(init_params())
    for t in range(6):
        train_state, _ = train(train_state, batch(t))
    assert_same_on_every_device(train.params(train_state), device_copies(want_params))


def test_a_checkpoint_of_other_buckets_names_bucket_bytes(mesh, tmp_path):
    """Residuals are sized per bucket, and the default buckets differ between GPU meshes and
    others (docs/gpu.md, "The bucket grain"): a checkpoint saved with other buckets is refused
    with the setting to pass, by ``restore`` and by ``restore_or_init`` alike."""
    from jax_bytegrad.checkpoint import Checkpointer

    def tx(bucket_bytes):
        sync = jax_bytegrad.bytegrad(
            bits=4, error_feedback=True, mesh=mesh, block_size=256, bucket_bytes=bucket_bytes
        )
        return optax.chain(sync, optax.sgd(0.1))

    one_bucket = shard_state(tx(None).init(init_params()), mesh)
    assert len(one_bucket[0].residuals) == 1
    with Checkpointer(tmp_path, every=1, async_save=False) as ckpt:
        ckpt.save(1, one_bucket)
        ckpt.wait()
    three = lambda: tx(4 * IN_DIM * HIDDEN).init(init_params())  # noqa: E731
    assert len(three()[0].residuals) == 3
    want = r"bucket_bytes the checkpoint was saved with .*bucket_bytes=32 \* 2\*\*20"
    with Checkpointer(tmp_path, every=1) as ckpt:
        with pytest.raises(ValueError, match=want):
            ckpt.restore(1, three, mesh)
        with pytest.raises(RuntimeError, match=want):
            ckpt.restore_or_init(three, mesh)
        restored = ckpt.restore(1, lambda: tx(None).init(init_params()), mesh)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(one_bucket), strict=True):
        if jnp.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_integer_wires_empty_residuals_checkpoint(mesh, tmp_path):
    """The integer wire codes once and keeps an empty ``mean`` residual, which orbax refuses
    to save: ``Checkpointer`` saves it as nothing and makes it again where it was."""
    from jax_bytegrad.checkpoint import Checkpointer

    sync = jax_bytegrad.bytegrad(error_feedback=True, mesh=mesh, wire="allreduce")
    tx = optax.chain(sync, optax.sgd(0.1))
    *_, (_, state) = run(tx, mesh, 2)
    send, mean = state[0].residuals[0]
    assert mean.size == 0 and np.abs(np.asarray(send)).max() > 0
    with Checkpointer(tmp_path, every=1) as ckpt:
        ckpt.save(2, state)
        ckpt.wait()
        restored = ckpt.restore(2, lambda: tx.init(init_params()), state)
    assert_same_on_every_device(restored, device_copies(state))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert got.sharding == want.sharding
