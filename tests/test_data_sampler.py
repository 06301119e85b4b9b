"""Load-balanced samplers: coverage, determinism, balance, validation, grain and the mesh."""

import numpy as np
import pytest

import jax_bytegrad
from jax_bytegrad.data import (
    LoadBalancingBatchSampler,
    LoadBalancingSampler,
    replica_ranks,
    token_budget_batches,
)
from jax_bytegrad.sharding import shard_batch


def _lengths(n=203, seed=0):
    # Heavy-tailed, like sequence lengths; 203 is not a multiple of 8.
    return np.random.default_rng(seed).lognormal(4.0, 1.0, size=n).astype(np.int64) + 1


def _sampler(lengths, replicas=8, **kwargs):
    return LoadBalancingSampler(lengths, lambda x: x, num_replicas=replicas, **kwargs)


@pytest.mark.parametrize("n", [203, 200, 5], ids=["uneven", "even", "fewer-than-replicas"])
@pytest.mark.parametrize("random_level", [0.0, 0.5], ids=["rl0", "rl0.5"])
def test_every_index_once_padding_by_repetition(n, random_level):
    lengths = _lengths(n)
    s = _sampler(lengths, random_level=random_level, seed=3)
    for epoch in range(3):
        s.set_epoch(epoch)
        order = s.order()
        assert order.shape == (-(-n // 8), 8) == (len(s), s.num_replicas)
        flat = np.concatenate([s.indices(r) for r in range(8)])
        assert set(flat.tolist()) == set(range(n))
        assert len(flat) - len(set(flat.tolist())) == (-n) % 8  # repeats only as padding


def test_drop_last_each_index_at_most_once():
    s = _sampler(_lengths(203), drop_last=True, seed=1)
    flat = s.order().reshape(-1)
    assert len(s) == 203 // 8 and len(flat) == 200 == len(set(flat.tolist()))
    s.set_epoch(1)
    assert set(s.order().reshape(-1).tolist()) != set(flat.tolist())  # other samples dropped


def test_order_is_deterministic_and_the_same_for_every_rank():
    lengths = _lengths()
    samplers = [_sampler(lengths, rank=r, seed=7, random_level=0.3) for r in range(8)]
    for s in samplers:
        s.set_epoch(2)
    for r, s in enumerate(samplers):
        np.testing.assert_array_equal(s.order(), samplers[0].order())
        assert list(s) == samplers[0].order()[:, r].tolist()
    other_epoch = _sampler(lengths, seed=7, random_level=0.3)
    other_epoch.set_epoch(3)
    assert not np.array_equal(other_epoch.order(), samplers[0].order())
    other_seed = _sampler(lengths, seed=8, random_level=0.3)
    other_seed.set_epoch(2)
    assert not np.array_equal(other_seed.order(), samplers[0].order())


def test_groups_are_balanced_and_their_order_shuffled():
    lengths = _lengths()
    s = _sampler(lengths, seed=0)
    costs = lengths[s.order()]
    # random_level=0: each step's group is a run of the sorted lengths.
    ranked = np.sort(lengths)
    spread = costs.max(axis=1) - costs.min(axis=1)
    runs = np.array([ranked[i * 8 + 7] - ranked[i * 8] for i in range(203 // 8)])
    assert spread.sum() <= runs.sum() + (ranked[-1] - ranked[-8])
    random = lengths[np.random.default_rng(0).permutation(np.resize(np.arange(203), 208))]
    random = random.reshape(-1, 8)
    assert (costs.max(axis=1) - costs.min(axis=1)).mean() < 0.2 * (
        random.max(axis=1) - random.min(axis=1)
    ).mean()
    group_min = costs.min(axis=1)
    assert not np.all(np.diff(group_min) >= 0)  # not in sorted order: shuffled
    unshuffled = _sampler(lengths, shuffle=False)
    assert np.all(np.diff(lengths[unshuffled.order()].min(axis=1)) >= 0)


def test_random_level_one_balances_worse_than_zero():
    lengths = _lengths(2000)

    def mean_spread(level):
        costs = lengths[_sampler(lengths, random_level=level, seed=0).order()]
        return (costs.max(axis=1) - costs.min(axis=1)).mean()

    assert mean_spread(0.0) < mean_spread(0.1) < mean_spread(1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(random_level=1.5), "random_level must be a number in \\[0, 1\\], got 1.5"),
        (dict(random_level=-0.1), "random_level"),
        (dict(random_level=float("nan")), "random_level"),
        (dict(rank=8), "rank must be an int in \\[0, 8\\), got 8"),
        (dict(rank=-1), "rank"),
        (dict(replicas=0), "num_replicas must be an int >= 1, got 0"),
        (dict(seed=-1), "seed"),
    ],
    ids=["rl-high", "rl-low", "rl-nan", "rank-high", "rank-neg", "replicas", "seed"],
)
def test_bad_arguments_raise(kwargs, match):
    replicas = kwargs.pop("replicas", 8)
    with pytest.raises(ValueError, match=match):
        _sampler(_lengths(20), replicas=replicas, **kwargs)


def test_bad_complexities_and_sizes_raise():
    with pytest.raises(ValueError, match="gave nan for sample 1"):
        _sampler(np.array([1.0, np.nan, 2.0]))
    with pytest.raises(ValueError, match="empty"):
        _sampler([])
    with pytest.raises(ValueError, match="drop_last with 3 samples and 8 replicas"):
        _sampler([1, 2, 3], drop_last=True)
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        _sampler([1, 2, 3]).set_epoch(-1)


def test_local_batches_match_the_mesh_slices():
    """Rows a process passes to shard_batch land on the device whose replica they are."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    replicas = replica_ranks(mesh)
    assert replicas == range(8)
    lengths = _lengths()
    s = _sampler(lengths, seed=5)
    data = np.arange(len(lengths)) * 10
    order = s.order()
    steps = list(s.local_batches(3, replicas))
    assert len(steps) == -(-len(s) // 3)
    for step, idx in enumerate(steps[:3]):
        batch = shard_batch(data[idx], mesh)
        flat_devices = list(mesh.devices.reshape(-1))
        for shard in batch.addressable_shards:
            replica = flat_devices.index(shard.device)
            rows = np.arange(step * 3, step * 3 + 3)
            np.testing.assert_array_equal(np.asarray(shard.data), data[order[rows, replica]])
    # The last step is completed from each replica's first samples.
    last = steps[-1].reshape(8, 3)
    rows = np.arange((len(steps) - 1) * 3, len(steps) * 3) % len(s)
    np.testing.assert_array_equal(last, order[rows].T)
    assert len(list(s.local_batches(3, replicas, drop_remainder=True))) == len(s) // 3


def test_grain_loader_gives_the_same_batches_as_the_plain_loop():
    grain = pytest.importorskip("grain", reason="grain is not installed (pip install grain)")
    lengths = _lengths()
    s = _sampler(lengths, seed=2, random_level=0.2)
    replicas = [4, 5, 6, 7]
    expected = [idx for epoch in (0, 1) for idx in _epoch_batches(s, epoch, replicas)]
    s.set_epoch(0)
    loader = grain.DataLoader(
        data_source=np.arange(len(lengths)),
        sampler=s.grain_sampler(2, replicas, num_epochs=2),
        operations=[grain.transforms.Batch(batch_size=8)],
        worker_count=0,
        shard_options=grain.sharding.NoSharding(),
    )
    got = [np.asarray(b) for b in loader]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)


def _epoch_batches(sampler, epoch, replicas):
    sampler.set_epoch(epoch)
    return list(sampler.local_batches(2, replicas))


def test_batch_sampler_pads_counts_groups_lengths_and_keeps_coverage():
    lengths = _lengths(400)
    s = _sampler(lengths, replicas=4, seed=0)
    bs = LoadBalancingBatchSampler(s, token_budget_batches(s.complexities, 600))
    batches = bs.all_batches()
    counts = [len(b) for b in batches]
    assert len(set(counts)) == 1 and len(bs) == counts[0]
    raw = [token_budget_batches(s.complexities, 600)(s.indices(r).tolist()) for r in range(4)]
    assert counts[0] == max(len(b) for b in raw)
    for r in range(4):
        seen = {i for b in batches[r] for i in b}
        assert seen == set(s.indices(r).tolist())  # padding repeats, never drops
        for b in batches[r]:
            assert len(b) == 1 or len(b) * lengths[b].max() <= 600
    # Similar lengths per step across replicas, and variable batch sizes.
    longest = np.array([[lengths[b].max() for b in batches[r]] for r in range(4)])
    sizes = {len(b) for r in range(4) for b in batches[r]}
    assert len(sizes) > 3
    assert np.median(longest.max(axis=0) / longest.min(axis=0)) < 1.5
    assert list(bs) == batches[0]
    steps = list(bs.local_batches([2, 3]))
    assert steps[0] == [batches[2][0], batches[3][0]]


def test_batch_sampler_drop_last_truncates_to_the_fewest():
    lengths = _lengths(400)
    s = _sampler(lengths, replicas=4, seed=0)
    fn = token_budget_batches(s.complexities, 600)
    fewest = min(len(fn(s.indices(r).tolist())) for r in range(4))
    bs = LoadBalancingBatchSampler(s, fn, drop_last=True)
    assert [len(b) for b in bs.all_batches()] == [fewest] * 4


def test_batch_sampler_validation():
    s = _sampler(_lengths(20), drop_last=True)
    with pytest.raises(ValueError, match="drop_last=False"):
        LoadBalancingBatchSampler(s, lambda idx: [idx])
    with pytest.raises(ValueError, match="must be a LoadBalancingSampler"):
        LoadBalancingBatchSampler(object(), lambda idx: [idx])
    bs = LoadBalancingBatchSampler(_sampler(_lengths(20)), lambda idx: [idx, []])
    with pytest.raises(ValueError, match="non-empty batches"):
        bs.all_batches()


def test_one_replica_per_row_balances_every_row_of_a_step_on_its_device():
    mesh = jax_bytegrad.make_mesh(2, 4)
    rows = replica_ranks(mesh, per_device=3)
    assert rows == range(24)
    lengths = _lengths(500)
    s = _sampler(lengths, replicas=24, seed=1)
    step = next(s.local_batches(1, rows))
    np.testing.assert_array_equal(step, s.order()[0])
    batch = shard_batch(lengths[step], mesh)
    flat_devices = list(mesh.devices.reshape(-1))
    for shard in batch.addressable_shards:
        d = flat_devices.index(shard.device)
        np.testing.assert_array_equal(
            np.asarray(shard.data), lengths[s.order()[0, 3 * d : 3 * d + 3]]
        )
    costs = lengths[s.order()]
    ranked = np.sort(lengths)
    # Each step's 24 rows are 24 consecutive sorted lengths (apart from the padded last group).
    assert (costs.max(axis=1) - costs.min(axis=1)).sum() <= ranked[-1] - ranked[0] + ranked[-1]
    with pytest.raises(ValueError, match="per_device must be an int >= 1, got 0"):
        replica_ranks(mesh, per_device=0)
