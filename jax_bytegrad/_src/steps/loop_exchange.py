"""Each scanned layer's exchange between nodes inside the backward loop: ``exchange_in_loop``.

Follows PyTorch FSDP's per-module reduce-scatter hooks and DeepSpeed's per-layer gradient
buckets (Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
VLDB 2023): a layer's gradient starts its exchange as soon as the backward pass has it. With
``shard="params"`` a scanned stack's gradient leaves the loop whole, so without help its
exchange between nodes can only start after the loop. The user marks the layer's params in
the scan body with ``exchange_in_loop`` (an identity anywhere else), and the step, which
holds the sync's settings, rewrites its trace of the loss: each mark becomes a
``jax.custom_vjp`` whose backward runs the sync's own wire between nodes on that layer's
node sums, inside the loop (``LoopSync``), and the optimizer's sync then skips those leaves
(``shards.Sharded.exchanged``).

With ``shard="full"`` the same mark says where the layer is gathered (``loop_gather``).

Why a mark the step rewrites, and not a function that reads the sync's settings: a transform
depends only on what it is given (no ambient state), and the loss function is the user's. The
step traces the loss anyway (``remat_order``); it finds the marks in that trace, inside
``lax.scan`` (``nn.scan``), ``jax.checkpoint`` (``nn.remat``) and ``jax.jit`` bodies, and
rebuilds those calls through their public APIs with the marks replaced.
"""

import dataclasses
from typing import Any

import jax
import jax.extend as jex
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src.sharding import rule
from jax_bytegrad._src.steps import interpret, loop_marks
from jax_bytegrad._src.steps.loop_marks import (
    MARK,
    PASS,
    at_row,
    inner_origins,
    is_mark,
    origin_of,
    scan_counts,
)
from jax_bytegrad._src.sync import collectives, shards
from jax_bytegrad._src.sync.config import Residuals, SyncConfig
from jax_bytegrad._src.sync.patterns import make_varying
from jax_bytegrad._src.transforms import ByteGradState

# Folded into the step's rounding key for the marked layers' keys ("loop"), so that they
# draw apart from the keys of the sync after the backward pass (the split of the state's key
# in ``transforms.py``).
LOOP_KEYS = 0x6C6F6F70


def exchange_in_loop(tree):
    """Marks a layer's params so that a ``shard="params"`` step exchanges their gradient between
    nodes inside the backward loop, as soon as the layer's backward has produced it.

    Wrap the params a scan body gets for one layer: in ``jax.lax.scan``, the body's slice of
    the stack; in Flax linen, ``nn.map_variables(nn.remat(Block), "params", exchange_in_loop,
    init=True)`` scanned by ``nn.scan``; in NNX, ``nnx.update(block,
    exchange_in_loop(nnx.state(block, nnx.Param)))`` at the top of the ``nnx.scan`` body. In
    the forward pass it is an identity. Inside a ``Strategy(..., shard="params")`` step of
    ``gradient_allreduce``, ``bytegrad`` or ``qadam``, the gradient of the marked params is
    averaged between nodes there, on the sync's own wire (the same settings and bytes; with
    stochastic rounding, each layer on its own key; with error feedback, each layer with its
    own residuals, for which the step's ``init`` needs a batch), and the sync after the
    backward pass skips them; in ``qadam``'s compressed phase what crosses is the layer's
    momentum ``b1 m + (1 - b1) g``, on the optimizer's ``m``. Inside a ``shard="full"`` step
    the marked params are gathered across nodes at the mark, and their gradient
    reduce-scattered there (put the mark inside the layer's ``jax.checkpoint``; leaves the
    loss does not mark are gathered before it). Anywhere else (outside a step, another
    ``shard=``, another algorithm) it stays an identity and the gradient crosses after the
    backward pass, as without it.

    Args:
      tree: a pytree of arrays: one layer's slices of the stacked params, as the scan body
        gets them.

    Returns:
      ``tree``, unchanged.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax_bytegrad.sharding import exchange_in_loop
      >>> def body(x, w):
      ...     return jnp.tanh(x @ exchange_in_loop(w)), None
      >>> x, _ = jax.lax.scan(body, jnp.ones((2, 4)), jnp.zeros((3, 4, 4)))
      >>> x.shape
      (2, 4)
    """

    def jax_bytegrad_exchange_in_loop(*leaves):
        # Typed as varying over the manual axes, as a step's params are: a step that exchanges
        # the layer here hands it over unvaried, so that the gradient's sum over the nodes is
        # this call's own (a no-op outside shard_map). The barrier keeps JAX from forwarding
        # the inputs past the call, so the step finds it.
        return jax.lax.optimization_barrier(tuple(_varying(x) for x in leaves))

    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    out = jax.jit(jax_bytegrad_exchange_in_loop)(*leaves)
    return jax.tree.unflatten(treedef, list(out))


def _varying(x, axes=None):
    """``x`` typed as varying over ``axes`` (None: the manual axes being traced)."""
    if axes is None:
        mesh = jax.sharding.get_abstract_mesh()
        axes = tuple(getattr(mesh, "manual_axes", ()) or ())
    return make_varying(x, axes)


@dataclasses.dataclass(frozen=True)
class LoopSync:
    """What a step's sync does to a marked layer's gradient, inside the loop.

    Attributes:
      config: the sync's settings (its axes, wire, bits).
      compressed: ``sync_mean`` (bytegrad, qadam after warm-up) or ``sync_full_precision``
        (gradient_allreduce, qadam's warm-up).
      average: divide by the device count.
      reduce_dtype: the full-precision sync's dtype (None: each leaf's own).
      b1: None to exchange the gradient; else the momentum's decay, to exchange each
        device's momentum ``b1 m + (1 - b1) g`` (``qadam``'s compressed phase), given the
        layer's ``m`` (``with_exchange``'s ``moments``).
    """

    config: SyncConfig
    compressed: bool
    average: bool = True
    reduce_dtype: Any = None
    b1: float | None = None

    def from_state(self, opt_state) -> tuple[list | None, jax.Array | None, Residuals | None]:
        """What the exchange takes from the optimizer's state: with ``b1``, the leaves of its
        ``m``; with ``takes_key``, ``bytegrad``'s rounding key, before its update splits it;
        with ``feeds_back``, its ``residuals`` (the marked layers' are the last,
        ``loop_marks.fed_residuals``).

        Raises:
          ValueError: if the state lacks the moments or the key.
        """
        moments = key = residuals = None
        if self.b1 is not None:
            moments = optax.tree.get(opt_state, "mu")
            if moments is None:
                raise ValueError("exchange_in_loop: a momentum exchange needs the state's mu")
            moments = jax.tree.leaves(moments)
        if self.takes_key:
            key = optax.tree.get(opt_state, "key", filtering=_bytegrad_key)
            if key is None:
                raise ValueError("exchange_in_loop: stochastic rounding needs bytegrad's key")
        if self.feeds_back:
            residuals = optax.tree.get(opt_state, "residuals")
        return moments, key, residuals

    @property
    def takes_key(self) -> bool:
        """Whether the exchange rounds stochastically, and so takes a key."""
        return self.compressed and self.config.stochastic

    @property
    def feeds_back(self) -> bool:
        """Whether the exchange keeps error feedback: each marked layer's residuals, carried
        in the optimizer state's ``residuals`` after the sync's own (``residuals``)."""
        return self.compressed and self.config.error_feedback

    def exchange(self, blocks: list, dims: tuple, moments: list | None = None, key=None,
                 residuals: Residuals | None = None) -> tuple[list, Residuals]:  # fmt: skip
        """The mean over every device of a layer's gradient, given as this device's blocks of
        its node's sums (inside ``shard_map`` over both axes); with ``b1``, of the devices'
        momenta on ``moments`` (this device's blocks of the layer's ``m``), as ``qadam``'s
        compressed phase computes them. ``key``: the layer's rounding key (``takes_key``),
        the same on every device; ``residuals``: this device's error feedback for the layer
        (``feeds_back``). Returns the mean and the new residuals (empty without)."""
        sharded = shards.Sharded(self.config.local_axis, dims, summed=True)
        if self.b1 is not None:
            within = sharded.momentum_within(list(moments))
            blocks = optax.tree.update_moment(list(blocks), within, self.b1, 1)
        if self.compressed:
            return collectives.sync_mean(
                blocks, self.config, average=self.average, key=key, residuals=residuals,
                sharded=sharded, where=MARK,
            )  # fmt: skip
        mean = collectives.sync_full_precision(
            blocks, self.config, average=self.average, reduce_dtype=self.reduce_dtype,
            sharded=sharded,
        )  # fmt: skip
        return mean, Residuals()


def _bytegrad_key(path, value) -> bool:
    del value
    return getattr(path[-1], "tuple_name", None) == ByteGradState.__name__


def _has_mark(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if is_mark(eqn):
            return True
        if any(_has_mark(sub) for sub in jex.core.jaxprs_in_params(eqn.params)):
            return True
    return False


class Rewrite:
    """One rewrite of a loss's trace: the marks become the exchange (``LoopSync``)."""

    def __init__(self, sync: LoopSync, mesh, dims, moments: dict | None = None,
                 keys: dict | None = None, residuals: dict | None = None):  # fmt: skip
        self.sync, self.mesh, self.dims = sync, mesh, dims
        # Per marked leaf, what its exchange also takes (``LoopSync.b1``'s ``m``, a rounding
        # key; per call, by its first leaf, the ``Slot``s of its residual vectors; per leaf,
        # ``loop_gather``'s), as the current scope sees it: outside a loop whole (one key),
        # inside a loop's body its slice (this iteration's key, this layer's residuals).
        self.moments = dict(moments or {})
        self.keys = dict(keys or {})
        self.residuals = dict(residuals or {})

    def eval(self, jaxpr, consts, args, origin: dict) -> list:
        """``jaxpr`` on ``consts`` and ``args``, as JAX's own interpreter runs it, but with
        the calls that hold a mark rebuilt. ``origin`` maps a variable to ``(leaf, kind)``:
        the param leaf it is (``"whole"``), a loop's slice of (``"slice"``), or a loop closes
        over (``"const"``)."""

        def run(eqn, ins):
            outs = self._eqn(eqn, ins, [origin_of(origin, v) for v in eqn.invars])
            if eqn.primitive.name in PASS and origin_of(origin, eqn.invars[0]) is not None:
                origin[eqn.outvars[0]] = origin[eqn.invars[0]]
            return outs

        return interpret.evaluate(jaxpr, consts, args, run)

    def _eqn(self, eqn, ins, origins) -> list:
        name = eqn.primitive.name
        if is_mark(eqn) and ins:
            return self._mark(ins, origins)
        # (A mark left with no inputs, its values unused where JAX traced it (a Flax
        # ``nn.map_variables`` under ``nn.remat``), marks nothing: it runs as it is.)
        subs = list(jex.core.jaxprs_in_params(eqn.params))
        if subs and any(_has_mark(s) for s in subs):
            if name == "scan":
                return self._scan(eqn, ins, origins)
            if name in ("jit", "pjit", "closed_call", "core_call"):
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                inner_origin = inner_origins(getattr(inner, "jaxpr", inner), origins)
                return self.eval(_open(inner), _consts(inner), ins, inner_origin)
            if name in ("remat", "remat2", "checkpoint"):
                return self._remat(eqn, ins, origins)
            raise ValueError(
                f"exchange_in_loop: the mark is inside a {name!r} call, which the step does "
                "not rebuild; put it in a jax.lax.scan, jax.checkpoint or jax.jit body"
            )
        return interpret.bind(eqn, ins)

    def _scan(self, eqn, ins, origins) -> list:
        p = eqn.params
        nc, nk = scan_counts(p)
        consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        body = p["jaxpr"]
        # The loop slices its xs: a marked slice of a leaf is one layer of it.
        sliced = [
            None if o is None or o[1] != "whole" else (o[0], "slice") for o in origins[nc + nk :]
        ]
        whole = [None if o is None else (o[0], "const") for o in origins[:nc]]
        inner_origin = inner_origins(body.jaxpr, [*whole, *[None] * nk, *sliced])
        # The moments of the leaves the loop slices are sliced with them and their keys split
        # into one per iteration, as extra xs; their residuals' slots take the iteration's
        # row.
        outer, outer_keys, outer_fed = self.moments, self.keys, self.residuals
        leaves = {o[0] for o in sliced if o is not None}
        slid = sorted(leaves & set(outer))
        keyed = sorted(leaves & set(outer_keys))
        fed = sorted(leaves & set(outer_fed))

        def step(carry, x):
            x, extra, keys, row = x
            self.moments = {**outer, **dict(zip(slid, extra, strict=True))}
            self.keys = {**outer_keys, **dict(zip(keyed, keys, strict=True))}
            self.residuals = {**outer_fed, **{leaf: at_row(outer_fed[leaf], row) for leaf in fed}}
            try:
                outs = self.eval(body.jaxpr, body.consts, [*consts, *carry, *x], dict(inner_origin))
            finally:
                self.moments, self.keys, self.residuals = outer, outer_keys, outer_fed
            return outs[:nk], outs[nk:]

        extra = [outer[leaf] for leaf in slid]
        keys = [jax.random.split(outer_keys[leaf], p["length"]) for leaf in keyed]
        row = jax.numpy.arange(p["length"]) if fed else ()
        carry, ys = jax.lax.scan(
            step, list(init), (list(xs), extra, keys, row), length=p["length"],
            reverse=p["reverse"], unroll=p["unroll"],
        )  # fmt: skip
        return [*carry, *ys]

    def _remat(self, eqn, ins, origins) -> list:
        inner = eqn.params["jaxpr"]
        inner_origin = inner_origins(getattr(inner, "jaxpr", inner), origins)

        def run(*args):
            return self.eval(_open(inner), _consts(inner), list(args), dict(inner_origin))

        policy, prevent_cse = eqn.params.get("policy"), eqn.params.get("prevent_cse", True)
        return jax.checkpoint(run, policy=policy, prevent_cse=prevent_cse)(*ins)

    def _marked(self, origins) -> tuple[list[int], list[int | None]]:
        """The leaves a mark's inputs are, and each one's split dimension as the mark sees it
        (one less for a loop's slice)."""
        leaves = []
        for o in origins:
            if o is None or o[1] == "const":
                raise ValueError(
                    "exchange_in_loop: mark the params as the scan body gets them (its xs: one "
                    "layer's slices of the stacked params), not values computed from them or "
                    "a whole stack the loop closes over"
                )
            leaves.append(o[0])
        dims = []
        for leaf, (_, kind) in zip(leaves, origins, strict=True):
            dim = self.dims[leaf]
            if kind == "slice" and dim is not None:
                if dim == 0:
                    raise ValueError(
                        "exchange_in_loop: a marked stack is split within the node along the "
                        "dimension the loop runs over; make a layer's own dimension divisible "
                        "by the devices per node"
                    )
                dim -= 1
            dims.append(dim)
        return leaves, dims

    def _mark(self, ins, origins) -> list:
        leaves, dims = self._marked(origins)
        moments = [self.moments[leaf] for leaf in leaves] if self.sync.b1 is not None else []
        # One key per call: the sync draws each bucket's and device's own from it. It goes in
        # as its data, with its implementation beside.
        key, impl = [], None
        if self.sync.takes_key:
            layer_key = self.keys[leaves[0]]
            key, impl = [jax.random.key_data(layer_key)], jax.random.key_impl(layer_key)
        residuals = self.residuals[leaves[0]] if self.sync.feeds_back else []
        exchanging = _exchanging(self, tuple(dims), len(moments), impl, len(residuals))
        return list(exchanging(*ins, *moments, *key, *residuals))


def _exchanging(rewrite: Rewrite, dims: tuple, moments: int = 0, impl=None, residuals: int = 0):
    """The mark of a layer whose split dimensions are ``dims``: an identity whose backward
    averages the layer's gradient between nodes. After the layer's leaves it takes
    ``moments`` of them, which its backward exchanges with the gradient (``LoopSync.b1``),
    then, given the key implementation ``impl``, its rounding key's data, then the ``Slot``s
    of ``residuals`` error-feedback vectors, each the node's devices' own as ``(local, n)``,
    which its backward reads and overwrites with the new ones. The cotangents of all but the
    layer's leaves are zero."""
    sync, mesh, local_axis = rewrite.sync, rewrite.mesh, rewrite.sync.config.local_axis
    node_axis = sync.config.node_axis
    count = len(dims)
    keyed = impl is not None
    fed = P(local_axis)

    def mean(cts, extra):
        pairs = zip(cts, dims, strict=True)
        specs = tuple(rule.spec(d, np.ndim(x), local_axis) for x, d in pairs)
        abstract = jax.sharding.get_abstract_mesh()

        def run_blocks(*xs):
            xs = list(xs)
            blocks, xs = xs[:count], xs[count:]
            ms, xs = xs[:moments] or None, xs[moments:]
            key = jax.random.wrap_key_data(xs.pop(0), impl=impl) if keyed else None
            flat = [x[0] for x in xs]  # this device's own vectors
            pairs = Residuals(zip(flat[::2], flat[1::2], strict=True)) if residuals else None
            mean, kept = sync.exchange(blocks, dims, ms, key, pairs)
            return (*mean, *(x[None] for pair in kept for x in pair))

        in_specs = specs + specs[:moments] + ((P(),) if keyed else ()) + (fed,) * residuals
        run = jax.shard_map(
            run_blocks, mesh=abstract if abstract.axis_names else mesh,
            in_specs=in_specs, out_specs=specs + (fed,) * residuals, axis_names={local_axis},
        )  # fmt: skip
        return tuple(run(*cts, *extra))

    # The layer comes unvaried over the nodes and leaves varying, as the mark's trace has it:
    # the cotangent that comes back is this node's own sum, and the mean goes on unvaried.
    @jax.custom_vjp
    def mark(*xs):
        return tuple(_varying(x, (node_axis,)) for x in xs[:count])

    def fwd(*xs):
        return mark(*xs), xs[count:]

    def bwd(extra, cts):
        slots = extra[len(extra) - residuals :]
        out = mean(cts, (*extra[: len(extra) - residuals], *(s.read() for s in slots)))
        for slot, kept in zip(slots, out[count:], strict=True):
            slot.write(kept)
        zeros = [jax.numpy.zeros_like(m) for m in extra[:moments]]
        if keyed:  # an integer input's cotangent
            zeros.append(np.zeros(np.shape(extra[moments]), jax.dtypes.float0))
        return (*out[:count], *zeros, *[None] * residuals)

    mark.defvjp(fwd, bwd)
    return mark


def _open(closed):
    return getattr(closed, "jaxpr", closed)


def _consts(closed):
    return list(getattr(closed, "consts", ()))


def with_exchange(fn, sync: LoopSync, mesh, dims, params_count: int, moments=None, keys=None,
                  slots=None):  # fmt: skip
    """``fn`` (whose first ``params_count`` leaves are the params, one array over the node,
    each split along ``dims``) with each ``exchange_in_loop`` mark it calls replaced by the
    exchange of ``sync``. The marked leaves (``marked_leaves``) come unvaried over the nodes,
    the others varying. ``moments``: with ``sync.b1``, per marked leaf index, its ``m``, shaped
    and split as the leaf; ``keys``: with ``sync.takes_key``, per marked leaf index, its
    rounding key (a scanned stack's is split into one per layer).

    ``slots``: with ``sync.feeds_back``, per marked call, the ``Slot``s of its residuals
    (``loop_marks.slots``), which each layer's backward reads and overwrites."""

    def rewritten(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        invars = closed.jaxpr.invars[:params_count]
        origin = {v: (i, "whole") for i, v in enumerate(invars)}
        rewrite = Rewrite(sync, mesh, dims, moments, keys, slots)
        outs = rewrite.eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), origin)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return rewritten


def rewriter(sync: LoopSync, mesh, dims, opt_state=None):
    """``(fn, args) -> (fn rewritten, marked, fed)``, for
    ``ModelState.value_and_grad_rows``: ``fn``'s marks found on ``args`` (the params varying
    first) and replaced by ``sync``'s exchange; ``fn`` itself where it marks nothing.
    ``opt_state``: the optimizer's state, from which the exchange takes what it needs
    (``LoopSync.from_state``). ``fed``: with error feedback and marks, ``fed()`` gives the
    marked layers' new residuals (``loop_marks.slots``) once the gradient is taken; else
    None."""
    moments, key, state_residuals = sync.from_state(opt_state)

    def rewrite(fn, args):
        count = len(dims)
        calls = loop_marks.mark_calls(fn, count, *args)
        marked = loop_marks.marked_leaves(calls, count)
        if not any(marked):
            return fn, marked, None
        ms = keys = slots = fed = None
        if sync.b1 is not None:
            ms = {i: m for i, (m, done) in enumerate(zip(moments, marked, strict=True)) if done}
        if sync.takes_key:
            base = jax.random.fold_in(key, LOOP_KEYS)
            keys = {i: jax.random.fold_in(base, i) for i, done in enumerate(marked) if done}
        if sync.feeds_back:
            config = sync.config
            n, local = (mesh.shape[a] for a in config.axes)
            shapes = jax.tree.leaves(args[0])
            sizes = loop_marks.residual_sizes(calls, shapes, config, (n, local))
            carried = loop_marks.fed_residuals(state_residuals, sizes, local)
            slots, fed = loop_marks.slots(carried, calls, sizes, local)
        return with_exchange(fn, sync, mesh, dims, count, ms, keys, slots), marked, fed

    return rewrite
