"""The cached dataset on the embedded SQLite store: round trip, keys, eviction, bad entries,
several processes on one file, and grain's loader with worker processes."""

import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import load_script

from jax_bytegrad.data import CachedDataset, SqliteStore, _codec, fingerprint

REPO = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "_mp_scripts" / "cache_worker.py"


worker = load_script(WORKER)


def assert_same(actual, expected):
    """Exact equality, with types, dtypes and shapes."""
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            assert_same(actual[k], expected[k])
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    elif isinstance(expected, np.ndarray | np.generic):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        np.testing.assert_array_equal(actual, expected)
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes()
    elif isinstance(expected, float) and np.isnan(expected):
        assert np.isnan(actual)
    else:
        assert actual == expected


VALUES = [
    {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "y": np.int64(3)},
    {"nested": {"a": [np.zeros((0, 5), np.uint8), (1, 2.5, "t")]}, "b": b"\x00\xff"},
    np.array([np.nan, -0.0, np.inf], dtype=np.float64),
    np.arange(24, dtype=">i4").reshape(2, 3, 4)[:, ::2].T,  # non-contiguous, big-endian
    np.array(["ab", "c"]),
    np.float32(np.nan),
    np.bool_(True),
    np.array(7, dtype=np.float16),
    [None, True, False, 2**100, -1, float("nan"), "\u00e9"],
    np.zeros((2, 2), dtype=np.complex64) + 1j,
]


@pytest.mark.parametrize("value", VALUES, ids=[f"v{i}" for i in range(len(VALUES))])
def test_codec_round_trips_exactly(value):
    assert_same(_codec.decode(b"k", _codec.encode(b"k", value)), value)


@pytest.mark.parametrize(
    "value, match",
    [
        (np.array([object()]), "dtype object"),
        ({1: np.zeros(2)}, "dict keys must be str, got int 1"),
        ({1, 2}, "cannot encode a set"),
    ],
    ids=["object-array", "int-key", "set"],
)
def test_codec_rejects_what_it_cannot_round_trip(value, match):
    with pytest.raises(ValueError, match=match):
        _codec.encode(b"k", value)


def _corruptions(data: bytes):
    flipped = bytearray(data)
    flipped[-3] ^= 0x10
    return {
        "flipped-bit": bytes(flipped),
        "truncated": data[:-5],
        "header-only": data[:20],
        "empty": b"",
        "garbage": os.urandom(64),
        "pickle": b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01.",
        "other-key": _codec.encode(b"other", VALUES[0]),
    }


@pytest.mark.parametrize("kind", list(_corruptions(b"x" * 40)))
def test_codec_detects_bad_entries(kind):
    data = _corruptions(_codec.encode(b"k", VALUES[0]))[kind]
    with pytest.raises(_codec.DecodeError):
        _codec.decode(b"k", data)


def _counting(fn):
    calls = []

    def wrapped(x):
        calls.append(x)
        return fn(x)

    wrapped.calls = calls
    return wrapped


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "cache.sqlite")


def test_first_epoch_misses_then_hits_with_exact_values(db):
    pre = worker.preprocess
    ds = CachedDataset(range(50), pre, store=SqliteStore(db, "16mb"), dataset_name="d")
    first = [ds[i] for i in range(50)]
    assert (ds.misses, ds.hits) == (50, 0)
    ds.flush()
    # A fresh dataset on the same file (another epoch, another process) reads them back.
    again = CachedDataset(range(50), pre, store=SqliteStore(db, "16mb"), dataset_name="d")
    second = [again[i] for i in reversed(range(50))][::-1]
    assert (again.misses, again.hits) == (0, 50)
    for a, e in zip(second, first, strict=True):
        assert_same(a, e)
    for i in range(50):
        assert_same(second[i], pre(i))


def test_writes_are_batched_by_writer_buffer_size(db):
    store = SqliteStore(db, "16mb")
    ds = CachedDataset(range(30), worker.preprocess, store=store, dataset_name="d",
                       writer_buffer_size=10)  # fmt: skip
    for i in range(9):
        ds[i]
    assert len(store) == 0  # still buffered
    assert_same(ds[3], worker.preprocess(3))  # served from the buffer, no recompute
    assert ds.misses == 9
    ds[9]
    assert len(store) == 10
    ds[10]
    ds.flush()
    assert len(store) == 11


def test_keys_carry_name_and_fingerprint_so_changed_preprocessing_misses(db):
    store = SqliteStore(db, "16mb")
    double = lambda i: np.full(3, 2 * i)
    ds = CachedDataset(range(10), double, store=store, dataset_name="d", writer_buffer_size=1)
    [ds[i] for i in range(10)]
    # The same code elsewhere (another line, another process) has the same keys.
    same_code = lambda i: np.full(3, 2 * i)
    same_code = CachedDataset(range(10), same_code, store=store, dataset_name="d")
    assert_same(same_code[4], np.full(3, 8))
    assert same_code.hits == 1
    triple = CachedDataset(range(10), lambda i: np.full(3, 3 * i), store=store, dataset_name="d")
    assert_same(triple[4], np.full(3, 12))
    assert (triple.hits, triple.misses) == (0, 1)
    other_name = CachedDataset(range(10), double, store=store, dataset_name="e")
    other_name[4]
    assert other_name.misses == 1
    scale = lambda i, k: np.full(3, k * i)
    assert fingerprint(functools.partial(scale, k=2)) != fingerprint(functools.partial(scale, k=3))
    k = 2
    closure_a = lambda i: k * i
    fp_a = fingerprint(closure_a)
    k = 3
    assert fingerprint(closure_a) != fp_a  # a closed-over value is part of it
    assert ds.key(4) == f"d/{fingerprint(double)}/4".encode()


def test_explicit_fingerprint_is_required_without_preprocess(db):
    with pytest.raises(ValueError, match="pass fingerprint="):
        CachedDataset(range(3), store=SqliteStore(db), dataset_name="d")
    with pytest.raises(ValueError, match="writer_buffer_size must be an int >= 1, got 0"):
        CachedDataset(range(3), abs, store=SqliteStore(db), dataset_name="d", writer_buffer_size=0)
    with pytest.raises(ValueError, match="dataset_name must be a non-empty str"):
        CachedDataset(range(3), abs, store=SqliteStore(db), dataset_name="")
    with pytest.raises(ValueError, match="capacity_bytes must be an int of bytes"):
        SqliteStore(db, "lots")
    ds = CachedDataset([np.ones(2)] * 3, store=SqliteStore(db), dataset_name="d", fingerprint="v1")
    assert_same(ds[1], np.ones(2))
    assert ds.key(1) == b"d/v1/1"


@pytest.mark.parametrize("kind", list(_corruptions(b"x" * 40)))
def test_a_corrupt_entry_is_a_miss_recomputed_and_overwritten(db, kind):
    store = SqliteStore(db, "16mb")
    pre = _counting(worker.preprocess)
    ds = CachedDataset(range(5), pre, store=store, dataset_name="d", writer_buffer_size=1)
    key = ds.key(2)
    good = _codec.encode(key, worker.preprocess(2))
    store.put_many([(key, _corruptions(good)[kind])])
    assert_same(ds[2], worker.preprocess(2))
    assert (ds.bad_entries, ds.misses, pre.calls) == (1, 1, [2])
    assert store.get(key) == good  # rewritten
    assert_same(ds[2], worker.preprocess(2))
    assert ds.hits == 1


def test_an_unreadable_database_is_a_miss_not_a_crash(db):
    store = SqliteStore(db, "16mb")
    ds = CachedDataset(range(5), worker.preprocess, store=store, dataset_name="d",
                       writer_buffer_size=1)  # fmt: skip
    ds[0]
    store.close()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.remove(db + suffix)
    with open(db, "wb") as f:
        f.write(os.urandom(8192))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = [ds[i] for i in range(5)]
    assert any("treated as a miss" in str(w.message) for w in caught)
    for i, v in enumerate(values):
        assert_same(v, worker.preprocess(i))
    assert ds.misses == 6


def test_eviction_keeps_the_store_under_capacity_oldest_first(db):
    store = SqliteStore(db, 100_000)
    value = np.zeros(2_000, np.float32)  # ~8 KB encoded
    ds = CachedDataset(range(100), lambda i: value + i, store=store, dataset_name="d",
                       writer_buffer_size=4)  # fmt: skip
    for i in range(100):
        ds[i]
        assert store.stored_bytes() <= 100_000
    ds.flush()
    kept = [i for i in range(100) if store.get(ds.key(i)) is not None]
    assert 9 <= len(kept) <= 12
    assert kept == list(range(100 - len(kept), 100))  # first in, first out
    ds2 = CachedDataset(range(100), lambda i: value + i, store=store, dataset_name="d")
    assert_same(ds2[0], value + 0)  # evicted: recomputed
    assert ds2.misses == 1
    assert_same(ds2[99], value + 99)
    assert ds2.hits == 1


def _run_worker(db, start, stop):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, str(WORKER), db, str(start), str(stop)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip


@pytest.mark.slow
def test_two_processes_share_the_embedded_cache(db):
    # Two processes at once, with overlapping ranges, write the same file.
    procs = [_run_worker(db, 0, 80), _run_worker(db, 40, 120)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for out, (start, stop) in zip(outs, [(0, 80), (40, 120)], strict=True):
        assert out["misses"] + out["hits"] == stop - start
        assert out["digest"] == worker.digest([worker.preprocess(i) for i in range(start, stop)])
    # A third process finds every sample cached, with the exact values.
    p = _run_worker(db, 0, 120)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert (result["misses"], result["hits"]) == (0, 120)
    assert result["digest"] == worker.digest([worker.preprocess(i) for i in range(120)])


@pytest.mark.slow
def test_grain_loader_with_worker_processes_reads_and_fills_the_cache(db):
    grain = pytest.importorskip("grain", reason="grain is not installed (pip install grain)")
    from absl import flags

    # grain reads its absl flags when it starts workers; outside absl.app nothing parsed them.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    ds = CachedDataset(range(40), worker.preprocess, store=SqliteStore(db, "16mb"),
                       dataset_name="g", writer_buffer_size=1)  # fmt: skip
    loader = grain.DataLoader(
        data_source=ds,
        sampler=grain.samplers.IndexSampler(40, shuffle=False, num_epochs=1),
        worker_count=2,
        shard_options=grain.sharding.NoSharding(),
    )
    got = list(loader)
    assert len(got) == 40
    for i, v in enumerate(got):
        # grain hands arrays back in its shared-memory subclass of ndarray.
        expected = worker.preprocess(i)
        assert_same(np.asarray(v["tokens"]).view(np.ndarray), expected["tokens"])
        assert_same(np.asarray(v["image"]).view(np.ndarray), expected["image"])
        assert v["meta"] == expected["meta"]
    assert ds.misses == 0  # the work happened in the worker processes...
    assert len(SqliteStore(db)) == 40  # ...which wrote the shared file
    mapped = grain.MapDataset.source(ds)
    assert_same(mapped[7], worker.preprocess(7))
    assert ds.hits == 1
