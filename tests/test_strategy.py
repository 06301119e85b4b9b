"""Tests for the one entry point, the registry of algorithms (jax_bytegrad/_src/strategy.py)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_all_close, assert_trees_all_equal

import jax_bytegrad
from jax_bytegrad import decentralized_step
from jax_bytegrad._src import strategy as strategy_lib
from jax_bytegrad.experimental import async_model_average
from jax_bytegrad.sharding import shard_batch

BATCH = 32


def _params():
    key = jax.random.PRNGKey(0)
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (16, 32)) * 0.3,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 4)) * 0.3,
    }


def _loss(params, batch):
    x, y = batch
    logits = jnp.tanh(x @ params["w1"] + params["b1"][None]) @ params["w2"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32))}


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(16, 4)).astype(np.float32)
    out = []
    for _ in range(n):
        x = rng.normal(size=(BATCH, 16)).astype(np.float32)
        out.append((x, np.argmax(x @ teacher, -1).astype(np.int32)))
    return out


# Per algorithm: its arguments, and the mesh it runs on in one process (async needs one
# node per process, so a single process is a 1 x 8 mesh).
CASES = {
    "gradient_allreduce": ({}, (2, 4)),
    "bytegrad": ({}, (2, 4)),
    "qadam": ({"learning_rate": 3e-2, "warmup_steps": 4, "eps": 1e-5}, (2, 4)),
    "decentralized": ({"peer_selection_mode": "shift_one"}, (2, 4)),
    "low_precision_decentralized": ({}, (2, 4)),
    "async": ({"sync_interval_ms": 5}, (1, 8)),
    "diloco": ({"inner_steps": 4}, (2, 4)),
}


def _strategy(name, **extra):
    kwargs, shape = CASES[name]
    return jax_bytegrad.Strategy(name, mesh=jax_bytegrad.make_mesh(*shape), **kwargs, **extra)


def _optimizer(name):
    return None if name == "qadam" else optax.adam(3e-2)


def test_the_six_bagua_names_and_diloco():
    assert set(jax_bytegrad.ALGORITHMS) == set(CASES) - {"diloco"}  # Bagua's, as the examples
    assert set(strategy_lib.REGISTRY) == set(CASES)


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_every_algorithm_trains_through_the_same_calls(name):
    params = _params()
    batches = _batches(12)
    with _strategy(name).train_step(_loss, _optimizer(name), has_aux=True) as step:
        state = step.init(params)
        assert int(state.step) == 0
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            assert metrics["loss"].shape == ()  # one number for every algorithm
            assert set(metrics) == {"loss", "aux"}
            losses.append(float(metrics["loss"]))
    assert int(state.step) == len(batches)
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    model = step.params(state)
    assert jax.tree.map(jnp.shape, model) == jax.tree.map(jnp.shape, params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(model))
    with pytest.raises(RuntimeError, match="closed"):
        step(state, batches[0])


def test_init_leaves_the_callers_params_alive():
    # The step donates its state; init must copy, so comparing two strategies from the same
    # initial params (the natural experiment) works.
    params = _params()
    for name in ("bytegrad", "gradient_allreduce"):
        step = _strategy(name).train_step(_loss, optax.adam(1e-2), has_aux=True)
        state = step.init(params)
        step(step(state, _batches(1)[0])[0], _batches(1)[0])
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))


def test_same_result_as_the_builders_it_wraps():
    mesh = jax_bytegrad.make_mesh(2, 4)
    batches = _batches(3)
    step = jax_bytegrad.Strategy("bytegrad", mesh=mesh).train_step(
        _loss, optax.adam(1e-2), has_aux=True
    )
    state = step.init(_params())
    tx = optax.chain(jax_bytegrad.bytegrad(), optax.adam(1e-2))
    dp = jax_bytegrad.data_parallel_step(_loss, tx, mesh, has_aux=True, donate=False)
    raw = dp.init(_params())
    for batch in batches:
        state, _ = step(state, batch)
        raw, _ = dp(raw, shard_batch(batch, mesh))
    assert_trees_all_equal(step.params(state), raw.params)

    dec = jax_bytegrad.Strategy("decentralized", mesh=mesh, hierarchical=False)
    dstep = dec.train_step(_loss, optax.sgd(0.1), has_aux=True)
    dstate = dstep.init(_params())
    train = decentralized_step(_loss, optax.sgd(0.1), mesh, hierarchical=False, has_aux=True)
    raw = train.init(_params())
    for batch in batches:
        dstate, _ = dstep(dstate, batch)
        raw, _ = train.step(raw, shard_batch(batch, mesh))
    assert_trees_all_equal(dstate.params, raw.params)


def test_unknown_algorithm_lists_the_names():
    with pytest.raises(ValueError, match="'bagua'.*gradient_allreduce, bytegrad, qadam"):
        jax_bytegrad.Strategy("bagua")


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_unknown_kwarg_lists_the_valid_ones(name):
    with pytest.raises(ValueError, match="unknown keyword argument.*no_such_option") as info:
        jax_bytegrad.Strategy(name, no_such_option=1)
    for valid in jax_bytegrad.Strategy.valid_kwargs(name):
        assert valid in str(info.value)


# The function whose keyword arguments each algorithm's settings are, beside the step's.
BUILDERS = {
    "gradient_allreduce": (jax_bytegrad.gradient_allreduce, jax_bytegrad.data_parallel_step),
    "bytegrad": (jax_bytegrad.bytegrad, jax_bytegrad.data_parallel_step),
    "qadam": (jax_bytegrad.qadam, jax_bytegrad.data_parallel_step),
    "decentralized": (jax_bytegrad.decentralized_step,),
    "low_precision_decentralized": (jax_bytegrad.low_precision_decentralized_step,),
    "async": (async_model_average,),
    "diloco": (jax_bytegrad.diloco_step,),
}


STRATEGY_ONLY = {
    "bytegrad": {"pipeline": False},
    "qadam": {"skip_nonfinite": False, "every_k_schedule": None},
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_the_registry_matches_the_builders_keyword_arguments_and_defaults(name):
    # The registry lists each setting and default once; the builders' signatures must agree.
    supplied = {"loss_fn", "optimizer", "mesh", "has_aux", "flatten", "phase", "phase_of"}
    supplied |= {"model_state", "rng_seed", "state_sync"}  # train_step's, not the strategy's
    settings = dict(strategy_lib.REGISTRY[name].settings)
    # Settings of the strategy itself, which no builder takes: which builder to use.
    for setting, default in STRATEGY_ONLY.get(name, {}).items():
        assert settings.pop(setting) is default, setting
    signature = {}
    for builder in BUILDERS[name]:
        for p in inspect.signature(builder).parameters.values():
            if p.name not in supplied:
                signature.setdefault(p.name, p.default)
    assert set(settings) == set(signature)
    for setting, default in settings.items():
        want = (
            strategy_lib.REQUIRED
            if signature[setting] is inspect.Parameter.empty
            else (signature[setting])
        )
        assert default is want or default == want, (setting, default, want)
    assert set(strategy_lib.tunable_settings(name)) <= set(settings)


def test_valid_kwargs_of_each_algorithm():
    valid_kwargs = jax_bytegrad.Strategy.valid_kwargs
    assert "sync_interval_ms" in valid_kwargs("async")
    assert "communication_interval" in valid_kwargs("low_precision_decentralized")
    assert "sync_interval_ms" not in valid_kwargs("bytegrad")
    assert "wire" in valid_kwargs("qadam")
    with pytest.raises(ValueError, match="unknown algorithm 'sgd'"):
        valid_kwargs("sgd")


def test_bad_values_are_rejected_at_construction():
    with pytest.raises(ValueError, match="block_size"):
        jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(2, 4), block_size=100)


def test_qadam_takes_its_settings_not_an_optimizer():
    mesh = jax_bytegrad.make_mesh(2, 4)
    with pytest.raises(ValueError, match="missing keyword argument.*warmup_steps"):
        jax_bytegrad.Strategy("qadam", mesh=mesh, learning_rate=1e-3)
    strategy = jax_bytegrad.Strategy("qadam", mesh=mesh, learning_rate=1e-3, warmup_steps=2)
    with pytest.raises(ValueError, match="optimizer=None"):
        strategy.train_step(_loss, optax.adam(1e-3), has_aux=True)
    with pytest.raises(ValueError, match="optimizer must be an optax"):
        jax_bytegrad.Strategy("bytegrad", mesh=mesh).train_step(_loss, has_aux=True)


def test_qadam_traffic_per_phase():
    mesh = jax_bytegrad.make_mesh(2, 4)
    step = jax_bytegrad.Strategy("qadam", mesh=mesh, learning_rate=1e-3, warmup_steps=2).train_step(
        _loss, has_aux=True
    )
    state, batch = step.init(_params()), _batches(1)[0]
    phases = step.communication_stats(state, batch)
    assert set(phases) == {"warmup", "compressed"}
    assert {r.dtype for r in phases["warmup"].rows if r.axes == "node"} == {"f32"}
    assert "u8" in {r.dtype for r in phases["compressed"].rows if r.axes == "node"}
    # Each phase is its own program: the warm-up sends no codes, the compressed phase no
    # float32 gradient between nodes (only the loss and accuracy means, and the integer
    # wire's block bounds: 8 bytes per 1024 values).
    assert "u8" not in {r.dtype for r in phases["warmup"].rows}
    node = [r for r in phases["compressed"].rows if "node" in r.axes]
    codes = sum(r.payload_bytes for r in node if r.dtype == "u8")
    f32 = sum(r.payload_bytes for r in node if r.dtype == "f32")
    assert 0 < f32 <= 2 * 4 + codes * 8 / 1024 * 1.01, phases["compressed"]
    assert not phases["warmup"].branches and not phases["compressed"].branches  # no lax.cond
    for batch in _batches(3):
        state, _ = step(state, batch)
    assert step.phase_counts(state) == {"warmup": 2, "compressed": 1}


def test_async_averages_from_the_first_step_until_close():
    step = _strategy("async").train_step(_loss, optax.adam(1e-2), has_aux=True)
    state = step.init(_params())
    assert not step.round_stats.running  # the first local step starts it, once it has run
    state, _ = step(state, _batches(1)[0])
    assert step.round_stats.running
    phases = step.communication_stats(state, _batches(1)[0])
    assert set(phases) == {"step", "averaging"}
    assert [r.kind for r in phases["averaging"].rows if r.dtype == "f32"] == ["all-reduce"]
    with pytest.raises(RuntimeError, match="close"):
        step.params(state)
    with step:
        pass
    assert not step.round_stats.running
    assert step.round_stats.rounds >= 1
    assert step.phase_counts(state) == {"step": 1, "averaging": step.round_stats.rounds}
    step.close()  # again: nothing to do
    model = step.params(state)
    assert model["w1"].sharding.mesh.shape == step.mesh.shape


def _bits(tree):
    """The tree with typed PRNG keys (ByteGrad's rounding key) as their raw key data."""

    def raw(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    return jax.tree.map(raw, tree)


@pytest.mark.parametrize("name", ["bytegrad", "qadam", "low_precision_decentralized"])
def test_orbax_round_trip_continues_bit_exactly(name, tmp_path):
    batches = _batches(6)
    step = _strategy(name).train_step(_loss, _optimizer(name), has_aux=True)
    state = step.init(_params())
    for batch in batches[:3]:
        state, _ = step(state, batch)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", state)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt", step.init(_params()))
    assert int(restored.step) == 3
    assert_trees_all_equal(_bits(restored), _bits(state))
    for batch in batches[3:]:
        state, _ = step(state, batch)
        restored, _ = step(restored, batch)
    assert_trees_all_equal(_bits(restored), _bits(state))


@pytest.mark.parametrize("name", ["gradient_allreduce", "decentralized"])
def test_flatten_trains_the_same_model_on_one_vector(name):
    # Bagua's fused layout: the optimizer sees one vector, the loss function the pytree.
    batches = _batches(4)
    runs = {}
    for flatten in (False, True):
        strategy = jax_bytegrad.Strategy(name, mesh=jax_bytegrad.make_mesh(2, 4), flatten=flatten)
        step = strategy.train_step(_loss, optax.adam(1e-2), has_aux=True)
        state = step.init(_params())
        for batch in batches:
            state, _ = step(state, batch)
        runs[flatten] = (state, step.params(state))
    flat_state, flat_params = runs[True]
    assert len(jax.tree.leaves(flat_state.params)) == 1
    # Float32 sums of the same numbers in another order: equal up to rounding.
    assert_trees_all_close(flat_params, runs[False][1], rtol=1e-5, atol=1e-6)


def test_flatten_must_be_a_bool():
    with pytest.raises(ValueError, match="flatten must be True or False"):
        jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(2, 4), flatten="yes")


@pytest.mark.parametrize(
    ("algorithm", "kwargs", "phases"),
    [
        ("bytegrad", {}, {"step"}),
        ("qadam", {"learning_rate": 1e-2, "warmup_steps": 1}, {"warmup", "compressed"}),
    ],
    ids=["bytegrad", "qadam"],
)
def test_every_step_says_its_bytes_between_nodes_the_same_way(algorithm, kwargs, phases):
    mesh = jax_bytegrad.make_mesh(2, 4)
    strategy = jax_bytegrad.Strategy(algorithm, mesh=mesh, **kwargs)
    params = {"w": np.zeros((64, 16), np.float32)}
    batch = np.ones((16, 64), np.float32)
    loss_fn = lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2)  # noqa: E731
    optimizer = () if algorithm == "qadam" else (optax.sgd(0.1),)
    with strategy.train_step(loss_fn, *optimizer) as step:
        state = step.init(params)
        sent = step.bytes_between_nodes(state, batch)
        stats = step.communication_stats(state, batch)
    assert set(sent) == phases
    for phase in phases:
        assert sent[phase] == stats[phase].bytes_on("node") > 0
