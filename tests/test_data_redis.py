"""The cached dataset on Redis: real ``redis-server`` processes on free loopback ports."""

import hashlib
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import load_script

from jax_bytegrad.data import CachedDataset, RedisServer, RedisStore, _codec

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")
pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="no redis-server binary on PATH (Debian: apt-get install redis-server; CI installs it)",
)

worker = load_script(Path(__file__).parent / "_mp_scripts" / "cache_worker.py")


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(b[k], np.ndarray | np.generic):
            assert a[k].dtype == b[k].dtype
            np.testing.assert_array_equal(a[k], b[k])
        else:
            assert a[k] == b[k]


@pytest.fixture(scope="module")
def two_servers():
    store = RedisStore.start_local(2, "64mb")
    yield store
    store.close()


@pytest.fixture
def store(two_servers):
    for client in two_servers._connect():
        client.flushall()
    return two_servers


def test_servers_run_with_a_cap_random_eviction_and_no_persistence(two_servers):
    for client in two_servers._connect():
        config = client.config_get("*")
        assert int(config["maxmemory"]) == 64 * 1024**2
        assert config["maxmemory-policy"] == "allkeys-random"
        assert config["save"] == "" and config["appendonly"] == "no"
        assert config["bind"] == "127.0.0.1"


def test_round_trip_and_hits_on_the_second_epoch(store):
    ds = CachedDataset(range(60), worker.preprocess, store=store, dataset_name="r")
    first = [ds[i] for i in range(60)]
    ds.flush()
    assert (ds.misses, ds.hits) == (60, 0)
    second = [ds[i] for i in range(60)]
    assert (ds.misses, ds.hits) == (60, 60)
    for i in range(60):
        _same(second[i], first[i])
        _same(second[i], worker.preprocess(i))
    # A pickled copy (as grain sends to a worker process) reads the same servers.
    copy = pickle.loads(pickle.dumps(store))
    assert copy.servers == []  # a copy never stops the servers
    reader = CachedDataset(range(60), worker.preprocess, store=copy, dataset_name="r")
    _same(reader[5], worker.preprocess(5))
    assert (reader.hits, reader.misses) == (1, 0)


def test_keys_are_sharded_by_a_stable_hash_over_both_servers(store):
    ds = CachedDataset(range(200), worker.preprocess, store=store, dataset_name="r",
                       writer_buffer_size=50)  # fmt: skip
    [ds[i] for i in range(200)]
    clients = store._connect()
    sizes = [c.dbsize() for c in clients]
    assert sum(sizes) == 200 and min(sizes) > 60
    for i in range(200):
        key = ds.key(i)
        expected = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 2
        assert store.shard(key) == expected
        assert clients[expected].exists(key) and not clients[1 - expected].exists(key)


def test_writes_are_batched_into_one_mset_per_server(store):
    ds = CachedDataset(range(30), worker.preprocess, store=store, dataset_name="r",
                       writer_buffer_size=10)  # fmt: skip
    clients = store._connect()
    before = [int(c.info("commandstats").get("cmdstat_mset", {}).get("calls", 0)) for c in clients]
    for i in range(9):
        ds[i]
    assert sum(c.dbsize() for c in clients) == 0
    ds[9]
    after = [int(c.info("commandstats").get("cmdstat_mset", {}).get("calls", 0)) for c in clients]
    assert sum(c.dbsize() for c in clients) == 10
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]


def test_a_corrupt_entry_is_a_miss_recomputed_and_overwritten(store):
    ds = CachedDataset(range(5), worker.preprocess, store=store, dataset_name="r",
                       writer_buffer_size=1)  # fmt: skip
    key = ds.key(3)
    client = store._connect()[store.shard(key)]
    good = _codec.encode(key, worker.preprocess(3))
    for bad in (good[:-1], b"\x80\x04K\x01.", _codec.encode(ds.key(2), worker.preprocess(2))):
        client.set(key, bad)
        _same(ds[3], worker.preprocess(3))
        assert client.get(key) == good
    assert ds.bad_entries == 3 and ds.misses == 3


def test_eviction_bounds_memory_and_evicted_samples_are_recomputed():
    with RedisServer("4mb") as server:
        store = RedisStore([server.address])
        value = np.arange(25_000, dtype=np.float32)  # ~100 KB a sample, 20 MB in all
        ds = CachedDataset(range(200), lambda i: value + i, store=store, dataset_name="big",
                           writer_buffer_size=5)  # fmt: skip
        [ds[i] for i in range(200)]
        ds.flush()
        client = store._connect()[0]
        assert client.info("memory")["used_memory"] <= 4 * 1024**2 + 512 * 1024
        assert 0 < client.dbsize() < 100
        kept = [i for i in range(200) if client.exists(ds.key(i))]
        evicted = sorted(set(range(200)) - set(kept))
        reader = CachedDataset(range(200), lambda i: value + i, store=store, dataset_name="big")
        for i in kept + evicted:
            np.testing.assert_array_equal(reader[i], value + i)
        assert (reader.hits, reader.misses) == (len(kept), len(evicted))
        store.close()


def test_a_dead_server_gives_misses_and_right_values_not_a_crash():
    server = RedisServer("16mb")
    store = RedisStore([server.address], socket_timeout_s=1.0)
    ds = CachedDataset(range(5), worker.preprocess, store=store, dataset_name="r",
                       writer_buffer_size=1)  # fmt: skip
    ds[0]
    server.stop()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            _same(ds[i], worker.preprocess(i))
    assert sum("treated as a miss" in str(w.message) for w in caught) == 1
    assert ds.misses == 6
    assert store._down_until[0] > 0  # skipped after the first failure, not retried per sample


def test_start_local_and_close_stop_the_servers():
    store = RedisStore.start_local(1, "8mb")
    process = store.servers[0].process
    assert process.poll() is None
    store.close()
    assert process.poll() is not None
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=store.hosts[0][1], retry=None).ping()


@pytest.mark.parametrize(
    "hosts, match",
    [([], "non-empty list"), ("127.0.0.1:6379", "non-empty list"), (["localhost"], "host:port")],
    ids=["empty", "string", "no-port"],
)
def test_bad_hosts_raise(hosts, match):
    with pytest.raises(ValueError, match=match):
        RedisStore(hosts)


def test_bad_server_arguments_raise():
    with pytest.raises(ValueError, match="maxmemory must be an int of bytes"):
        RedisServer("a lot")
    with pytest.raises(FileNotFoundError, match="apt-get install redis-server"):
        RedisServer("1mb", executable="/nonexistent/redis-server")


def test_a_started_server_stops_when_its_process_exits():
    import os
    import subprocess
    import sys
    import time

    code = (
        "from jax_bytegrad.data import RedisStore\n"
        "print(RedisStore.start_local(1, '8mb').servers[0].process.pid)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60, check=True)  # fmt: skip
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)  # still there (or a zombie not yet reaped by init)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split()[2] == "Z":
                return
        time.sleep(0.1)
    raise AssertionError(f"redis-server {pid} outlived the process that started it")
