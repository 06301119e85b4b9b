"""jax_bytegrad.nnx: an NNX model with BatchNorm and Dropout, trained in place by a strategy,
against plain single-device NNX training on the same global batches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_all_close
from sklearn.datasets import load_digits

import jax_bytegrad
from jax_bytegrad.checkpoint import Checkpointer

STEPS, BATCH, DEVICES, SEED = 3, 64, 8, 7


class MLP(nnx.Module):
    def __init__(self, rngs):
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam magnifies.
        self.hidden = nnx.Linear(64, 32, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": (logits.argmax(-1) == y).mean()}


def _batches():
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    return [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(10)]


@nnx.jit
def _device_grad(model, x, y, key):
    nnx.reseed(model, default=jax.random.fold_in(key, 0))  # the model's one stream: "default"
    (loss, _), grad = nnx.value_and_grad(loss_fn, has_aux=True)(model, (x, y))
    return loss, grad


@nnx.jit(static_argnames="state_sync")
def _update(optimizer, model, grads, stats, state_sync):
    # One program, not op by op: eagerly, each of the optimizer's ops compiles on its own, and
    # that took most of this file's time.
    mean = lambda *xs: sum(xs) / len(xs)  # noqa: E731
    optimizer.update(model, jax.tree.map(mean, *grads))
    nnx.update(model, jax.tree.map(mean, *stats) if state_sync == "mean" else stats[0])


def _reference(batches, steps, tx, state_sync="mean"):
    """Plain NNX on one device: each device's rows with its own dropout key (the device's key
    at that step, as docs/strategy.md writes it and ``TrainStep.device_key`` computes it), the
    gradients averaged and the new batch statistics averaged (or device 0's), one optimizer
    update."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = jax.random.key(SEED)
    losses = []
    for step in range(steps):
        x, y = batches[step]
        grads, stats, shard_losses = [], [], []
        for device, rows in enumerate(np.split(np.arange(BATCH), DEVICES)):
            local = nnx.clone(model)
            key = jax.random.fold_in(jax.random.fold_in(rng, step), device)
            loss, grad = _device_grad(local, x[rows], y[rows], key)
            grads.append(grad)
            stats.append(nnx.state(local, nnx.BatchStat))
            shard_losses.append(loss)
        _update(optimizer, model, grads, stats, state_sync)
        losses.append(float(np.mean(shard_losses)))
    return model, losses


def _trained(algorithm, batches, steps, tx, state_sync="mean", **kwargs):
    model = MLP(nnx.Rngs(0))
    strategy = jax_bytegrad.Strategy(algorithm, mesh=jax_bytegrad.make_mesh(2, 4), **kwargs)
    with jax_bytegrad.nnx.train_step(
        strategy, model, tx, loss_fn, has_aux=True, rng_seed=SEED, state_sync=state_sync
    ) as step:
        losses = [float(step(batches[i])["loss"]) for i in range(steps)]
    return model, step, losses


def _variables(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))


@pytest.fixture(scope="module")
def batches():
    return _batches()


@pytest.fixture(scope="module")
def reference(batches):
    return _reference(batches, STEPS, optax.adamw(1e-2))


def test_gradient_allreduce_matches_plain_nnx_training(batches, reference):
    model, step, losses = _trained("gradient_allreduce", batches, STEPS, optax.adamw(1e-2))
    expected, expected_losses = reference
    assert_trees_all_close(_variables(model), _variables(expected), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    # The statistics moved (BatchNorm trained) and the step wrote them back.
    assert not np.allclose(np.asarray(model.norm.mean[...]), 0.0)
    assert int(step.state.step) == STEPS


def test_state_sync_first_keeps_device_zeros_batch_statistics(batches):
    model, _, _ = _trained("gradient_allreduce", batches, 2, optax.sgd(0.1), state_sync="first")
    expected, _ = _reference(batches, 2, optax.sgd(0.1), state_sync="first")
    assert_trees_all_close(_variables(model), _variables(expected), rtol=1e-5, atol=1e-6)
    averaged, _ = _reference(batches, 2, optax.sgd(0.1))
    assert not np.allclose(model.norm.mean[...], averaged.norm.mean[...], atol=1e-4)


def test_bytegrad_stays_within_its_bound_of_plain_nnx_training(batches):
    # SGD, whose update is linear in the gradient: each step's 8-bit mean is off by at most
    # 1/127 of its block's largest entry (below 0.5 here), so 3 steps of lr 0.1 move each
    # weight by less than 3 * 0.1 * 0.5 / 127 ~ 1.2e-3 from plain training (Adam would
    # divide tiny gradients' rounding by their tiny second moment instead).
    model, _, losses = _trained("bytegrad", batches, STEPS, optax.sgd(0.1))
    expected, expected_losses = _reference(batches, STEPS, optax.sgd(0.1))
    assert_trees_all_close(_variables(model), _variables(expected), atol=1.5e-3)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-3)
    # Not vacuous: a model that missed one update is farther off than the bound.
    skipped, _ = _reference(batches, STEPS - 1, optax.sgd(0.1))
    with pytest.raises(AssertionError):
        assert_trees_all_close(_variables(model), _variables(skipped), atol=1.5e-3)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["qadam", "decentralized"])
def test_other_algorithms_train_the_nnx_model(batches, algorithm):
    kwargs, tx = {}, optax.adamw(1e-2)
    if algorithm == "qadam":
        kwargs, tx = {"learning_rate": 1e-2, "warmup_steps": 2}, None
    model, step, losses = _trained(algorithm, batches, 8, tx, **kwargs)
    assert losses[-1] < losses[0]
    # The model holds what the step holds: the trained params and the synced statistics.
    np.testing.assert_array_equal(
        np.asarray(model.norm.mean[...]), np.asarray(step.state.model_state["norm"]["mean"])
    )
    assert not np.allclose(np.asarray(model.norm.var[...]), 1.0)


@pytest.mark.slow
def test_a_checkpoint_restores_the_model_and_replays_the_dropout_keys(batches, tmp_path):
    model, step, _ = _trained("gradient_allreduce", batches, 1, optax.sgd(0.1))
    saved = jax.tree.map(np.asarray, _variables(model))
    mesh = jax_bytegrad.make_mesh(2, 4)
    strategy = jax_bytegrad.Strategy("gradient_allreduce", mesh=mesh)
    with Checkpointer(tmp_path, every=1) as ckpt:
        with jax_bytegrad.nnx.train_step(
            strategy, model, optax.sgd(0.1), loss_fn, has_aux=True, rng_seed=SEED
        ) as again:
            again.state = step.state
            ckpt.save(1, again.state, force=True)
            ckpt.wait()
            first = float(again(batches[1])["loss"])
            after = jax.tree.map(np.asarray, _variables(model))
            assert not np.allclose(after["out"]["kernel"], saved["out"]["kernel"])
            again.state = ckpt.restore(1, lambda: again.state, mesh)
            assert_trees_all_close(jax.tree.map(np.asarray, _variables(model)), saved)
            # The same step again: the same dropout masks, so the same loss and model.
            assert float(again(batches[1])["loss"]) == first
            assert_trees_all_close(jax.tree.map(np.asarray, _variables(model)), after)


def test_a_model_without_state_or_dropout_adds_no_traffic(batches):
    mesh = jax_bytegrad.make_mesh(2, 4)
    strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh)
    model = nnx.Linear(64, 10, rngs=nnx.Rngs(0))

    def plain_loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()

    with jax_bytegrad.nnx.train_step(strategy, model, optax.sgd(0.1), plain_loss) as step:
        assert step.state.model_state is None and step.state.rng is None
        nnx_bytes = step.communication_stats(batches[0])["step"].total_bytes

    def loss(params, batch):
        logits = batch[0] @ params["kernel"] + params["bias"][None]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with strategy.train_step(loss, optax.sgd(0.1)) as plain:
        plain_bytes = plain.communication_stats(plain.init(params), batches[0])["step"].total_bytes
    assert nnx_bytes == plain_bytes > 0


def test_a_model_that_is_not_nnx_is_refused():
    strategy = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(1, 1))
    with pytest.raises(ValueError, match="flax.nnx.Module"):
        jax_bytegrad.nnx.train_step(strategy, {"w": jnp.ones(3)}, optax.sgd(0.1), loss_fn)


def test_the_step_reports_its_memory_and_each_devices_dropout_key(batches):
    """``memory_stats`` and ``device_key`` read the step's own state: a sharded step needs less
    memory per device, and device 1's key is the underlying step's, another than device 0's."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    peaks = {}
    for shard in (None, "params"):
        strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard=shard)
        model = MLP(nnx.Rngs(0))
        with jax_bytegrad.nnx.train_step(
            strategy, model, optax.adam(1e-3), loss_fn, has_aux=True, rng_seed=SEED
        ) as step:
            memory = step.memory_stats(batches[0])["step"]
            peaks[shard] = memory.argument_bytes
            step(batches[0])
            key = step.device_key(1)
            want = step.train_step.device_key(step.state, 1)
            assert jax.random.key_data(key).tolist() == jax.random.key_data(want).tolist()
            other = jax.random.key_data(step.device_key(0)).tolist()
            assert other != jax.random.key_data(key).tolist()
    assert 0 < peaks["params"] < peaks[None]
