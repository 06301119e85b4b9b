"""Datasets for the examples: real data that ships with an installed package, no download.

- ``digits``: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), with a fixed
  80/20 train/test split.
- ``pysource``: bytes of a fixed list of Python standard-library modules, for character-level
  language modelling; the last 10% of the text is held out. The text is that of the Python
  running the example, so figures vary a little between Python versions.
"""

import dataclasses
import importlib
import inspect

import numpy as np

# Fixed, so every process and every run reads the same text. About 0.6 MB on Python 3.11.
STDLIB_MODULES = (
    "argparse",
    "dataclasses",
    "difflib",
    "functools",
    "heapq",
    "inspect",
    "string",
    "textwrap",
)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Train and test arrays of one task.

    Attributes:
      name: ``"digits"`` or ``"pysource"``.
      train_inputs: digits: float32 images (n, 8, 8, 1) in [0, 1]; pysource: the uint8 text.
      train_targets: digits: int32 labels (n,); pysource: None (targets are the next byte).
      test_inputs: as ``train_inputs``, held out.
      test_targets: as ``train_targets``, held out.
      num_classes: 10 digits, or 256 byte values.
    """

    name: str
    train_inputs: np.ndarray
    train_targets: np.ndarray | None
    test_inputs: np.ndarray
    test_targets: np.ndarray | None
    num_classes: int


def load_digits(seed: int = 0) -> Dataset:
    """scikit-learn's digits, split 80/20 by a seeded permutation (1437 train, 360 test)."""
    from sklearn.datasets import load_digits as sk_load_digits

    digits = sk_load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = len(labels) // 5
    test, train = order[:n_test], order[n_test:]
    return Dataset("digits", images[train], labels[train], images[test], labels[test], 10)


def load_pysource() -> Dataset:
    """The source bytes of ``STDLIB_MODULES``, concatenated; the last 10% is the test text."""
    parts = []
    for name in STDLIB_MODULES:
        path = inspect.getsourcefile(importlib.import_module(name))
        with open(path, "rb") as f:
            parts.append(f.read())
    text = np.frombuffer(b"\n".join(parts), dtype=np.uint8)
    split = int(0.9 * len(text))
    return Dataset("pysource", text[:split], None, text[split:], None, 256)


def train_batch(data: Dataset, rng: np.random.Generator, batch_size: int, seq_len: int):
    """Draws one global training batch ``(inputs, targets)`` with ``rng``.

    Every process draws the same global batch from the same seed and keeps its own rows.
    """
    if data.train_targets is not None:
        idx = rng.integers(0, len(data.train_targets), size=batch_size)
        return data.train_inputs[idx], data.train_targets[idx]
    starts = rng.integers(0, len(data.train_inputs) - seq_len - 1, size=batch_size)
    window = starts[:, None] + np.arange(seq_len + 1)[None, :]
    tokens = data.train_inputs[window].astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def test_set(data: Dataset, seq_len: int, max_windows: int = 512):
    """The held-out ``(inputs, targets)``: all test images, or non-overlapping text windows."""
    if data.test_targets is not None:
        return data.test_inputs, data.test_targets
    n = min(max_windows, (len(data.test_inputs) - 1) // seq_len)
    tokens = data.test_inputs[: n * seq_len + 1].astype(np.int32)
    inputs = tokens[:-1].reshape(n, seq_len)
    targets = tokens[1:].reshape(n, seq_len)
    return inputs, targets


def load(name: str) -> Dataset:
    """Loads ``"digits"`` or ``"pysource"``."""
    loaders = {"digits": load_digits, "pysource": load_pysource}
    if name not in loaders:
        raise ValueError(f"data: unknown dataset {name!r}; use one of {sorted(loaders)}")
    return loaders[name]()
