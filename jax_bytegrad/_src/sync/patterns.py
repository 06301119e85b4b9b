"""Collective patterns any wire or step uses: flat scatter and gather, split messages, rings.

Each is written with public ``jax.lax`` collectives inside ``shard_map``. The ring patterns
exist because through Gloo on CPU hosts, one-way and ring patterns run at 93-95% of a link
while two-way exchanges (all_to_all, a swap) reach only part of one (benchmarks/RESULTS.md,
"Integer wire and rings").
"""

import jax
import jax.numpy as jnp

from jax_bytegrad._src import checks


def make_varying(tree, axes):
    """Each leaf of ``tree`` typed as varying over ``axes``: cast over those it does not yet
    vary over (``jax.grad`` of a value replicated over an axis would sum it over that axis)."""

    def cast(x):
        vma = checks.varying_axes(x)
        missing = tuple(a for a in axes if a not in vma)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def gather_invariant(x: jax.Array, axis) -> jax.Array:
    """Tiled all_gather whose result is typed as replicated over ``axis`` (one value)."""
    return jax.lax.all_gather(x, axis, axis=0, tiled=True, to="invarying")


def scatter_flat(flat: jax.Array, axis, parts: int) -> jax.Array:
    """Sums a flat vector over ``axis``, each device keeping its 1/``parts`` (zero-padded)."""
    flat = jnp.pad(flat, (0, -flat.size % parts))
    return jax.lax.psum_scatter(flat, axis, scatter_dimension=0, tiled=True)


def own_flat(flat: jax.Array, axis, parts: int) -> jax.Array:
    """This device's 1/``parts`` of a flat vector that every device of ``axis`` holds alike
    (zero-padded), as ``scatter_flat`` would leave it had the others sent zeros."""
    flat = jnp.pad(flat, (0, -flat.size % parts))
    size = flat.size // parts
    return jax.lax.dynamic_slice_in_dim(flat, jax.lax.axis_index(axis) * size, size)


def gather_flat(part: jax.Array, axis, size: int, *, invariant: bool = True) -> jax.Array:
    """Undoes ``scatter_flat``'s split: the ``parts`` gathered over ``axis``, padding dropped.

    With ``invariant`` the result is typed as one value over ``axis``; otherwise it stays
    varying, as per-device state must.
    """
    if invariant:
        return gather_invariant(part, axis)[:size]
    return jax.lax.all_gather(part, axis, axis=0, tiled=True)[:size]


def message_slices(blocks: int, block_bytes: int, message_bytes: int | None) -> list[slice]:
    """Consecutive block ranges of about ``message_bytes`` each (at least one block)."""
    per = blocks if message_bytes is None else max(1, message_bytes // block_bytes)
    return [slice(start, min(start + per, blocks)) for start in range(0, blocks, per)]


def split_ppermute(tree, axis, perm, message_bytes: int | None):
    """``jax.lax.ppermute`` of every leaf of ``tree``, sent in messages of ``message_bytes``.

    The same result as one ``ppermute`` per leaf, bit for bit: only the message size changes.
    """

    def send(x):
        if message_bytes is None or x.size * x.dtype.itemsize <= message_bytes:
            return jax.lax.ppermute(x, axis, perm)
        flat = x.reshape(-1)
        pieces = message_slices(flat.size, x.dtype.itemsize, message_bytes)
        return jnp.concatenate([jax.lax.ppermute(flat[p], axis, perm) for p in pieces]).reshape(
            x.shape
        )

    return jax.tree.map(send, tree)


# Ring patterns ------------------------------------------------------------------------------


def _shift(n: int, s: int) -> list[tuple[int, int]]:
    return [(i, (i + s) % n) for i in range(n)]


def ring_all_to_all(x: jax.Array, axis, *, message_bytes: int | None = None) -> jax.Array:
    """``jax.lax.all_to_all(x, axis, 0, 0, tiled=True)`` as n - 1 ppermute shifts.

    Shift s sends row me + s of ``x`` to device me + s and receives device me - s's row for
    this device. Each device then sends to one peer and receives from another, except at
    s = n / 2 (n even, and every shift at n = 2), where pairs swap: through Gloo a swap gets
    about half a link (benchmarks/RESULTS.md, "Integer wire and rings").

    Args:
      x: shape (n, ...), n the size of ``axis``: row j goes to device j.
      axis: a mesh axis name, or a tuple of them.
      message_bytes: bytes per message of each shift; None sends each row in one.

    Returns:
      Shape (n, ...): row j is what device j sent to this one, as ``all_to_all`` returns it.
    """
    n = x.shape[0]
    me = jax.lax.axis_index(axis)
    out = x  # row me is this device's own
    for s in range(1, n):
        row = jax.lax.dynamic_index_in_dim(x, (me + s) % n, 0, keepdims=False)
        got = split_ppermute(row, axis, _shift(n, s), message_bytes)
        out = jax.lax.dynamic_update_index_in_dim(out, got, (me - s) % n, 0)
    return out


def ring_all_gather(x: jax.Array, axis, n: int, *, message_bytes: int | None = None) -> jax.Array:
    """``jax.lax.all_gather(x, axis, axis=0)`` as n - 1 shifts by one, each device passing on
    what it got last. The result is typed varying over ``axis`` (public JAX has no way to
    mark a ppermute's result replicated), so no wire uses it; it is measured in
    benchmarks/network.py.
    """
    me = jax.lax.axis_index(axis)
    out = jnp.broadcast_to(x[None], (n, *x.shape))
    current = x
    for s in range(1, n):
        current = split_ppermute(current, axis, _shift(n, 1), message_bytes)
        out = jax.lax.dynamic_update_index_in_dim(out, current, (me - s) % n, 0)
    return out
