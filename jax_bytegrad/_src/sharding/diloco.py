"""Where DiLoCo's state rests on a ("node", "local") mesh, for each ``shard=`` placement.

Follows DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023) with the node's state split as ZeRO splits it within a node (Rajbhandari et
al., SC 2020), through the data-parallel step's placement objects (``sharding/placement.py``):

    state.params      each node's params, stacked over nodes, split within the node as
                      the placement keeps params (shard="params": in blocks)
    state.opt_state   each node's inner optimizer state, stacked over nodes, split within the
                      node as the placement keeps optimizer state
    global params     replicated over nodes, split within the node as each device's update
    outer state       (its blocks with shard=, whole without), one outer state per fragment
    residuals         per device, as the sync's error feedback keeps them
    in flight         (delay > 1) the node's params when each exchange started, stacked over
                      nodes and split as each device's update; the means received, per chunk
                      of each exchange, each piece split as its leaf
    landing           (background) per fragment, what each node adds to its pieces when the
                      fragment's exchange lands, stacked over nodes, each piece split as its
                      leaf

The outer state goes where each device's update goes: with ``shard=`` the global params and
the outer momentum, two params' worth that a big model cannot keep whole on every device, are
split like the inner optimizer state, and each device runs the outer step on its blocks. No
spec here depends on anything but the params' shapes, the fragments and the placement.
"""

from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src.sharding.pieces import Piece, split_chunks, split_fragments
from jax_bytegrad._src.sharding.placement import Placement

# The names ``state.extra`` holds.
GLOBAL, OUTER, RESIDUALS = "global_params", "outer_opt_state", "residuals"
# With delay > 1, the exchanges in flight: each node's params when they started, and the means
# received so far.
STARTED, RECEIVED = "exchange_started", "exchange_received"
# In the background, per fragment: the new global params minus the node's params when the
# exchange started, which the node adds to its own when the exchange lands.
LANDING = "exchange_landing"


def fragment(tree, pieces):
    """``tree`` with each leaf of ``pieces`` cut to its piece, and the others None (optax
    skips them)."""
    leaves, treedef = jax.tree.flatten(tree)
    out = [None] * len(leaves)
    for p in pieces:
        out[p.leaf] = p.of(leaves)
    return jax.tree.unflatten(treedef, out)


def merged(tree, fragment_tree, pieces):
    """``tree`` with the ``pieces`` taken from ``fragment_tree`` (as ``fragment`` cut them)."""
    leaves, treedef = jax.tree.flatten(tree)
    for p, x in zip(pieces, jax.tree.leaves(fragment_tree), strict=True):
        p.put(leaves, x)
    return jax.tree.unflatten(treedef, leaves)


def _stacked(spec: P, axes: tuple[str, str]) -> P:
    """The spec of a node's leaf of spec ``spec`` stacked on a leading axis of the node
    count: split over nodes first, and within the node as ``spec`` splits it (a per-device
    entry, such as a ``MultiSteps`` accumulator's, stays whole per node)."""
    return P(axes[0], *[e if e == axes[1] else None for e in spec])


def _stack(specs, axes):
    return jax.tree.map(lambda s: _stacked(s, axes), specs, is_leaf=lambda x: isinstance(x, P))


class DiLoCoLayout(NamedTuple):
    """DiLoCo's state specs, and what each exchange sends, from the params' shapes alone.

    Attributes:
      dims: per leaf, the dimension split within the node (None: whole).
      params: one node's params' specs (unstacked).
      opt_state: one node's inner optimizer state's specs (unstacked).
      extra: ``state.extra``'s specs: the global params, the outer states, the residuals and
        the exchanges in flight.
      fragments: per fragment, its ``Piece``s (``pieces.split_fragments``).
      chunks: per fragment, the ``Piece``s each of its exchange's steps sends
        (``pieces.split_chunks``).
      slots: ``(fragment, chunk)`` of each chunk that sends anything, in order: the index of
        its residuals and of its means in flight.
    """

    dims: tuple[int | None, ...]
    params: Any
    opt_state: Any
    extra: dict
    fragments: tuple[tuple[Piece, ...], ...]
    chunks: tuple[tuple[tuple[Piece, ...], ...], ...]
    slots: dict[tuple[int, int], int]

    def stacked(self, axes: tuple[str, str]) -> tuple[Any, Any]:
        """The specs of ``state.params`` and ``state.opt_state`` (stacked over nodes)."""
        return _stack(self.params, axes), _stack(self.opt_state, axes)


def diloco_layout(placement: Placement, optimizer, outer, params, fragments: int, feedback: bool,
                  steps: int, background: bool = False) -> DiLoCoLayout:  # fmt: skip
    """The ``DiLoCoLayout`` of a DiLoCo state of ``params`` (arrays or shapes) in ``fragments``
    fragments, each exchanged over ``steps`` steps (``delay``, at least 1; 1 in the
    background); ``feedback``: with error feedback's residuals; ``background``: with what
    each exchange in the background lands."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    dims = placement.dims(shapes)
    dims = (None,) * len(jax.tree.leaves(shapes)) if dims is None else dims
    sizes = [(x.shape, x.dtype.itemsize) for x in jax.tree.leaves(shapes)]
    members = split_fragments(sizes, dims, fragments)
    chunks = tuple(split_chunks(m, sizes, dims, steps) for m in members)
    sent = [(f, k) for f, parts in enumerate(chunks) for k, chunk in enumerate(parts) if chunk]
    slots = {event: i for i, event in enumerate(sent)}
    frags = [jax.eval_shape(lambda t, m=m: fragment(t, m), shapes) for m in members]
    _check_pieces_split_as_their_leaves(placement, frags, members, dims)
    extra = {
        GLOBAL: placement.update_specs(shapes),
        OUTER: tuple(placement.state_specs(jax.eval_shape(outer.init, p), p) for p in frags),
    }
    if feedback:
        extra[RESIDUALS] = P(placement.axes)
    # A piece keeps its leaf's split dimension: its leaf's spec.
    update = jax.tree.leaves(extra[GLOBAL], is_leaf=lambda x: isinstance(x, P))
    if steps > 1:
        extra[STARTED] = _stack(extra[GLOBAL], placement.axes)
        extra[RECEIVED] = tuple(tuple(update[p.leaf] for p in chunks[f][k]) for f, k in slots)
    if background:
        extra[LANDING] = tuple(
            tuple(_stacked(update[p.leaf], placement.axes) for p in m) for m in members
        )
    return DiLoCoLayout(
        dims,
        placement.param_specs(shapes),
        placement.state_specs(jax.eval_shape(optimizer.init, shapes), shapes),
        extra,
        members,
        chunks,
        slots,
    )


def _check_pieces_split_as_their_leaves(placement, frags, members, dims) -> None:
    """Raises where a fragment's piece of rows would be split within the node along another
    dimension than its leaf (the outer state's blocks would not match the params')."""
    for frag, pieces in zip(frags, members, strict=True):
        got = placement.dims(jax.tree.leaves(frag))
        for p, dim in zip(pieces, got or (None,) * len(pieces), strict=True):
            if p.dim is not None and dim != dims[p.leaf]:
                raise ValueError(
                    f"diloco: a fragment's rows {p.start}:{p.stop} of leaf {p.leaf} would be "
                    f"split within the node along dimension {dim}, and the leaf along "
                    f"{dims[p.leaf]}; pass fewer fragments (at most the params' leaves)"
                )
