"""Gradient accumulation (optax.MultiSteps): the large batch's step, one exchange between nodes
per k micro-steps, with or without shard=, and in a shard_map of one's own."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import classification_batches
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad.checkpoint import Checkpointer
from jax_bytegrad.sharding import replicate, shard_batch, shard_state, state_specs

K = 4


def params0():
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(64, 32)) * 0.2).astype(np.float32),
        "b1": np.zeros(32, np.float32),
        "w2": (rng.normal(size=(32, 10)) * 0.2).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None])
    logits = h @ params["w2"] + params["b2"][None]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def micro_batches(steps, rows=32):
    return classification_batches(steps, rows)


def large(batches, k=K, devices=8):
    """The k micro-batches of each gradient step as one batch: each device's rows of every
    micro-batch, so that every device sees the same examples as when it accumulates."""
    out = []
    for i in range(0, len(batches), k):
        group = batches[i : i + k]
        out.append(
            tuple(
                np.concatenate(
                    [b[j].reshape(devices, -1, *b[j].shape[1:]) for b in group], axis=1
                ).reshape(-1, *group[0][j].shape[1:])
                for j in range(2)
            )
        )
    return out


def run(step, batches):
    with step:
        state = step.init(params0())
        for batch in batches:
            state, metrics = step(state, batch)
        return state, jax.device_get(step.params(state)), float(metrics["loss"])


@pytest.fixture(scope="module")
def large_batch_step():
    """Per algorithm, the params after the large batches' steps, unsharded: one run each for
    every case below."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    batches = large(micro_batches(3 * K))
    return {
        algorithm: run(
            jax_bytegrad.Strategy(algorithm, mesh=mesh).train_step(loss_fn, optax.adam(1e-2)),
            batches,
        )[1]
        for algorithm in ("gradient_allreduce", "bytegrad")
    }


# The accumulator and its placement are the step's, whatever the algorithm that exchanges the
# accumulated gradient: gradient_allreduce, whose float32 mean matches to 1e-5, takes every
# shard= against the unsharded large-batch step; bytegrad's 8-bit exchange of the
# accumulated gradient runs once (shard="params" accumulates through it in the checkpoint
# test below).
@pytest.mark.parametrize(
    "algorithm,shard",
    [
        ("gradient_allreduce", None),
        ("gradient_allreduce", "optimizer"),
        ("gradient_allreduce", "params"),
        ("bytegrad", None),
    ],
)
def test_strategy_with_multisteps_takes_the_large_batch_step(algorithm, shard, large_batch_step):
    mesh = jax_bytegrad.make_mesh(2, 4)
    s = jax_bytegrad.Strategy(algorithm, mesh=mesh, shard=shard)
    batches = micro_batches(3 * K)
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K)
    state, got, _ = run(s.train_step(loss_fn, tx), batches)
    want = large_batch_step[algorithm]
    tolerance = 1e-5 if algorithm == "gradient_allreduce" else 5e-3
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=tolerance)
    acc = state.extra["accumulated"]
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(acc))  # reset after a step
    if shard is not None:  # each device holds its block of its node's sum
        assert acc["w1"].addressable_shards[0].data.shape == (1, 16, 32)


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad"])
def test_nodes_exchange_once_per_k_micro_steps(algorithm):
    mesh = jax_bytegrad.make_mesh(2, 4)
    s = jax_bytegrad.Strategy(algorithm, mesh=mesh, hierarchical=True)
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K)
    with s.train_step(loss_fn, tx) as step:
        state = step.init(params0())
        batches = micro_batches(2 * K)
        for batch in batches:
            state, _ = step(state, batch)
        stats = step.communication_stats(state, batches[0])
        counts = step.phase_counts(state)
    with s.train_step(loss_fn, optax.adam(1e-2)) as plain:
        every_step = plain.communication_stats(plain.init(params0()), batches[0])["step"]
    assert counts == {"accumulate": 2 * (K - 1), "step": 2}
    # An accumulating micro-step sends only the loss's mean between nodes.
    assert stats["accumulate"].bytes_on("node") <= 8
    assert stats["step"].bytes_on("node") == pytest.approx(every_step.bytes_on("node"))
    per_micro_step = sum(stats[p].bytes_on("node") * n for p, n in counts.items()) / (2 * K)
    assert per_micro_step <= 1.01 * every_step.bytes_on("node") / K


def test_data_parallel_step_with_multisteps_of_a_chain():
    mesh = jax_bytegrad.make_mesh(2, 4)
    tx = optax.chain(jax_bytegrad.gradient_allreduce(), optax.adamw(1e-2))
    batches = micro_batches(2 * K)
    accumulating = jax_bytegrad.data_parallel_step(loss_fn, optax.MultiSteps(tx, K), mesh)
    _, got, _ = run(accumulating, batches)
    _, want, _ = run(jax_bytegrad.data_parallel_step(loss_fn, tx, mesh), large(batches))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5)


def test_qadam_accumulates_through_data_parallel_step():
    mesh = jax_bytegrad.make_mesh(2, 4)
    tx = jax_bytegrad.qadam(1e-2, warmup_steps=2)
    batches = micro_batches(4 * 2)
    _, got, _ = run(
        jax_bytegrad.data_parallel_step(loss_fn, optax.MultiSteps(tx, 2), mesh), batches
    )
    _, want, _ = run(jax_bytegrad.data_parallel_step(loss_fn, tx, mesh), large(batches, k=2))
    for k in want:  # the compressed phase's codes differ by a step at most
        np.testing.assert_allclose(got[k], want[k], atol=5e-3)


def test_qadam_strategy_accumulates_as_the_larger_batch():
    # Strategy("qadam") takes no optimizer to wrap: every_k_schedule is its setting.
    mesh = jax_bytegrad.make_mesh(2, 4)
    settings = {"mesh": mesh, "learning_rate": 1e-2, "warmup_steps": 2}
    batches = micro_batches(4 * 2)
    accumulating = jax_bytegrad.Strategy("qadam", every_k_schedule=2, **settings)
    state, got, _ = run(accumulating.train_step(loss_fn), batches)
    assert int(state.step) == 8
    _, want, _ = run(jax_bytegrad.Strategy("qadam", **settings).train_step(loss_fn),
                     large(batches, k=2))  # fmt: skip
    for k in want:  # warm-up, then the 8-bit momentum codes: the same codes, near enough
        np.testing.assert_allclose(got[k], want[k], atol=5e-3)
        assert not np.allclose(got[k], params0()[k], atol=1e-3), k  # it trained


def test_a_schedule_of_k_is_followed():
    mesh = jax_bytegrad.make_mesh(2, 4)
    schedule = lambda gradient_step: 1 + gradient_step  # noqa: E731 - 1, 2, 3 micro-steps
    s = jax_bytegrad.Strategy("gradient_allreduce", mesh=mesh)
    with s.train_step(loss_fn, optax.MultiSteps(optax.sgd(0.1), every_k_schedule=schedule)) as step:
        state = step.init(params0())
        phases = []
        for batch in micro_batches(6):
            phases.append(step._phase(int(state.step))[0])
            state, _ = step(state, batch)
    assert phases == ["step", "accumulate", "step", "accumulate", "accumulate", "step"]


def test_a_checkpoint_in_the_middle_of_an_accumulation_resumes_exactly(tmp_path):
    mesh = jax_bytegrad.make_mesh(2, 4)
    s = jax_bytegrad.Strategy("bytegrad", mesh=mesh, shard="params")
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K)
    batches = micro_batches(2 * K)
    _, straight, _ = run(s.train_step(loss_fn, tx), batches)
    with s.train_step(loss_fn, tx) as step, Checkpointer(tmp_path, every=1) as ckpt:
        state = step.init(params0())
        for batch in batches[: K + 2]:
            state, _ = step(state, batch)
        ckpt.save(K + 2, state)
        ckpt.wait()
        target = step.state_shapes(params0())
        state = ckpt.restore(K + 2, lambda: target, target)
        for batch in batches[K + 2 :]:
            state, _ = step(state, batch)
        resumed = jax.device_get(step.params(state))
    for k in straight:
        np.testing.assert_array_equal(resumed[k], straight[k])


def test_refusals_name_what_to_do():
    mesh = jax_bytegrad.make_mesh(2, 4)
    skip = optax.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=optax.skip_not_finite)
    with pytest.raises(ValueError, match="should_skip_update_fn.*skip_nonfinite"):
        jax_bytegrad.Strategy("bytegrad", mesh=mesh).train_step(loss_fn, skip)
    with pytest.raises(ValueError, match="accumulation .* is supported by gradient_allreduce"):
        jax_bytegrad.Strategy("decentralized", mesh=mesh).train_step(
            loss_fn, optax.MultiSteps(optax.sgd(0.1), 2)
        )


def test_multisteps_of_bytegrad_in_a_shard_map_of_ones_own():
    """The form docs/bytegrad.md teaches: each device accumulates its own gradient
    (state_specs and shard_state place MultiSteps' accumulator per device)."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    square = lambda params, batch: ((batch @ params["w"] - 1.0) ** 2).mean()  # noqa: E731

    def train(tx, batches):
        params = replicate({"w": np.zeros((64, 8), np.float32)}, mesh)
        state = shard_state(tx.init(params), mesh)
        specs = state_specs(state)

        def per_device(params, state, batch):
            varying = jax.lax.pcast(params, ("node", "local"), to="varying")
            updates, state = tx.update(jax.grad(square)(varying, batch), state, params)
            return optax.apply_updates(params, updates), state

        step = jax.jit(
            jax.shard_map(
                per_device,
                mesh=mesh,
                in_specs=(P(), specs, P(("node", "local"))),
                out_specs=(P(), specs),
            )
        )
        for batch in batches:
            params, state = step(params, state, shard_batch(batch, mesh))
        return np.asarray(params["w"])

    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(64, 64)).astype(np.float32) for _ in range(4)]
    # Each device's rows of two micro-batches, as one batch.
    bigs = [
        np.concatenate([xs[i].reshape(8, 8, 64), xs[i + 1].reshape(8, 8, 64)], 1) for i in (0, 2)
    ]
    inner = optax.chain(jax_bytegrad.gradient_allreduce(), optax.adamw(1e-2))
    got = train(optax.MultiSteps(inner, every_k_schedule=2), xs)
    want = train(inner, [big.reshape(128, 64) for big in bigs])
    np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="scalar gradient"):
        shard_state(optax.MultiSteps(optax.sgd(0.1), 2).init({"s": jnp.ones(())}), mesh)
