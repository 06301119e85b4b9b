"""Model state and per-device keys in every train step; a state from another step and integer
parameters get the library's ValueError."""

import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_bytegrad
from jax_bytegrad import StepState
from jax_bytegrad.checkpoint import Checkpointer

DEVICES = 8
AXES = ("node", "local")
ALGORITHMS = {
    "gradient_allreduce": {},
    "bytegrad": {},
    "qadam": {"learning_rate": 1e-2, "warmup_steps": 1},
    "decentralized": {},
    "low_precision_decentralized": {},
}


def _strategy(name, **kwargs):
    mesh = jax_bytegrad.make_mesh(2, 4)
    return jax_bytegrad.Strategy(name, mesh=mesh, **{**ALGORITHMS[name], **kwargs})


def _tx(name):
    return None if name == "qadam" else optax.sgd(0.1)


PARAMS = {"w": np.full((256, 2), 0.1, np.float32)}
BATCH = np.linspace(-1, 1, 16 * 256, dtype=np.float32).reshape(16, 256)


def _probe_loss(params, batch, *, model_state, key):
    """Each device writes into its own slot of the state: a draw from its key, and its index."""
    device = jax.lax.axis_index(AXES)
    draw = jax.random.uniform(key)
    new = {
        "draws": jnp.zeros(DEVICES).at[device].set(draw * DEVICES),
        "device": device.astype(jnp.float32),
        "count": model_state["count"] + device.astype(jnp.int32) + 1,
    }
    return jnp.mean((batch @ params["w"]) ** 2), new


def _probe_state():
    return {"draws": np.zeros(DEVICES, np.float32), "device": np.float32(0), "count": np.int32(0)}


@pytest.mark.parametrize("name", list(ALGORITHMS), ids=list(ALGORITHMS))
def test_each_device_gets_its_own_key_each_step_and_the_state_is_averaged(name):
    strategy = _strategy(name)
    kwargs = dict(model_state=_probe_state(), rng_seed=3)
    with strategy.train_step(_probe_loss, _tx(name), **kwargs) as step:
        state = step.init(PARAMS)
        seen = []
        for _ in range(2):
            expected = [
                float(jax.random.uniform(step.device_key(state, d))) for d in range(DEVICES)
            ]
            state, _ = step(state, BATCH)
            draws = np.asarray(state.model_state["draws"])
            # "mean": each slot is its device's draw times 8, averaged over 8 devices.
            np.testing.assert_allclose(draws, expected, rtol=1e-6)
            seen.append(draws)
        assert len(set(np.concatenate(seen).tolist())) == 2 * DEVICES  # all keys differ
        assert float(state.model_state["device"]) == pytest.approx(3.5)  # mean of 0..7
        assert int(state.model_state["count"]) == 2  # integer leaves: device 0's
        assert (
            np.asarray(jax.random.key_data(state.rng)).tolist()
            == np.asarray(jax.random.key_data(jax.random.key(3))).tolist()
        )


def test_device_key_is_the_documented_fold_and_refuses_bad_calls():
    strategy = _strategy("gradient_allreduce")
    loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)  # noqa: E731
    keyed = lambda p, b, *, key: loss(p, b) + 0.0 * jax.random.uniform(key)  # noqa: E731
    with strategy.train_step(keyed, optax.sgd(0.1), rng_seed=3) as step:
        state, _ = step(step.init(PARAMS), BATCH)
        # Device 6 at step 1: fold_in(fold_in(key(seed), step), device), as the docs say.
        want = jax.random.fold_in(jax.random.fold_in(jax.random.key(3), 1), 6)
        got = step.device_key(state, 6)
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
        with pytest.raises(ValueError, match=r"device must be an int in \[0, 7\], got 8"):
            step.device_key(state, 8)
        with pytest.raises(ValueError, match="device_key needs a state of arrays"):
            step.device_key(step.state_shapes(PARAMS), 0)
    with strategy.train_step(loss, optax.sgd(0.1)) as plain:
        with pytest.raises(ValueError, match="device_key needs a step built with rng_seed"):
            plain.device_key(plain.init(PARAMS), 0)


@pytest.mark.parametrize("name", ["gradient_allreduce", "decentralized"])
def test_state_sync_first_takes_device_zeros_state(name):
    strategy = _strategy(name)
    with strategy.train_step(
        _probe_loss, _tx(name), model_state=_probe_state(), rng_seed=0, state_sync="first"
    ) as step:
        state, _ = step(step.init(PARAMS), BATCH)
    assert float(state.model_state["device"]) == 0.0
    draws = np.asarray(state.model_state["draws"])
    assert draws[0] != 0.0 and not draws[1:].any()


def test_a_restart_from_a_checkpoint_replays_the_keys(tmp_path):
    strategy = _strategy("gradient_allreduce")
    mesh = strategy.mesh
    kwargs = dict(model_state=_probe_state(), rng_seed=5)
    with Checkpointer(tmp_path, every=1) as ckpt:
        with strategy.train_step(_probe_loss, optax.sgd(0.1), **kwargs) as step:
            state, _ = step(step.init(PARAMS), BATCH)
            ckpt.save(1, state, force=True)
            ckpt.wait()
            keys = [jax.random.key_data(step.device_key(state, d)) for d in range(DEVICES)]
            state, _ = step(state, BATCH)
            first_run = np.asarray(state.model_state["draws"])
        with strategy.train_step(_probe_loss, optax.sgd(0.1), **kwargs) as step:
            restored = ckpt.restore(1, lambda: step.init(PARAMS), mesh)
            assert int(restored.step) == 1
            for d in range(DEVICES):
                again = jax.random.key_data(step.device_key(restored, d))
                np.testing.assert_array_equal(np.asarray(again), np.asarray(keys[d]))
            state, _ = step(restored, BATCH)
    np.testing.assert_array_equal(np.asarray(state.model_state["draws"]), first_run)


class TrainState(NamedTuple):
    """The state's class as it was named before it became ``StepState``, fields unchanged."""

    step: np.ndarray
    params: Any
    opt_state: Any
    extra: dict[str, Any]


def test_a_checkpoint_of_the_state_under_its_old_name_restores(tmp_path):
    # orbax keys a NamedTuple by its field names, not its class: a checkpoint saved while
    # the class was TrainState restores into a StepState.
    strategy = _strategy("gradient_allreduce")
    kwargs = dict(model_state=_probe_state(), rng_seed=5)
    with strategy.train_step(_probe_loss, optax.sgd(0.1), **kwargs) as step:
        state, _ = step(step.init(PARAMS), BATCH)
        with Checkpointer(tmp_path, every=1) as ckpt:
            ckpt.save(1, TrainState(*state), force=True)
            ckpt.wait()
            restored = ckpt.restore(1, lambda: step.init(PARAMS), strategy.mesh)
        assert type(restored) is StepState and int(restored.step) == 1
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
            if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
                got, want = jax.random.key_data(got), jax.random.key_data(want)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        after, metrics = step(restored, BATCH)
    assert int(after.step) == 2 and np.isfinite(float(metrics["loss"]))


def test_a_state_of_the_old_layout_restores(tmp_path):
    # Checkpoints written before the state had model_state and rng hold four fields.
    strategy = _strategy("gradient_allreduce")
    with strategy.train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.1)) as step:
        state = step.init(PARAMS)
        old = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
        with Checkpointer(tmp_path, every=1) as ckpt:
            ckpt.save(0, {**old, "extra": {}}, force=True)
            ckpt.wait()
            restored = ckpt.restore(0, lambda: step.init(PARAMS), strategy.mesh)
        assert restored.model_state is None and restored.rng is None
        state, metrics = step(restored, BATCH)
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("name", ["bytegrad", "decentralized"])
def test_no_model_state_adds_no_traffic_and_state_adds_its_bytes(name):
    strategy = _strategy(name)

    def plain(params, batch):
        return jnp.mean((batch @ params["w"]) ** 2)

    def with_key(params, batch, *, key):
        return plain(params, batch) + 0.0 * jax.random.uniform(key)

    def with_state(params, batch, *, model_state):
        new = {"mean": 0.9 * model_state["mean"] + 0.1 * jnp.mean(batch, 0)}
        return plain(params, batch), new

    def traffic(loss, **kwargs):
        with strategy.train_step(loss, _tx(name), **kwargs) as step:
            stats = step.communication_stats(step.init(PARAMS), BATCH)
        return {phase: (s.rows, s.total_bytes) for phase, s in stats.items()}

    base = traffic(plain)
    assert traffic(with_key, rng_seed=0) == base  # the key costs no collective
    stateful = traffic(with_state, model_state={"mean": np.zeros(256, np.float32)})
    for phase, (_, total) in base.items():
        # One float32 all-reduce of the state's 1 KiB: ~2 x 7/8 of it on a ring of 8.
        assert 1024 <= stateful[phase][1] - total <= 2 * 1024


@pytest.mark.parametrize("name", [*ALGORITHMS, "pipelined"])
def test_integer_params_are_refused_at_init_naming_the_leaf(name):
    params = {"w": np.ones((4, 2), np.float32), "steps": np.zeros((), np.int32)}
    if name == "pipelined":
        strategy = _strategy("bytegrad", pipeline=True)
    else:
        strategy = _strategy(name)
    with strategy.train_step(lambda p, b: jnp.sum(p["w"]), _tx(name)) as step:
        with pytest.raises(ValueError, match=r"parameter \['steps'\] has dtype int32.*model_state"):
            step.init(params)


# Every pair of steps whose states differ; bytegrad and its pipelined form share theirs.
STEPS = [*ALGORITHMS, "pipelined"]
PAIRS = [(a, b) for a, b in itertools.permutations(STEPS, 2) if {a, b} != {"bytegrad", "pipelined"}]


def _step(name):
    if name == "pipelined":
        return _strategy("bytegrad", pipeline=True).train_step(
            lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.1)
        )
    return _strategy(name).train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), _tx(name))


@pytest.fixture(scope="module")
def initial_states():
    states = {}
    for name in STEPS:
        with _step(name) as step:
            states[name] = step.init(PARAMS)
    return states


@pytest.mark.parametrize("made_by,used_by", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_a_state_from_another_step_names_both_algorithms(initial_states, made_by, used_by):
    with _step(used_by) as step:
        with pytest.raises(ValueError) as info:
            step(initial_states[made_by], BATCH)
    message = str(info.value)
    made = "bytegrad" if made_by == "pipelined" else made_by
    used = "bytegrad" if used_by == "pipelined" else used_by
    assert f"'{made}' step" in message and f"this '{used}' step" in message, message
    assert "step.init(params)" in message


def test_a_state_missing_its_model_state_or_key_is_refused():
    strategy = _strategy("gradient_allreduce")
    loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)  # noqa: E731
    with strategy.train_step(loss, optax.sgd(0.1)) as plain:
        state = plain.init(PARAMS)
    with strategy.train_step(lambda p, b, *, key: loss(p, b), optax.sgd(0.1), rng_seed=0) as step:
        with pytest.raises(ValueError, match="its rng is missing.*rng_seed"):
            step(state, BATCH)
        with pytest.raises(ValueError, match="must be the StepState"):
            step((state.params, state.opt_state), BATCH)


def test_bad_model_state_arguments_are_refused():
    strategy = _strategy("gradient_allreduce")
    loss = lambda p, b, **kw: jnp.mean((b @ p["w"]) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match="state_sync must be one of 'mean', 'first'"):
        strategy.train_step(loss, optax.sgd(0.1), model_state={}, state_sync="median")
    with pytest.raises(ValueError, match=r"model_state leaf \['k'\].*PRNG keys"):
        strategy.train_step(loss, optax.sgd(0.1), model_state={"k": jax.random.key(0)})
    with pytest.raises(ValueError, match="rng_seed must be an int >= 0"):
        strategy.train_step(loss, optax.sgd(0.1), rng_seed=-1)
    for other in (_strategy("bytegrad", pipeline=True), jax_bytegrad.Strategy("async")):
        with pytest.raises(ValueError, match="does not take model_state= or rng_seed="):
            other.train_step(loss, optax.sgd(0.1), rng_seed=0)
    # Python numbers are leaves too, placed as JAX would type them.
    with strategy.train_step(loss, optax.sgd(0.1), model_state={"n": 0, "x": 0.5}) as step:
        placed = step.init(PARAMS).model_state
    assert (placed["n"].dtype, placed["x"].dtype) == (jnp.int32, jnp.float32)
    # A loss that forgets to return its state says so.
    with strategy.train_step(
        loss, optax.sgd(0.1), model_state={"n": np.zeros(2, np.float32)}
    ) as step:
        with pytest.raises(ValueError, match=r"must return \(loss, new_model_state\)"):
            step(step.init(PARAMS), BATCH)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("gradient_allreduce", {}), ("decentralized", {}), ("bytegrad", {"pipeline": True})],
    ids=["gradient_allreduce", "decentralized", "bytegrad-pipelined"],
)
def test_a_loss_returning_aux_without_has_aux_is_told_to_pass_it(name, kwargs):
    # jax.grad's own error ("Gradient only defined for scalar-output functions") named neither
    # the cause nor has_aux.
    strategy = _strategy(name, **kwargs)
    loss = lambda p, b: (jnp.mean((b @ p["w"]) ** 2), {"n": jnp.float32(1)})  # noqa: E731
    with strategy.train_step(loss, _tx(name)) as step:
        with pytest.raises(ValueError, match=r"\(loss, aux\).*pass has_aux=True"):
            step(step.init(PARAMS), BATCH)
    with strategy.train_step(loss, _tx(name), has_aux=True) as step:
        _, metrics = step(step.init(PARAMS), BATCH)
    assert float(np.asarray(metrics["aux"]["n"]).ravel()[0]) == 1.0


def test_autotune_takes_the_model_state():
    strategy = _strategy("bytegrad")
    result = jax_bytegrad.autotune(
        strategy, _probe_loss, optax.sgd(0.1), PARAMS, [BATCH] * 3,
        space={"message_bytes": [2**16, None]}, steps_per_trial=1, verbose=False,
        model_state=_probe_state(), rng_seed=0,
    )  # fmt: skip
    assert len(result.trials) >= 2 and all(t.error is None for t in result.trials)


def test_step_state_keeps_its_four_fields():
    # The model state and key live in extra: a state without them is laid out as before.
    state = StepState(np.int64(0), {}, (), {})
    assert StepState._fields == ("step", "params", "opt_state", "extra")
    assert state.model_state is None and state.rng is None


@pytest.mark.parametrize("name", ["bytegrad", "decentralized"])
def test_flatten_carries_the_model_state_and_key(name):
    # flatten=True hands the loss the unflattened params and the keywords as they are.
    strategy = _strategy(name, flatten=True)
    kwargs = dict(model_state=_probe_state(), rng_seed=3)
    with strategy.train_step(_probe_loss, _tx(name), **kwargs) as step:
        state = step.init(PARAMS)
        expected = [float(jax.random.uniform(step.device_key(state, d))) for d in range(DEVICES)]
        state, _ = step(state, BATCH)
    np.testing.assert_allclose(np.asarray(state.model_state["draws"]), expected, rtol=1e-6)
    assert jax.tree.map(np.shape, step.params(state)) == {"w": (256, 2)}
