"""shard="full" on 2 x 4 CPU devices: the state split over every device, nodes included, the
weights gathered across nodes as codes where the model uses them and the gradient
reduce-scattered across nodes as codes (the integer wire's sums, or an all-to-all). Each
model trains as with shard=None, a checkpoint resumes exactly (into another layout too), and
what crosses between nodes is codes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_sharding_models
from helpers import assert_trees_all_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_exchange_in_loop import nnx_train
from test_sharding_models import LLAMA, SHAPE, _nnx_run, token_batches

import jax_bytegrad
from jax_bytegrad.checkpoint import Checkpointer
from jax_bytegrad.sharding import exchange_in_loop

MESH_SHAPE = (2, 4)
SETTINGS = {"gradient_allreduce": {"hierarchical": True}, "bytegrad": {}}


def train(algorithm: str, shard, *, scan: bool, steps: int, mark="inside", **settings):
    """``test_sharding_models.train`` with ``SETTINGS``, each layer marked inside its remat."""
    settings = {**SETTINGS[algorithm], **settings}
    return test_sharding_models.train(
        algorithm, shard, scan=scan, steps=steps, mark=mark, **settings
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "scan", "mark"),
    [("gradient_allreduce", False, "inside"), ("gradient_allreduce", True, False)],
    ids=["list-marked", "scanned-unmarked"],
)
def test_float32_fsdp_trains_as_replicated(algorithm, scan, mark):
    want_params, want, _ = train(algorithm, None, scan=scan, steps=8, mark=mark)
    got_params, got, state = train(algorithm, "full", scan=scan, steps=8, mark=mark)
    assert want[-1] < 0.95 * want[0], "the model did not learn"
    assert_trees_all_close(got_params, want_params, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # Every device rests with an eighth of every layer.
    wq = state.params["layers"]["wq"] if scan else state.params["layers"][0]["wq"]
    block = wq.addressable_shards[0].data.shape
    assert block == ((SHAPE.layers, SHAPE.dim // 8, SHAPE.dim) if scan else (4, SHAPE.dim))


@pytest.mark.slow
def test_bytegrad_full_ends_within_a_percent_of_replicated():
    steps = 60
    _, want, _ = train("bytegrad", None, scan=True, steps=steps)
    _, got, _ = train("bytegrad", "full", scan=True, steps=steps)
    assert want[-1] < 0.8 * want[0], "the model did not learn"
    tail = lambda x: np.mean(x[-10:])  # noqa: E731
    assert abs(tail(got) / tail(want) - 1) < 0.01, (tail(got), tail(want))


def _compiled(algorithm: str, shard, *, width: int = 256, layers: int = 4, mark: bool = True,
              learning_rate: float = 0.1, mesh_shape=MESH_SHAPE, **settings):  # fmt: skip
    """The compiled step (SGD) of a scanned stack of ``layers`` square layers of ``width``
    under jax.checkpoint (marked inside it), plus a head, and its state; ``settings``: the
    sync's, beyond ``SETTINGS``."""

    def loss_fn(params, batch):
        x, y = batch

        def layer(h, w):
            w = exchange_in_loop(w) if mark else w
            return jnp.tanh(h @ w)

        h, _ = jax.lax.scan(lambda h, w: (jax.checkpoint(layer)(h, w), None), x, params["stack"])
        return jnp.mean((h @ params["head"] - y) ** 2)

    rng = np.random.default_rng(0)
    params = {
        "stack": rng.normal(size=(layers, width, width)).astype(np.float32) / np.sqrt(width),
        "head": rng.normal(size=(width, 8)).astype(np.float32),
    }
    batch = (np.ones((16, width), np.float32), np.zeros((16, 8), np.float32))
    mesh = jax_bytegrad.make_mesh(*mesh_shape)
    kwargs = {**SETTINGS[algorithm], **settings}
    strategy = jax_bytegrad.Strategy(algorithm, mesh=mesh, shard=shard, **kwargs)
    step = strategy.train_step(loss_fn, optax.sgd(learning_rate))
    state = step.init(params)
    return step, state, batch, params


def test_what_crosses_between_nodes_is_codes_a_third_more_than_params():
    stats = {}
    for algorithm, shard in [("bytegrad", "params"), ("bytegrad", "full"),
                             ("gradient_allreduce", "full")]:  # fmt: skip
        step, state, batch, _ = _compiled(algorithm, shard)
        with step:
            stats[algorithm, shard] = step.communication_stats(state, batch)["step"]
    full = stats["bytegrad", "full"]
    between = [r for r in full.rows if r.axes == "node"]
    floats = sum(r.bytes_sent for r in between if "f32" in r.dtype)
    codes = sum(r.bytes_sent for r in between if r.dtype == "u8")
    kinds = {r.kind for r in between if r.dtype == "u8"}
    # The weights' codes gathered and the gradient's reduce-scattered, all 8-bit: the float32
    # between nodes is the blocks' headers and bounds, 8 B per block of 2048 codes each.
    assert {"all-gather", "reduce-scatter"} <= kinds
    assert floats < 0.02 * codes
    params = stats["bytegrad", "params"].bytes_on("node")
    # Three passes of the model's codes (gather, re-gather in the backward, reduce-scatter)
    # against the hybrid layout's all-reduce (two): 1.5x.
    assert full.bytes_on("node") <= 1.6 * params
    assert stats["gradient_allreduce", "full"].bytes_on("node") >= 3.8 * full.bytes_on("node")


def _while_bodies(hlo: str) -> str:
    """The text of the computations the compiled step's while loops run."""
    bodies = set(re.findall(r"while\(.*?\), condition=%?[\w.\-]+, body=%?([\w.\-]+)", hlo))
    out, keep = [], False
    for line in hlo.splitlines():
        head = re.match(r"^%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            keep = head.group(1) in bodies
        if keep:
            out.append(line)
    return "\n".join(out)


def test_a_marked_layer_is_gathered_and_reduced_across_nodes_inside_the_loop():
    step, state, batch, _ = _compiled("bytegrad", "full")
    with step:
        hlo = step.lower(state, batch).compile().as_text()
    loops = _while_bodies(hlo)
    # One layer's codes at a time: the gather and the gradient's reduce-scatter run in the
    # loops (forward, and backward with the checkpoint's re-gather), never the whole stack.
    assert re.search(r"u8\[[^\]]*\][^\n]*all-gather", loops), "no gather of codes in the loop"
    assert re.search(r"reduce-scatter\(", loops), "no reduce-scatter in the loop"
    assert not re.search(r"f32\[4,256,256\][^\n]*all-gather", hlo)


def test_a_full_checkpoint_resumes_exactly_and_restores_into_params(tmp_path):
    batches = token_batches(6)
    mesh = jax_bytegrad.make_mesh(*MESH_SHAPE)
    params = jax.device_get(LLAMA.init(SHAPE, jax.random.key(0), scan=True))
    loss = LLAMA.loss_fn(SHAPE, scan=True, mark="inside")

    def run(shard, start_state=None, batches=batches):
        strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard=shard)
        step = strategy.train_step(loss, optax.adamw(3e-3))
        state = start_state(step) if start_state else step.init(params)
        for b in batches:
            state, _ = step(state, b)
        return step, state

    step, state = run("full", batches=batches[:3])
    with step, Checkpointer(tmp_path, every=1) as ckpt:
        at_3 = jax.device_get(step.params(state))
        ckpt.save(3, state)
        ckpt.wait()
        for b in batches[3:]:
            state, _ = step(state, b)
        want = jax.device_get(step.params(state))

    def restored():
        def start(step):
            with Checkpointer(tmp_path, every=1) as ckpt:
                shapes = step.state_shapes(params)
                got = ckpt.restore(3, lambda: shapes, shapes)
            return got

        return start

    again, state = run("full", restored(), batches[3:])
    with again:
        assert_trees_all_close(jax.device_get(again.params(state)), want)
        spec = state.params["layers"]["wq"].sharding.spec
        assert spec == P(None, ("local", "node"), None)
    # The same checkpoint onto the hybrid layout: each leaf as it was saved.
    hybrid, state = run("params", restored(), [])
    with hybrid:
        assert_trees_all_close(jax.device_get(hybrid.params(state)), at_3, atol=0)
        assert state.params["layers"]["wq"].sharding.spec == P(None, "local", None)


def test_nnx_stacked_blocks_with_dropout_train_full_as_replicated():
    nnx = pytest.importorskip("flax.nnx")
    base, want = _nnx_run(nnx, None, 6)
    step, got = _nnx_run(nnx, "full", 6)
    with base, step:
        assert want[-1] < want[0]
        np.testing.assert_allclose(got, want, rtol=1e-5)
        params = [nnx.to_pure_dict(nnx.state(s.model, nnx.Param)) for s in (step, base)]
        assert_trees_all_close(*params, atol=1e-5)
        kernel = step.state.params["blocks"]["linear"]["kernel"]
        assert kernel.addressable_shards[0].data.shape == (4, 2, 16)


def test_diloco_is_refused_clearly_with_full():
    mesh = jax_bytegrad.make_mesh(*MESH_SHAPE)
    with pytest.raises(ValueError, match="whole model on each node"):
        strategy = jax_bytegrad.Strategy("diloco", mesh=mesh, shard="full", inner_steps=4)
        strategy.train_step(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1))


def test_a_bare_step_is_refused_with_full():
    # (optax.MultiSteps is taken: tests/test_full_accumulation.py.)
    mesh = jax_bytegrad.make_mesh(*MESH_SHAPE)
    loss = lambda p, b: jnp.sum(p["w"] * b)  # noqa: E731
    tx = optax.chain(jax_bytegrad.bytegrad(), optax.sgd(0.1))
    with pytest.raises(ValueError, match="Strategy"):
        jax_bytegrad.data_parallel_step(loss, tx, mesh, shard="full")


def test_the_weights_the_forward_computes_on_are_the_masters_to_8_bits():
    step, state, batch, params = _compiled("bytegrad", "full", width=64, layers=2)
    with step:
        mesh = step.mesh
        spec = state.params["stack"].sharding.spec
        config = jax_bytegrad.SyncConfig()
        from jax_bytegrad._src.sync import across_nodes

        def gather(block):
            return across_nodes.gather_weights(block, 1, config, compressed=True)[None]

        fn = jax.shard_map(gather, mesh=mesh, in_specs=spec, out_specs=P(("node", "local")))
        got = np.asarray(jax.jit(fn)(state.params["stack"]))
    want = params["stack"]
    # Every device computes on the same decoded weights, each within half a code step of
    # the master (a block's range over 255 levels).
    assert all((g == got[0]).all() for g in got)
    error = np.abs(got[0] - want).max() / np.abs(want).max()
    assert 0 < error < 1 / 255, error
    assert isinstance(state.params["stack"].sharding, NamedSharding)


def test_4_bit_codes_train_on_the_integer_wire_of_2_nodes():
    # wire="allreduce" (wire="auto" takes the scatter-gather wire for 4 bits): on 2 nodes
    # 4-bit codes sum on the integer wire, 7 levels a node.
    _, want, _ = train("bytegrad", None, scan=True, steps=12, bits=4, wire="allreduce")
    _, got, _ = train("bytegrad", "full", scan=True, steps=12, bits=4, wire="allreduce")
    assert want[-1] < want[0] and got[-1] < got[0]
    # No worse than 2% above: the two sum their codes in different collectives (an
    # all-reduce, a reduce-scatter), so their rounding differs, and "full" gathers 8-bit
    # weights.
    assert got[-1] <= want[-1] * 1.02, (got[-1], want[-1])


@pytest.mark.slow
def test_4_and_2_bit_codes_cross_4_nodes_on_the_scatter_gather_wire():
    # Beyond 2 nodes 4-bit codes no longer sum on the integer wire (their nibbles would
    # carry), nor 2-bit ones on any: wire="auto" reduce-scatters them as an all-to-all.
    # The 2-bit run trains (4-bit codes take the same path: 0.96x here, measured); it ends
    # no worse than 2% above the replicated 4-bit run.
    shape, settings = (4, 2), {"error_feedback": True}
    _, want, _ = train("bytegrad", None, scan=True, steps=12, bits=4, mesh_shape=shape, **settings)
    _, got, _ = train("bytegrad", "full", scan=True, steps=12, bits=2, mesh_shape=shape, **settings)
    assert got[-1] < 0.95 * got[0]
    assert got[-1] <= want[-1] * 1.02, (got[-1], want[-1])
    # 4-bit: the weights' 8-bit codes are gathered; the gradient's codes cross as an all-to-all.
    step, state, batch, _ = _compiled("bytegrad", "full", mesh_shape=shape, bits=4, **settings)
    with step:
        rows = step.communication_stats(state, batch)["step"].rows
    assert {r.kind for r in rows if r.axes == "node" and r.dtype == "u8"} == {
        "all-gather",
        "all-to-all",
    }
    mesh = jax_bytegrad.make_mesh(*shape)
    refusals = [("allreduce", "4-bit codes sum over at most 2"), ("ring", "not wire='ring'")]
    for wire, says in refusals:
        with pytest.raises(ValueError, match=re.escape(says)):
            jax_bytegrad.Strategy(
                "bytegrad", mesh=mesh, shard="full", bits=4, error_feedback=True, wire=wire
            ).train_step(LLAMA.loss_fn(SHAPE, scan=True, mark="inside"), optax.sgd(0.1))


def _scattered(grads, residuals, key=None, wire="allreduce", bits=4):
    """``across_nodes.scatter_gradient`` on the 2 x 4 mesh of each device's gradient of a
    (64, 80) leaf (split along 0) and its residual, with error feedback on ``wire``: every
    device's block of the sum, and its new residual, one row per device in mesh order."""
    from jax_bytegrad._src.sync import across_nodes

    rounding = "nearest" if key is None else "stochastic"
    config = jax_bytegrad.SyncConfig(
        bits=bits, error_feedback=True, rounding=rounding, wire=wire, block_size=1024 // bits
    )  # pieces of 640 values: 2 blocks of 512 at 2 bits, 3 of 256 at 4 (the last padded)

    def scatter(grad, residual, key):
        block, kept = across_nodes.scatter_gradient(
            grad[0], 0, config, True, 1.0, key=key, residual=residual[0]
        )
        return block[None], kept[None]

    devices = P(("node", "local"))
    fn = jax.shard_map(
        scatter, mesh=jax_bytegrad.make_mesh(*MESH_SHAPE), in_specs=(devices, devices, P()),
        out_specs=(devices, devices),
    )  # fmt: skip
    return [np.asarray(x) for x in jax.jit(fn)(grads, residuals, key)]


@pytest.mark.parametrize(
    ("stochastic", "wire", "bits"),
    [(False, "allreduce", 4), (True, "allreduce", 4), (False, "scatter_gather", 4),
     (True, "scatter_gather", 2)],
    ids=["nearest", "stochastic", "scatter-gather-nearest", "scatter-gather-2-bit-stochastic"],
)  # fmt: skip
def test_full_error_feedback_keeps_what_the_codes_missed(stochastic, wire, bits):
    nodes, local = MESH_SHAPE
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(nodes * local, 64, 80)).astype(np.float32)
    residuals = rng.normal(scale=0.1, size=(nodes * local, 64 * 80 // local)).astype(np.float32)
    key = jax.random.key(1) if stochastic else None
    blocks, kept = _scattered(grads, residuals, key, wire, bits)
    # Device (node m, local k) owns piece k K + m of the summed leaf, and each device (i, k)
    # codes row m of its run for it: the decoded sum and the residuals left over add up to
    # the sum plus the residuals that went in.
    pieces = grads.sum(0).reshape(nodes * local, -1)
    went_in = residuals.reshape(nodes, local, nodes, -1).sum(0)  # (local k, piece m, n)
    left = kept.reshape(nodes, local, nodes, -1).sum(0)
    for m in range(nodes):
        for k in range(local):
            got = blocks[m * local + k].reshape(-1) + left[k, m]
            np.testing.assert_allclose(got, pieces[k * nodes + m] + went_in[k, m], atol=2e-5)
    assert np.abs(kept).max() > 1e-3  # the codes miss something
    if stochastic:  # the codes differ from nearest rounding's, and with the key
        again = lambda key: _scattered(grads, residuals, key, wire, bits)[0]  # noqa: E731
        assert not np.array_equal(blocks, again(None))
        assert not np.array_equal(blocks, again(jax.random.key(2)))


@pytest.mark.slow
def test_4_bit_error_feedback_trains_full_as_replicated_and_resumes_exactly(tmp_path):
    settings = {"bits": 4, "error_feedback": True}
    _, want, _ = train("bytegrad", None, scan=True, steps=12, **settings)
    _, got, state = train("bytegrad", "full", scan=True, steps=12, **settings)
    assert want[-1] < want[0] and got[-1] < got[0]
    # No worse than 2% above. It ends lower here (0.97x): both take the scatter-gather wire,
    # where "full" codes each device's gradient once and its owner sums the decoded codes,
    # and the replicated wire codes it twice (each device's, then each owner's mean).
    assert got[-1] <= want[-1] * 1.02, (got[-1], want[-1])
    # Each split leaf's residual is its device's own, kept in the optimizer state.
    residuals = optax.tree.get(state.opt_state, "residuals")
    sends = [np.asarray(send) for send, _ in residuals]
    assert len(sends) == len(jax.tree.leaves(state.params))
    assert all(np.abs(x).max() > 0 for x in sends)
    assert residuals[0][0].sharding.spec == P(("node", "local"))
    # A checkpoint restores them exactly, into the layout state_shapes gives.
    mesh = jax_bytegrad.make_mesh(*MESH_SHAPE)
    params = jax.device_get(LLAMA.init(SHAPE, jax.random.key(0), scan=True))
    strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard="full", **settings)
    step = strategy.train_step(LLAMA.loss_fn(SHAPE, scan=True, mark="inside"), optax.adamw(3e-3))
    with step, Checkpointer(tmp_path, every=1) as ckpt:
        ckpt.save(12, state)
        ckpt.wait()
        shapes = step.state_shapes(params)
        restored = ckpt.restore(12, lambda: shapes, shapes)
    got = optax.tree.get(restored.opt_state, "residuals")
    assert_trees_all_close(jax.device_get(got), jax.device_get(residuals))
    assert [x.sharding for x in jax.tree.leaves(got)] == [
        x.sharding for x in jax.tree.leaves(residuals)
    ]


def test_stochastic_rounding_trains_full_and_differs_from_nearest():
    losses = {}
    for rounding in ("nearest", "stochastic"):
        step, state, batch, _ = _compiled("bytegrad", "full", width=64, layers=2,
                                          learning_rate=1e-3, rounding=rounding)  # fmt: skip
        with step:
            losses[rounding] = []
            for _ in range(4):
                state, metrics = step(state, batch)
                losses[rounding].append(float(metrics["loss"]))
    got, want = losses["stochastic"], losses["nearest"]
    assert got[-1] < 0.5 * got[0]
    # The same weights at the first step; the gradient's codes differ from the second on.
    assert got[0] == want[0] and all(g != w for g, w in zip(got[1:], want[1:], strict=True))
    np.testing.assert_allclose(got, want, rtol=0.02)


def test_bfloat16_params_train_full_and_stay_bfloat16():
    params = jax.device_get(LLAMA.init(SHAPE, jax.random.key(0), scan=True, dtype=jnp.bfloat16))
    loss = LLAMA.loss_fn(SHAPE, scan=True, mark="inside")
    mesh = jax_bytegrad.make_mesh(*MESH_SHAPE)
    last = {}
    for shard in (None, "full"):
        strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard=shard)
        with strategy.train_step(loss, optax.adamw(3e-3)) as step:
            state = step.init(params)
            losses = []
            for batch in token_batches(10):
                state, metrics = step(state, batch)
                losses.append(float(metrics["loss"]))
            assert state.params["layers"]["wq"].dtype == jnp.bfloat16
            assert losses[-1] < 0.9 * losses[0]
            last[shard] = losses[-1]
    np.testing.assert_allclose(last["full"], last[None], rtol=0.02)


def _linen_loss(mark: bool):
    """A linen stack as users write one: nn.scan over nn.remat'd blocks, the marked one's
    params through exchange_in_loop inside the remat (``nn.map_variables``)."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(64)(h)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, h):
            block = Block
            if mark:  # the opt-in line, inside the remat
                block = nn.map_variables(block, "params", exchange_in_loop, init=True)
            blocks = nn.scan(
                nn.remat(block), variable_axes={"params": 0}, split_rngs={"params": True},
                length=3,
            )  # fmt: skip
            h, _ = blocks(name="blocks")(h, None)
            return nn.Dense(8)(h)

    model = Model()
    x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)

    def loss_fn(params, batch):
        return jnp.mean((model.apply(params, batch[0]) - batch[1]) ** 2)

    return loss_fn, model.init(jax.random.key(0), x[:1]), (x, np.tanh(x[:, :8]))


@pytest.mark.slow
def test_marked_linen_and_nnx_stacks_train_full_as_replicated():
    loss_fn, params, batch = _linen_loss(mark=True)
    mesh = jax_bytegrad.make_mesh(*MESH_SHAPE)
    out = {}
    for shard in (None, "full"):
        strategy = jax_bytegrad.Strategy("gradient_allreduce", mesh=mesh, shard=shard)
        with strategy.train_step(loss_fn, optax.sgd(0.1, momentum=0.9)) as step:
            state = step.init(params)
            losses = []
            for _ in range(4):
                state, metrics = step(state, batch)
                losses.append(float(metrics["loss"]))
            out[shard] = losses, jax.device_get(step.params(state))
    assert out[None][0][-1] < out[None][0][0]
    np.testing.assert_allclose(out["full"][0], out[None][0], rtol=1e-5)
    assert_trees_all_close(out["full"][1], out[None][1], atol=1e-5)
    want, _, _, want_params = nnx_train(True, 4, shard=None)
    got, _, _, got_params = nnx_train(True, 4, shard="full")
    assert want[-1] < want[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_all_close(got_params, want_params, atol=1e-5)
