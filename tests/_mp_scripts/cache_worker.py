"""Worker for tests/test_data_cache.py: one process reading a CachedDataset on a shared file.

``python cache_worker.py DB START STOP`` reads samples START..STOP-1 (with a 7-sample write
buffer), flushes, and prints one JSON line: its misses, hits and a digest of the values read.
Several copies run at once on one SQLite file.
"""

import hashlib
import json
import sys

import numpy as np

from jax_bytegrad.data import CachedDataset, SqliteStore

N = 120


def preprocess(index):
    """Deterministic, varied samples: a dict of arrays of several dtypes and shapes."""
    rng = np.random.default_rng(index)
    return {
        "tokens": rng.integers(0, 256, size=1 + index % 37).astype(np.int32),
        "image": rng.standard_normal((4, 3)).astype(np.float32),
        "label": np.int64(index % 10),
        "meta": ("sample", index, [1.5, None]),
    }


def digest(values) -> str:
    h = hashlib.sha256()
    for v in values:
        h.update(v["tokens"].tobytes() + v["image"].tobytes() + v["label"].tobytes())
        h.update(repr(v["meta"]).encode())
    return h.hexdigest()


def main(db: str, start: int, stop: int) -> None:
    ds = CachedDataset(
        range(N), preprocess, store=SqliteStore(db, "64mb"), dataset_name="worker",
        writer_buffer_size=7,
    )  # fmt: skip
    values = [ds[i] for i in range(start, stop)]
    ds.close()
    print(json.dumps({"misses": ds.misses, "hits": ds.hits, "digest": digest(values)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
