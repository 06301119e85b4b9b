"""Tests for decentralized and low-precision decentralized SGD
(jax_bytegrad/_src/algorithms/decentralized/step.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_all_close, assert_trees_all_equal

import jax_bytegrad
from jax_bytegrad import consensus_params, decentralized_step, low_precision_decentralized_step

# The shift_one pairings, private: the tests below check the schedule itself.
from jax_bytegrad._src.algorithms.decentralized.step import shift_one_schedule
from jax_bytegrad.profiling import communication_stats

DIM = 5
LR = 0.1


def _loss(w, batch):
    x, y = batch
    return jnp.mean((x @ w - y) ** 2)


def _grad(w, x, y):  # numpy gradient of _loss
    return (2.0 / len(y)) * x.T @ (x @ w - y)


def _data(devices, rows=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((devices * rows, DIM)).astype(np.float32)
    y = rng.standard_normal(devices * rows).astype(np.float32)
    return x, y


def _grads(w, x, y, devices):  # one gradient per device, from its own rows and weights
    xs, ys = x.reshape(devices, -1, DIM), y.reshape(devices, -1)
    return np.stack([_grad(w[d], xs[d], ys[d]) for d in range(devices)])


# Schedules --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8], ids=lambda n: f"n{n}")
def test_shift_one_schedule_is_matching_and_covers_every_peer(n):
    rounds = shift_one_schedule(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n) if n > 1 else len(rounds) == 1
    met = set()
    for pairs in rounds:
        flat = [p for pair in pairs for p in pair]
        assert len(flat) == len(set(flat)), "a peer is paired twice in one round"
        # Even: everyone is paired; odd: exactly one peer sits out.
        assert len(flat) == (n if n % 2 == 0 else n - 1)
        met |= set(pairs)
    assert met == {(a, b) for a in range(n) for b in range(a + 1, n)}, "some pair never meets"


def test_shift_one_schedule_rejects_bad_count():
    with pytest.raises(ValueError, match="num_peers"):
        shift_one_schedule(0)


# Decentralized SGD: exact math --------------------------------------------------------------


def _reference_dpsgd(w0, x, y, *, nodes, local, mode, hierarchical, interval, steps):
    devices = nodes * local
    w = np.tile(w0, (devices, 1)).astype(np.float32)
    peers = nodes if hierarchical else devices
    rounds = shift_one_schedule(peers)
    for t in range(steps):
        g = _grads(w, x, y, devices)
        v = w.reshape(nodes, local, DIM)
        if hierarchical:
            v = np.broadcast_to(v.mean(1, keepdims=True), v.shape)
        v = v.reshape(peers, -1, DIM).copy()
        if t % interval == 0:
            if mode == "all":
                v[:] = v.mean(0, keepdims=True)
            else:
                new = v.copy()
                for a, b in rounds[(t // interval) % len(rounds)]:
                    new[a] = new[b] = (v[a] + v[b]) / 2
                v = new
        w = v.reshape(devices, DIM) - LR * g
    return w


CASES = [
    (2, 4, "all", True, 1),
    (2, 4, "all", False, 2),
    (4, 2, "shift_one", True, 1),
    (4, 2, "shift_one", False, 1),
    (3, 2, "shift_one", True, 2),  # odd node count: one node sits out each round
]


@pytest.mark.parametrize(
    "nodes,local,mode,hierarchical,interval",
    CASES,
    ids=[f"{n}x{loc}-{m}-{'hier' if h else 'flat'}-k{k}" for n, loc, m, h, k in CASES],
)
def test_decentralized_matches_numpy_reference(nodes, local, mode, hierarchical, interval):
    mesh = jax_bytegrad.make_mesh(nodes, local)
    devices = nodes * local
    x, y = _data(devices)
    w0 = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
    train = decentralized_step(
        _loss,
        optax.sgd(LR),
        mesh,
        peer_selection_mode=mode,
        hierarchical=hierarchical,
        communication_interval=interval,
        donate=False,
    )
    state = train.init(jnp.asarray(w0))
    steps = 7
    for _ in range(steps):
        state, metrics = train.step(state, (x, y))
    assert metrics["loss"].shape == ()  # the mean of the devices' losses
    expected = _reference_dpsgd(
        w0, x, y, nodes=nodes, local=local, mode=mode, hierarchical=hierarchical,
        interval=interval, steps=steps,
    )  # fmt: skip
    assert_trees_all_close(np.asarray(state.params), expected, rtol=1e-5, atol=1e-6)
    assert state.step == steps


def test_decentralized_shift_one_only_talks_to_peer():
    """On a 4x1 mesh, one shift_one step mixes each node with exactly its scheduled peer."""
    mesh = jax_bytegrad.make_mesh(4, 1)
    train = decentralized_step(
        lambda w, b: jnp.sum(w) * 0.0, optax.sgd(LR), mesh, peer_selection_mode="shift_one"
    )
    state = train.init(jnp.zeros(1))
    start = np.arange(4, dtype=np.float32)[:, None]
    state = state._replace(params=jax.device_put(start, state.params.sharding))
    state, _ = train.step(state, jnp.zeros((4, 1)))
    (a, b), (c, d) = shift_one_schedule(4)[0]
    want = start.copy()
    want[a] = want[b] = (start[a] + start[b]) / 2
    want[c] = want[d] = (start[c] + start[d]) / 2
    assert_trees_all_equal(np.asarray(state.params), want)


def test_decentralized_sends_no_gradient_all_reduce():
    mesh = jax_bytegrad.make_mesh(2, 4)
    train = decentralized_step(_loss, optax.sgd(LR), mesh, peer_selection_mode="shift_one")
    state = train.init(jnp.zeros(DIM))
    stats = communication_stats(train, state, _data(8))
    # Only the node average (within a node) and ppermutes: no all-reduce across nodes.
    assert any(r.kind == "collective-permute" and r.axes == "node" for r in stats.rows), stats
    assert not [r for r in stats.rows if r.kind == "all-reduce" and "node" in r.axes], stats


def test_gossip_and_local_steps_are_programs_of_their_own():
    mesh = jax_bytegrad.make_mesh(2, 4)
    train = decentralized_step(_loss, optax.sgd(LR), mesh, communication_interval=3)
    state = train.init(jnp.zeros(DIM))
    phases = train.communication_stats(state, _data(8))
    assert set(phases) == {"gossip", "local"}
    assert phases["gossip"].bytes_on("node") > 0
    assert phases["local"].bytes_on("node") == 0, phases["local"]
    for _ in range(4):
        state, _ = train(state, _data(8))
    assert train.phase_counts(state) == {"gossip": 2, "local": 2}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"peer_selection_mode": "ring"}, "peer_selection_mode"),
        ({"communication_interval": 0}, "communication_interval"),
        ({"hierarchical": 1}, "hierarchical"),
        ({"node_axis": "nodes"}, "'nodes'"),
    ],
    ids=["mode", "interval", "hierarchical", "axis"],
)
def test_decentralized_validates_at_build_time(kwargs, match):
    with pytest.raises(ValueError, match=match):
        decentralized_step(_loss, optax.sgd(LR), jax_bytegrad.make_mesh(2, 4), **kwargs)


def test_decentralized_rejects_bad_batch():
    train = decentralized_step(_loss, optax.sgd(LR), jax_bytegrad.make_mesh(2, 4))
    with pytest.raises(ValueError, match="multiple of the 8 devices"):
        train.step(train.init(jnp.zeros(DIM)), _data(1, rows=3))


# Low-precision decentralized SGD --------------------------------------------------------


def _q(z, block_size):
    return np.asarray(
        jax_bytegrad.dequantize(jax_bytegrad.quantize(jnp.asarray(z), block_size=block_size))
    )


def _reference_low_precision(w0, x, y, *, nodes, local, hierarchical, interval, steps, block):
    devices = nodes * local
    peers, parts = (nodes, local) if hierarchical else (devices, 1)
    shard = -(-DIM // parts)
    params = np.tile(w0, (devices, 1)).astype(np.float32)
    padded = np.pad(w0, (0, shard * parts - DIM)).reshape(parts, shard)
    w = np.tile(padded, (peers, 1, 1))  # (peers, parts, shard)
    left, right = w.copy(), w.copy()
    third = np.float32(1.0 / 3.0)
    for t in range(steps):
        half = params - LR * _grads(params, x, y, devices)
        half = np.pad(half, ((0, 0), (0, shard * parts - DIM)))
        own = half.reshape(peers, -1, parts, shard).mean(1)  # node average, per part
        if t % interval == 0:
            z = (w + left + right) * third - w + (own - w)
            q = np.stack([[_q(z[i, j], block) for j in range(parts)] for i in range(peers)])
            left = left + np.roll(q, 1, axis=0)  # from the left neighbour, i - 1
            right = right + np.roll(q, -1, axis=0)
            own = w + q
            w = own
        full = own.reshape(peers, parts * shard)[:, :DIM]
        params = np.repeat(full, devices // peers, axis=0)
    return params, w, left, right


LP_CASES = [(2, 4, True, 1), (4, 2, True, 2), (2, 4, False, 1)]


@pytest.mark.parametrize(
    "nodes,local,hierarchical,interval",
    LP_CASES,
    ids=[f"{n}x{loc}-{'hier' if h else 'flat'}-k{k}" for n, loc, h, k in LP_CASES],
)
def test_low_precision_matches_numpy_reference(nodes, local, hierarchical, interval):
    mesh = jax_bytegrad.make_mesh(nodes, local)
    devices = nodes * local
    x, y = _data(devices, seed=1)
    w0 = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
    train = low_precision_decentralized_step(
        _loss, optax.sgd(LR), mesh, hierarchical=hierarchical,
        communication_interval=interval, block_size=128, donate=False,
    )  # fmt: skip
    state = train.init(jnp.asarray(w0))
    steps = 6
    for _ in range(steps):
        state, _ = train.step(state, (x, y))
    params, w, left, right = _reference_low_precision(
        w0, x, y, nodes=nodes, local=local, hierarchical=hierarchical, interval=interval,
        steps=steps, block=128,
    )  # fmt: skip
    assert_trees_all_close(np.asarray(state.params), params, rtol=1e-5, atol=1e-5)
    # Device (k, j) holds part j of peer k's ring state.
    assert_trees_all_close(
        np.asarray(state.extra["weight"]).reshape(w.shape), w, rtol=1e-5, atol=1e-5
    )
    assert_trees_all_close(
        np.asarray(state.extra["left_peer_weight"]).reshape(w.shape), left, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("hierarchical", [True, False], ids=["hier", "flat"])
def test_low_precision_ring_replicas_stay_bit_identical(hierarchical):
    """Each peer's left replica equals its left neighbour's weight exactly (and right too)."""
    nodes, local = 4, 2
    mesh = jax_bytegrad.make_mesh(nodes, local)
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.standard_normal((40, 7)), jnp.float32), "b": jnp.zeros(7)}

    def loss(p, batch):
        return jnp.mean(jnp.tanh(batch @ p["w"] + p["b"][None]) ** 2)

    train = low_precision_decentralized_step(
        loss, optax.sgd(0.5), mesh, hierarchical=hierarchical, block_size=128
    )
    state = train.init(params)
    for _ in range(5):
        batch = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
        state, _ = train.step(state, batch)
    w = np.asarray(state.extra["weight"])
    left, right = (
        np.asarray(state.extra["left_peer_weight"]),
        np.asarray(state.extra["right_peer_weight"]),
    )
    if hierarchical:  # peers are nodes; device (k, j) holds part j of node k
        w, left, right = (a.reshape(nodes, local, -1) for a in (w, left, right))
    assert not np.array_equal(w[0], w[1]), "the peers should have drifted apart"
    assert_trees_all_equal(left, np.roll(w, 1, axis=0))
    assert_trees_all_equal(right, np.roll(w, -1, axis=0))


def test_low_precision_validates_at_build_time():
    mesh = jax_bytegrad.make_mesh(2, 4)
    with pytest.raises(ValueError, match="block_size"):
        low_precision_decentralized_step(_loss, optax.sgd(LR), mesh, block_size=100)
    with pytest.raises(ValueError, match="communication_interval"):
        low_precision_decentralized_step(_loss, optax.sgd(LR), mesh, communication_interval=-1)


# Convergence on real data -----------------------------------------------------------------


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
    return (x[:1440], y[:1440]), (x[1440:], y[1440:])


def _mlp_init(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.standard_normal((64, 64)) / 8.0, jnp.float32),
        "b1": jnp.zeros(64, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((64, 10)) / 8.0, jnp.float32),
        "b2": jnp.zeros(10, jnp.float32),
    }


def _logits(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"][None])
    return h @ p["w2"] + p["b2"][None]


def _xent(p, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(_logits(p, x), y).mean()


def _accuracy(p, x, y):
    return float(np.mean(np.asarray(jnp.argmax(_logits(p, jnp.asarray(x)), -1)) == y))


def _batches(x, y, steps, size=128, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(y), size, replace=False)
        yield x[idx], y[idx]


STEPS = 250


@pytest.mark.slow
def test_convergence_on_digits_within_two_points_of_allreduce():
    (xtr, ytr), (xte, yte) = _digits()
    mesh = jax_bytegrad.make_mesh(2, 4)
    opt = optax.sgd(0.2, momentum=0.9)

    tx = optax.chain(jax_bytegrad.gradient_allreduce(), opt)
    step = jax_bytegrad.data_parallel_step(_xent, tx, mesh)
    state = step.init(_mlp_init())
    for batch in _batches(xtr, ytr, STEPS):
        state, _ = step(state, batch)
    baseline = _accuracy(state.params, xte, yte)
    assert baseline > 0.9, baseline

    builders = {
        "decentralized-all": lambda: decentralized_step(_xent, opt, mesh),
        "decentralized-shift_one": lambda: decentralized_step(
            _xent, opt, mesh, peer_selection_mode="shift_one", hierarchical=False
        ),
        "low_precision": lambda: low_precision_decentralized_step(_xent, opt, mesh, block_size=128),
    }
    results = {}
    for name, build in builders.items():
        train = build()
        state = train.init(_mlp_init())
        for batch in _batches(xtr, ytr, STEPS):
            state, _ = train.step(state, batch)
        results[name] = _accuracy(consensus_params(state.params), xte, yte)
    print(
        f"\ngradient_allreduce={baseline:.4f} "
        + " ".join(f"{k}={v:.4f}" for k, v in results.items())
    )
    for name, acc in results.items():
        assert acc >= baseline - 0.02, (name, acc, baseline)
