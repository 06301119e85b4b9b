"""A random-access data source that caches each preprocessed sample the first time it is read.

Follows Bagua's ``CachedDataset`` (Gan et al., VLDB 2022): when preprocessing or reading a
sample is slow, epochs after the first read it from a key-value store instead. As there,
writes are batched (``writer_buffer_size`` samples per write) and a failed read is a miss.
Unlike there, keys carry a fingerprint of the preprocessing, so changing it never serves
the old samples, and values use a safe encoding with a digest, not pickle (``_codec``).

``CachedDataset`` has ``__len__``, ``__getitem__`` and a stable ``__repr__``: it is a grain
``RandomAccessDataSource`` (``grain.MapDataset.source(cached)``, or ``grain.DataLoader(
data_source=cached, ...)`` with worker processes), and a plain ``Sequence`` for a Python loop.
"""

import hashlib
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

from jax_bytegrad._src import checks
from jax_bytegrad.data import _codec


def _code_text(code) -> str:
    consts = ",".join(
        _code_text(c) if inspect.iscode(c) else repr(c) for c in code.co_consts
    )  # a nested code object's repr holds its address, which differs between processes
    return f"{code.co_code.hex()}|{consts}|{code.co_names}"


def _describe(obj, depth: int = 0) -> str:
    """Text that changes when a preprocessing callable's code or bound arguments change."""
    if depth > 8:
        return "..."
    func = getattr(obj, "func", None)
    if func is not None and hasattr(obj, "args"):  # functools.partial
        args = ",".join(_describe(a, depth + 1) for a in obj.args)
        kwargs = ",".join(f"{k}={_describe(v, depth + 1)}" for k, v in sorted(obj.keywords.items()))
        return f"partial({_describe(func, depth + 1)};{args};{kwargs})"
    if callable(obj) and hasattr(obj, "__qualname__"):
        # Bytecode, not source text: a lambda's source is its whole line, which changes
        # with the code around it.
        code = getattr(obj, "__code__", None)
        source = _code_text(code) if code is not None else ""
        defaults = (getattr(obj, "__defaults__", None), getattr(obj, "__kwdefaults__", None))
        source += _describe(defaults, depth + 1)
        closure = getattr(obj, "__closure__", None) or ()
        cells = ",".join(_describe(c.cell_contents, depth + 1) for c in closure)
        return f"{getattr(obj, '__module__', '')}.{obj.__qualname__}:{source}:[{cells}]"
    if callable(obj):  # an instance with __call__: its class's code and its attributes
        state = ",".join(
            f"{k}={_describe(v, depth + 1)}"
            for k, v in sorted(getattr(obj, "__dict__", {}).items())
        )
        return f"{_describe(type(obj).__call__, depth + 1)}{{{state}}}"
    return repr(obj)


def fingerprint(preprocess: Callable) -> str:
    """A short hash of a preprocessing callable: its bytecode, closure and bound arguments.

    It covers the function's own code and constants, its default arguments, the values it
    closes over and a ``functools.partial``'s arguments (through their ``repr``), and a
    callable object's ``__call__`` and attributes. It is the same in every process and run
    under one Python version (bytecode differs between versions: a new Python recomputes
    once). It does not see into the functions or globals that ``preprocess`` uses: when
    those change, pass an explicit ``fingerprint=`` (a version string) to ``CachedDataset``.

    Examples:
      >>> fingerprint(lambda x: x + 1) == fingerprint(lambda x: x + 2)
      False
    """
    return hashlib.sha256(_describe(preprocess).encode()).hexdigest()[:16]


_fingerprint_of = fingerprint  # the argument of CachedDataset shadows the name


class CachedDataset:
    """``preprocess(source[i])``, computed once and then read from a store.

    Args:
      source: the raw records, anything with ``__len__`` and ``__getitem__`` (a grain data
        source, a list, an array).
      preprocess: the slow, deterministic function of one record; ``None`` when ``source``
        itself does the slow work (then ``fingerprint`` is required).
      store: a ``SqliteStore`` or ``RedisStore`` (or any object with ``get`` and
        ``put_many``).
      dataset_name: names the data in the keys; two datasets in one store need two names.
      fingerprint: identifies the preprocessing in the keys; by default ``fingerprint(
        preprocess)``. Change it whenever the preprocessing changes in a way the default
        cannot see.
      writer_buffer_size: samples computed before they are written in one batch (Bagua's
        default, 20). Pending samples are written by ``flush()`` or ``close()``; samples
        still pending when a process ends are simply not cached.

    Raises:
      ValueError: for an empty ``dataset_name``, a missing fingerprint with no
        ``preprocess``, or ``writer_buffer_size`` below 1.

    Examples:
      >>> import tempfile, os, numpy as np
      >>> from jax_bytegrad.data import CachedDataset, SqliteStore
      >>> store = SqliteStore(os.path.join(tempfile.mkdtemp(), "c.sqlite"), "10mb")
      >>> ds = CachedDataset(range(4), lambda i: {"x": np.full(3, i)}, store=store,
      ...                    dataset_name="toy", writer_buffer_size=2)
      >>> [int(ds[i]["x"][0]) for i in range(4)], ds.misses
      ([0, 1, 2, 3], 4)
      >>> int(ds[3]["x"][0]), ds.hits
      (3, 1)
    """

    def __init__(
        self,
        source: Sequence,
        preprocess: Callable[[Any], Any] | None = None,
        *,
        store,
        dataset_name: str,
        fingerprint: str | None = None,
        writer_buffer_size: int = 20,
    ):
        if not isinstance(dataset_name, str) or not dataset_name:
            raise ValueError(
                f"CachedDataset: dataset_name must be a non-empty str, got {dataset_name!r}"
            )
        if fingerprint is None:
            if preprocess is None:
                raise ValueError(
                    "CachedDataset: with preprocess=None the source does the work, and its "
                    "code cannot be fingerprinted; pass fingerprint='<version of the source>'"
                )
            fingerprint = _fingerprint_of(preprocess)
        checks.integer(writer_buffer_size, "writer_buffer_size", "CachedDataset")
        self.source = source
        self.preprocess = preprocess
        self.store = store
        self.dataset_name = dataset_name
        self.fingerprint = str(fingerprint)
        self.writer_buffer_size = writer_buffer_size
        self._prefix = f"{dataset_name}/{self.fingerprint}/".encode()
        self._pending: dict[bytes, bytes] = {}
        self._lock = threading.Lock()  # grain reads a source from several threads
        self.hits = 0
        self.misses = 0
        self.bad_entries = 0

    def key(self, index: int) -> bytes:
        """The store key of sample ``index``: dataset name, fingerprint, index."""
        return self._prefix + str(int(index)).encode()

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        # Stable across processes: grain uses it to check a restored checkpoint.
        return (
            f"CachedDataset(dataset_name={self.dataset_name!r}, fingerprint={self.fingerprint!r},"
            f" len={len(self)}, store={self.store!r})"
        )

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pending"] = {}  # a worker writes its own samples
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def __getitem__(self, index: int):
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"CachedDataset: index {index} out of range for {len(self)} samples")
        index %= len(self)
        key = self.key(index)
        with self._lock:
            data = self._pending.get(key)
        if data is None:
            data = self.store.get(key)
        if data is not None:
            try:
                value = _codec.decode(key, data)
                with self._lock:
                    self.hits += 1
                return value
            except _codec.DecodeError:
                with self._lock:
                    self.bad_entries += 1  # recomputed below, and overwritten
        record = self.source[index]
        value = record if self.preprocess is None else self.preprocess(record)
        encoded = _codec.encode(key, value)
        with self._lock:
            self.misses += 1
            self._pending[key] = encoded
            full = len(self._pending) >= self.writer_buffer_size
        if full:
            self.flush()
        return value

    def flush(self) -> None:
        """Writes the pending samples to the store in one batch."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if pending:
            self.store.put_many(pending.items())

    def close(self) -> None:
        """Flushes, then closes the store."""
        self.flush()
        self.store.close()
