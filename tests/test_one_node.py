"""One node sends nothing and costs nothing: on a 1 x 8 mesh the compressed syncs (ByteGrad,
pipelined or not, QAdam's compressed phase) compile to gradient_allreduce's collectives and
train as it does; on 2 x 4 (and flat on 1 x 8) the compressed wire still runs."""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_bit_identical, assert_trees_all_close
from jax.sharding import PartitionSpec as P

import jax_bytegrad
import jax_bytegrad.experimental
from jax_bytegrad.profiling import hlo_instructions

LR = 1e-2
STEPS = 3
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
# ByteGrad's step also splits its PRNG key (a u32 threefry), whatever the mesh: a concatenate of
# the key's words, not of the gradient's buckets.
FLOAT = re.compile(r"\(?(f16|bf16|f32|f64)\[")
INTEGER = re.compile(r"[su](8|16|32)\[")

# name: (algorithm, its settings); QAdam runs one warm-up step first, then its compressed phase.
# QAdam has no pipelined step (pipeline= is ByteGrad's only).
CASES = {
    "bytegrad8": ("bytegrad", {}),
    "bytegrad4-ef": ("bytegrad", {"bits": 4, "error_feedback": True}),
    "bytegrad8-pipelined": ("bytegrad", {"pipeline": True}),
    "bytegrad4-ef-pipelined": ("bytegrad", {"bits": 4, "error_feedback": True, "pipeline": True}),
    "qadam": ("qadam", {"warmup_steps": 1, "learning_rate": LR}),
}


def _params():
    key = jax.random.key(0)
    sizes = (32, 64, 64, 10)
    return [
        {
            "w": jax.random.normal(jax.random.fold_in(key, i), (a, b)) / np.sqrt(a),
            "b": jnp.full((b,), 0.01 * (i + 1)),
        }
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=False))
    ]


def _batch(i: int):
    rng = np.random.default_rng(i)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    return x, np.tanh(x[:, :10] * 2.0).astype(np.float32)


def _loss(params, batch):
    x, y = batch
    for i, p in enumerate(params):
        x = x @ p["w"] + p["b"][None]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return jnp.mean((x - y) ** 2)


def _strategy(name, mesh, shard=None, **extra):
    algorithm, settings = CASES.get(name, (name, {}))
    return jax_bytegrad.Strategy(algorithm, mesh=mesh, shard=shard, **settings, **extra)


def _optimizer(name):
    return None if name == "qadam" else optax.adam(LR)


def _ops(text: str) -> dict[str, int]:
    """Each collective's count, and the concatenates of float values (the buckets')."""
    counts = collections.Counter()
    for ins in hlo_instructions(text):
        op = ins.opcode.removesuffix("-start")
        if op in COLLECTIVES:
            counts[op] += 1
        elif op == "concatenate" and FLOAT.match(ins.shape):
            counts["float concatenate"] += 1
    return dict(counts)


def _integer_collectives(text: str) -> int:
    return sum(
        ins.opcode.removesuffix("-start") in COLLECTIVES and bool(INTEGER.search(ins.shape))
        for ins in hlo_instructions(text)
    )


def _compiled_text(strategy, name) -> str:
    with strategy.train_step(_loss, _optimizer(name)) as step:
        state = step.init(_params())
        if name == "qadam":
            state, _ = step(state, _batch(0))  # the warm-up: the next step is compressed
        return step.lower(state, _batch(1)).compile().as_text()


@functools.cache
def _reference_ops(shape, shard) -> dict[str, int]:
    mesh = jax_bytegrad.make_mesh(*shape)
    name = "gradient_allreduce"
    return _ops(_compiled_text(_strategy(name, mesh, shard), name))


@pytest.mark.parametrize(
    "name,shard",
    [
        ("bytegrad8", None),
        ("bytegrad4-ef", None),
        ("bytegrad8-pipelined", None),
        ("bytegrad4-ef-pipelined", None),
        ("qadam", None),
        ("bytegrad8", "optimizer"),
        ("qadam", "optimizer"),
        ("bytegrad4-ef", "params"),
    ],
    ids=["bytegrad8", "bytegrad4-ef", "bytegrad8-pipelined", "bytegrad4-ef-pipelined", "qadam",
         "bytegrad8-optimizer", "qadam-optimizer", "bytegrad4-ef-params"],
)  # fmt: skip
def test_one_node_compiles_to_gradient_allreduces_collectives(name, shard):
    mesh = jax_bytegrad.make_mesh(1, 8)
    got = _ops(_compiled_text(_strategy(name, mesh, shard), name))
    want = _reference_ops((1, 8), shard)
    assert got == want, f"{name} (shard={shard}): {got}; gradient_allreduce: {want}"
    if shard is None:
        assert want == {"all-reduce": 1}, want  # the gradient's and the loss's, combined


# Each name replicated and with its optimizer state split within the node, but the pipelined
# step's, which carries the whole state (no shard=).
TRAINED = {
    f"{name}-{shard or 'replicated'}": (name, shard)
    for name in CASES
    for shard in (None, "optimizer")
    if shard is None or "pipeline" not in CASES[name][1]
}


@pytest.mark.parametrize("name,shard", list(TRAINED.values()), ids=list(TRAINED))
def test_one_node_trains_as_gradient_allreduce(name, shard):
    mesh = jax_bytegrad.make_mesh(1, 8)
    if name == "qadam":
        # QAdam is Adam on the mean gradient where that mean is exact (its default
        # second_moment="gradient" recovers it from two consecutive momenta).
        reference = optax.adam(LR)
    else:
        reference = _optimizer(name)
    runs = {}
    for key, strategy, optimizer in (
        ("got", _strategy(name, mesh, shard), _optimizer(name)),
        ("want", _strategy("gradient_allreduce", mesh, shard), reference),
    ):
        with strategy.train_step(_loss, optimizer) as step:
            state = init = step.init(_params())
            for i in range(STEPS):
                state, _ = step(state, _batch(i))
            runs[key] = (step.params(state), state, init)
    params, state, init = runs["got"]
    assert_trees_all_close(params, runs["want"][0], rtol=1e-6, atol=1e-6)
    assert not np.allclose(params[0]["w"], _params()[0]["w"])  # it trained
    assert_replicas_bit_identical(state.params, devices=8)
    # The state keeps its structure (checkpoints restore), and what no compression left
    # unsent stays zero.
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(init.opt_state)
    for leaf in jax.tree.leaves(state.opt_state[0].residuals):
        assert not np.any(np.asarray(leaf))


def test_compressed_mean_on_one_node_is_the_float32_mean_and_keeps_its_residuals():
    mesh = jax_bytegrad.make_mesh(1, 8)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((8, 1000)), jnp.float32)
    config = jax_bytegrad.SyncConfig(bits=4)
    # With error feedback the residuals' sizes follow the plan: both zero on one node, where
    # nothing is compressed.
    sizes = jax_bytegrad.experimental.residual_sizes(x[0], config, (1, 8))
    assert sizes == ((0, 0),)
    residuals = tuple((jnp.ones(s), jnp.ones(m)) for s, m in sizes)

    def body(x):
        return jax_bytegrad.compressed_mean(x[0], sync=config, residuals=residuals)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("node", "local")), out_specs=P()))
    mean, kept = fn(x)
    np.testing.assert_allclose(mean, np.asarray(x, np.float64).mean(0), rtol=1e-6, atol=1e-6)
    assert jax.tree.structure(tuple(kept)) == jax.tree.structure(residuals)
    assert _ops(fn.lower(x).compile().as_text()) == {"all-reduce": 1}
    # Residuals that do not fit are refused as on the compressed path.
    with pytest.raises(ValueError, match="residuals of per-device sizes"):
        bad = ((jnp.ones(3), jnp.ones(1)),)
        jax.shard_map(
            lambda x: jax_bytegrad.compressed_mean(x[0], sync=config, residuals=bad),
            mesh=mesh,
            in_specs=P(("node", "local")),
            out_specs=P(),
        )(x)


@pytest.mark.parametrize(
    "shape,settings",
    [
        ((2, 4), {}),
        ((2, 4), {"bits": 4, "error_feedback": True}),
        ((1, 8), {"hierarchical": False}),
    ],
    ids=["2x4", "2x4-4bit-ef", "1x8-flat"],
)
def test_the_compressed_wire_still_runs_between_nodes_and_flat(shape, settings):
    """Between nodes the codes still cross; flat ByteGrad compresses every device's gradient
    whatever the mesh (its bits on 1 x 8 are its bits on 2 x 4), so it keeps its wire."""
    mesh = jax_bytegrad.make_mesh(*shape)
    strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh, **settings)
    text = _compiled_text(strategy, "bytegrad")
    assert _integer_collectives(text) > 0 or "all-to-all" in _ops(text), _ops(text)
    assert _ops(text) != _reference_ops(shape, None)
