"""Variable-length training data for the examples, with a cache and load-balanced batches.

- ``function_sources``: every function and method of the stdlib modules in
  ``data.STDLIB_MODULES``, as bytes: a real length distribution (10% under 92 bytes, half
  under 374, a tenth over 1000 on Python 3.11).
- ``open_dataset``: those sources tokenized, through ``jax_bytegrad.data.CachedDataset`` on
  the embedded SQLite store or on Redis, or uncached.
- ``step_batches``: per training step, this process's rows of the global batch, padded to a
  width shared by every process (the step's longest sequence, rounded up to a bucket), with
  a loss mask; from a random shard, or from ``LoadBalancingSampler`` with one replica per
  row of the global batch, so each step holds sequences of similar length.
"""

import ast
import importlib
import importlib.util
import inspect
import os
import tempfile
from pathlib import Path

import numpy as np

from jax_bytegrad.data import (
    CachedDataset,
    LoadBalancingSampler,
    RedisStore,
    SqliteStore,
    replica_ranks,
)


def _stdlib_modules() -> tuple[str, ...]:
    # By path: benchmarks/data.py shares the module name of examples/data.py.
    spec = importlib.util.spec_from_file_location(
        "examples_data", Path(__file__).with_name("data.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.STDLIB_MODULES


def function_sources(max_len: int | None = None) -> list[bytes]:
    """The source bytes of every function and method in ``STDLIB_MODULES``, in file order."""
    out = []
    for name in _stdlib_modules():
        with open(inspect.getsourcefile(importlib.import_module(name)), "rb") as f:
            text = f.read()
        lines = text.split(b"\n")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                source = b"\n".join(lines[node.lineno - 1 : node.end_lineno])
                out.append(source if max_len is None else source[:max_len])
    return out


def tokenize(source: bytes) -> dict:
    """Bytes to int32 tokens (the preprocessing the cache keeps)."""
    return {"tokens": np.frombuffer(source, dtype=np.uint8).astype(np.int32)}


def open_dataset(
    cache: str,
    sources: list[bytes],
    *,
    path: str | None = None,
    redis_hosts: list[str] | None = None,
):
    """``tokenize(sources[i])`` behind ``cache``: ``"none"``, ``"embedded"`` or ``"redis"``.

    ``"embedded"`` shares one SQLite file (``path``, by default in the temp directory) among
    the processes of a host. ``"redis"`` uses ``redis_hosts`` (``JAX_BYTEGRAD_REDIS_HOSTS``,
    comma-separated, by default), or starts a local server for this process with a 256 MB
    cap; ``dataset.close()`` stops it.
    """
    if cache == "none":
        return _Tokenized(sources)
    if cache == "embedded":
        store = SqliteStore(
            path or os.path.join(tempfile.gettempdir(), "jax_bytegrad_cache.sqlite")
        )
    elif cache == "redis":
        hosts = redis_hosts or [
            h for h in os.environ.get("JAX_BYTEGRAD_REDIS_HOSTS", "").split(",") if h
        ]
        store = RedisStore(hosts) if hosts else RedisStore.start_local(1, "256mb")
    else:
        raise ValueError(f"cached_data: unknown cache {cache!r}; use none, embedded or redis")
    return CachedDataset(sources, tokenize, store=store, dataset_name="pysource-functions")


class _Tokenized:
    def __init__(self, sources):
        self.sources = sources

    def __len__(self):
        return len(self.sources)

    def __getitem__(self, i):
        return tokenize(self.sources[i])

    def close(self):
        pass


def step_order(
    lengths: np.ndarray, rows: int, *, load_balance: bool, seed: int, epoch: int
) -> np.ndarray:
    """The epoch's samples, shape (steps, rows): row ``k`` is step ``k``'s global batch.

    The same on every process. ``load_balance``: Bagua's sampler with one replica per row,
    so a step's rows have similar lengths; otherwise a random shard (shuffle, pad by
    repetition, deal out).
    """
    if load_balance:
        sampler = LoadBalancingSampler(lengths, lambda x: x, num_replicas=rows, seed=seed)
        sampler.set_epoch(epoch)
        return sampler.order()
    perm = np.random.default_rng(seed + epoch).permutation(len(lengths))
    return np.resize(perm, -(-len(lengths) // rows) * rows).reshape(-1, rows)


def step_batches(
    dataset,
    lengths: np.ndarray,
    mesh,
    *,
    batch_size: int,
    load_balance: bool,
    seed: int = 0,
    epoch: int = 0,
    max_len: int = 512,
    bucket: int = 64,
):
    """Yields ``(inputs, targets, mask)`` per step: this process's rows, for ``shard_batch``.

    ``batch_size`` rows per device. Every process pads to the same width, the step's
    longest sequence rounded up to ``bucket`` (at most ``max_len``), so each width compiles
    once. ``mask`` is 1.0 where ``targets`` is a real next byte.
    """
    devices = mesh.devices.size
    mine = list(replica_ranks(mesh, per_device=batch_size))
    order = step_order(lengths, devices * batch_size, load_balance=load_balance, seed=seed,
                       epoch=epoch)  # fmt: skip
    for step in order:
        longest = int(lengths[step].max())
        width = min(-(-longest // bucket) * bucket, max_len) + 1
        tokens = np.zeros((len(mine), width), np.int32)
        valid = np.zeros((len(mine), width), bool)
        for row, i in enumerate(step[mine]):
            sample = dataset[int(i)]["tokens"][:width]
            tokens[row, : len(sample)] = sample
            valid[row, : len(sample)] = True
        yield tokens[:, :-1], tokens[:, 1:], valid[:, 1:].astype(np.float32)
