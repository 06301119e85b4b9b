"""How gradients cross the mesh: one frozen ``SyncConfig``, the plan it resolves to, and error
feedback's residual state.

Every compressed sync (``bytegrad``, ``qadam``'s momentum exchange, ``compressed_mean``) is
described by the same eleven settings, documented once, in ``SyncConfig``, and validated
there, once, when the config is built. The user-facing factories (``bytegrad``, ``qadam``,
``Strategy``) keep flat keyword arguments (the optax convention) and build one; ``sync_mean``,
``scale_by_qadam`` and the steps take that one config.

Where a sync starts, with the mesh's shape, its platform and the gradient's leaves known,
``plan_sync`` resolves the config once into a ``SyncPlan``: the buckets' layout and one
frozen ``BucketPlan`` per bucket (who compresses with whom, over which wire, at which
integer width, with which residual sizes). The wire functions take that plan and never ask
the config again, so each derived value has one place where it is decided.

References:
  Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
"""

import dataclasses
from typing import Any, Literal

import jax
import numpy as np

from jax_bytegrad._src import checks
from jax_bytegrad._src.axes import LOCAL_AXIS, NODE_AXIS
from jax_bytegrad._src.codecs import (
    IMPLEMENTATIONS,
    INTEGER_OPS,
    Codec,
    Implementation,
    IntegerOps,
    resolve,
    resolve_implementation,
)
from jax_bytegrad._src.codecs.integer import Width
from jax_bytegrad._src.codecs.widths import BITS as BITS
from jax_bytegrad._src.codecs.widths import DEFAULT_BLOCK_SIZES as DEFAULT_BLOCK_SIZES
from jax_bytegrad._src.codecs.widths import MIN_BLOCK_SIZE as MIN_BLOCK_SIZE
from jax_bytegrad._src.codecs.widths import ROUNDINGS as ROUNDINGS
from jax_bytegrad._src.codecs.widths import Bits as Bits
from jax_bytegrad._src.codecs.widths import Rounding as Rounding
from jax_bytegrad._src.codecs.widths import check_block_size as check_block_size
from jax_bytegrad._src.platforms import platform_of as platform_of
from jax_bytegrad._src.sync.buckets import Layout, make_layout

# The bucket size off GPU meshes: big enough that each collective runs at link speed, small
# enough that a 25M-parameter model gets a few buckets whose communication can overlap the next
# one's quantize.
DEFAULT_BUCKET_BYTES = 32 * 2**20
# On GPU meshes: smaller buckets, each of at least two leaves. A bucket is the grain of the
# overlap with the backward pass, and a bucket of one leaf leaves its exchange only the next
# leaf's gemms to run beside (benchmarks/RESULTS.md, "The bucket grain on GPU meshes").
GPU_BUCKET_BYTES = 24 * 2**20
GPU_BUCKET_LEAVES = 2
# Bytes per message of the exchanges between nodes (codes, per peer); see docs/performance.md.
DEFAULT_MESSAGE_BYTES = 256 * 2**10
Wire = Literal["auto", "scatter_gather", "allreduce", "ring"]
BucketBytes = int | Literal["auto"] | None
WIRES = ("auto", "scatter_gather", "allreduce", "ring")


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """The settings of a compressed gradient sync over a ("node", "local") mesh.

    Built by ``bytegrad``, ``qadam`` and ``Strategy`` from their keyword arguments, and
    validated once, here; ``compressed_mean``, ``scale_by_qadam`` and ``pipelined_step``
    take one as ``sync=``. Frozen and hashable.

    Attributes:
      node_axis: mesh axis between nodes (slow links): the compressed hop.
      local_axis: mesh axis within a node (fast links): float32.
      hierarchical: reduce-scatter within the node before the compressed hop; False
        compresses over both axes as one group (L times more bytes between nodes).
      bits: bits per code between nodes, 8, 4 (packed two per byte) or 2 (four per byte,
        on the scatter-gather wires only; use it with ``error_feedback=True``). Each is a
        ``codecs.Codec``'s width (``codecs/widths.py``).
      block_size: elements per quantization block, a power of two >= 128 (>= 256 at 4
        bits, >= 512 at 2); None is resolved to the default of ``bits``: 1024 at 8 bits,
        512 at 4 and 2.
      bucket_bytes: float32 bytes per communication bucket, of whole leaves (a larger leaf
        gets a bucket of its own); None for a single bucket. ``"auto"`` (default): the
        platform's grain, resolved where the mesh is known (``bucket_grain``): on GPU meshes
        24 MiB buckets of at least two leaves each (docs/gpu.md), elsewhere 32 MiB
        (``DEFAULT_BUCKET_BYTES``). Error feedback's residuals are sized per bucket.
      message_bytes: bytes per message of the pairwise exchanges between nodes (the
        scatter-gather and ring wires); None for one message per peer. It changes the speed,
        never the result. The all-reduce wire sends one psum per bucket: an all-reduce cut
        into messages only runs slower (benchmarks/RESULTS.md), so ``bucket_bytes`` sizes it.
      rounding: ``"nearest"`` or ``"stochastic"`` (unbiased).
      implementation: quantization kernels: ``"xla"``, ``"pallas"``,
        ``"pallas_interpret"``, or None for the best available. The integer wire's ops are
        XLA fusions only: an explicit ``"pallas"`` raises ``NotImplementedError`` there.
      error_feedback: keep each device's compression errors and add them back next step.
      wire: how codes cross between nodes. ``"auto"`` (default): ``"allreduce"`` for 8-bit
        codes summed over at most 8 devices (the nodes, or every device with
        ``hierarchical=False``), the fastest wire measured at 2-4 hosts on 1 and 10 Gbit/s
        (benchmarks/RESULTS.md, "Integer wire and rings"); ``"scatter_gather"`` otherwise.
        ``"scatter_gather"``: an all_to_all of codes to
        each block's owner, which averages and requantizes, then an all_gather (Bagua's
        ByteGrad). ``"allreduce"``: every device quantizes onto a grid the group agrees on
        (one pmax of the block bounds) with headroom, and the codes are summed by one
        integer psum per bucket, then decoded with factors agreed by one more pmax (fewer
        levels per device: 255 // g at 8 bits for a group of g <= 8, uint16 beyond; 4 bits
        for g <= 2; never 2 bits, whose 3 levels leave fewer than 2 per device in any group,
        a ``ValueError`` here; one residual per device).
        ``"ring"``: scatter-gather with the all_to_all as ppermute shifts; the same result.
      axes: ``(node_axis, local_axis)``. This and the next two are derived from the settings
        once, when the config is built, so that the sync never asks for them again.
      stochastic: whether codes are rounded stochastically (``rounding="stochastic"``).
      codec: the codec these settings name, a ``codecs.Codec`` of ``bits``, ``rounding``
        and ``implementation``: the one object that travels from here to a kernel, and
        that the sync asks whatever depends on the width (its wire for ``"auto"``, its
        integer width, its code bytes).

    Raises:
      ValueError: for a bad value, naming it and ``where`` (an init-only argument: the
        function that builds the config, for the message).

    Examples:
      >>> from jax_bytegrad import SyncConfig
      >>> SyncConfig(bits=4).block_size
      512
      >>> SyncConfig(bits=3)
      Traceback (most recent call last):
      ValueError: SyncConfig: bits must be one of 8, 4, 2, got 3
    """

    node_axis: str = NODE_AXIS
    local_axis: str = LOCAL_AXIS
    hierarchical: bool = True
    bits: Bits = 8
    block_size: int | None = None
    bucket_bytes: BucketBytes = "auto"
    message_bytes: int | None = DEFAULT_MESSAGE_BYTES
    rounding: Rounding = "nearest"
    implementation: Implementation | None = None
    error_feedback: bool = False
    wire: Wire = "auto"
    where: dataclasses.InitVar[str] = "SyncConfig"

    def __post_init__(self, where: str) -> None:
        checks.axis_names(self.node_axis, self.local_axis, where)
        checks.boolean(self.hierarchical, "hierarchical", where)
        checks.one_of(self.bits, BITS, "bits", where)
        block_size = check_block_size(self.block_size, where, self.bits)
        object.__setattr__(self, "block_size", block_size)
        if self.bucket_bytes != "auto":
            why = ", or 'auto' (the platform's default)"
            checks.integer(self.bucket_bytes, "bucket_bytes", where, or_none=True, why=why)
        checks.integer(self.message_bytes, "message_bytes", where, or_none=True)
        checks.one_of(self.rounding, ROUNDINGS, "rounding", where)
        if self.implementation is not None:
            checks.one_of(self.implementation, IMPLEMENTATIONS, "implementation", where)
        checks.boolean(self.error_feedback, "error_feedback", where)
        checks.one_of(self.wire, WIRES, "wire", where)
        if self.wire == "allreduce":
            # Refused here, before any mesh, where no group of two fits (2-bit codes).
            Codec(bits=self.bits).check_integer(2, where)
        # Derived once, here (see Attributes): plain attributes, not fields, so that they are
        # no arguments, and ``dataclasses.fields``, ``asdict``, equality and the repr hold the
        # settings alone.
        stochastic = self.rounding == "stochastic"
        object.__setattr__(self, "axes", (self.node_axis, self.local_axis))
        object.__setattr__(self, "stochastic", stochastic)
        codec = Codec(bits=self.bits, stochastic=stochastic, implementation=self.implementation)
        object.__setattr__(self, "codec", codec)

    def bucket_grain(self, platform: str) -> tuple[int | None, int]:
        """``(bucket_bytes, fewest leaves per bucket)`` on ``platform`` (a JAX platform name,
        ``platform_of``): ``bucket_bytes`` with any number of leaves, or ``"auto"`` resolved.

        Examples:
          >>> from jax_bytegrad import SyncConfig
          >>> SyncConfig().bucket_grain("gpu"), SyncConfig().bucket_grain("cpu")
          ((25165824, 2), (33554432, 1))
          >>> SyncConfig(bucket_bytes=2**20).bucket_grain("gpu")
          (1048576, 1)
        """
        if self.bucket_bytes != "auto":
            return self.bucket_bytes, 1
        if platform == "gpu":
            return GPU_BUCKET_BYTES, GPU_BUCKET_LEAVES
        return DEFAULT_BUCKET_BYTES, 1

    def mesh_shape(self, mesh, where: str) -> tuple[int, int] | None:
        """(nodes, devices per node) of ``mesh`` along this config's axes, or None without a
        mesh; error feedback sizes its residuals by it, so it needs one. Refuses, where the
        step is built, an implementation the mesh's platform cannot run."""
        if self.error_feedback and mesh is None:
            raise ValueError(
                f"{where}: error_feedback=True keeps residuals per device, sized by the mesh; "
                "pass mesh=... (the mesh the step runs on)"
            )
        if mesh is None:
            return None
        nodes, per_node = checks.mesh_axes(mesh, *self.axes, where)
        resolve_implementation(self.implementation, platform_of(mesh))
        if self.wire == "allreduce":
            self.codec.check_integer(self.group(nodes, per_node).size, where)
        return nodes, per_node

    def wire_for(self, size: int) -> str:
        """The wire between ``size`` devices (or nodes): ``wire``, with ``"auto"`` resolved
        for that many (``Codec.auto_wire``)."""
        return self.codec.auto_wire(size) if self.wire == "auto" else self.wire

    def group(self, nodes: int, per_node: int) -> "Group":
        """The ``Group`` that compresses on a mesh of ``nodes`` x ``per_node``: the nodes
        (hierarchical: one device per node), or every device (flat), over ``wire`` with
        ``"auto"`` resolved for that many devices.

        Examples:
          >>> from jax_bytegrad import SyncConfig
          >>> SyncConfig().group(2, 4).wire, SyncConfig().group(16, 1).wire
          ('allreduce', 'scatter_gather')
        """
        size = nodes if self.hierarchical else nodes * per_node
        wire = self.wire_for(size)
        plain = size == 1
        if not self.hierarchical:
            return Group(self.axes, self.axes, size, False, wire, plain)
        # With one device per node, the integer sum over both axes types its result replicated
        # over both; the scatter-gather wire gathers over both for the same reason: a size-1
        # gather would copy the whole bucket.
        summed = self.node_axis if per_node > 1 or wire != "allreduce" else self.axes
        gather = self.node_axis if per_node > 1 else self.axes
        return Group(summed, gather, size, per_node > 1, wire, plain)

    def replace(self, **changes) -> "SyncConfig":
        """A copy with some settings changed, validated again."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Group:
    """The devices that compress together: one device per node (hierarchical, after a
    reduce-scatter within the node), or every device (``SyncConfig.group``).

    Attributes:
      axis: the axes the codes are exchanged or summed over.
      gather: the scatter-gather wire's all_gather axes (the same devices).
      size: devices in the group.
      scatter: whether a reduce-scatter within the node comes first (and an all_gather
        there last).
      wire: the wire that runs between them (``"auto"`` resolved).
      plain: one device in the group (``size == 1``): nothing is compressed.
    """

    axis: Any
    gather: Any
    size: int
    scatter: bool
    wire: Wire
    plain: bool


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """One bucket's way between nodes, resolved once where the sync starts (``plan_sync``).

    Everything a wire function reads: it never asks the ``SyncConfig`` again.

    Attributes:
      index: the bucket's index in the layout (its rounding key folds it in).
      padded: its values per device, a whole number of devices x blocks.
      dtype: its dtype within the node (``buckets.Layout.bucket_dtypes``).
      residual: error feedback's per-device (send, mean) lengths (``residual_sizes``).
      group: who compresses with whom, over which wire.
      codec: the codecs' settings (bits, rounding, implementation).
      integer: the integer wire's ops for ``codec`` (``codecs.IntegerOps``), resolved once;
        None where ``width`` is.
      block_size: values per quantization block.
      width: the integer wire's code width for the group (``allreduce_width``); None on the
        other wires, and where nothing is compressed.
      message_bytes: bytes per message of the pairwise exchanges (None: one per peer).
      node_axis, local_axis: the mesh axes.
      local: devices per node.
      hierarchical: a reduce-scatter within the node before the compressed hop.
      weight: what the sum is scaled by (1 / devices for a mean).
      scatter: the wire first reduce-scatters the bucket within the node (hierarchical, and
        the bucket is not this device's share of its node's sum already, as a row of a
        ``shard="params"`` step's node sums is: ``shards.Sharded``).
      gather: the reduced shard is gathered within the node into the whole bucket (after a
        reduce-scatter, but for a sharded step's rows, which stay this device's).
      platform: the mesh's JAX platform.
    """

    index: int
    padded: int
    dtype: np.dtype
    residual: tuple[int, int]
    group: Group
    codec: Codec
    integer: IntegerOps | None
    block_size: int
    width: Width | None
    message_bytes: int | None
    node_axis: str
    local_axis: str
    local: int
    hierarchical: bool
    weight: float
    scatter: bool
    gather: bool
    platform: str


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """A sync resolved for one gradient tree on one mesh: its buckets and their plans.

    Attributes:
      layout: which leaves go into which bucket (``buckets.Layout``).
      buckets: one ``BucketPlan`` per bucket, in layout order.
    """

    layout: Layout
    buckets: tuple[BucketPlan, ...]

    @property
    def residual_sizes(self) -> tuple[tuple[int, int], ...]:
        """Error feedback's per-device (send, mean) lengths, one pair per bucket."""
        return tuple(bucket.residual for bucket in self.buckets)


def plan_sync(
    config: SyncConfig,
    leaves,
    mesh_shape: tuple[int, int],
    platform: str | None = None,
    *,
    weight: float = 1.0,
    sums_within: bool = True,
    gathers_within: bool = True,
) -> SyncPlan:
    """Resolves ``config`` once for ``leaves`` on a (nodes, devices per node) mesh of
    ``platform`` (None: the mesh being traced, ``platform_of``): the buckets
    (``bucket_grain`` there, each padded to a whole number of blocks on every device, as
    every wire needs) and each bucket's ``BucketPlan``.

    ``sums_within`` and ``gathers_within`` say what the layout of the gradient leaves to the
    wire within the node (``shards.Whole``, ``shards.Sharded``): its reduce-scatter there, and
    the gather of the reduced bucket.

    Residual sizes: the scatter-gather wires keep two, ``send``, what the first compression
    left unsent (the device's share of its node's sum, hierarchical, or of its own bucket,
    flat), and ``mean``, what the requantize of its averaged chunk left unsent, 1/g of that.
    The integer wire keeps one, what this device's codes missed, and an empty ``mean``.
    Both are 0 where nothing is compressed (one node, hierarchical).
    """
    nodes, local = mesh_shape
    platform = platform_of() if platform is None else platform
    # The config's own answers first, then the layout's, then the codec's width: each asked once.
    bucket_bytes, min_leaves = config.bucket_grain(platform)
    group, codec = config.group(nodes, local), config.codec
    layout = make_layout(
        leaves,
        bucket_bytes=bucket_bytes,
        granularity=nodes * local * config.block_size,
        min_leaves=min_leaves,
    )
    integer = group.wire == "allreduce" and not group.plain
    width = codec.integer_width(group.size, platform) if integer else None
    ops = IntegerOps(*(resolve(op, codec) for op in INTEGER_OPS)) if integer else None
    plans = []
    for b, padded in enumerate(layout.padded_sizes):
        send = padded // local if config.hierarchical else padded
        mean = 0 if group.wire == "allreduce" else send // group.size
        plans.append(
            BucketPlan(
                index=b,
                padded=padded,
                dtype=layout.bucket_dtypes[b],
                residual=(0, 0) if group.plain else (send, mean),
                group=group,
                codec=codec,
                integer=ops,
                block_size=config.block_size,
                width=width,
                message_bytes=config.message_bytes,
                node_axis=config.node_axis,
                local_axis=config.local_axis,
                local=local,
                hierarchical=config.hierarchical,
                weight=weight,
                scatter=group.scatter and sums_within,
                gather=group.scatter and gathers_within,
                platform=platform,
            )
        )
    return SyncPlan(layout, tuple(plans))


def sync_config(sync: SyncConfig | None, where: str) -> SyncConfig:
    """``sync``, or the default ``SyncConfig()`` for None, for a function that takes
    ``sync=``; raises a ``ValueError`` for anything else."""
    if sync is None:
        return SyncConfig(where=where)
    if not isinstance(sync, SyncConfig):
        raise ValueError(
            f"{where}: sync must be a jax_bytegrad.SyncConfig, got {type(sync).__name__}; "
            "pass sync=SyncConfig(bits=4, wire=...)"
        )
    return sync


class Residuals(tuple):
    """Error feedback's state: one ``(send, mean)`` pair of float32 vectors per bucket.

    ``send`` holds what a device's first compression left unsent, ``mean`` what the
    requantize of its averaged chunk left unsent. Inside ``shard_map`` each device holds its
    own; outside, each is the concatenation of every device's in mesh order, sharded over
    ``(node_axis, local_axis)``. ``state_specs`` finds these by type, wherever they sit in an
    optimizer state. Flattens like a plain tuple, with the same key paths, so a checkpoint
    holding tuples restores into it.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Residuals({tuple(self)!r})"


jax.tree_util.register_pytree_with_keys(
    Residuals,
    lambda r: ([(jax.tree_util.SequenceKey(i), pair) for i, pair in enumerate(r)], None),
    lambda _, pairs: Residuals(pairs),
    flatten_func=lambda r: (tuple(r), None),
)
