"""Exchanges between nodes split into messages of ``message_bytes``: same results, same bytes.

The pairwise exchanges of the scatter-gather wire; the integer wire sends one psum per bucket
(tests/test_wire.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from test_bytegrad import documented_bound, flat_f32, flat_result

import jax_bytegrad
from jax_bytegrad import scale_by_qadam
from jax_bytegrad.profiling import communication_stats

pytestmark = pytest.mark.usefixtures("strict_dtypes")

AXES = ("node", "local")
BLOCK = 128
# None: one message per peer; BLOCK: one block of codes per message; 3 * BLOCK + 1: pieces of
# three blocks, the last one shorter.
SPLITS = [None, BLOCK, 3 * BLOCK + 1]


def _grads(devices: int, seed: int, size: int = 5000):
    rng = np.random.default_rng(seed)
    return [
        jnp.asarray(rng.standard_normal((devices, size)) * 0.1, jnp.float32),
        jnp.asarray(rng.standard_normal((devices, 40, 25)) * 10.0, jnp.float32),
    ]


def _mean_fn(mesh, **kwargs):
    def body(tree):
        return jax_bytegrad.compressed_mean(
            jax.tree.map(lambda x: x[0], tree),
            sync=jax_bytegrad.SyncConfig(wire="scatter_gather", **kwargs),
        )

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P()))


def _node_all_to_alls(stats) -> int:
    return sum(r.count for r in stats.rows if r.kind == "all-to-all" and r.axes != "local")


# Each way the pairwise exchange's group forms: a reduce-scatter within nodes, then an odd
# number of nodes (3x2-hier; 2x4-hier runs the same code); a flat group over both axes
# (2x4-flat; 3x2-flat the same); one device per node (8x1-hier; 8x1-flat compiles to the same
# program).
@pytest.mark.parametrize(
    "shape,hierarchical",
    [((3, 2), True), ((2, 4), False), ((8, 1), True)],
    ids=["3x2-hier", "2x4-flat", "8x1-hier"],
)
def test_message_size_changes_no_result_and_no_bytes(shape, hierarchical):
    mesh = jax_bytegrad.make_mesh(*shape)
    grads = _grads(shape[0] * shape[1], seed=sum(shape))
    outs, stats = [], []
    for message_bytes in SPLITS:
        fn = _mean_fn(
            mesh,
            hierarchical=hierarchical,
            block_size=BLOCK,
            bucket_bytes=None,
            message_bytes=message_bytes,
        )
        outs.append([np.asarray(x) for x in fn(grads)])
        stats.append(communication_stats(fn, grads))
    for out, message_bytes in zip(outs[1:], SPLITS[1:], strict=True):
        for got, want in zip(out, outs[0], strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"message_bytes={message_bytes}")
    # The split really happened: one message per block, then one per three blocks ...
    counts = [_node_all_to_alls(s) for s in stats]
    assert counts[0] == 1  # codes and headers travel together, one message per peer
    assert counts[1] > counts[2] > counts[0], counts
    # ... and the bytes between nodes are the same: splitting adds no padding.
    node = [s.bytes_on("node") for s in stats]
    assert node[0] > 0
    assert node[1] == node[2] == node[0], node


def test_stochastic_rounding_split_keeps_replicas_identical_and_close():
    mesh = jax_bytegrad.make_mesh(2, 4)
    grads = _grads(8, seed=3, size=1500)  # 3 blocks per peer: 3 messages

    def body(tree):
        mean = jax_bytegrad.compressed_mean(
            jax.tree.map(lambda x: x[0], tree),
            key=jax.random.key(0),
            sync=jax_bytegrad.SyncConfig(
                block_size=BLOCK, message_bytes=BLOCK, rounding="stochastic", wire="scatter_gather"
            ),
        )
        # Per device, so that replicas can be compared.
        return jax.tree.map(lambda x: jax.lax.pcast(x, AXES, to="varying")[None], mean)

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))(grads)
    for leaf in out:
        leaf = np.asarray(leaf).reshape(8, -1)
        for replica in leaf[1:]:
            np.testing.assert_array_equal(replica, leaf[0])
    # Stochastic rounding errs by up to a whole code step, twice nearest rounding's half step.
    exact, bound = documented_bound(flat_f32(grads), 2, 4, True, BLOCK)
    result = flat_result([np.asarray(leaf)[0] for leaf in out])
    assert np.all(np.abs(result - exact) <= 2 * bound)


def test_qadam_compressed_phase_does_not_depend_on_the_split():
    mesh = jax_bytegrad.make_mesh(2, 4)
    grads = _grads(8, seed=5, size=1500)  # 3 blocks per peer: 3 messages
    params = [g[0] for g in grads]
    results = []
    for message_bytes in (None, BLOCK):
        tx = scale_by_qadam(
            warmup_steps=1,
            sync=jax_bytegrad.SyncConfig(
                block_size=BLOCK, message_bytes=message_bytes, wire="scatter_gather"
            ),
        )
        state = tx.init(params)
        state = state._replace(count=jnp.asarray(1, jnp.int32))  # past warm-up: compressed

        def body(g, state, tx=tx):
            updates, state = tx.update([x[0] for x in g], state)
            return updates, state

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), P()), out_specs=P()))
        updates, _ = fn(grads, state)
        results.append([np.asarray(u) for u in updates])
    for got, want in zip(results[1], results[0], strict=True):
        np.testing.assert_array_equal(got, want)


def test_split_train_step_has_no_float32_gradient_all_reduce():
    mesh = jax_bytegrad.make_mesh(2, 4)
    rng = np.random.default_rng(0)
    # 4160 values: about 4 blocks per peer, so several messages, and a float32 all-reduce of
    # the gradient (at least its 16 KiB) would stand far above the bound below (2 KiB).
    params = {
        "w": jnp.asarray(rng.standard_normal((64, 64)) * 0.1, jnp.float32),
        "b": jnp.zeros(64, jnp.float32),
    }

    def loss_fn(p, batch):
        return jnp.mean((batch @ p["w"] + p["b"][None]) ** 2)

    tx = optax.chain(
        jax_bytegrad.bytegrad(block_size=BLOCK, message_bytes=BLOCK, wire="scatter_gather"),
        optax.sgd(0.1),
    )
    step = jax_bytegrad.data_parallel_step(loss_fn, tx, mesh, donate=False)
    batch = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    stats = communication_stats(step, step.init(params), batch)
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    f32_reductions = [r for r in stats.rows if r.kind == "all-reduce" and "f32" in r.dtype]
    assert sum(r.payload_bytes for r in f32_reductions) < grad_bytes / 8, str(stats)
    assert _node_all_to_alls(stats) > 2, str(stats)  # split into several messages


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1MiB"], ids=str)
def test_message_bytes_is_validated_when_built(bad):
    with pytest.raises(ValueError, match="message_bytes must be an int >= 1 or None"):
        jax_bytegrad.bytegrad(message_bytes=bad)
    with pytest.raises(ValueError, match="message_bytes must be an int >= 1 or None"):
        scale_by_qadam(warmup_steps=1, sync=jax_bytegrad.SyncConfig(message_bytes=bad))


@pytest.mark.parametrize("algorithm", ["shift_one", "low_precision"])
def test_decentralized_exchanges_split_without_changing_the_weights(algorithm):
    from jax_bytegrad import decentralized_step, low_precision_decentralized_step

    mesh = jax_bytegrad.make_mesh(4, 2)
    rng = np.random.default_rng(7)
    w0 = {"w": jnp.asarray(rng.standard_normal((32, 40)) * 0.1, jnp.float32)}
    batch = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

    finals, permutes = [], []
    for message_bytes in (None, 4 * BLOCK):
        if algorithm == "shift_one":
            train = decentralized_step(
                loss_fn, optax.sgd(0.5), mesh, peer_selection_mode="shift_one",
                message_bytes=message_bytes, donate=False,
            )  # fmt: skip
        else:
            train = low_precision_decentralized_step(
                loss_fn, optax.sgd(0.5), mesh, block_size=BLOCK, message_bytes=message_bytes,
                donate=False,
            )  # fmt: skip
        state = train.init(w0)
        for _ in range(4):
            state, _ = train.step(state, batch)
        finals.append(jax.tree.map(np.asarray, state))
        stats = communication_stats(train, state, batch)
        permutes.append(sum(r.count for r in stats.rows if r.kind == "collective-permute"))
    jax.tree.map(np.testing.assert_array_equal, finals[1], finals[0])
    assert permutes[1] > permutes[0] > 0, permutes
