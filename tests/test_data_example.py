"""examples/cached_data.py: cached, load-balanced step batches on the stdlib's functions."""

from pathlib import Path

import numpy as np
import pytest
from helpers import load_script

import jax_bytegrad
from jax_bytegrad.sharding import shard_batch

cached_data = load_script(Path(__file__).parent.parent / "examples" / "cached_data.py")


@pytest.mark.parametrize("cache", ["none", "embedded"])
def test_step_batches_cover_the_epoch_with_the_right_rows(cache, tmp_path):
    sources = cached_data.function_sources(256)
    lengths = np.array([len(s) for s in sources])
    dataset = cached_data.open_dataset(cache, sources, path=str(tmp_path / "c.sqlite"))
    mesh = jax_bytegrad.make_mesh(2, 4)
    order = cached_data.step_order(lengths, 16, load_balance=True, seed=0, epoch=0)
    steps = list(cached_data.step_batches(dataset, lengths, mesh, batch_size=2,
                                          load_balance=True, max_len=256))  # fmt: skip
    assert len(steps) == len(order) == -(-len(sources) // 16)
    for (inputs, targets, mask), rows in zip(steps, order, strict=True):
        assert inputs.shape == targets.shape == mask.shape and inputs.shape[0] == 16
        assert inputs.shape[1] % 64 == 0 and inputs.shape[1] >= lengths[rows].max() - 1
        for r, i in enumerate(rows):
            n = lengths[i]
            assert bytes(inputs[r, : n - 1].astype(np.uint8)) == sources[i][:-1]
            assert bytes(targets[r, : n - 1].astype(np.uint8)) == sources[i][1:]
            assert mask[r].sum() == n - 1
        shard_batch((inputs, targets, mask), mesh)
    dataset.close()


def test_load_balance_pads_fewer_tokens_than_a_random_shard():
    lengths = np.array([len(s) for s in cached_data.function_sources(1024)])

    def padded(load_balance):
        order = cached_data.step_order(lengths, 32, load_balance=load_balance, seed=0, epoch=0)
        return sum(32 * (-(-int(lengths[row].max()) // 64) * 64) for row in order)

    assert padded(True) < 0.7 * padded(False)
