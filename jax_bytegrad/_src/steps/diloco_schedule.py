"""Which of DiLoCo's exchanges crosses between nodes in which step, and what each carries.

Follows streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication",
2025): the params are split into F fragments, fragment p is exchanged after inner steps
(p + 1) H / F, then every H steps, and its exchange takes tau steps:

    delay (tau) 0     the exchange runs in the step that ends the fragment's H steps
    delay (tau) 1     it runs in the next step
    delay (tau) > 1   its chunk k runs in the (k + 1)-th step after the H steps, k < tau
    background        it starts after the step that ends the H steps, in a program of its
                      own beside the next tau steps, and lands in the tau-th of them

A fragment and a chunk are lists of ``Piece``s: whole leaves, or runs of rows of a leaf along a
dimension that the state does not split within the node. Fragments are sets of whole leaves
where the params have as many leaves, else runs of rows, so that a scanned layer stack is
fragmented by layers (``split_fragments``); a fragment's exchange is cut into tau chunks of
rows, so that one large leaf spreads over the tau steps too (``split_chunks``). Nothing here
depends on anything but the params' shapes and the settings, so the schedule of a resumed run
follows from its step count.
"""

from typing import NamedTuple

import jax
import numpy as np

INNER = "inner"
# In the background (``Schedule(..., background=True)``), what a step does with a fragment's
# exchange: its H steps end there and it starts, or it lands.
START, LAND = "start", "land"


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

      >>> from jax_bytegrad._src.steps.diloco_schedule import Piece, split_chunks
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
      >>> from jax_bytegrad._src.steps.diloco_schedule import split_fragments
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


class Schedule:
    """DiLoCo's schedule: ``inner_steps`` H, ``fragments`` F, ``delay`` tau.

    ``events(steps_taken)`` are the exchanges in the next step's program, as ``(fragment,
    chunk)`` pairs (in the background ``(fragment, START)`` and ``(fragment, LAND)``);
    ``phase(steps_taken)`` names that program (``"inner"``, ``"outer"``, ``"outer_0"``...,
    with tau > 1 ``"outer.0"``, ``"outer_1.0+outer_0.2"``...; in the background ``"outer"``
    for a start and ``"outer.land"`` for a landing).
    """

    def __init__(self, inner_steps: int, fragments: int, delay: int, background: bool = False):
        self.inner_steps, self.fragments, self.delay = inner_steps, fragments, delay
        self.background = background
        self._stride = inner_steps // fragments
        if fragments == 1:
            self.names = ("outer",)
        else:
            self.names = tuple(f"outer_{f}" for f in range(fragments))
        # One period, once every exchange can be in flight: every phase, inner first.
        names = [self.phase(s)[0] for s in range(delay + inner_steps)]
        self.phases = tuple(dict.fromkeys(sorted(names, key=lambda name: name != INNER)))

    @property
    def chunks(self) -> int:
        """How many chunks each exchange is cut into: one per step it takes, one in the
        background."""
        return 1 if self.background else max(self.delay, 1)

    def synced_after(self, steps_taken: int) -> int | None:
        """The fragment whose H steps end with step ``steps_taken`` (counted from 0), if any."""
        done = steps_taken + 1
        if done % self._stride:
            return None
        return (done // self._stride - 1) % self.fragments

    def events(self, steps_taken: int) -> tuple[tuple[int, int | str], ...]:
        """The exchanges in the next step's program: with delay tau >= 1, chunk k of each
        fragment whose H steps ended k + 1 steps before; in the background, ``(f, START)``
        for the fragment whose H steps end with this step and ``(f, LAND)`` for the one whose
        H steps ended tau steps before."""
        if self.background:
            start = self.synced_after(steps_taken)
            ended = steps_taken - self.delay
            land = self.synced_after(ended) if ended >= 0 else None
            return tuple((f, what) for f, what in ((start, START), (land, LAND)) if f is not None)
        if self.delay == 0:
            fragment = self.synced_after(steps_taken)
            return () if fragment is None else ((fragment, 0),)
        ended = [(steps_taken - 1 - k, k) for k in range(self.delay) if steps_taken > k]
        return tuple((f, k) for t, k in ended if (f := self.synced_after(t)) is not None)

    def phase(self, steps_taken: int) -> tuple[str, tuple | str]:
        """``(name, key)`` of the next step's program; the key is its events (or ``"inner"``)."""
        events = self.events(steps_taken)
        if not events:
            return INNER, INNER
        if self.background:
            names = (self.names[f] + (".land" if k == LAND else "") for f, k in events)
            return "+".join(names), events
        if self.delay <= 1:
            return self.names[events[0][0]], events
        return "+".join(f"{self.names[f]}.{k}" for f, k in events), events

    def period(self) -> range:
        """One period of H steps in which every exchange is in its turn."""
        return range(self.delay, self.delay + self.inner_steps)
