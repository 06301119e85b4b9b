"""How DiLoCo cuts the params into fragments, and each fragment's exchange into chunks.

Follows streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication",
2025). A fragment and a chunk are lists of ``Piece``s: whole leaves, or runs of rows of a leaf
along a dimension that the state does not split within the node. Fragments are sets of whole
leaves where the params have as many leaves, else runs of rows, so that a scanned layer stack
is fragmented by layers (``split_fragments``); a fragment's exchange is cut into chunks of
rows, so that one large leaf spreads over the steps the exchange takes (``split_chunks``).
Nothing here depends on anything but the params' shapes and the split rule's dimensions.
"""

from typing import NamedTuple

import jax
import numpy as np


class Piece(NamedTuple):
    """Leaf ``leaf``, whole (``dim`` None), or its rows ``[start, stop)`` along ``dim``."""

    leaf: int
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def of(self, leaves) -> jax.Array:
        """This piece of ``leaves`` (a list of the params' leaves, or of blocks of them)."""
        x = leaves[self.leaf]
        if self.dim is None:
            return x
        return jax.lax.slice_in_dim(x, self.start, self.stop, axis=self.dim)

    def put(self, leaves: list, value) -> None:
        """Writes ``value`` where this piece lies in ``leaves`` (a list, changed in place)."""
        if self.dim is None:
            leaves[self.leaf] = value
        else:
            x = leaves[self.leaf]
            leaves[self.leaf] = jax.lax.dynamic_update_slice_in_dim(x, value, self.start, self.dim)


def _cut_dim(shape, split: int | None) -> int | None:
    """The dimension a leaf's rows run along: the first of size > 1 that the state does not
    split within the node (``split``); None: the leaf goes whole."""
    return next((d for d, n in enumerate(shape) if n > 1 and d != split), None)


def split_chunks(members, shapes, split_dims, steps: int) -> tuple[tuple[Piece, ...], ...]:
    """A fragment's pieces (``members``) in ``steps`` chunks as even in bytes as rows allow:
    the pieces laid end to end in tree order, cut at each multiple of a ``steps``-th of their
    bytes, each cut moved to the nearest boundary of a row (of a whole leaf, where its rows
    cannot be cut). A whole leaf's rows run along its first dimension of size > 1 that the
    node does not split; a piece of rows is cut along its own. Chunks may be empty.

    Args:
      members: the fragment's ``Piece``s, in tree order, at most one per leaf.
      shapes: per leaf of the params, ``(shape, itemsize)``.
      split_dims: per leaf, the dimension the state splits within the node (None: none).
      steps: how many chunks.

    Returns:
      ``steps`` tuples of ``Piece``; with ``steps=1``, one chunk of the pieces as given.

    Examples:
      A (4, 3) leaf and a (3,) leaf of float32 in two chunks: the cut, at 30 of 60 bytes,
      falls in the first leaf's rows.

      >>> from jax_bytegrad._src.sharding.pieces import Piece, split_chunks
      >>> chunks = split_chunks([Piece(0), Piece(1)], [((4, 3), 4), ((3,), 4)], [None, None], 2)
      >>> [[(p.leaf, p.dim, p.start, p.stop) for p in chunk] for chunk in chunks]
      [[(0, 0, 0, 2)], [(0, 0, 2, 4), (1, None, 0, 0)]]
    """
    units = []  # (piece, dim, first row, rows, bytes per row)
    for piece in members:
        shape, itemsize = shapes[piece.leaf]
        size = int(np.prod(shape)) * itemsize
        if piece.dim is not None:
            dim, first, rows = piece.dim, piece.start, piece.stop - piece.start
        else:
            dim = _cut_dim(shape, split_dims[piece.leaf]) if steps > 1 and size else None
            first, rows = 0, 1 if dim is None else shape[dim]
        units.append((piece, dim, first, rows, size / (1 if dim is None else shape[dim])))
    total = sum(rows * size for *_, rows, size in units)
    # Each cut as (unit, rows of it before the cut), from the start to the end.
    cuts, unit, before = [(0, 0)], 0, 0.0
    for k in range(1, steps):
        at = total * k / steps
        while unit < len(units) - 1 and before + units[unit][3] * units[unit][4] <= at:
            before += units[unit][3] * units[unit][4]
            unit += 1
        rows, size = units[unit][3:]
        row = min(round((at - before) / size), rows) if size else rows
        cuts.append(max((unit, row), cuts[-1]))
    cuts.append((len(units) - 1, units[-1][3]))
    chunks = []
    for (u0, r0), (u1, r1) in zip(cuts[:-1], cuts[1:], strict=True):
        pieces = []
        for u in range(u0, u1 + 1):
            piece, dim, first, rows, _ = units[u]
            start, stop = (r0 if u == u0 else 0), (r1 if u == u1 else rows)
            if stop > start:
                whole = start == 0 and stop == rows
                pieces.append(
                    piece if whole else Piece(piece.leaf, dim, first + start, first + stop)
                )
        chunks.append(tuple(pieces))
    return tuple(chunks)


def split_fragments(shapes, split_dims, fragments: int) -> tuple[tuple[Piece, ...], ...]:
    """The params' F fragments, each a tuple of ``Piece``s in tree order.

    With F at most the leaves, sets of whole leaves as even in bytes as whole leaves allow:
    the largest leaf goes first to the lightest fragment (ties: the lower index). With more
    fragments than leaves (a scanned layer stack: its layers are its rows), the leaves laid
    end to end and cut by rows, as ``split_chunks`` cuts a fragment into chunks.

    Args:
      shapes: per leaf of the params, ``(shape, itemsize)``.
      split_dims: per leaf, the dimension the state splits within the node (None: none).
      fragments: F.

    Raises:
      ValueError: when the rows cannot give every fragment some of the params.

    Examples:
      >>> from jax_bytegrad._src.sharding.pieces import split_fragments
      >>> shapes = [((100,), 4), ((25,), 4), ((75,), 4), ((50,), 4)]
      >>> [[p.leaf for p in f] for f in split_fragments(shapes, [None] * 4, 2)]
      [[0, 1], [2, 3]]
      >>> [[tuple(p) for p in f] for f in split_fragments([((4, 8), 4)], [None], 2)]
      [[(0, 0, 0, 2)], [(0, 0, 2, 4)]]
    """
    if fragments > len(shapes):
        split = split_chunks([Piece(i) for i in range(len(shapes))], shapes, split_dims, fragments)
        if not all(split):
            raise ValueError(
                f"diloco: fragments={fragments}: the params' {len(shapes)} leaves, cut by rows, "
                f"cannot give each of {fragments} fragments a share; pass fewer fragments"
            )
        return split
    sizes = [int(np.prod(shape)) * itemsize for shape, itemsize in shapes]
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    load, members = [0] * fragments, [[] for _ in range(fragments)]
    for i in order:
        f = min(range(fragments), key=lambda k: (load[k], k))
        load[f] += sizes[i]
        members[f].append(i)
    return tuple(tuple(Piece(i) for i in sorted(m)) for m in members)
