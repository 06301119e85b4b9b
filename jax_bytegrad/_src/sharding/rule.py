"""The rule that splits a leaf of the state over a node's devices, or over every device.

Follows ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020): within a node, as PyTorch FSDP's hybrid sharding (HSDP) does,
each of a node's L devices keeps 1/L of the optimizer state (``shard="optimizer"``,
ZeRO-1/2) and, with ``shard="params"`` (ZeRO-3), of the parameters too, and every node holds
the whole model; across nodes too (``shard="full"``, FSDP's FULL_SHARD), each of the K L
devices keeps 1/(K L) of both.

A leaf is split along its largest dimension that the devices divide (``split_dim``); a leaf
with none (a scalar, a bias of odd size) stays whole on every device. The arrays stay global:
a sharded state is the same pytree, of the same shapes, as the replicated one, only placed
otherwise (``leaf_specs``), so a checkpoint restores onto any number of devices and any
``shard=`` setting, and ``step.params(state)`` is the whole model.

Inside ``shard_map`` a device holds its block of each split leaf: the leaf's slice
``[j b, (j + 1) b)`` along the split dimension, j its index along the axis (or axes, node
first) that split it.
"""

from typing import Literal

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src.sync.config import Residuals

Shard = Literal["optimizer", "params", "full"]
SHARDS = ("optimizer", "params", "full")
# An axis, or several (major first), that split a leaf's dimension.
Axis = str | tuple[str, ...]


def split_dim(shape: tuple[int, ...], parts: int) -> int | None:
    """The dimension of a leaf of ``shape`` that ``parts`` devices split: the largest whose
    size they divide (the first of equals); None for a leaf kept whole (no such dimension, or
    one device).

    The largest, not the first: a scanned stack of layers, ``(layers, d_in, d_out)``, is then
    split along a layer's own dimension, so each layer is gathered inside the loop, and not
    along the one the scan runs over (which would gather the whole stack before it)."""
    if parts == 1:
        return None
    fits = [(size, -dim) for dim, size in enumerate(shape) if size >= parts and size % parts == 0]
    return -max(fits)[1] if fits else None


def split_dims(tree, parts: int) -> tuple[int | None, ...]:
    """``split_dim`` of every leaf of ``tree`` (arrays or ``ShapeDtypeStruct``)."""
    return tuple(split_dim(tuple(np.shape(x)), parts) for x in jax.tree.leaves(tree))


def spec(dim: int | None, ndim: int, axis: Axis) -> P:
    """The ``PartitionSpec`` of a leaf split along ``dim`` over ``axis`` (``P()``: whole)."""
    if dim is None:
        return P()
    return P(*[axis if d == dim else None for d in range(ndim)])


def leaf_specs(tree, axis: Axis, parts: int):
    """A ``PartitionSpec`` per leaf of ``tree``: split over ``axis`` (``parts`` devices in
    all) where ``split_dim`` says."""
    return jax.tree.map(lambda x: spec(split_dim(np.shape(x), parts), np.ndim(x), axis), tree)


def split_state_specs(opt_state, params, *, axis: Axis, parts: int, devices: tuple[str, str]):
    """``shard_map`` specs for the optimizer state of a step whose state is split over
    ``axis`` (``parts`` devices): a leaf shaped like a parameter is split as that parameter
    is (moments, and accumulators like them), error-feedback ``Residuals`` are per device (one
    row per device of ``devices``, the mesh's two axes), the rest (counts, keys) whole. The
    split depends on the shape only, so leaves of one shape agree."""
    shapes = {tuple(np.shape(p)) for p in jax.tree.leaves(params)}

    def specs(node):
        if isinstance(node, Residuals):
            return jax.tree.map(lambda _: P(tuple(devices)), node)
        shape = tuple(np.shape(node))
        if shape in shapes:
            return spec(split_dim(shape, parts), len(shape), axis)
        return P()

    return jax.tree.map(specs, opt_state, is_leaf=lambda x: isinstance(x, Residuals))


def check_placed(tree, specs, mesh, where: str) -> None:
    """Raises, naming ``state_shapes``, for an array of ``tree`` placed otherwise than
    ``specs`` say on ``mesh`` (a state restored onto another ``shard=``'s shardings, say)."""
    for (path, x), spec in zip(
        jax.tree.leaves_with_path(tree), jax.tree.leaves(specs), strict=True
    ):
        want = NamedSharding(mesh, spec)
        if isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(want, x.ndim):
            raise ValueError(
                f"{where}: {jax.tree_util.keystr(path)} of the state is placed as "
                f"{x.sharding}, and this step keeps it as {spec}: start from "
                "step.init(params), or restore a checkpoint onto step.state_shapes(params), "
                "which carries this step's shardings"
            )
