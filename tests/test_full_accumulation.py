"""shard="full" with gradient accumulation (optax.MultiSteps), and qadam's two phases with it, on
2 x 4 CPU devices. With the state split across nodes no device holds a gradient to accumulate
whole: each micro-step's gradient is reduce-scattered across nodes in the backward pass, and
the accumulator holds this device's blocks of the mean. Each run is set against the replicated
step's, and a run stopped between two micro-steps resumes from its checkpoint exactly."""

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_all_close
from test_sharding import ALGORITHMS, batches, loss_fn, params0, strategy

import jax_bytegrad
from jax_bytegrad.checkpoint import Checkpointer

K = 2  # micro-steps per gradient step
FEEDBACK = {"bits": 4, "error_feedback": True, "rounding": "stochastic"}


def run(algorithm, shard, steps, *, k=K, state=None, start=0, **settings):
    """``steps`` micro-steps (from ``start``, on ``state`` if given) of ``test_sharding``'s
    model with ``optax.MultiSteps(adam, k)`` (no accumulation for ``k`` None); returns the
    step (open), its state and the losses."""
    if algorithm == "qadam" and k is not None:  # QAdam is the optimizer: a setting
        settings["every_k_schedule"] = k
    s = strategy(algorithm, jax_bytegrad.make_mesh(2, 4), shard, **settings)
    tx = None if algorithm == "qadam" else optax.adam(1e-2)
    if k is not None and tx is not None:
        tx = optax.MultiSteps(tx, every_k_schedule=k)
    step = s.train_step(loss_fn, tx)
    state = step.init(params0()) if state is None else state(step)
    losses = []
    for batch in batches(start + steps)[start:]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return step, state, losses


def test_qadam_trains_full_as_replicated():
    # Both phases: the float32 warm-up (8 steps) and the compressed momentum exchange.
    ref, _, want = run("qadam", None, 30, k=None)
    step, state, got = run("qadam", "full", 30, k=None)
    with ref, step:
        assert step.phase_counts(state) == {"warmup": 8, "compressed": 22}
        assert want[-1] < 0.8 * want[0], "the model did not learn"
        np.testing.assert_allclose(got, want, rtol=0.01)
        # Every device rests with an eighth of w1, and of its moments.
        assert state.params["w1"].addressable_shards[0].data.shape == (8, 32)


def test_qadam_accumulates_full_as_replicated():
    # Warm-up and compressed phases count gradient steps; every micro-step of "full" crosses
    # on its gradient step's phase (the compressed one's gradient codes, then the momentum).
    ref, _, want = run("qadam", None, 32)
    step, state, got = run("qadam", "full", 32)
    with ref, step:
        assert step.phase_counts(state) == {"accumulate": 16, "warmup": 8, "compressed": 8}
        assert want[-1] < 0.8 * want[0], "the model did not learn"
        np.testing.assert_allclose(got, want, rtol=0.01)
        acc = state.extra["accumulated"]
        assert acc["w1"].addressable_shards[0].data.shape == (1, 8, 32)


def test_qadam_takes_its_accumulation_as_a_setting():
    settings = {"mesh": jax_bytegrad.make_mesh(2, 4), **ALGORITHMS["qadam"]}
    for bad in (0, 1.5, "2", True):
        with pytest.raises(ValueError, match="every_k_schedule must be an int >= 1"):
            jax_bytegrad.Strategy("qadam", every_k_schedule=bad, **settings)
    s = jax_bytegrad.Strategy("qadam", **settings)
    with pytest.raises(ValueError, match="every_k_schedule=k to accumulate"):
        s.train_step(loss_fn, optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K))


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad"])
def test_full_accumulates_as_the_replicated_step(algorithm):
    extra = {"hierarchical": True} if algorithm == "gradient_allreduce" else {}
    ref, ref_state, want = run(algorithm, None, 24, **extra)
    step, state, got = run(algorithm, "full", 24, **extra)
    with ref, step:
        assert step.phase_counts(state) == {"accumulate": 12, "step": 12}
        assert want[-1] < 0.8 * want[0], "the model did not learn"
        if algorithm == "gradient_allreduce":
            # Float32 both ways: the mean of the micro-steps' means is the mean of the sums.
            got_params, want_params = step.params(state), ref.params(ref_state)
            assert_trees_all_close(jax.device_get(got_params), jax.device_get(want_params),
                                   atol=1e-5)  # fmt: skip
            np.testing.assert_allclose(got, want, rtol=1e-5)
        else:
            np.testing.assert_allclose(got, want, rtol=0.01)
        # The accumulator holds this device's block of w1's mean: an eighth.
        acc = state.extra["accumulated"]
        assert acc["w1"].addressable_shards[0].data.shape == (1, 8, 32)
        assert acc["b2"].addressable_shards[0].data.shape == (1, 10)  # whole: each its own


def test_each_micro_step_crosses_between_nodes():
    sent = {}
    for shard, k in [("full", K), ("full", None), ("params", K)]:
        step, state, _ = run("bytegrad", shard, 1, k=k)
        with step:
            sent[shard, k] = step.bytes_between_nodes(state, batches(1)[0])
    full = sent["full", K]
    # The micro-steps of "full" send the gathers and the gradient's codes; those of "params"
    # only the loss's mean. The step that applies sends what a step without accumulation does.
    assert full["accumulate"] > 0.5 * full["step"], sent
    assert sent["params", K]["accumulate"] < 0.01 * full["accumulate"], sent
    assert full["step"] == pytest.approx(sent["full", None]["step"], rel=0.01), sent


def test_4_bit_feedback_accumulates_and_resumes_exactly_between_micro_steps(tmp_path):
    k, stop, steps = K, 5, 24  # stopped after a gradient step's first micro-step
    ref, _, want = run("bytegrad", None, steps, k=k, **FEEDBACK)
    step, state, got = run("bytegrad", "full", steps, k=k, **FEEDBACK)
    with ref, step:
        assert want[-1] < 0.8 * want[0], "the model did not learn"
        assert np.mean(got[-3:]) <= 1.02 * np.mean(want[-3:]), (got, want)
        uninterrupted = jax.device_get(step.params(state))

    first, state, _ = run("bytegrad", "full", stop, k=k, **FEEDBACK)
    with first, Checkpointer(tmp_path, every=1) as ckpt:
        # The micro-steps keep error feedback: the residuals moved since init.
        residuals = jax.device_get(optax.tree.get(state.opt_state, "residuals"))
        assert any(np.any(r != 0) for r in jax.tree.leaves(residuals))
        ckpt.save(stop, state)
        ckpt.wait()

    def restored(step):
        with Checkpointer(tmp_path, every=1) as ckpt:
            shapes = step.state_shapes(params0())
            return ckpt.restore(stop, lambda: shapes, shapes)

    again, state, _ = run("bytegrad", "full", steps - stop, k=k, state=restored, start=stop,
                          **FEEDBACK)  # fmt: skip
    with again:
        assert int(state.step) == steps
        assert_trees_all_close(jax.device_get(again.params(state)), uninterrupted, atol=0)
