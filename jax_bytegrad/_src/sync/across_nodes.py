"""The wire of a state split across nodes (``shard="full"``): weights gathered as codes,
gradients reduce-scattered as codes.

Follows ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant
Model Training", 2023): with the state split over every device (FSDP's FULL_SHARD), each step
gathers the weights across nodes for the forward pass (and again for the backward pass, where
the model recomputes a layer under ``jax.checkpoint``) and reduce-scatters the gradient across
nodes. Here the part that crosses between nodes is compressed, per layer, inside the step's
``shard_map`` (manual over both mesh axes), where each device holds its block of each leaf:

    gather_weights     a device's block of a leaf, quantized block-wise (min-max, 8 bits,
                       nearest rounding: ZeRO++'s qwZ), codes and headers all-gathered over
                       the nodes, then within the node, decoded: every device computes on
                       the same decoded weights. The float32 master block stays with its
                       owner, unchanged.
    scatter_gradient   a device's gradient of a whole leaf, reduce-scattered within the node
                       in float32 so that each device holds the node's sum of its run of
                       blocks, one for each node, then coded on the sync's wire between
                       nodes (``SyncConfig.wire_for``). On the integer wire (``"allreduce"``)
                       the run is coded on a shared grid (``codecs/integer.py``: bounds, one
                       ``pmax``, encode) and summed by one integer ``psum_scatter`` over the
                       nodes: each device decodes its own block's sum, times ``weight``. On
                       ``"scatter_gather"`` (any width, any node count: what ``"auto"``
                       picks for 4 and 2 bits) each piece is coded min-max, one
                       ``all_to_all`` hands each node its pieces, and each device decodes
                       and sums them. With error feedback each device adds its residual to
                       its run before coding it and keeps what its codes missed (1-bit
                       Adam's per-worker error); with stochastic rounding each device rounds
                       on its own key.

With ``compressed=False`` both are float32 (``all_gather`` and ``psum_scatter``): FSDP's
exact baseline. A leaf kept whole (``dim`` None: a scalar, a leaf no dimension of which the
devices divide) is not gathered, and the optimizer's sync averages its gradient.

Non-finite values stay visible: a weight block holding NaN decodes to NaN (the min-max codec),
and a gradient block holding NaN or +-inf on any node decodes to NaN on its owner (the integer
wire's bounds).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src.codecs import Codec, average_blocks, integer, quantize_with_feedback
from jax_bytegrad._src.sync import collectives
from jax_bytegrad._src.sync.config import SyncConfig, platform_of


def _pieces(x: jax.Array, dim: int, parts: int) -> jax.Array:
    """``x`` cut into ``parts`` equal pieces along ``dim``: shape (parts, size / parts)."""
    shape = x.shape
    cut = x.reshape(*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1 :])
    return jnp.moveaxis(cut, dim, 0).reshape(parts, -1)


def _joined(pieces: jax.Array, dim: int, block_shape: tuple[int, ...]) -> jax.Array:
    """The inverse of ``_pieces``: (parts, n) pieces of ``block_shape`` joined along ``dim``."""
    parts = pieces.shape[0]
    stacked = pieces.reshape(parts, *block_shape)
    joined = jnp.moveaxis(stacked, 0, dim)
    shape = list(block_shape)
    shape[dim] *= parts
    return joined.reshape(shape)


def _blocks(flat: jax.Array, block_size: int) -> jax.Array:
    """(parts, n) values padded with zeros to whole blocks: (parts, blocks, block_size)."""
    pad = -flat.shape[1] % block_size
    if pad:
        flat = jnp.pad(flat, ((0, 0), (0, pad)))
    return flat.reshape(flat.shape[0], -1, block_size)


def weight_codec(config: SyncConfig) -> Codec:
    """The codec of the weights' gather: 8 bits whatever the gradient's width, nearest
    rounding. Every node must decode the same weights, and a weight's error does not average
    out over steps: fresh 4-bit codes of the weights miss them by 11% (relative), 8-bit ones
    by 0.7% (benchmarks/weight_codes.py)."""
    return Codec(bits=8, stochastic=False, implementation=config.implementation)


def gather_weights(block: jax.Array, dim: int | None, config: SyncConfig,
                   compressed: bool) -> jax.Array:  # fmt: skip
    """The whole leaf from every device's ``block`` (split along ``dim`` over the local and
    node axes, local-major: device ``(k, j)`` holds block ``j K + k``), in ``block``'s dtype:
    each device's values (or with ``compressed`` its codes, which every device then decodes)
    gathered between nodes, then within the node."""
    axis, local_axis = config.axes
    if dim is None:
        return block

    def gathered(x):
        # Between nodes, then within the node: (local, nodes, ...), in the leaf's order; each
        # device sends its own block across.
        x = jax.lax.all_gather(x, axis, to="invarying")
        return jax.lax.all_gather(x, local_axis, to="invarying")

    if not compressed:
        values = gathered(block)
        return _joined(values.reshape(-1, block.size), dim, block.shape)
    codec, size = weight_codec(config), config.block_size
    flat = _blocks(block.astype(jnp.float32).reshape(1, -1), size)[0]
    codes, header = (gathered(x) for x in codec.quantize_blocks(flat))
    parts = codes.shape[0] * codes.shape[1]
    flat = codec.dequantize_blocks(codes.reshape(-1, codes.shape[-1]), header.reshape(-1, 2))
    decoded = flat.reshape(parts, -1)[:, : block.size]
    return _joined(decoded, dim, block.shape).astype(block.dtype)


def residual_size(shape: tuple[int, ...], local: int) -> int:
    """The length of one device's error-feedback residual for a leaf of ``shape`` (split over
    every device, ``local`` of them per node): its run of pieces, one for each node, that
    ``scatter_gradient`` codes."""
    return int(np.prod(shape, dtype=np.int64)) // local


def scatter_gradient(
    grad: jax.Array,
    dim: int,
    config: SyncConfig,
    compressed: bool,
    weight: float,
    *,
    key: jax.Array | None = None,
    residual: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """This device's block of ``weight`` times the sum over every device of ``grad`` (each
    device's gradient of a whole leaf), split along ``dim`` over the local and node axes as
    ``gather_weights`` takes it: reduce-scattered within the node in float32 (device j of a
    node takes the j-th run of K blocks, one for each node), then between nodes, as float32
    or as codes on the sync's wire (``SyncConfig.wire_for`` the nodes). In ``grad``'s dtype.

    With ``compressed``, ``key`` (the leaf's rounding key, the same on every device: each
    device rounds on its own fold of it) rounds stochastically, and ``residual`` (this
    device's error feedback, ``residual_size`` values) is added to the run before it is
    coded. Returns the block and the new residual, what this device's codes missed (None
    without ``residual``; uncompressed, ``residual`` as it is)."""
    axis, local_axis = config.axes
    nodes = jax.lax.axis_size(axis)
    local = jax.lax.axis_size(local_axis)
    # (local, nodes, n): block j K + k is device (k, j)'s.
    rows = _pieces(grad.astype(jnp.float32), dim, nodes * local).reshape(local, nodes, -1)
    pieces = jax.lax.psum_scatter(rows, local_axis)  # (nodes, n): this device's run
    count = pieces.shape[1]
    shape = list(grad.shape)
    shape[dim] //= nodes * local
    if not compressed:
        mine = jax.lax.psum_scatter(pieces, axis)
        return (mine * np.float32(weight)).reshape(shape).astype(grad.dtype), residual
    device_key = collectives.bucket_keys(key, config.axes, (0,))[0]
    if config.wire_for(nodes) == "scatter_gather":
        block, kept = _scattered(pieces, config, weight, device_key, residual)
        return block.reshape(shape).astype(grad.dtype), kept
    if residual is not None:
        pieces = pieces + residual.reshape(pieces.shape)
    size = config.block_size
    width = config.codec.integer_width(nodes, platform_of())
    flat = _blocks(pieces, size).reshape(-1)
    bounds = jax.lax.pmax(integer.integer_bounds(config.codec, flat, size), axis)
    seed = None if device_key is None else integer.dither_seed(device_key)
    codes, kept = integer.integer_encode(
        config.codec, flat, bounds, block_size=size, width=width, seed=seed,
        feedback=residual is not None,
    )  # fmt: skip
    codes = codes.reshape(nodes, -1, codes.shape[-1])
    mine = jax.lax.psum_scatter(codes, axis)  # this device's block's sum
    own = jnp.take(bounds.reshape(nodes, -1, 2), jax.lax.axis_index(axis), axis=0)
    factors = integer.decode_factors(
        config.codec, own, width=width, group_size=nodes, weight=weight
    )
    decoded = integer.integer_decode(config.codec, mine, factors, width=width)[:count]
    if kept is not None:  # the padding's residual is 0: 0 is on every grid
        kept = kept.reshape(nodes, -1)[:, :count].reshape(-1)
    return decoded.reshape(shape).astype(grad.dtype), kept


def _scattered(pieces, config, weight, key, residual):
    """The scatter-gather form of ``scatter_gradient``'s step between nodes, for any width
    and node count: this device's run of ``pieces`` (one per node) is coded block-wise, each
    node's piece sent to it (one ``all_to_all``), and the pieces received, every node's codes
    of this device's block, decoded and summed, times ``weight`` (``average_blocks``: the
    weight folded into each piece's scale, so the sum between nodes does not overflow where
    the mean would not). With ``residual`` (this device's error feedback) the run is coded
    with it added (``quantize_with_feedback``). Returns the block and the new residual, what
    this device's codes missed (the padding's share dropped; None without ``residual``)."""
    axis = config.axes[0]
    codec, size = config.codec, config.block_size
    nodes, count = pieces.shape
    flat = _blocks(pieces, size).reshape(-1, size)
    kept = None
    if residual is None:
        codes, header = codec.quantize_blocks(flat, key)
    else:
        fed = _blocks(residual.reshape(pieces.shape), size).reshape(-1, size)
        codes, header, kept = quantize_with_feedback(codec, flat, fed, key)
        kept = kept.reshape(nodes, -1)[:, :count].reshape(-1)
    per_node = lambda x: x.reshape(nodes, -1, x.shape[-1])  # noqa: E731
    received = [jax.lax.all_to_all(per_node(x), axis, 0, 0) for x in (codes, header)]
    mine = average_blocks(codec, *received, weight=weight).reshape(-1)[:count]
    return mine, kept
