"""State split within each node (shard="optimizer" and "params"): the same training, 1/L of the
state per device, the same bytes between nodes, and clear refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import classification_batches
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad.checkpoint import Checkpointer

SHARDS = ["optimizer", "params"]
ALGORITHMS = {
    "gradient_allreduce": {},
    "bytegrad": {},
    "bytegrad_4bit_feedback": {"bits": 4, "error_feedback": True},
    "qadam": {"learning_rate": 1e-2, "warmup_steps": 8},
}


def params0():
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(64, 32)) * 0.2).astype(np.float32),  # split along 0
        "b1": np.zeros(32, np.float32),  # split
        "w2": (rng.normal(size=(32, 10)) * 0.2).astype(np.float32),  # split along 0
        "b2": np.zeros(10, np.float32),  # 10 does not split over 4: whole
        "scale": np.ones((), np.float32),  # a scalar: whole
    }


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None]) * params["scale"]
    logits = h @ params["w2"] + params["b2"][None]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(steps, rows=64):
    return classification_batches(steps, rows)


def strategy(algorithm, mesh, shard, **extra):
    name = "bytegrad" if algorithm.startswith("bytegrad") else algorithm
    return jax_bytegrad.Strategy(name, mesh=mesh, shard=shard, **ALGORITHMS[algorithm], **extra)


def train(algorithm, shard, steps, mesh=None, optimizer=None):
    mesh = mesh or jax_bytegrad.make_mesh(2, 4)
    s = strategy(algorithm, mesh, shard)
    tx = None if algorithm == "qadam" else optimizer or optax.adam(1e-2)
    with s.train_step(loss_fn, tx) as step:
        state = step.init(params0())
        losses = []
        for batch in batches(steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return step, state, losses


@functools.cache
def replicated_run(algorithm):
    """The replicated run's params and losses: each shard= case compares with the same one."""
    step, state, losses = train(algorithm, None, 40)
    return jax.device_get(step.params(state)), losses


@pytest.mark.slow
@pytest.mark.parametrize("shard", SHARDS)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_the_sharded_step_trains_as_the_replicated_one(algorithm, shard):
    replicated, want = replicated_run(algorithm)
    step, state, got = train(algorithm, shard, 40)
    assert want[-1] < 0.8 * want[0], "the model did not learn"
    if algorithm == "gradient_allreduce":
        for k, v in jax.device_get(step.params(state)).items():
            np.testing.assert_allclose(v, replicated[k], atol=1e-5)
    if algorithm != "bytegrad_4bit_feedback":
        # Compressed: the blocks group other values than the replicated buckets' (the codes
        # differ by up to a step), so the runs drift apart by Adam's steps, not by more.
        np.testing.assert_allclose(got, want, rtol=0.01)
    else:
        # At 4 bits a code step is 17x an 8-bit one and the two runs part more (up to 8% at
        # some steps); the split layout's blocks never straddle two leaves of other scales,
        # so it is no worse (measured: 3% lower over the last steps).
        assert np.mean(got[-10:]) <= 1.01 * np.mean(want[-10:])


def test_one_step_of_the_compressed_mean_is_within_a_code_step_of_the_exact_mean():
    """With SGD(lr=1) the update is minus the synced gradient: sharded or not, each is within
    one code step of the exact mean of the devices' gradients."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    batch = batches(1)[0]
    grad = jax.jit(jax.grad(loss_fn))  # one compile, not one per op as eagerly
    per_device = [
        grad(params0(), (batch[0][i * 8 : (i + 1) * 8], batch[1][i * 8 : (i + 1) * 8]))
        for i in range(8)
    ]
    exact = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *per_device)
    # The integer wire's grid: each block's bounds, shared by the 2 nodes, 127 levels each.
    node_sums = [
        jax.tree.map(lambda *g: np.sum(np.stack(g), 0), *per_device[k : k + 4]) for k in (0, 4)
    ]
    largest = max(
        float(np.max(np.abs(np.concatenate([np.ravel(x) for x in jax.tree.leaves(s)]))))
        for s in node_sums
    )
    code_step = 2 * largest / 127 / 8
    for shard in [None, *SHARDS]:
        s = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard=shard)
        with s.train_step(loss_fn, optax.sgd(1.0)) as step:
            state, _ = step(step.init(params0()), batch)
            got = jax.device_get(step.params(state))
        for k, start in params0().items():
            error = np.abs((start - got[k]) - exact[k])
            assert np.max(error) <= code_step, (shard, k, np.max(error), code_step)


@pytest.mark.parametrize("shard", SHARDS)
def test_each_device_holds_a_quarter_of_the_optimizer_state(shard):
    step, state, _ = train("bytegrad", shard, 1)
    mu = state.opt_state[1][0].mu  # chain(bytegrad, adam): adam's first moment
    assert mu["w1"].addressable_shards[0].data.shape == (16, 32)
    assert mu["b1"].addressable_shards[0].data.shape == (8,)
    assert mu["b2"].addressable_shards[0].data.shape == (10,)  # whole
    total = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    one_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.opt_state))
    assert one_device <= 0.3 * total
    w1 = state.params["w1"].addressable_shards[0].data.shape
    assert w1 == ((16, 32) if shard == "params" else (64, 32))
    # The whole model, whatever the placement.
    assert {k: v.shape for k, v in step.params(state).items()} == {
        k: np.shape(v) for k, v in params0().items()
    }


@pytest.mark.parametrize("algorithm", ["bytegrad", "qadam", "gradient_allreduce"])
def test_the_same_bytes_cross_between_nodes(algorithm):
    mesh = jax_bytegrad.make_mesh(2, 4)
    tx = None if algorithm == "qadam" else optax.adam(1e-2)
    figures = {}
    for shard in [None, *SHARDS]:
        extra = {"hierarchical": True} if algorithm == "gradient_allreduce" else {}
        s = strategy(algorithm, mesh, shard, **extra)
        with s.train_step(loss_fn, tx) as step:
            stats = step.communication_stats(step.init(params0()), batches(1)[0])
        figures[shard] = {phase: one.bytes_on("node") for phase, one in stats.items()}
    for shard in SHARDS:
        for phase, sent in figures[None].items():
            assert figures[shard][phase] == pytest.approx(sent, rel=0.01), (shard, phase)


def test_memory_stats_say_what_a_device_needs():
    mesh = jax_bytegrad.make_mesh(2, 4)
    peaks = {}
    for shard in [None, *SHARDS]:
        s = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard=shard)
        with s.train_step(loss_fn, optax.adam(1e-2)) as step:
            state = step.state_shapes(params0())
            batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches(1)[0])
            memory = step.memory_stats(state, batch)["step"]
        assert memory.argument_bytes > 0 and memory.peak_bytes >= memory.argument_bytes
        peaks[shard] = memory.argument_bytes
    # Params + Adam's two moments replicated, against 1/4 of the moments, then of the params.
    assert peaks["optimizer"] < peaks[None] and peaks["params"] < peaks["optimizer"]


@pytest.mark.parametrize(
    "algorithm, kwargs, match",
    [
        (
            "decentralized",
            {},
            "shard= is supported by gradient_allreduce, bytegrad, qadam and diloco",
        ),
        ("async", {}, "shard= is supported by gradient_allreduce, bytegrad, qadam and diloco"),
        ("bytegrad", {"pipeline": True}, "not supported with pipeline=True"),
        ("bytegrad", {"hierarchical": False}, "needs hierarchical=True"),
        # Flat by default and run hierarchically when sharded; a flat sync asked for is not.
        ("gradient_allreduce", {"hierarchical": False}, "needs hierarchical=True"),
        ("bytegrad", {"shard": "everything"}, "shard must be one of 'optimizer', 'params'"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(algorithm, kwargs, match):
    mesh = jax_bytegrad.make_mesh(2, 4)
    kwargs = {"shard": "params", **kwargs}
    with pytest.raises(ValueError, match=match):
        jax_bytegrad.Strategy(algorithm, mesh=mesh, **kwargs)


def test_flatten_is_refused_with_shard():
    with pytest.raises(ValueError, match="flatten=True"):
        jax_bytegrad.Strategy(
            "bytegrad", mesh=jax_bytegrad.make_mesh(2, 4), shard="optimizer", flatten=True
        )


def test_an_optimizer_that_reduces_over_the_whole_update_is_refused():
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    with pytest.raises(ValueError, match="must be elementwise.*'reduce_sum'"):
        train("bytegrad", "optimizer", 1, optimizer=tx)
    # Elementwise clipping, masked weight decay and schedules are fine.
    masked = optax.adamw(
        optax.cosine_decay_schedule(1e-2, 10), mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    )
    train("bytegrad", "params", 2, optimizer=optax.chain(optax.clip(1.0), masked))


def host(state) -> list[np.ndarray]:
    """Every leaf of a train state as numpy (PRNG keys as their data)."""
    return [
        np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )
        for x in jax.tree.leaves(state)
    ]


def test_a_checkpoint_restores_exactly_onto_another_shard_and_node_size(tmp_path):
    _, state, _ = train("bytegrad", "params", 3)
    with Checkpointer(tmp_path, every=1) as ckpt:
        ckpt.save(3, state)
        ckpt.wait()
        for shape, shard in [((2, 4), None), ((4, 2), "optimizer"), ((2, 4), "params")]:
            mesh = jax_bytegrad.make_mesh(*shape)
            with jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard=shard).train_step(
                loss_fn, optax.adam(1e-2)
            ) as step:
                target = step.state_shapes(params0())
                restored = ckpt.restore(3, lambda t=target: t, target)
                for got, want in zip(host(restored), host(state), strict=True):
                    np.testing.assert_array_equal(got, want)
                spec = restored.opt_state[1][0].mu["w1"].sharding.spec
                assert spec == (P() if shard is None else P("local", None))
                step(restored, batches(1)[0])  # the restored state runs


def test_bfloat16_params_train_sharded():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params0())
    mesh = jax_bytegrad.make_mesh(2, 4)
    for shard in SHARDS:
        s = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard=shard)
        with s.train_step(loss_fn, optax.adam(1e-2)) as step:
            state = step.init(params)
            losses = []
            for batch in batches(10):
                state, metrics = step(state, batch)
                losses.append(float(metrics["loss"]))
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))
        assert losses[-1] < losses[0]


def test_nnx_model_with_batchnorm_and_dropout_trains_sharded():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(64, 32, rngs=rngs)
            self.norm = nnx.BatchNorm(32, rngs=rngs)
            self.dropout = nnx.Dropout(0.1, rngs=rngs)
            self.out = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))

    def nnx_loss(model, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    model = MLP(nnx.Rngs(0))
    s = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(2, 4), shard="params")
    with jax_bytegrad.nnx.train_step(s, model, optax.adam(1e-2), nnx_loss) as step:
        losses = [float(step(batch)["loss"]) for batch in batches(15)]
        kernel = step.state.params["hidden"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (16, 32)
    assert losses[-1] < losses[0]
    # The model holds the whole trained kernel, and its BatchNorm statistics moved.
    assert model.hidden.kernel.value.shape == (64, 32)
    assert not np.allclose(np.asarray(model.norm.mean.value), 0.0)


def test_data_parallel_step_takes_shard_and_places_the_params():
    mesh = jax_bytegrad.make_mesh(2, 4)
    tx = optax.chain(jax_bytegrad.bytegrad(), optax.sgd(0.1))
    step = jax_bytegrad.data_parallel_step(loss_fn, tx, mesh, shard="params")
    state = step.init(params0())
    assert state.params["w1"].sharding.spec == P("local", None)
    assert state.params["b2"].sharding == NamedSharding(mesh, P())
    state, metrics = step(state, batches(1)[0])
    assert np.isfinite(float(metrics["loss"]))


def test_skip_nonfinite_skips_on_every_device_of_a_node_together():
    """A NaN reaches some devices' blocks only: the node decides together, so the step is
    skipped whole, not in the blocks that saw it."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    s = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard="params")
    with s.train_step(loss_fn, jax_bytegrad.skip_nonfinite(optax.adam(1e-2))) as step:
        step.on_divergence = "ignore"
        good, bad = batches(2)
        state, _ = step(step.init(params0()), good)
        before = jax.device_get(step.params(state))
        x = bad[0].copy()
        x[0, 0] = np.nan  # one row of the first device's slice
        state, _ = step(state, (x, bad[1]))
        after = jax.device_get(step.params(state))
        assert jax_bytegrad.skipped_steps(state.opt_state) == 1
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_a_state_placed_otherwise_is_refused_by_name():
    mesh = jax_bytegrad.make_mesh(2, 4)
    replicated = jax_bytegrad.Strategy("bytegrad", mesh=mesh)
    with replicated.train_step(loss_fn, optax.adam(1e-2)) as step:
        state = step.init(params0())
    sharded = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard="params")
    with sharded.train_step(loss_fn, optax.adam(1e-2)) as step:
        with pytest.raises(ValueError, match="restore a checkpoint onto step.state_shapes"):
            step(state, batches(1)[0])
