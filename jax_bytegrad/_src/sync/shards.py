"""What the sync is told of a state split within the node: its layouts and the blocks.

The sync (``collectives``) asks a layout object what each device's updates are: ``Whole``
(every device's gradient of the whole leaves) or ``Sharded`` (each device's blocks of them,
split as ``sharding/rule.py`` says), and never branches on the setting. The helpers below cut,
place, gather and sum a leaf's blocks, and ``check_elementwise`` says whether an optimizer can
run on blocks.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src.sync import buckets, patterns


@dataclasses.dataclass(frozen=True)
class Whole:
    """The replicated layout: every device holds the whole leaves, and each device's gradient
    of them comes to the sync. The sync reduce-scatters each bucket within the node, crosses
    between nodes and gathers the bucket within the node again. ``Sharded`` is the other
    layout; both answer the same questions, so the sync asks and never branches."""

    # Whether the sync still sums within the node, gathers the reduced buckets within it, and
    # lets each tied bucket go on from its barrier (``collectives._tie``).
    sums_within = True
    gathers_within = True
    ties_through = False
    # Per leaf, whether the step averaged it inside the backward loop (``Sharded``): none.
    exchanged = ()

    def full_shapes(self, leaves, local: int, hierarchical: bool, where: str):
        """The whole leaves, whose buckets the sync lays out: the updates' own. Raises, naming
        ``where``, where this layout's updates cannot go on the sync (never, here)."""
        del local, hierarchical, where
        return leaves

    def run(self, fn, *args):
        """``fn(*args)``: the library's own code over the updates."""
        return fn(*args)

    # What each bucket's wire sums, ``to_parts(leaves, layout, block_size)``: the buckets, as
    # parts; and ``from_parts(reduced, leaves, layout)``, the leaves of the reduced buckets.
    to_parts = staticmethod(buckets.to_bucket_parts)
    from_parts = staticmethod(buckets.from_buckets)

    def leaf_dims(self, count: int) -> tuple[int | None, ...]:
        """Per leaf, the dimension split within the node: none."""
        return (None,) * count

    def per_leaf(self, hierarchical: bool, local: int) -> bool:
        """Whether the full-precision mean is one all-reduce per leaf over both axes, with
        nothing to reduce-scatter within the node first."""
        return not (hierarchical and local > 1)

    def node_part(self, x, dim, axis: str, local: int) -> jax.Array:
        """This device's part of the node's sum of ``x``: of its flat values."""
        del dim
        return patterns.scatter_flat(x.reshape(-1), axis, local)

    def momentum_within(self, mu):
        """The momentum each device adds its gradient to (``qadam``): ``mu`` itself."""
        return mu

    def exchanged_from(self, given, tree):
        """``tree`` with the leaves in ``exchanged`` taken from ``given`` instead (or, for a
        ``given`` of None, left out as None: an empty subtree)."""
        if not any(self.exchanged):
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        given = jax.tree.leaves(given) if given is not None else [None] * len(leaves)
        mixed = [g if done else x for x, g, done in zip(leaves, given, self.exchanged, strict=True)]
        return jax.tree.unflatten(treedef, mixed)

    def varying_axes(self, node_axis: str, local_axis: str) -> set[str]:
        """The axes every update varies over: each device's own gradient."""
        return {node_axis, local_axis}

    def all_agree(self, predicate, tree) -> jax.Array:
        """``predicate(tree)``, a boolean every device holds alike already."""
        return predicate(tree)


WHOLE = Whole()


@dataclasses.dataclass(frozen=True)
class Sharded(Whole):
    """What a step whose state is split within the node hands its optimizer, as the
    ``sharded`` extra argument of ``update``: the sync's layout there.

    The gradient transformations that sync (``bytegrad``, ``gradient_allreduce``, ``qadam``)
    then return the mean over every device in this device's blocks: for a split leaf
    (``dims[i]`` the dimension split over ``local_axis``), its block; for a whole leaf
    (``dims[i]`` None), all of it. The updates they are given are either each device's
    gradient of the whole leaves (``summed`` False, ``shard="optimizer"``: the sync sums
    within the node itself, each bucket's reduce-scatter in its own chain), or already the
    node's sums in those blocks (``summed`` True, ``shard="params"``, where ``jax.grad`` of the
    gather did the reduce-scatter): then only the hop between nodes is left. Each bucket's
    rows (``buckets.to_rows``) cross between nodes as the replicated layout's shards would,
    with the same sizes, wire and residuals.

    Attributes:
      local_axis: the mesh axis within a node.
      dims: per leaf of the updates, the dimension split over ``local_axis``, or None.
      summed: whether the updates are the node's sums already.
      exchanged: per leaf, whether the step averaged it between nodes already, inside the
        backward loop (``steps/loop_exchange.py``): the sync passes those on as they are
        (``skip_exchanged``). Empty: none.
    """

    local_axis: str
    dims: tuple[int | None, ...]
    summed: bool
    exchanged: tuple[bool, ...] = ()

    gathers_within = False
    # XLA's simplifier would drop a tied row's barrier (``collectives._tie``).
    ties_through = True

    @property
    def sums_within(self) -> bool:
        return not self.summed

    def full_shapes(self, leaves, local, hierarchical, where) -> list[jax.ShapeDtypeStruct]:
        """The whole leaves' shapes and dtypes, from the updates' leaves."""
        if not hierarchical:
            raise ValueError(
                f"{where}: state split within the node (shard=...) needs hierarchical=True: "
                "each device then sends its share of its node's sum; hierarchical=False would "
                "compress every device's own gradient between nodes"
            )
        if len(self.dims) != len(leaves):
            raise ValueError(
                f"{where}: the sharded step's layout names {len(self.dims)} leaves, but the "
                f"updates have {len(leaves)}; pass the params' own tree"
            )
        if not self.summed:
            return [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
        out = []
        for leaf, dim in zip(leaves, self.dims, strict=True):
            shape = list(np.shape(leaf))
            if dim is not None:
                shape[dim] *= local
            out.append(jax.ShapeDtypeStruct(tuple(shape), leaf.dtype))
        return out

    def run(self, fn, *args):
        """``fn(*args)`` in a jit of its own, which the sharded step's check of the optimizer
        leaves out (``block_aware``)."""
        return block_aware(fn, *args)

    def to_parts(self, leaves, layout, block_size):
        rows = buckets.own_rows if self.summed else buckets.to_rows
        return rows(leaves, layout, self.dims, self.local_axis)

    def from_parts(self, reduced, leaves, layout):
        return buckets.from_rows(reduced, leaves, layout, self.dims, self.local_axis)

    def leaf_dims(self, count):
        return self.dims

    def per_leaf(self, hierarchical, local):
        return False

    def node_part(self, x, dim, axis, local):
        """This device's part of the node's sum: its block of a split leaf, or of the flat
        values of a whole one; where the updates are the node's sums, cut from them."""
        if dim is not None:
            if self.summed:
                return x
            return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
        if self.summed:
            return patterns.own_flat(x.reshape(-1), axis, local)
        return patterns.scatter_flat(x.reshape(-1), axis, local)

    def momentum_within(self, mu):
        """So that the node's sum of the devices' ``b1 m + (1 - b1) g`` is what the sync sums,
        where devices hold blocks of ``m``: ``L m`` in this device's block (zeros elsewhere),
        or ``L m`` everywhere where the updates are the node's sums."""
        local = jax.lax.axis_size(self.local_axis)
        leaves, treedef = jax.tree.flatten(mu)
        out = []
        for m, dim in zip(leaves, self.dims, strict=True):
            if self.summed or dim is not None:
                m = m * np.asarray(local, m.dtype)
            if not self.summed:
                m = place_block(m, dim, self.local_axis)
            out.append(m)
        return jax.tree.unflatten(treedef, out)

    def varying_axes(self, node_axis, local_axis):
        """The node's sums vary over the node axis only."""
        return {node_axis} if self.summed else {node_axis, local_axis}

    def all_agree(self, predicate, tree):
        """Each device holds its blocks of ``tree``: the node's devices decide together."""

        def node_agrees(tree):
            mine = predicate(tree).astype(jnp.int32)
            return jax.lax.pmin(mine, self.local_axis) > 0

        return block_aware(node_agrees, tree)


def skip_exchanged(sync, updates, sharded: Sharded | None, order):
    """``sync(rest, sharded=..., order=...)`` on the leaves of ``updates`` that the step did not
    average inside the backward loop (``Sharded.exchanged``), with ``sharded`` and ``order``
    (leaf indices, or None) cut to them; the others pass on as they are.

    ``sync`` returns ``(means, other)``: the means shaped as what it was given (the whole
    ``updates``, whose paths its errors name, where the loop exchanged none; else a list of
    the rest's leaves), and anything else (residuals), which is returned as it is. Returns
    ``(the updates' pytree of means, other)``.
    """
    if not any(layout_of(sharded).exchanged):
        return sync(updates, sharded=sharded, order=order)
    leaves, treedef = jax.tree.flatten(updates)
    keep = [i for i, done in enumerate(sharded.exchanged) if not done]
    out = list(leaves)
    other = None
    if keep:
        index = {leaf: j for j, leaf in enumerate(keep)}
        rest = dataclasses.replace(sharded, dims=tuple(sharded.dims[i] for i in keep), exchanged=())
        order = None if order is None else tuple(index[i] for i in order if i in index)
        means, other = sync([leaves[i] for i in keep], sharded=rest, order=order)
        for i, mean in zip(keep, means, strict=True):
            out[i] = mean
    return jax.tree.unflatten(treedef, out), other


def layout_of(sharded: Sharded | None) -> Whole:
    """The sync's layout: the step's ``Sharded``, or ``WHOLE`` where it hands none over."""
    return WHOLE if sharded is None else sharded


def own_block(x: jax.Array, dim: int | None, axis: str) -> jax.Array:
    """This device's block of a whole leaf ``x`` split along ``dim`` over ``axis`` (``x``
    itself for a leaf kept whole)."""
    if dim is None:
        return x
    size = x.shape[dim] // jax.lax.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, axis=dim)


def place_block(block: jax.Array, dim: int | None, axis: str) -> jax.Array:
    """The whole leaf that holds ``block`` where this device's block lies, zeros elsewhere
    (``block`` itself for a leaf kept whole): summed over ``axis``, the whole leaf."""
    if dim is None:
        return block
    local = jax.lax.axis_size(axis)
    shape = list(block.shape)
    shape[dim] *= local
    start = jax.lax.axis_index(axis) * block.shape[dim]
    return jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, block.dtype), block, start, dim)


def gather_block(x: jax.Array, dim: int | None, axis: str) -> jax.Array:
    """The whole leaf of the blocks ``x`` over ``axis`` (a tiled all_gather along ``dim``),
    typed as one value over ``axis``: the params after an update."""
    if dim is None:
        return x
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True, to="invarying")


def node_sum(g: jax.Array, dim: int | None, axis: str) -> jax.Array:
    """The sum over ``axis`` of each device's gradient ``g`` of a whole leaf: this device's
    block of it (a reduce-scatter) for a split leaf, all of it for a whole one. Summed in
    float32, as the replicated step's buckets sum, and returned in ``g``'s dtype."""
    wide = g.astype(jnp.float32)
    if dim is None:
        return jax.lax.psum(wide, axis).astype(g.dtype)
    return jax.lax.psum_scatter(wide, axis, scatter_dimension=dim, tiled=True).astype(g.dtype)


# The optimizer on blocks ----------------------------------------------------------------------

# The name of the jitted functions in which the library's own code handles the blocks of a
# sharded step knowingly (``block_aware``): a sync, a decision reduced over the node, a block
# placed in its whole leaf. ``check_elementwise`` leaves them out.
BLOCK_AWARE = "jax_bytegrad_block_aware"

# Primitives whose every output element depends on the same element of each operand (or on
# scalars): the optimizer's update may use them on blocks and get each block of the update
# the whole arrays would give.
ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
    is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real rem
    round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan tanh xor pvary pcast
    optimization_barrier""".split()
)
# Primitives that call a jaxpr of their own, looked into.
_CALLS = frozenset("jit pjit closed_call core_call custom_jvp_call custom_vjp_call cond".split())


def block_aware(fn, *args):
    """``fn(*args)`` inside a jit named ``BLOCK_AWARE``: the library's own code over a sharded
    step's blocks, which knows how they are split (a sync between nodes, a decision reduced
    over the node, a block placed in its whole leaf) and which ``check_elementwise`` leaves
    out. Inlined by XLA: it changes no value."""

    def jax_bytegrad_block_aware(*args):
        return fn(*args)

    return jax.jit(jax_bytegrad_block_aware)(*args)


def _offender(jaxpr) -> str | None:
    """The first primitive of ``jaxpr`` that mixes elements, or None."""
    from jax.extend import core

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("jit", "pjit") and eqn.params.get("name") == BLOCK_AWARE:
            continue
        if name in _CALLS or name in ("while", "custom_lin"):
            for sub in core.jaxprs_in_params(eqn.params):
                found = _offender(sub)
                if found:
                    return found
            continue
        if name in ELEMENTWISE:
            continue
        # On scalars (step counts, schedules) or PRNG keys, nothing of a block is mixed.
        operands = [v.aval for v in eqn.invars if hasattr(v.aval, "shape")]
        if all(
            np.prod(a.shape) <= 1 or jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
            for a in operands
        ):
            continue
        return name
    return None


def check_elementwise(jaxpr, where: str) -> None:
    """Raises a ``ValueError`` unless the optimizer's update ``jaxpr`` (of a step whose state
    is split within the node) is elementwise outside its sync: each device updates its blocks
    alone, so a transformation that reduces over a whole leaf or over all of them (global-norm
    clipping, factored or layer-wise optimizers) would see one block and silently differ."""
    found = _offender(jaxpr)
    if found is not None:
        raise ValueError(
            f"{where}: with shard=..., each device updates its blocks of the parameters, so "
            "the optimizer after the sync must be elementwise (Adam, AdamW, SGD, Lion, "
            f"RMSProp...); this one computes {found!r} over the update, which on a block would "
            "give another result than on the whole (optax.clip_by_global_norm, adafactor, "
            "lamb do this). Use shard=None, or clip elementwise (optax.clip)"
        )
