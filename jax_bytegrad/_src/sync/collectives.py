"""Gradient means over a ("node", "local") mesh: 8- or 4-bit codes between nodes, or uncompressed.

Follows Bagua's ByteGrad and GradientAllReduce (Gan et al., "Bagua: Scaling up Distributed
Learning with System Relaxations", VLDB 2022). Everything here runs inside ``jax.shard_map``
on per-device values. A pytree's float leaves are laid out in flat buckets (``buckets.py``:
bfloat16 where all of a bucket's leaves are, float32 otherwise); each bucket is summed by
the wire of the ``SyncConfig`` (``wire.py``: Bagua's scatter-gather of codes, an integer
all-reduce of codes on a shared grid, or the scatter-gather as ppermute rings), and the
buckets are unflattened back into the leaves' own dtypes. Every device decodes the same
codes, so all replicas end bit-identical.

The buckets cross between nodes in the order the backward pass completes them
(``buckets.ready_order``), each bucket's exchange between nodes tied to the previous one's
by an ``optimization_barrier``: bucket b + 1's compressed chain (block bounds, codes, decode
factors) waits for bucket b's, and for nothing else than its own gradient. Without that tie,
XLA:GPU's combiners merge every bucket's bounds, codes and factors into one collective each,
which needs the whole gradient, and its scheduler runs them stage by stage after the last
gradient; with it, each bucket's exchange runs while the backward pass computes the next
bucket (benchmarks/RESULTS.md, "Overlap on GPU"). The tie changes no value.

With error feedback (as in 1-bit Adam's worker and server errors), each device keeps what its
compressions failed to send and adds it back at the same point next step; ``residual_sizes``
sizes that state, per bucket.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src import checks
from jax_bytegrad._src.codecs import check_key, resolve_implementation
from jax_bytegrad._src.sync import buckets as bucketing
from jax_bytegrad._src.sync import patterns, shards
from jax_bytegrad._src.sync import wire as wires
from jax_bytegrad._src.sync.config import (
    DEFAULT_BUCKET_BYTES,
    Residuals,
    SyncConfig,
    SyncPlan,
    plan_sync,
    platform_of,
    sync_config,
)
from jax_bytegrad._src.sync.shards import Sharded


def _mesh_axis_names() -> tuple[str, ...]:
    try:
        return tuple(jax.sharding.get_abstract_mesh().axis_names)
    except Exception:  # noqa: BLE001 - only used to word an error message
        return ()


def axis_sizes(node_axis: str, local_axis: str, where: str) -> tuple[int, int]:
    """Sizes of the two mesh axes, with an error that says what to do when one is unbound."""
    sizes = []
    for name, param in ((node_axis, "node_axis"), (local_axis, "local_axis")):
        try:
            sizes.append(int(jax.lax.axis_size(name)))
        except NameError:
            names = _mesh_axis_names()
            if not names:
                raise ValueError(
                    f"{where}: must run inside jax.shard_map over a mesh with axes "
                    f"({node_axis!r}, {local_axis!r}); use jax_bytegrad.data_parallel_step, "
                    "or call it from your own shard_map"
                ) from None
            raise ValueError(
                f"{where}: axis {name!r} is not in the mesh axes {names}; pass {param}=..."
            ) from None
    return sizes[0], sizes[1]


def residual_sizes(
    tree, config: SyncConfig, mesh_shape: tuple[int, int], platform: str | None = None
) -> tuple:
    """Per-device residual lengths of error feedback, one (send, mean) pair per bucket.

    ``send`` holds what the first compression left unsent: the device's share of its node's
    sum (hierarchical) or of its own bucket (flat); ``mean`` what the requantize of the
    device's averaged chunk left unsent, 1/n (1/(nL) flat) of that. Both are 0 where
    nothing is compressed (one node, hierarchical).

    Args:
      tree: the gradient pytree (arrays or ``jax.ShapeDtypeStruct``), as one device has it.
      config: the sync's settings.
      mesh_shape: (nodes, devices per node).
      platform: the mesh's JAX platform (``"gpu"``, ``"cpu"``), which sizes the buckets of
        ``bucket_bytes="auto"``; None for the mesh being traced (``config.platform_of``).

    Returns:
      One (send, mean) pair of per-device lengths per bucket.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jax_bytegrad import SyncConfig
      >>> residual_sizes({"w": jnp.ones(1000)}, SyncConfig(bits=4), (2, 4))
      ((1024, 512),)
    """
    return plan_sync(config, jax.tree.leaves(tree), mesh_shape, platform).residual_sizes


def bucket_layout(
    leaves, config: SyncConfig, mesh_shape: tuple[int, int], platform: str | None = None
) -> bucketing.Layout:
    """The buckets of ``leaves`` for ``config`` on a (nodes, devices per node) mesh of
    ``platform`` (None: the mesh being traced, ``config.platform_of``): the layout of
    ``config.plan_sync``."""
    return plan_sync(config, leaves, mesh_shape, platform).layout


def mesh_residuals(
    tree, config: SyncConfig, mesh_shape: tuple[int, int], platform: str | None = None
) -> Residuals:
    """Zero residuals of every device, for an optimizer state that is placed on the mesh
    (of ``platform``, as ``residual_sizes``); none (``Residuals()``) without error feedback.

    Each vector is the concatenation of every device's own residual in mesh order; the
    state's ``shard_map`` specs (``sharding.state_specs``) give each device its slice.
    """
    if not config.error_feedback:
        return Residuals()
    devices = mesh_shape[0] * mesh_shape[1]
    return Residuals(
        (jnp.zeros(devices * send, jnp.float32), jnp.zeros(devices * mean, jnp.float32))
        for send, mean in residual_sizes(tree, config, mesh_shape, platform)
    )


def _flat_leaves(tree, where: str):
    """``tree``'s leaves and treedef; raises for an integer or bool leaf: it cannot be
    averaged, and passing it on would hand every device its own value back as if it were
    the mean."""
    paths_and_leaves, treedef = jax.tree.flatten_with_path(tree)
    for path, leaf in paths_and_leaves:
        dtype = jnp.dtype(leaf.dtype)
        if dtype not in checks.FLOAT_DTYPES and dtype != jax.dtypes.float0:
            raise ValueError(
                f"{where}: leaf {jax.tree_util.keystr(path)} has dtype {dtype}; only float32, "
                "bfloat16 and float16 leaves can be averaged. Keep integer state out of the "
                "gradients (jax.grad of an integer parameter gives float0, which passes)"
            )
    return [leaf for _, leaf in paths_and_leaves], treedef


def _check_residuals(residuals, plan: SyncPlan, mesh_shape, where: str) -> None:
    want = plan.residual_sizes
    try:
        got = tuple((int(send.size), int(mean.size)) for send, mean in residuals)
    except (TypeError, ValueError, AttributeError):
        got = None
    if got != want:
        raise ValueError(
            f"{where}: residuals of per-device sizes {got} do not fit this tree on a "
            f"{mesh_shape[0]} x {mesh_shape[1]} mesh, which needs {want}; start from the "
            "optimizer's init (or residual_sizes) with the same settings"
        )


def _tie(x, previous, *, through: bool):
    """``x`` made to wait for ``previous`` (an ``optimization_barrier``): ``(x, previous)``.

    With ``through``, ``previous`` goes on from the barrier too, where JAX types the
    barrier's outputs as their inputs (JAX >= 0.11): XLA's simplifier drops a barrier's operand
    whose result is unused, and with it the tie, as it did with the sharded layout's rows
    (benchmarks/RESULTS.md, "Sharded state within a node"). JAX 0.10 types every output as
    varying over all the inputs' axes, so there the tied value goes on as it was. The
    replicated layout keeps its tie without it, and its bits as they were.
    """
    x, tied = jax.lax.optimization_barrier((x, previous))
    if not through:
        return x, previous
    same = jax.tree.map(
        lambda a, b: checks.varying_axes(a) == checks.varying_axes(b), previous, tied
    )
    return x, tied if all(jax.tree.leaves(same)) else previous


def _in_ready_order(parts: list, cross, layout, order, *, through: bool):
    """``cross(b, parts[b])`` of every bucket b, in the order the backward pass completes
    them (``buckets.ready_order``), each bucket's part tied to the previous bucket's crossed
    value (``_tie``) so that the exchanges between nodes run one after another (module
    docstring). ``cross`` returns (the value the next bucket waits for, anything else);
    returns both lists, in bucket order."""
    crossed, other = [None] * len(parts), [None] * len(parts)
    last = None
    for b in bucketing.ready_order(layout, order):
        part = parts[b]
        if last is not None:
            part, crossed[last] = _tie(part, crossed[last], through=through)
        crossed[b], other[b] = cross(b, part)
        last = b
    return crossed, other


def bucket_keys(key: jax.Array | None, axes, buckets) -> dict:
    """Each bucket's rounding key on this device, ``{b: key}`` for the indices ``buckets``,
    from the step's ``key`` (None: nearest rounding, and every bucket's key is None): the key
    folded with this device's index over ``axes``, then with the bucket's. Call it inside
    ``shard_map``.

    Every device rounds independently; the mean is gathered, so every device still ends
    with the same values. ``sync_mean`` and the pipelined step
    (``algorithms/bytegrad/stages.py``) both take their keys from here.
    """
    if key is None:
        return dict.fromkeys(buckets)
    device = jax.random.fold_in(key, jax.lax.axis_index(axes))
    return {b: jax.random.fold_in(device, b) for b in buckets}


def sends_nothing(config: SyncConfig, nodes: int) -> bool:
    """Whether a sync over ``nodes`` nodes sends nothing between them, and so compresses
    nothing: one node, with ``hierarchical=True``. Then ``sync_mean`` is
    ``gradient_allreduce``'s one all-reduce within the node, and the pipelined step is the
    one-program step. With ``hierarchical=False`` the codes are every device's, whatever the
    mesh's shape, so they still run (and give the same bits on 1 x 8 as on 2 x 4)."""
    return nodes == 1 and config.hierarchical


def sync_mean(
    tree,
    config: SyncConfig,
    *,
    average: bool = True,
    key: jax.Array | None = None,
    residuals: Residuals | None = None,
    order: tuple[int, ...] | None = None,
    sharded: Sharded | None = None,
    where: str = "compressed_mean",
) -> tuple:
    """``compressed_mean`` over a validated ``SyncConfig``: what the transforms call.

    Here the sync starts: the config is resolved once into a ``SyncPlan`` for this tree on
    this mesh (``config.plan_sync``), and each bucket's wire reads its ``BucketPlan``.

    ``order`` is the leaves' indices in the order the backward pass produces their gradients
    (``buckets.ready_order``); None for last bucket first. It orders the buckets' exchanges,
    never changes a value.

    With ``sharded`` (a step whose state is split within the node, ``shards.Sharded``),
    ``tree`` holds the node's sums, each device its blocks of the split leaves: each bucket's
    row of them (``buckets.to_rows``) crosses between nodes as the replicated layout's
    shard would, with the same sizes, wire and residuals, and the result is the mean in the
    same blocks (whole leaves whole).

    Where nothing crosses between nodes (``sends_nothing``: one node, hierarchical), nothing
    is compressed: the mean is ``sync_full_precision``'s, one all-reduce within the node per
    leaf as ``gradient_allreduce``'s (blocks of a ``sharded`` step's leaves as its), with no
    buckets, and ``residuals`` come back as they were (zero: what a compression leaves
    unsent). The arguments are checked as on the compressed path.

    Leaves the step averaged inside the backward loop (``sharded.exchanged``) pass on as
    they are, the rest is averaged (``shards.skip_exchanged``).

    Returns the pair (the mean, or sum, pytree; the new ``Residuals``, empty without
    ``residuals``).
    """
    within = shards.layout_of(sharded)
    if any(within.exchanged):
        rest = functools.partial(
            sync_mean, config=config, average=average, key=key, residuals=residuals, where=where
        )
        means, kept = shards.skip_exchanged(rest, tree, sharded, order)
        return means, Residuals(()) if kept is None else kept  # None: every leaf was
    n, _ = axis_sizes(config.node_axis, config.local_axis, where)
    if sends_nothing(config, n):
        _checked_plan(tree, key, residuals, config=config, average=average, within=within,
                      where=where)  # fmt: skip
        mean = sync_full_precision(tree, config, average=average, order=order, sharded=sharded)
        return mean, Residuals(() if residuals is None else residuals)
    sync = functools.partial(
        _sync_mean, config=config, average=average, order=order, within=within, where=where
    )
    return within.run(sync, tree, key, residuals)


def _checked_plan(tree, key, residuals, *, config, average, within, where):
    """``tree``'s flat leaves, treedef and ``SyncPlan`` on this mesh; raises, naming
    ``where``, for an integer leaf, a bad ``key``, an ``implementation`` this platform lacks
    or ``residuals`` that do not fit the plan."""
    n, local = axis_sizes(config.node_axis, config.local_axis, where)
    leaves, treedef = _flat_leaves(tree, where)
    plan = plan_sync(
        config,
        within.full_shapes(leaves, local, config.hierarchical, where),
        (n, local),
        weight=1.0 / (n * local) if average else 1.0,
        sums_within=within.sums_within,
        gathers_within=within.gathers_within,
    )
    check_key(config.stochastic, key, where)
    # Refuses "pallas" on a mesh of another platform than GPUs (a TPU mesh), or on a GPU
    # that Mosaic GPU does not run on, when the sync is traced (None chooses each kernel
    # where it is dispatched: nothing to refuse). The integer wire, which has no kernels on
    # any platform, has refused it in its plan.
    resolve_implementation(config.implementation, platform_of())
    if residuals is not None:
        _check_residuals(residuals, plan, (n, local), where)
    return leaves, treedef, plan


def _sync_mean(tree, key, residuals, *, config, average, order, within, where):
    leaves, treedef, plan = _checked_plan(
        tree, key, residuals, config=config, average=average, within=within, where=where
    )
    layout = plan.layout
    keys = bucket_keys(key, config.axes, range(len(layout.buckets)))
    parts = within.to_parts(leaves, layout, config.block_size)

    def cross(b, part):
        residual = None if residuals is None else residuals[b]
        return wires.sum_shard(part, plan.buckets[b], key=keys[b], residual=residual)

    crossed, kept = _in_ready_order(parts, cross, layout, order, through=within.ties_through)
    reduced = [wires.gather_shard(s, p) for s, p in zip(crossed, plan.buckets, strict=True)]
    out = within.from_parts(reduced, leaves, layout)
    return jax.tree.unflatten(treedef, out), Residuals(() if residuals is None else kept)


def compressed_mean(
    tree,
    *,
    sync: SyncConfig | None = None,
    average: bool = True,
    key: jax.Array | None = None,
    residuals=None,
):
    """Averages a pytree over all devices, 8- or 4-bit compressed between nodes (ByteGrad).

    Call it inside ``jax.shard_map`` on per-device values. Float leaves are bucketed,
    reduced within a node in float32 (in bfloat16 for a bucket of bfloat16 leaves: half the
    bytes, and an error far below the codes'; benchmarks/RESULTS.md, "bfloat16"), exchanged
    between nodes as block-wise 8- or 4-bit codes, and returned in their own dtypes; every
    device returns bit-identical values. On one node (hierarchical) nothing crosses between
    nodes: it is ``full_precision_mean``, one all-reduce per leaf, and the residuals come
    back as they were.
    With ``residuals`` (error feedback), each compression first adds what it left unsent
    last time, and the new residuals are returned too.

    Args:
      tree: a pytree of per-device float arrays (float0 leaves, from ``jax.grad`` of
        integer parameters, pass through).
      sync: the sync's settings, a ``SyncConfig`` (``SyncConfig(bits=4, wire="ring")``);
        None for the defaults. Its ``error_feedback`` follows ``residuals``.
      average: divide by the total device count (default); False returns the sum.
      key: PRNG key for stochastic rounding (``rounding="stochastic"``).
      residuals: None (no error feedback), or this device's ``Residuals``, from the
        previous call or zeros of ``residual_sizes``. Error feedback is on exactly when
        they are given.

    Returns:
      A pytree like ``tree`` holding the mean (or sum), typed as replicated over both axes;
      with ``residuals``, the pair (that pytree, the new residuals).

    Raises:
      ValueError: outside ``shard_map``, for an axis name the mesh lacks, for ``sync`` that
        is not a ``SyncConfig``, a bad ``key``, an integer or bool leaf, or ``residuals``
        that do not fit this tree and mesh.

    Examples:
      >>> import jax, jax.numpy as jnp, jax_bytegrad
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> f = jax.shard_map(jax_bytegrad.compressed_mean, mesh=mesh,
      ...                   in_specs=P(), out_specs=P())
      >>> f({"w": jnp.ones(3)})["w"]
      Array([1., 1., 1.], dtype=float32)

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    where = "compressed_mean"
    checks.boolean(average, "average", where)
    config = sync_config(sync, where)
    if config.error_feedback != (residuals is not None):
        config = config.replace(error_feedback=residuals is not None)
    if residuals is not None:
        residuals = Residuals(residuals)
    mean, kept = sync_mean(tree, config, average=average, key=key, residuals=residuals, where=where)
    return mean if residuals is None else (mean, kept)


def reduce_dtype_of(reduce_dtype, where: str) -> np.dtype | None:
    """``reduce_dtype`` as a NumPy dtype, None kept (each leaf's own dtype); raises a
    ``ValueError`` for anything but a float dtype the collectives average."""
    if reduce_dtype is None:
        return None
    try:
        dtype = jnp.dtype(reduce_dtype)
    except (TypeError, ValueError):
        dtype = None
    if dtype not in checks.FLOAT_DTYPES:
        raise ValueError(
            f"{where}: reduce_dtype must be None (each gradient's own dtype) or one of "
            f"float32, bfloat16, float16, got {reduce_dtype!r}; pass reduce_dtype=jnp.float32 "
            "to sum 16-bit gradients in float32"
        )
    return dtype


def full_precision_mean(
    tree,
    *,
    sync: SyncConfig | None = None,
    average: bool = True,
    reduce_dtype: jax.typing.DTypeLike | None = None,
):
    """Averages a pytree over all devices, uncompressed (GradientAllReduce), by default in
    each leaf's own dtype: ``compressed_mean``'s twin, over the same ``SyncConfig``.

    Call it inside ``jax.shard_map`` on per-device values. Of ``sync`` it reads the axes and
    ``hierarchical``: with ``hierarchical=True`` each leaf is reduce-scattered within the
    node, all-reduced between nodes and gathered within the node, so each device sends 1/L of
    the bytes between nodes; otherwise one all-reduce spans both axes.

    Args:
      tree: a pytree of per-device float arrays (float0 leaves, from ``jax.grad`` of
        integer parameters, pass through).
      sync: a ``SyncConfig`` (``SyncConfig(hierarchical=True)``); None for one all-reduce
        over the default axes (``SyncConfig(hierarchical=False)``).
      average: divide by the total device count (default); False returns the sum.
      reduce_dtype: the dtype every collective sums in (None: each leaf's own): each leaf
        is cast to it first and the mean back to the leaf's dtype. ``jnp.float32`` sums
        bfloat16 gradients in float32, as XLA:CPU does anyway (it runs bfloat16 collectives
        in float32), at twice bfloat16's bytes on a GPU.

    Returns:
      A pytree like ``tree`` holding the mean (or sum), typed as replicated over both axes.

    Raises:
      ValueError: outside ``shard_map``, for an axis name the mesh lacks, for ``sync`` that
        is not a ``SyncConfig``, for an integer or bool leaf, or for a ``reduce_dtype`` that
        is not a float dtype.

    Examples:
      >>> import functools, jax, jax.numpy as jnp, jax_bytegrad
      >>> sync = jax_bytegrad.SyncConfig(hierarchical=True)
      >>> total = functools.partial(jax_bytegrad.full_precision_mean, sync=sync, average=False)
      >>> specs = jax.sharding.PartitionSpec()
      >>> jax.shard_map(total, mesh=jax_bytegrad.make_mesh(1, 1), in_specs=specs,
      ...               out_specs=specs)(jnp.ones(2))
      Array([1., 1.], dtype=float32)
    """
    where = "full_precision_mean"
    checks.boolean(average, "average", where)
    config = SyncConfig(hierarchical=False, where=where) if sync is None else sync
    config = sync_config(config, where)
    dtype = reduce_dtype_of(reduce_dtype, where)
    return sync_full_precision(tree, config, average=average, reduce_dtype=dtype)


def sync_full_precision(
    tree,
    config: SyncConfig,
    *,
    average: bool = True,
    reduce_dtype: np.dtype | None = None,
    order: tuple[int, ...] | None = None,
    sharded: Sharded | None = None,
):
    """``full_precision_mean`` over a validated ``SyncConfig`` (its axes and
    ``hierarchical``), as ``sync_mean`` is ``compressed_mean``'s: what ``gradient_allreduce``,
    ``qadam`` and DiLoCo call. ``reduce_dtype`` is a checked dtype (``reduce_dtype_of``) or
    None. ``order`` orders the hierarchical buckets as ``sync_mean``'s. With ``sharded``
    (``sync_mean``), ``tree`` holds the node's sums and only the all-reduce between nodes is
    left, as with ``hierarchical=True``; split leaves stay blocks. Leaves averaged inside the
    backward loop pass on, as ``sync_mean``'s."""
    within = shards.layout_of(sharded)
    if any(within.exchanged):

        def rest(leaves, sharded, order):
            return sync_full_precision(leaves, config, average=average, reduce_dtype=reduce_dtype,
                                       order=order, sharded=sharded), None  # fmt: skip

        return shards.skip_exchanged(rest, tree, sharded, order)[0]
    mean = functools.partial(
        _full_precision_mean, config=config, average=average, dtype=reduce_dtype,
        order=order, within=within,
    )  # fmt: skip
    return within.run(mean, tree)


def _full_precision_mean(tree, *, config, average, dtype, order, within):
    leaves, treedef = _flat_leaves(tree, "full_precision_mean")
    wide = [_cast(x, dtype) for x in leaves]
    means = _summed_means(wide, config, average, order, within)
    out = [_cast(mean, x.dtype) for mean, x in zip(means, leaves, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _cast(x, dtype):
    """``x`` in ``dtype``; as it is for None (no ``reduce_dtype``) and for a float0 leaf."""
    if dtype is None or jnp.dtype(x.dtype) == jax.dtypes.float0:
        return x
    return x.astype(dtype)


def _summed_means(leaves, config: SyncConfig, average, order, within) -> list:
    """``full_precision_mean`` of the flat leaves, each in its own dtype, in the layout
    ``within`` (``shards.Whole``, ``shards.Sharded``)."""
    node_axis, local_axis = config.axes
    n, local = axis_sizes(node_axis, local_axis, "full_precision_mean")
    devices = n * local
    dims = within.leaf_dims(len(leaves))

    def mean(x):
        return x / np.asarray(devices, x.dtype) if average else x

    def reduce(x):
        if jnp.dtype(x.dtype) == jax.dtypes.float0:
            return x
        return mean(jax.lax.psum(x, config.axes))

    def whole(x, dim, part):
        if dim is not None:
            return part
        return patterns.gather_flat(part, local_axis, x.size).reshape(x.shape)

    # On one node a hierarchical mean is one all-reduce within it: there is nothing to send
    # between nodes, so no reduce-scatter and gather around it.
    if within.per_leaf(config.hierarchical and n > 1, local):
        return [reduce(x) for x in leaves]
    # Each leaf is reduce-scattered within the node, summed between nodes and gathered. The
    # leaves go in buckets of whole leaves, in the order the backward pass completes them,
    # each bucket's sums between nodes tied to the previous bucket's, as sync_mean ties its
    # buckets (module docstring): otherwise XLA:GPU merges them all after the last gradient.
    layout = bucketing.make_layout(leaves, bucket_bytes=DEFAULT_BUCKET_BYTES, granularity=1)
    held = {i for members in layout.buckets for i in members}
    # What no bucket holds (float0 and empty leaves) as the flat path does.
    reduced = [x if i in held else reduce(x) for i, x in enumerate(leaves)]

    def cross(b, members):
        sums = [
            jax.lax.psum(within.node_part(x, dims[i], local_axis, local), node_axis)
            for i, x in zip(layout.buckets[b], members, strict=True)
        ]
        return sums, None

    members = [[leaves[i] for i in bucket] for bucket in layout.buckets]
    parts, _ = _in_ready_order(members, cross, layout, order, through=within.ties_through)
    for b, bucket in enumerate(layout.buckets):
        for i, part in zip(bucket, parts[b], strict=True):
            reduced[i] = mean(whole(leaves[i], dims[i], part))
    return reduced
