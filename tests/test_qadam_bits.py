"""QAdam's compressed momentum at 4 bits and with error feedback: bytes, invariant, replicas,
checkpoints, arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_qadam
from test_error_feedback import assert_same_on_every_device, device_copies

import jax_bytegrad
from jax_bytegrad import ScaleByQAdamState, qadam, scale_by_qadam
from jax_bytegrad.checkpoint import Checkpointer
from jax_bytegrad.profiling import communication_stats
from jax_bytegrad.sharding import shard_batch, state_specs

NODES, LOCAL = 2, 4
DEVICES = NODES * LOCAL
BLOCK = 512  # the 4-bit default
IN, OUT = 128, 128  # one bucket of 16,384 values: 4,096 per device, 4 blocks per node chunk
B1 = 0.9


@pytest.fixture(scope="module")
def mesh():
    return jax_bytegrad.make_mesh(NODES, LOCAL)


def init_params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.standard_normal((IN, OUT)) * 0.1, jnp.float32)}


def make_batches(steps, seed=1):
    """Regression batches whose per-device slices differ, so local momenta differ too."""
    return test_qadam.make_batches(steps, seed, shape=(IN, OUT))


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


@jax.jit
def per_device_grads(params, batch):
    """Each device's gradient, stacked in mesh order: the slices ``shard_batch`` gives them."""
    split = jax.tree.map(lambda x: x.reshape(DEVICES, -1, *x.shape[1:]), batch)
    return jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, split)


def make_tx(mesh, **kwargs):
    settings = dict(warmup_steps=2, bits=4, error_feedback=True, mesh=mesh, eps=1e-5)
    return qadam(1e-2, **(settings | kwargs))


def run(mesh, tx, batches, *, params=None, state=None):
    """Trains with ``data_parallel_step``, yielding (params, state) after every step."""
    step = jax_bytegrad.data_parallel_step(loss_fn, tx, mesh, donate=False)
    if params is None:
        train = step.init(init_params())
    else:
        train = jax_bytegrad.StepState(np.asarray(0), params, state, {})
    for batch in batches:
        train, _ = step(train, shard_batch(batch, mesh))
        yield train.params, train.opt_state


def qadam_state(opt_state) -> ScaleByQAdamState:
    return opt_state[0]


# --- bytes between nodes ----------------------------------------------------------------


def test_four_bit_momentum_sends_an_eighth_of_the_float32_bytes(mesh):
    # 512 x 512 + 512: padding to whole 8 x 512-value blocks adds 1.4%.
    params = {"w": jnp.zeros((512, 512), jnp.float32), "b": jnp.zeros(512, jnp.float32)}

    def batch_loss(params, batch):
        return jnp.mean(
            (batch["x"] @ params["w"][:IN, :OUT] + params["b"][None, :OUT] - batch["y"]) ** 2
        )

    def node_bytes(**kwargs):
        tx = qadam(1e-2, warmup_steps=2, mesh=mesh, wire="scatter_gather", **kwargs)
        step = jax_bytegrad.data_parallel_step(batch_loss, tx, mesh, donate=False)
        batch = shard_batch(make_batches(1)[0], mesh)
        stats = communication_stats(step, step.init(params), batch, mesh=mesh)
        node = [r for r in stats.rows if "node" in r.axes.split("+")]
        codes = sum(r.bytes_sent for r in node if r.dtype == "u8")
        warmup = sum(r.bytes_sent for r in node if r.kind == "all-reduce" and r.axes == "node")
        return codes, warmup

    codes8, warmup8 = node_bytes(bits=8)
    codes4, warmup4 = node_bytes(bits=4)
    codes4_ef, warmup4_ef = node_bytes(bits=4, error_feedback=True)
    assert warmup8 == warmup4 == warmup4_ef > 0  # float32 warm-up: the gradient_allreduce bytes
    assert 1 / 8 < codes4 / warmup4 <= 0.135, codes4 / warmup4
    assert 1 / 4 < codes8 / warmup8 <= 0.26, codes8 / warmup8
    assert codes4_ef == codes4  # the residuals never cross the network


# --- error feedback's invariant through QAdam's exchange ----------------------------------


def test_exchange_returns_the_exact_mean_plus_the_residuals_it_released(mesh):
    """One compressed step: the momentum QAdam keeps is the exact mean of the devices' local
    momenta, plus what the residuals released: (old - new) of each device's send residual,
    weighted 1/(n L) and summed over the nodes that sent to it, and (old - new) of the
    averaged chunk's residual. A residual on the wrong device, or one not added back, breaks
    it by the size of a 4-bit quantization error."""
    tx = make_tx(mesh, b1=B1)
    batches = make_batches(5)
    history = list(run(mesh, tx, batches))
    (params, state), (_, new) = history[-2], history[-1]
    old, new = qadam_state(jax.device_get(state)), qadam_state(jax.device_get(new))
    assert int(old.count) == 4 > 2  # the fifth step is compressed, with residuals in hand

    grads = np.asarray(per_device_grads(jax.device_get(params), batches[-1])["w"], np.float64)
    exact = B1 * np.asarray(old.mu["w"], np.float64) + (1 - B1) * grads.mean(axis=0)
    # Bucket order: local shard l, then node chunk j; residuals: every device in mesh order.
    exact = exact.reshape(LOCAL, NODES, -1)
    ((send_old, mean_old),) = old.residuals
    ((send_new, mean_new),) = new.residuals
    send = (np.asarray(send_old, np.float64) - np.asarray(send_new, np.float64)).reshape(
        NODES, LOCAL, NODES, -1
    )  # [sending node a, local l, receiving node j]
    mean = (np.asarray(mean_old, np.float64) - np.asarray(mean_new, np.float64)).reshape(
        NODES, LOCAL, -1
    )  # [node j, local l]
    released = send.sum(axis=0) / DEVICES + mean.transpose(1, 0, 2)  # [l, j]
    got = np.asarray(new.mu["w"], np.float64).reshape(LOCAL, NODES, -1)

    off = np.abs(got - (exact + released))
    scale = np.abs(exact).max()
    # float32 rounding of the local momenta, the node sums and the two residual updates.
    assert off.max() <= 1e-6 * scale, off.max() / scale  # measured: 1.1e-7
    # Not vacuous: what the residuals released is far above that, and so is the error a
    # step without feedback would leave.
    assert np.abs(released).max() > 1e-3 * scale
    assert np.abs(got - exact).max() > 1e-3 * scale


# --- replicas, Strategy, checkpoints ------------------------------------------------------


@pytest.mark.parametrize("rule", ["momentum", "gradient"])
def test_replicas_bit_identical_over_20_steps_with_refreshes(mesh, rule):
    # Refreshes at 5, 11, 23; "gradient" also reads the momentum of the step before.
    tx = make_tx(mesh, nu_refresh_interval=3, nu_refresh_growth=2.0, second_moment=rule)
    for params, state in run(mesh, tx, make_batches(20)):
        replicated = (
            params,
            qadam_state(state)._replace(residuals=jax_bytegrad.Residuals()),
            state[1:],
        )
        for copies in device_copies(replicated):
            for other in copies[1:]:
                np.testing.assert_array_equal(other, copies[0])
    assert int(qadam_state(state).count) == 20
    # Each device keeps its own residuals, all different and not all zero.
    for residual in jax.tree.leaves(qadam_state(state).residuals):
        rows = np.asarray(residual).reshape(DEVICES, -1)
        assert all(row.any() for row in rows)
        assert len({row.tobytes() for row in rows}) == DEVICES
        assert residual.sharding.spec == jax.sharding.PartitionSpec(("node", "local"))


def test_error_feedback_changes_the_trajectory(mesh):
    *_, (plain, _) = run(mesh, make_tx(mesh, error_feedback=False), make_batches(6))
    *_, (feedback, _) = run(mesh, make_tx(mesh), make_batches(6))
    assert not np.array_equal(np.asarray(plain["w"]), np.asarray(feedback["w"]))


def test_state_specs_put_only_the_residuals_per_device(mesh):
    specs = state_specs(make_tx(mesh).init(init_params()))
    per_device = jax.sharding.PartitionSpec(("node", "local"))
    assert jax.tree.leaves(qadam_state(specs).residuals) == [per_device] * 2
    rest = qadam_state(specs)._replace(residuals=jax_bytegrad.Residuals()), specs[1:]
    assert all(spec == jax.sharding.PartitionSpec() for spec in jax.tree.leaves(rest))


def test_strategy_matches_data_parallel_step(mesh):
    batches = make_batches(6)
    *_, (want_params, want_state) = run(mesh, make_tx(mesh), batches)
    strategy = jax_bytegrad.Strategy(
        "qadam", mesh=mesh, learning_rate=1e-2, warmup_steps=2, bits=4, error_feedback=True,
        eps=1e-5,
    )  # fmt: skip
    with strategy.train_step(loss_fn) as train:
        state = train.init(init_params())
        for batch in batches:
            state, _ = train(state, batch)
        assert_same_on_every_device(train.params(state), device_copies(want_params))
        assert_same_on_every_device(state.opt_state, device_copies(want_state))
        phases = train.communication_stats(state, batches[0])
    codes = sum(r.bytes_sent for r in phases["compressed"].rows if r.dtype == "u8")
    assert 0 < codes < phases["warmup"].bytes_on("node") / 7


def test_checkpoint_restores_the_residuals_and_continues_bit_exactly(mesh, tmp_path):
    pytest.importorskip("orbax.checkpoint")
    tx = make_tx(mesh)
    batches = make_batches(8)
    *_, straight = run(mesh, tx, batches)
    *_, (params, state) = run(mesh, tx, batches[:5])
    assert np.any(np.asarray(qadam_state(state).residuals[0][0]) != 0)
    saved = {"params": params, "opt_state": state}
    shardings = jax.tree.map(lambda x: x.sharding, saved)  # the step's: residuals per device
    copies = device_copies(saved)
    with Checkpointer(tmp_path, every=5) as checkpointer:
        assert checkpointer.save(5, saved)
        checkpointer.wait()
        del params, state, saved
        restored = checkpointer.restore(
            5, lambda: {"params": init_params(), "opt_state": tx.init(init_params())}, shardings
        )
    # Every device gets its own residuals back, not another device's.
    assert_same_on_every_device(restored, copies)
    *_, resumed = run(mesh, tx, batches[5:], params=restored["params"], state=restored["opt_state"])
    assert_same_on_every_device(resumed, device_copies(straight))


# --- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 3}, "bits must be one of 8, 4, 2, got 3"),
        ({"bits": True}, "bits must be one of 8, 4, 2, got True"),
        ({"bits": 4, "block_size": 128}, "block_size"),
        ({"error_feedback": 1}, "error_feedback must be True or False, got 1"),
        ({"error_feedback": True}, "pass mesh="),
        ({"error_feedback": True, "mesh": "2x4"}, "mesh must be a jax.sharding.Mesh"),
    ],
    ids=["bits-2", "bits-bool", "block-too-small", "ef-int", "ef-no-mesh", "mesh-str"],
)
@pytest.mark.parametrize("factory", [qadam, scale_by_qadam], ids=["qadam", "scale_by_qadam"])
def test_bad_arguments_raise_at_build_time(factory, kwargs, message):
    with pytest.raises(ValueError, match=message):
        if factory is qadam:
            qadam(1e-2, warmup_steps=2, **kwargs)
        else:  # its sync settings come in one SyncConfig
            settings = {k: v for k, v in kwargs.items() if k != "mesh"}
            sync = jax_bytegrad.SyncConfig(**settings)
            scale_by_qadam(warmup_steps=2, sync=sync, mesh=kwargs.get("mesh"))


def test_mesh_without_the_axes_raises():
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    with pytest.raises(ValueError, match="axis 'node' is not in the mesh axes"):
        qadam(1e-2, warmup_steps=2, error_feedback=True, mesh=mesh)


def test_strategy_rejects_bad_bits_when_built(mesh):
    with pytest.raises(ValueError, match="bits must be one of 8, 4, 2, got 3"):
        jax_bytegrad.Strategy("qadam", mesh=mesh, learning_rate=1e-2, warmup_steps=2, bits=3)
    assert {"bits", "error_feedback"} <= set(jax_bytegrad.Strategy.valid_kwargs("qadam"))
