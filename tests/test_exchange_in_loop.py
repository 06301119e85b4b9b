"""exchange_in_loop: with shard="params", a scanned stack's exchange between nodes runs inside the
backward loop, one layer per iteration, with the replicated step's bytes, on 2 x 4 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_all_close

import jax_bytegrad
from jax_bytegrad import Residuals
from jax_bytegrad.sharding import exchange_in_loop

LAYERS = 3
# Each layer's share per device (64 x 256 / 4) is 4 blocks of 1024: no padding but the head's.
RNG = np.random.default_rng(0)
PARAMS = {
    "stack": RNG.normal(size=(LAYERS, 64, 256)).astype(np.float32) * 0.1,
    "proj": RNG.normal(size=(256, 64)).astype(np.float32) * 0.1,
    "head": RNG.normal(size=(64, 8)).astype(np.float32) * 0.2,
}
X = RNG.normal(size=(64, 64)).astype(np.float32)
BATCH = (X, X[:, :8].argmax(-1))


def loss_of(mark: bool):
    def loss_fn(params, batch):
        def body(h, w):
            w = exchange_in_loop(w) if mark else w
            return jnp.tanh(jnp.tanh(h @ w) @ params["proj"]), None

        h, _ = jax.lax.scan(jax.checkpoint(body), batch[0], params["stack"])
        logits = h @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return loss_fn


def node_exchanges(stats_by_phase):
    """Per phase of ``communication_stats``: (bytes sent between nodes, loop runs counted;
    the most runs of one)."""
    out = {}
    for phase, stats in stats_by_phase.items():
        (node,) = [o for o in stats.overlap if o.axis == "node"]
        out[phase] = (node.bytes_sent, max(e.runs for e in node.exchanges))
    return out


def train(algorithm, mark: bool, steps=4, loss_fn=None, params=PARAMS, **kwargs):
    strategy = jax_bytegrad.Strategy(
        algorithm, mesh=jax_bytegrad.make_mesh(2, 4), shard="params", **kwargs
    )
    optimizer = None if algorithm == "qadam" else optax.adam(1e-2)
    with strategy.train_step(loss_fn or loss_of(mark), optimizer) as step:
        # The batch shows the step the marks (error feedback lays out residuals for them).
        state = step.init(params, BATCH)
        exchanges = node_exchanges(step.communication_stats(state, BATCH))
        losses = []
        for _ in range(steps):
            state, metrics = step(state, BATCH)
            losses.append(float(metrics["loss"]))
        return losses, exchanges, state, jax.device_get(step.params(state))


def assert_nodes_identical(state):
    # Device j of node 0 and device j of node 1 hold the same block of every leaf.
    for leaf in jax.tree.leaves(state.params):
        shards = {s.device.id: np.asarray(s.data) for s in leaf.addressable_shards}
        for j in range(4):
            np.testing.assert_array_equal(shards[j], shards[4 + j])


@pytest.mark.parametrize(
    "algorithm, kwargs",
    [
        ("gradient_allreduce", {}),
        # 8-bit codes in the loop; each layer rounds on its own key, drawn from bytegrad's
        # state. (Plain 8-bit nearest rounding is this exchange without the key, and nearest
        # rounding in the loop is 4bit-ef's and qadam's 8-bit case's.)
        pytest.param("bytegrad", {"rounding": "stochastic"}, marks=pytest.mark.slow),
        # Each layer keeps its own residuals, scanned with the stack.
        ("bytegrad", {"bits": 4, "error_feedback": True}),
    ],
    ids=["gradient_allreduce", "bytegrad-stochastic", "bytegrad-4bit-ef"],
)
def test_a_marked_stack_trains_as_unmarked_and_exchanges_inside_the_loop(algorithm, kwargs):
    want, want_bytes, _, want_params = train(algorithm, False, **kwargs)
    got, got_bytes, state, got_params = train(algorithm, True, **kwargs)
    assert want[-1] < 0.9 * want[0], "the model did not learn"
    if algorithm == "gradient_allreduce":
        assert_trees_all_close(got_params, want_params, atol=1e-5)
    # 4-bit codes in a layer's own blocks round otherwise than in the whole gradient's
    # buckets: here both runs stray up to ~7% from float32's losses in 10 steps.
    np.testing.assert_allclose(got, want, rtol=0.05 if kwargs.get("bits") == 4 else 0.01)
    assert_nodes_identical(state)
    # Unmarked, every exchange between nodes runs once, after the loop; marked, the stack's
    # runs inside the backward loop, once per layer, with the same bytes in all.
    assert want_bytes["step"][1] == 1 and got_bytes["step"][1] == LAYERS
    assert got_bytes["step"][0] == want_bytes["step"][0], (got_bytes, want_bytes)
    if kwargs.get("error_feedback"):
        assert_residuals_fed(state)


def assert_residuals_fed(state, layer=64 * 256):
    # The last pair is the stack's (each layer's residuals, stacked), which the loop wrote:
    # a 4-bit exchange always leaves something unsent.
    residuals = optax.tree.get(state.opt_state, "residuals")
    send, mean = (np.asarray(jax.device_get(x)) for x in residuals[-1])
    per_device = send.reshape(8, LAYERS, -1)
    assert send.size >= 8 * LAYERS * layer // 4 and mean.size == send.size // 2
    assert all(np.abs(per_device[:, layer]).max() > 0 for layer in range(LAYERS))


@pytest.mark.slow
@pytest.mark.parametrize(
    "feedback", [{}, {"bits": 4, "error_feedback": True}], ids=["8bit", "4bit-ef"]
)
def test_qadam_exchanges_inside_the_loop_in_both_phases(feedback):
    kwargs = dict(learning_rate=1e-2, warmup_steps=2, **feedback)
    want, want_bytes, want_state, _ = train("qadam", False, **kwargs)
    got, got_bytes, state, _ = train("qadam", True, **kwargs)
    # The momentum the loop exchanged is b1 m + (1 - b1) g on the state's m: to about a code
    # step (of a grid whose range spans every device's momentum, over 255 or 15 codes).
    step = 0.02 if not feedback else 0.25
    want_mu = jax.device_get(optax.tree.get(want_state.opt_state, "mu"))
    for got_m, want_m in zip(
        jax.tree.leaves(jax.device_get(optax.tree.get(state.opt_state, "mu"))),
        jax.tree.leaves(want_mu),
        strict=True,
    ):
        np.testing.assert_allclose(got_m, want_m, atol=step * np.abs(want_m).max())
    # The losses before the first compressed update, as float32; after it, as 8-bit momenta
    # quantized in a layer's own blocks rather than the whole gradient's buckets.
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-5)
    np.testing.assert_allclose(got, want, rtol=0.01)
    assert_nodes_identical(state)
    assert got_bytes["warmup"] == (want_bytes["warmup"][0], LAYERS)
    # The compressed phase's momentum b1 m + (1 - b1) g, on the optimizer's m, 8-bit.
    assert got_bytes["compressed"] == (want_bytes["compressed"][0], LAYERS)
    if feedback:
        assert_residuals_fed(state)


def test_an_unmarked_loss_gets_the_program_it_had_without_the_loop_machinery():
    # A step that could exchange in the loop traces the loss through the rewriter; without a
    # mark, its program must be the plain step's: the same buckets, crossing in the order the
    # backward produces them (the marks' flags once hid that order, reversing the buckets).
    strategy = jax_bytegrad.Strategy(
        "bytegrad", mesh=jax_bytegrad.make_mesh(2, 4), shard="params", bucket_bytes=1
    )
    texts = []
    for loop in (True, False):
        with strategy.train_step(loss_of(False), optax.adam(1e-2)) as step:
            if not loop:
                step._loop_syncs = {}  # the step as it was before exchange_in_loop
            texts.append(step.lower(step.init(PARAMS), BATCH).as_text())
    assert texts[0] == texts[1]


def test_error_feedback_inside_the_loop_needs_the_batch_at_init_and_restores_onto_its_shapes():
    strategy = jax_bytegrad.Strategy(
        "bytegrad", mesh=jax_bytegrad.make_mesh(2, 4), shard="params", bits=4,
        error_feedback=True,
    )  # fmt: skip
    with strategy.train_step(loss_of(True), optax.adam(1e-2)) as step:
        # Without the batch the state's residuals are the whole gradient's: refused, saying so.
        with pytest.raises(ValueError, match=r"step.init\(params, batch\)"):
            step(step.init(PARAMS), BATCH)
        state = step.init(PARAMS, BATCH)
        shapes = step.state_shapes(PARAMS, BATCH)
        assert jax.tree.structure(shapes) == jax.tree.structure(state)
        for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(shapes), strict=True):
            assert np.shape(want) == np.shape(got)
            assert getattr(want, "sharding", None) == getattr(got, "sharding", None)
        # The sync's own residuals (the unmarked leaves'), then the stack's.
        residuals = optax.tree.get(state.opt_state, "residuals")
        sizes = [(int(a.size), int(b.size)) for a, b in residuals]
        assert sizes[-1] == (8 * LAYERS * 64 * 256 // 4, 8 * LAYERS * 64 * 256 // 8)
        # The loop reads the stack's residuals: given others, only the stack trains otherwise.
        send = jax.device_put(np.full(sizes[-1][0], 1e-2, np.float32), residuals[-1][0].sharding)
        fed = Residuals((*residuals[:-1], (send, residuals[-1][1])))
        other = state._replace(opt_state=optax.tree.set(state.opt_state, residuals=fed))
        want = jax.device_get(step.params(step(step.init(PARAMS, BATCH), BATCH)[0]))
        got = jax.device_get(step.params(step(other, BATCH)[0]))
    for name in ("proj", "head"):
        np.testing.assert_array_equal(got[name], want[name])
    assert np.abs(got["stack"] - want["stack"]).max() > 0


def test_the_mark_is_an_identity_outside_a_sharded_step():
    loss = loss_of(True)
    got = jax.grad(loss)(PARAMS, BATCH)
    want = jax.grad(loss_of(False))(PARAMS, BATCH)
    assert_trees_all_close(got, want, atol=0)


def linen_loss(mark: bool):
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(64)(h)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, h):
            block = nn.remat(Block)
            if mark:  # the opt-in line
                block = nn.map_variables(block, "params", exchange_in_loop, init=True)
            blocks = nn.scan(
                block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
            )
            # Named: an automatic name would follow the wrapped class's.
            h, _ = blocks(name="blocks")(h, None)
            return nn.Dense(8)(h)

    model = Model()

    def loss_fn(params, batch):
        logits = model.apply(params, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return loss_fn, model.init(jax.random.key(0), X[:1])


@pytest.mark.slow
def test_a_marked_linen_scan_trains_as_unmarked_and_exchanges_inside_the_loop():
    loss_fn, params = linen_loss(False)
    want, want_bytes, _, want_params = train("gradient_allreduce", False, 3, loss_fn, params)
    loss_fn, marked_params = linen_loss(True)
    assert jax.tree.structure(marked_params) == jax.tree.structure(params)
    got, got_bytes, state, got_params = train("gradient_allreduce", True, 3, loss_fn, params)
    assert_trees_all_close(got_params, want_params, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_nodes_identical(state)
    assert want_bytes["step"][1] == 1 and got_bytes["step"] == (want_bytes["step"][0], LAYERS)


@pytest.mark.slow
def test_a_marked_linen_scan_keeps_error_feedback_inside_the_loop():
    # Flax's map_variables also leaves a mark with no inputs in the trace: it marks nothing.
    kwargs = dict(bits=4, error_feedback=True)
    loss_fn, params = linen_loss(False)
    want, want_bytes, _, _ = train("bytegrad", False, 3, loss_fn, params, **kwargs)
    loss_fn, _ = linen_loss(True)
    got, got_bytes, state, _ = train("bytegrad", True, 3, loss_fn, params, **kwargs)
    np.testing.assert_allclose(got, want, rtol=0.05)
    assert_nodes_identical(state)
    assert_residuals_fed(state, layer=64 * 64)
    assert want_bytes["step"][1] == 1 and got_bytes["step"][1] == LAYERS


def nnx_train(mark: bool, steps=3, algorithm="gradient_allreduce", shard="params", **kwargs):
    """NNX's stacked blocks with Dropout (built under nnx.vmap, run by nnx.scan under
    nnx.remat, ``mark``: each block's params through exchange_in_loop inside the remat),
    trained on 2 x 4; returns the losses, ``node_exchanges``, the last state and the params."""
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(64, 64, rngs=rngs)
            self.dropout = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, h):
            return self.dropout(jnp.tanh(self.linear(h)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs):
                return Block(rngs)

            self.blocks = make_blocks(rngs)
            self.head = nnx.Linear(64, 8, rngs=rngs)

        def __call__(self, h):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def run(h, block):
                if mark:  # the opt-in line
                    nnx.update(block, exchange_in_loop(nnx.state(block, nnx.Param)))
                return block(h)

            return self.head(run(h, self.blocks))

    def loss_fn(model, batch):
        logits = model(batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    strategy = jax_bytegrad.Strategy(
        algorithm, mesh=jax_bytegrad.make_mesh(2, 4), shard=shard, **kwargs
    )
    model = Model(nnx.Rngs(0, dropout=1))
    with jax_bytegrad.nnx.train_step(strategy, model, optax.adam(1e-2), loss_fn) as step:
        exchanges = node_exchanges(step.communication_stats(BATCH))
        losses = [float(step(BATCH)["loss"]) for _ in range(steps)]
        return losses, exchanges, step.state, jax.device_get(step.train_step.params(step.state))


@pytest.mark.slow
def test_marked_nnx_stacked_blocks_train_as_unmarked_and_exchange_inside_the_loop():
    want, want_bytes, _, want_params = nnx_train(False)
    got, got_bytes, state, got_params = nnx_train(True)
    assert_trees_all_close(got_params, want_params, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_nodes_identical(state)
    # The blocks' kernel and bias, each once per layer inside the loop.
    assert want_bytes["step"][1] == 1 and got_bytes["step"] == (want_bytes["step"][0], LAYERS)


@pytest.mark.slow
def test_marked_nnx_stacked_blocks_keep_error_feedback_inside_the_loop():
    # The step fits its state to the marks on the first batch it sees.
    kwargs = dict(algorithm="bytegrad", bits=4, error_feedback=True)
    want, want_bytes, _, _ = nnx_train(False, **kwargs)
    got, got_bytes, state, _ = nnx_train(True, **kwargs)
    np.testing.assert_allclose(got, want, rtol=0.05)
    assert_nodes_identical(state)
    assert_residuals_fed(state, layer=64 * 64)
    # Once per layer inside the loop (each 64 x 64 layer pads its own blocks: more bytes
    # than the whole gradient's one bucket, at this size).
    assert want_bytes["step"][1] == 1 and got_bytes["step"][1] == LAYERS
