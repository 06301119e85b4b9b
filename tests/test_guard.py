"""Divergence is visible: the train step's loss watch, and the opt-in non-finite guard."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_all_equal

import jax_bytegrad
from jax_bytegrad import DivergenceWarning, skip_nonfinite, skipped_steps
from jax_bytegrad.checkpoint import Checkpointer

DEVICES = 8


@pytest.fixture(scope="module")
def mesh():
    return jax_bytegrad.make_mesh(2, 4)


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def params0():
    return {"w": jnp.zeros((16, 4), jnp.float32)}


def batch(seed=0, poison=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((DEVICES * 2, 16)).astype(np.float32)
    y = rng.standard_normal((DEVICES * 2, 4)).astype(np.float32)
    if poison:
        x[-1, 0] = np.nan  # the last device's rows only
    return {"x": x, "y": y}


def replicas_identical(tree):
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])


def unguarded(opt_state):
    """The state of the guarded optimizer (not the sync's, whose rounding key moves on)."""
    guarded = lambda x: isinstance(x, jax_bytegrad.SkipNonFiniteState)  # noqa: E731
    found = [x.inner_state for x in jax.tree.leaves(opt_state, is_leaf=guarded) if guarded(x)]
    assert len(found) == 1
    return found[0]


# --- skip_nonfinite ---------------------------------------------------------------------


def test_skip_nonfinite_is_the_inner_transform_on_finite_updates_and_skips_the_others():
    inner = optax.adam(1e-2)
    tx = skip_nonfinite(inner)
    params = jnp.ones(3)
    ref_state, state = inner.init(params), tx.init(params)
    for g in (jnp.array([1.0, -2.0, 0.5]), jnp.array([0.3, 0.1, -1.0])):
        ref_updates, ref_state = inner.update(g, ref_state, params)
        updates, state = tx.update(g, state, params)
        assert_trees_all_equal((updates, state.inner_state), (ref_updates, ref_state))
    before = state
    updates, state = tx.update(jnp.array([1.0, jnp.inf, 0.0]), state, params)
    np.testing.assert_array_equal(updates, np.zeros(3))
    assert_trees_all_equal(state.inner_state, before.inner_state)
    assert int(state.skipped) == 1 == skipped_steps(state)


def test_skip_nonfinite_refuses_what_is_not_a_transformation():
    with pytest.raises(ValueError, match="skip_nonfinite: expected an optax"):
        skip_nonfinite(lambda g: g)


@pytest.mark.parametrize(
    "name, kwargs, guarded",
    [
        ("qadam", dict(learning_rate=1e-2, warmup_steps=1, skip_nonfinite=True), None),
        ("bytegrad", {}, skip_nonfinite(optax.adam(1e-2))),
        ("gradient_allreduce", {}, skip_nonfinite(optax.adam(1e-2))),
    ],
    ids=["qadam", "bytegrad", "gradient_allreduce"],
)
def test_one_device_nan_is_skipped_on_every_replica(mesh, name, kwargs, guarded):
    """A NaN on one device's rows: every replica skips the same step (qadam in both phases),
    the params and the optimizer state stay as they were, and training goes on."""
    strategy = jax_bytegrad.Strategy(name, mesh=mesh, **kwargs)
    with strategy.train_step(loss_fn, guarded) as step:
        state = step.init(params0())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DivergenceWarning)  # the loss is NaN on purpose
            for i, poison in enumerate([False, True, False, True, False]):
                before = jax.device_get(state)
                state, _ = step(state, batch(i, poison))
                jax.block_until_ready(state)
                after = jax.device_get(state)
                if poison:
                    assert_trees_all_equal(after.params, before.params)
                    assert_trees_all_equal(unguarded(after.opt_state), unguarded(before.opt_state))
                else:
                    assert not np.array_equal(after.params["w"], before.params["w"])
        replicas_identical((state.params, unguarded(state.opt_state)))
        assert skipped_steps(state.opt_state) == 2
        assert np.all(np.isfinite(jax.device_get(step.params(state))["w"]))


def test_a_guarded_checkpoint_restores_with_its_skipped_count(mesh, tmp_path):
    """The guard's state keeps the layout checkpoints were written with: two fields, named
    ``inner_state`` and ``skipped`` (orbax stores them by name); a run restored from one goes on
    as the saved run does."""
    assert jax_bytegrad.SkipNonFiniteState._fields == ("inner_state", "skipped")
    strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DivergenceWarning)  # the NaN is on purpose
        with Checkpointer(tmp_path, every=1) as ckpt:
            with strategy.train_step(loss_fn, skip_nonfinite(optax.adam(1e-2))) as step:
                state = step.init(params0())
                for i, poison in enumerate([False, True]):
                    state, _ = step(state, batch(i, poison))
                ckpt.save(2, state, force=True)
                ckpt.wait()
                state, _ = step(state, batch(2))
                saved_run = jax.device_get(step.params(state))
            with strategy.train_step(loss_fn, skip_nonfinite(optax.adam(1e-2))) as step:
                host_params = jax.device_get(params0())  # the target is built abstractly
                restored = ckpt.restore(2, lambda: step.init(host_params), mesh)
                assert skipped_steps(restored.opt_state) == 1
                state, _ = step(restored, batch(2))
                assert_trees_all_equal(jax.device_get(step.params(state)), saved_run)
                # The watch of the resumed run names steps as the first run did, and counts
                # from the restored count: nothing for step 3, then step 4's skip, 2 of 4.
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for i, poison in enumerate([True, False, False], start=3):
                        jax.block_until_ready(state)
                        state, _ = step(state, batch(i, poison))
    (message,) = [str(w.message) for w in caught if w.category is DivergenceWarning]
    assert "skipped step 4: " in message and "(2 of 4 steps skipped so far;" in message


def test_decentralized_takes_the_guarded_optimizer(mesh):
    strategy = jax_bytegrad.Strategy("decentralized", mesh=mesh)
    with strategy.train_step(loss_fn, skip_nonfinite(optax.adam(1e-2))) as step:
        state = step.init(params0())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DivergenceWarning)
            for i, poison in enumerate([False, True, False]):
                state, _ = step(state, batch(i, poison))
                jax.block_until_ready(state)
        # Only the poisoned device skipped; the gossip kept every model finite.
        assert np.all(np.isfinite(np.asarray(jax.device_get(step.params(state))["w"])))
        assert skipped_steps(state) >= 1
    with jax_bytegrad.Strategy("decentralized", mesh=mesh).train_step(
        loss_fn, skip_nonfinite(optax.adam(1e-2))
    ) as step:
        _, messages = run_with_poison(step, poisoned={2}, steps=4)
    assert len(messages) == 1 and "skipped step 2: " in messages[0], messages
    assert "stayed as they were on the devices that had one (1 of 2 steps" in messages[0]


# --- the loss watch ---------------------------------------------------------------------


def diverging_step(mesh, lr=0.4):
    strategy = jax_bytegrad.Strategy("gradient_allreduce", mesh=mesh)
    return strategy.train_step(loss_fn, optax.sgd(lr))


def test_a_diverging_run_warns_once_naming_the_algorithm_and_what_to_change(mesh):
    with diverging_step(mesh) as step:
        state = step.init(params0())
        x = batch(0)
        x["x"] *= 4.0  # a curvature that makes lr 0.4 explode
        with pytest.warns(DivergenceWarning) as caught:
            for _ in range(40):
                state, metrics = step(state, x)
                jax.block_until_ready(state)
    messages = [str(w.message) for w in caught if w.category is DivergenceWarning]
    assert len(messages) == 1
    assert messages[0].startswith("gradient_allreduce: the training loss")
    assert "learning rate" in messages[0]


def test_raise_mode_and_a_healthy_run(mesh):
    with diverging_step(mesh) as step:
        step.on_divergence = "raise"
        state = step.init(params0())
        x = batch(0)
        x["x"] *= 4.0
        with pytest.raises(FloatingPointError, match="gradient_allreduce: the training loss"):
            for _ in range(40):
                state, _ = step(state, x)
                jax.block_until_ready(state)
    with diverging_step(mesh, lr=0.01) as step:
        state = step.init(params0())
        with warnings.catch_warnings():
            warnings.simplefilter("error", DivergenceWarning)
            for i in range(30):
                state, _ = step(state, batch(i))
                jax.block_until_ready(state)


def run_with_poison(step, poisoned, steps):
    """Steps 1..``steps`` of ``step`` on fresh batches, those in ``poisoned`` holding a NaN on
    one device; returns the final state and the DivergenceWarnings' messages."""
    state = step.init(params0())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number in range(1, steps + 1):
            state, _ = step(state, batch(number, poison=number in poisoned))
            jax.block_until_ready(state)  # the watch reads a finished step at the next call
    found = [w for w in caught if w.category is DivergenceWarning]
    assert all(w.filename == __file__ for w in found), [w.filename for w in found]
    return state, [str(w.message) for w in found]


def test_a_nan_batch_without_the_guard_names_the_batch(mesh):
    """Unguarded, one NaN on one device makes every parameter NaN on every replica; the
    warning names the batch as the likely cause (the loss was finite and falling), not the
    learning rate, and says how to skip such steps."""
    with jax_bytegrad.Strategy("bytegrad", mesh=mesh).train_step(loss_fn, optax.adam(1e-2)) as step:
        state, messages = run_with_poison(step, poisoned={5}, steps=8)
    for shard in state.params["w"].addressable_shards:
        assert np.isnan(np.asarray(shard.data)).all()
    assert len(messages) == 1, messages
    assert messages[0].startswith("bytegrad: the training loss became nan at step 5 at once")
    assert "a batch holding a NaN or inf is the likely cause" in messages[0]
    assert "(np.isfinite)" in messages[0] and "restore the last checkpoint" in messages[0]
    assert "jax_bytegrad.skip_nonfinite(...)" in messages[0]
    assert "learning rate" not in messages[0]


def test_a_skipped_step_says_so_and_how_often(mesh):
    """Guarded, each skip at the 1st, 2nd and 4th count says it was skipped and how often so
    far, and never advises the guard it has. A handled skip warns even in "raise" mode."""
    with jax_bytegrad.Strategy("bytegrad", mesh=mesh).train_step(
        loss_fn, skip_nonfinite(optax.adam(1e-2))
    ) as step:
        step.on_divergence = "raise"
        state, messages = run_with_poison(step, poisoned={3, 6, 7, 9}, steps=12)
    assert skipped_steps(state.opt_state) == 4
    assert [m.split(":")[1] for m in messages] == [
        " skip_nonfinite skipped step 3",
        " skip_nonfinite skipped step 6",
        " skip_nonfinite skipped step 9",
    ]
    assert "(1 of 3 steps skipped so far; reported again at 2 skipped)" in messages[0]
    assert "(4 of 9 steps skipped so far; reported again at 8 skipped)" in messages[2]
    assert "a batch holding a NaN or inf is the likely cause" in messages[0]
    assert not [m for m in messages if "wrap the optimizer" in m or "learning rate" in m]


def test_skips_in_a_row_mean_training_has_stopped(mesh):
    with jax_bytegrad.Strategy("gradient_allreduce", mesh=mesh).train_step(
        loss_fn, skip_nonfinite(optax.sgd(0.01))
    ) as step:
        step.on_divergence = "raise"
        with pytest.raises(FloatingPointError, match="skipped the last 10 steps in a row") as e:
            run_with_poison(step, poisoned=set(range(3, 40)), steps=40)
    assert "(to step 12; 10 of 12 in all), so training has stopped" in str(e.value)


class FakeStep:
    """What the watch reads of a train step: its algorithm, on_divergence and loss_watch."""

    def __init__(self, algorithm="bytegrad"):
        from jax_bytegrad._src import guard

        self.algorithm = algorithm
        self.loss_watch = guard.Watch()


def watched(step, losses, skipped=None):
    """Feeds ``losses`` (host values: ready at once) to the watch; ``skipped[i]``, when given,
    is the guard's count after step i + 1. Returns the DivergenceWarnings' messages."""
    from jax_bytegrad._src import guard

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, loss in enumerate(losses):
            state = None
            if skipped is not None:
                state = (SkipNonFiniteStateOf(skipped[i]),)
            guard.watch_loss(step, (state, {"loss": np.float32(loss)}))
    return [str(w.message) for w in caught if w.category is DivergenceWarning]


def SkipNonFiniteStateOf(count):  # noqa: N802 - builds a SkipNonFiniteState
    return jax_bytegrad.SkipNonFiniteState((), np.int32(count))


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_a_loss_that_grew_into_nan_gets_the_algorithm_s_advice(guarded):
    losses = [1.0, 0.9, 0.8, 3.0, 40.0, np.inf]
    skipped = [0] * len(losses) if guarded else None
    (message,) = watched(FakeStep(), losses, skipped)
    assert message.startswith("bytegrad: the training loss became inf at step 6 after growing")
    assert "(40 at step 5, over 2x the largest before it). It is diverging." in message
    assert "Lower the learning rate; with bits=4" in message
    assert ("skip_nonfinite" in message) is not guarded


def test_a_nan_from_the_first_step_and_a_skip_with_a_finite_loss():
    (first,) = watched(FakeStep("qadam"), [np.nan])
    assert first.startswith("qadam: the training loss became nan at step 1 from the first step")
    assert "pass skip_nonfinite=True to Strategy('qadam'" in first
    (skip,) = watched(FakeStep(), [1.0, 0.5, 0.4], skipped=[0, 0, 1])
    assert "skipped step 3" in skip and "Its loss was finite (0.4), so the gradient" in skip


def test_qadam_warning_names_the_second_moment(mesh):
    from jax_bytegrad._src import guard

    message = guard._message("qadam", 23, 1.5e4, 2.3)
    assert "qadam: the training loss reached 1.5e+04" in message
    assert "second_moment='frozen'" in message and "'gradient' at 8 bits" in message


def test_bad_on_divergence_is_refused_when_set(mesh):
    with diverging_step(mesh) as step:
        with pytest.raises(ValueError, match="on_divergence must be one of .*got 'loud'"):
            step.on_divergence = "loud"
        assert step.on_divergence == "warn"


def test_the_watch_compares_magnitudes_and_warns_once():
    """A loss that may be negative (a log-likelihood bound) is judged by its magnitude."""
    from jax_bytegrad._src import guard

    step = FakeStep()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        for loss in [-5.0] * 10 + [-3.0, 4.0, 400.0, -499.0]:
            guard.watch_loss(step, (None, {"loss": np.float32(loss)}))
    with pytest.warns(DivergenceWarning, match=r"bytegrad: the training loss reached -1e\+04"):
        guard.watch_loss(step, (None, {"loss": np.float32(-1e4)}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)  # once per step object
        guard.watch_loss(step, (None, {"loss": np.float32(np.nan)}))
