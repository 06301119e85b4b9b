"""Key-value stores behind the cached dataset: an embedded SQLite file and Redis servers.

Follows the cache of Bagua's ``CachedDataset`` (Gan et al., VLDB 2022), whose ``RedisStore``
starts its own ``redis-server`` with ``maxmemory`` and ``allkeys-random`` eviction and no
persistence, and shards keys over several servers.

A store maps bytes keys to bytes values. It has ``get(key) -> bytes | None``,
``put_many(items)`` (one batched write), ``close()``, and survives being pickled into a
grain worker process (it reopens its connections in the new process). Reads that fail are
misses; writes that fail are dropped with a warning: a cache may forget, it may not crash
the input pipeline.

The embedded default is SQLite, through the standard library's ``sqlite3``:
- it needs no server and no extra package;
- several processes of one host can share one file safely (write-ahead log, a busy timeout,
  one transaction per batch of writes);
- its size bound and eviction are plain SQL (delete the oldest rows until the file's data
  fits), where LMDB only fails with ``MapFullError`` when its map is full and would leave
  eviction and map resizing to us.
"""

import atexit
import contextlib
import hashlib
import os
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Sequence

from jax_bytegrad._src import checks

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS cache ("
    " id INTEGER PRIMARY KEY AUTOINCREMENT, key BLOB UNIQUE NOT NULL,"
    " value BLOB NOT NULL, size INTEGER NOT NULL)"
)
_EVICT_TO = 0.9  # evict down to this fraction of the capacity, so eviction is not per write


def _parse_size(value, name: str) -> int:
    """Bytes from an int or a string like ``"512mb"`` (Redis's units: kb, mb, gb are 1024^k)."""
    units = {"": 1, "b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        text = value.strip().lower()
        digits = text.rstrip("kmgb")
        if not digits.isdigit() or text[len(digits) :] not in units:
            raise ValueError(
                f"{name} must be an int of bytes or a string like '512mb', got {value!r}"
            )
        number = int(digits) * units[text[len(digits) :]]
    else:
        raise ValueError(f"{name} must be an int of bytes or a string like '512mb', got {value!r}")
    if number <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number


class _ProcessLocal:
    """A store whose connections belong to the process that opened them.

    A pickled copy, as grain sends to a worker process, carries the settings alone and
    opens its own connections on first use.
    """

    _SETTINGS: tuple[str, ...] = ()  # the attributes a pickled copy carries

    def _reset(self) -> None:
        """Drops this process's connections and what came with them."""
        raise NotImplementedError

    def __getstate__(self):
        return {name: getattr(self, name) for name in self._SETTINGS}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()


class SqliteStore(_ProcessLocal):
    """A size-bounded cache in one SQLite file, shared by the processes of one host.

    Eviction: when a batch of writes takes the stored values past ``capacity_bytes``, the
    oldest-written entries are deleted until the values take at most 90% of it (first in,
    first out). The file on disk is a little larger than the values (keys, pages, the
    write-ahead log). Put the file on a local disk: SQLite's locking is not safe on NFS.

    Args:
      path: the database file; created if missing. Every process that opens the same path
        shares the cache.
      capacity_bytes: bound on the stored values, an int or a string like ``"2gb"``.
      timeout_s: how long a writer waits for another process's write to finish.

    Raises:
      ValueError: for a non-positive capacity.

    Examples:
      >>> import tempfile, os
      >>> store = SqliteStore(os.path.join(tempfile.mkdtemp(), "c.sqlite"), "1mb")
      >>> store.put_many([(b"k", b"v")])
      >>> store.get(b"k"), store.get(b"other")
      (b'v', None)
    """

    _SETTINGS = ("path", "capacity_bytes", "timeout_s")

    def __init__(
        self, path: str | os.PathLike, capacity_bytes: int | str = "1gb", *, timeout_s: float = 60.0
    ):
        self.path = os.fspath(path)
        self.capacity_bytes = _parse_size(capacity_bytes, "SqliteStore: capacity_bytes")
        self.timeout_s = float(timeout_s)
        self._reset()
        self._connect()

    def _reset(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[sqlite3.Connection] = []
        self._pid = os.getpid()
        self._warned = False

    def _connect(self) -> sqlite3.Connection:
        # A connection must not cross a fork, nor (sqlite3's rule) a thread: grain reads from
        # a pool of threads. Each thread of each process opens its own.
        if self._pid != os.getpid():
            self._reset()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(
                self.path, timeout=self.timeout_s, isolation_level=None, check_same_thread=False
            )
            self._enable_wal(conn)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(_SCHEMA)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def _enable_wal(self, conn: sqlite3.Connection) -> None:
        # Switching a new file to WAL takes an exclusive lock and, when another process is
        # doing the same, fails with "database is locked" without waiting on the busy
        # timeout: retry until the timeout instead.
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r}, capacity_bytes={self.capacity_bytes})"

    def _warn(self, what: str, error: Exception) -> None:
        if not self._warned:
            warnings.warn(f"{self!r}: {what} failed ({error}); treated as a miss", stacklevel=3)
            self._warned = True

    def get(self, key: bytes) -> bytes | None:
        """The value stored under ``key``, or None (also when the read fails)."""
        try:
            row = (
                self._connect().execute("SELECT value FROM cache WHERE key = ?", (key,)).fetchone()
            )
        except sqlite3.Error as e:
            self._warn("read", e)
            return None
        return None if row is None else bytes(row[0])

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Writes ``(key, value)`` pairs in one transaction, then evicts past the capacity."""
        items = [(k, v, len(v)) for k, v in items if len(v) <= self.capacity_bytes]
        if not items:
            return
        try:
            conn = self._connect()
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Delete then insert, so a rewritten key counts as newly written for FIFO.
                conn.executemany("DELETE FROM cache WHERE key = ?", [(k,) for k, _, _ in items])
                conn.executemany("INSERT INTO cache (key, value, size) VALUES (?, ?, ?)", items)
                self._evict(conn)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            self._warn("write", e)

    def _evict(self, conn: sqlite3.Connection) -> None:
        (total,) = conn.execute("SELECT COALESCE(SUM(size), 0) FROM cache").fetchone()
        if total <= self.capacity_bytes:
            return
        excess = total - int(_EVICT_TO * self.capacity_bytes)
        cutoff = None
        for row_id, size in conn.execute("SELECT id, size FROM cache ORDER BY id"):
            cutoff, excess = row_id, excess - size
            if excess <= 0:
                break
        conn.execute("DELETE FROM cache WHERE id <= ?", (cutoff,))

    def stored_bytes(self) -> int:
        """The total size of the stored values."""
        return self._connect().execute("SELECT COALESCE(SUM(size), 0) FROM cache").fetchone()[0]

    def __len__(self) -> int:
        return self._connect().execute("SELECT COUNT(*) FROM cache").fetchone()[0]

    def close(self) -> None:
        """Closes this process's connections; the file and its entries stay."""
        if self._pid == os.getpid():
            with self._lock:
                for conn in self._conns:
                    conn.close()
        self._reset()


class RedisServer:
    """A local ``redis-server`` process with a memory cap, an eviction policy, no persistence.

    As Bagua starts one per node: ``maxmemory`` bounds the memory, ``allkeys-random`` evicts
    random keys when it is reached, and neither RDB snapshots nor the append-only file are
    written. The server listens on 127.0.0.1 only and is stopped by ``stop()``, at the end
    of a ``with`` block, or when this process exits.

    Args:
      maxmemory: the memory cap, an int of bytes or a string like ``"256mb"``.
      port: the TCP port; by default a free one.
      policy: Redis's ``maxmemory-policy``; ``allkeys-random`` as Bagua, or e.g.
        ``allkeys-lru``.
      executable: the server binary, found on ``PATH`` by default.
      startup_timeout_s: how long to wait for the server to answer.

    Raises:
      FileNotFoundError: if there is no ``redis-server`` binary (Debian: ``apt-get install
        redis-server``).
      RuntimeError: if the server does not come up.
    """

    def __init__(
        self,
        maxmemory: int | str = "256mb",
        *,
        port: int | None = None,
        policy: str = "allkeys-random",
        executable: str | None = None,
        startup_timeout_s: float = 20.0,
    ):
        maxmemory = _parse_size(maxmemory, "RedisServer: maxmemory")
        binary = shutil.which(executable or "redis-server")
        if binary is None:
            raise FileNotFoundError(
                f"RedisServer: no {executable or 'redis-server'} binary on PATH; install it "
                "(Debian: apt-get install redis-server) or pass executable=..."
            )
        self.host = "127.0.0.1"
        self.port = port or checks.free_port()
        self._dir = tempfile.mkdtemp(prefix="jax_bytegrad_redis_")
        args = [
            binary, "--bind", self.host, "--port", str(self.port),
            "--maxmemory", str(maxmemory), "--maxmemory-policy", policy,
            "--save", "", "--appendonly", "no", "--dir", self._dir,
            "--daemonize", "no", "--loglevel", "warning",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        self._wait_ready(startup_timeout_s)
        # A server outliving its process would hold memory and a port: stop it at exit.
        atexit.register(self.stop)

    def _wait_ready(self, timeout_s: float) -> None:
        import redis

        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace")
                self.stop()
                raise RuntimeError(f"RedisServer: redis-server exited at start-up: {err.strip()}")
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"RedisServer: no answer on {self.host}:{self.port} after {timeout_s} s"
                    ) from None
                time.sleep(0.05)

    @property
    def address(self) -> str:
        """``"host:port"``, as ``RedisStore`` takes it."""
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        """Stops the server (its data is gone: nothing was persisted)."""
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _parse_host(host) -> tuple[str, int]:
    if isinstance(host, tuple) and len(host) == 2:
        return str(host[0]), int(host[1])
    if isinstance(host, str) and ":" in host:
        name, port = host.rsplit(":", 1)
        if port.isdigit():
            return name, int(port)
    raise ValueError(f"RedisStore: a host must be 'host:port' or (host, port), got {host!r}")


class RedisStore(_ProcessLocal):
    """A cache sharded over one or more Redis servers, through redis-py.

    Each key goes to server ``blake2b(key) mod len(hosts)``: a hash that is the same in every
    process and every run (Python's ``hash`` of bytes is not). Writes are batched: one
    ``MSET`` per server per ``put_many``. Eviction is the servers' own: start them with
    ``maxmemory`` and an ``allkeys-*`` policy, as ``RedisServer`` does; a server with the
    ``noeviction`` policy refuses writes once full, and those writes are dropped.

    Args:
      hosts: ``"host:port"`` strings or ``(host, port)`` pairs; the order fixes the sharding,
        so every process must list them in the same order.
      socket_timeout_s: per-request timeout; a read that times out is a miss.
      retry_after_s: after a server fails to answer, its keys are misses (and its writes
        dropped) for this long before it is tried again, so a dead server costs one
        timeout, not one per sample.

    Raises:
      ValueError: for no hosts or a malformed one.

    Examples:
      >>> with RedisServer("64mb") as server:  # doctest: +SKIP
      ...     store = RedisStore([server.address])
      ...     store.put_many([(b"k", b"v")])
      ...     store.get(b"k")
      b'v'
    """

    _SETTINGS = ("hosts", "socket_timeout_s", "retry_after_s")

    def __init__(
        self,
        hosts: Sequence[str | tuple[str, int]],
        *,
        socket_timeout_s: float = 5.0,
        retry_after_s: float = 30.0,
    ):
        if isinstance(hosts, str | tuple) or not hosts:
            raise ValueError(
                f"RedisStore: hosts must be a non-empty list of 'host:port', got {hosts!r}"
            )
        self.hosts = [_parse_host(h) for h in hosts]
        self.socket_timeout_s = float(socket_timeout_s)
        self.retry_after_s = float(retry_after_s)
        self._reset()

    def _reset(self) -> None:
        self._down_until = [0.0] * len(self.hosts)
        self._clients = None
        self._pid = None
        self._warned = False
        # Only the store that started servers stops them; a pickled copy owns none.
        self.servers: list[RedisServer] = []

    @classmethod
    def start_local(
        cls,
        num_servers: int = 1,
        maxmemory_per_server: int | str = "256mb",
        *,
        policy: str = "allkeys-random",
    ) -> "RedisStore":
        """Starts ``num_servers`` local servers and returns a store over them.

        ``close()`` stops the servers. Only the process that started them may stop them; a
        pickled copy (in a grain worker) connects to them and leaves them running.
        """
        checks.integer(num_servers, "num_servers", "RedisStore")
        servers = []
        try:
            for _ in range(num_servers):
                servers.append(RedisServer(maxmemory_per_server, policy=policy))
        except BaseException:
            for server in servers:
                server.stop()
            raise
        store = cls([s.address for s in servers])
        store.servers = servers
        return store

    def _connect(self):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if self._clients is None or self._pid != os.getpid():
            self._clients = [
                redis.Redis(
                    host=h,
                    port=p,
                    socket_timeout=self.socket_timeout_s,
                    socket_connect_timeout=self.socket_timeout_s,
                    # One try: a cache read is cheaper to recompute than to retry.
                    retry=Retry(NoBackoff(), 0),
                )
                for h, p in self.hosts
            ]
            self._pid = os.getpid()
        return self._clients

    def __repr__(self) -> str:
        return f"RedisStore({[f'{h}:{p}' for h, p in self.hosts]!r})"

    def shard(self, key: bytes) -> int:
        """The index in ``hosts`` of the server that holds ``key``."""
        digest = hashlib.blake2b(key, digest_size=8).digest()
        return int.from_bytes(digest, "little") % len(self.hosts)

    def _failed(self, shard: int, what: str, error: Exception) -> None:
        import redis

        if isinstance(error, redis.ConnectionError | redis.TimeoutError):
            self._down_until[shard] = time.monotonic() + self.retry_after_s
        if not self._warned:
            warnings.warn(
                f"{self!r}: {what} on {self.hosts[shard]} failed ({error}); treated as a miss",
                stacklevel=3,
            )
            self._warned = True

    def _up(self, shard: int) -> bool:
        return time.monotonic() >= self._down_until[shard]

    def get(self, key: bytes) -> bytes | None:
        """The value stored under ``key``, or None (also when the server cannot answer)."""
        import redis

        shard = self.shard(key)
        if not self._up(shard):
            return None
        try:
            return self._connect()[shard].get(key)
        except redis.RedisError as e:
            self._failed(shard, "read", e)
            return None

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Writes ``(key, value)`` pairs with one ``MSET`` per server."""
        import redis

        by_shard: dict[int, dict[bytes, bytes]] = {}
        for key, value in items:
            by_shard.setdefault(self.shard(key), {})[key] = value
        clients = self._connect()
        for shard, mapping in by_shard.items():
            if not self._up(shard):
                continue
            try:
                clients[shard].mset(mapping)
            except redis.RedisError as e:
                self._failed(shard, "write", e)

    def close(self) -> None:
        """Closes the connections, and stops the servers this store started."""
        if self._clients is not None and self._pid == os.getpid():
            for client in self._clients:
                with contextlib.suppress(Exception):
                    client.close()
        self._clients = None
        for server in self.servers:
            server.stop()
        self.servers = []
