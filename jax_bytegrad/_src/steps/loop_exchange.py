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

from jax_bytegrad._src import checks
from jax_bytegrad._src.steps import interpret
from jax_bytegrad._src.sync import collectives, shards
from jax_bytegrad._src.sync.config import SyncConfig
from jax_bytegrad._src.transforms import ByteGradState

MARK = "jax_bytegrad_exchange_in_loop"
# Primitives that pass a value through unchanged in shape (a copy, a type cast over axes).
_PASS = frozenset({"copy", "copy_p", "pvary", "pcast"})
# Folded into the step's rounding key for the marked layers' keys ("loop"), so that they
# draw apart from the keys of the sync after the backward pass (``collectives.step_keys``).
_LOOP_KEYS = 0x6C6F6F70


def exchange_in_loop(tree):
    """Marks a layer's params so that a ``shard="params"`` step exchanges their gradient between
    nodes inside the backward loop, as soon as the layer's backward has produced it.

    Wrap the params a scan body gets for one layer: in ``jax.lax.scan``, the body's slice of
    the stack; in Flax linen, ``nn.map_variables(nn.remat(Block), "params", exchange_in_loop,
    init=True)`` scanned by ``nn.scan``; in NNX, ``nnx.update(block,
    exchange_in_loop(nnx.state(block, nnx.Param)))`` at the top of the ``nnx.scan`` body. In
    the forward pass it is an identity. Inside a ``Strategy(..., shard="params")`` step of
    ``gradient_allreduce``, ``bytegrad`` (without error feedback) or ``qadam``, the gradient
    of the marked params is averaged between nodes there, on the sync's own wire (the same
    settings and bytes; with stochastic rounding, each layer on its own key), and the sync
    after the backward pass skips them; in ``qadam``'s compressed phase (without error
    feedback) what crosses is the layer's momentum ``b1 m + (1 - b1) g``, on the optimizer's
    ``m``. Anywhere else (outside a step, another ``shard=``, another algorithm) it stays an
    identity and the gradient crosses after the backward pass, as without it.

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
    missing = tuple(a for a in axes if a not in checks.varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


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

    def refusal(self) -> str | None:
        """Why this sync cannot run inside the loop, or None."""
        if self.compressed and self.config.error_feedback:
            return "error feedback (its residuals are sized for the whole gradient at init)"
        return None

    def from_state(self, opt_state) -> tuple[list | None, jax.Array | None]:
        """What the exchange takes from the optimizer's state: with ``b1``, the leaves of its
        ``m``; with ``takes_key``, ``bytegrad``'s rounding key, before its update splits it.

        Raises:
          ValueError: if the state lacks them.
        """
        moments = key = None
        if self.b1 is not None:
            moments = optax.tree.get(opt_state, "mu")
            if moments is None:
                raise ValueError("exchange_in_loop: a momentum exchange needs the state's mu")
            moments = jax.tree.leaves(moments)
        if self.takes_key:
            key = optax.tree.get(opt_state, "key", filtering=_bytegrad_key)
            if key is None:
                raise ValueError("exchange_in_loop: stochastic rounding needs bytegrad's key")
        return moments, key

    @property
    def takes_key(self) -> bool:
        """Whether the exchange rounds stochastically, and so takes a key."""
        return self.compressed and self.config.stochastic

    def exchange(self, blocks: list, dims: tuple, moments: list | None = None, key=None) -> list:
        """The mean over every device of a layer's gradient, given as this device's blocks of
        its node's sums (inside ``shard_map`` over both axes); with ``b1``, of the devices'
        momenta on ``moments`` (this device's blocks of the layer's ``m``), as ``qadam``'s
        compressed phase computes them. ``key``: the layer's rounding key (``takes_key``),
        the same on every device."""
        sharded = shards.Sharded(self.config.local_axis, dims, summed=True)
        if self.b1 is not None:
            within = sharded.momentum_within(list(moments))
            blocks = optax.tree.update_moment(list(blocks), within, self.b1, 1)
        if self.compressed:
            mean, _ = collectives.sync_mean(
                blocks, self.config, average=self.average, key=key, sharded=sharded, where=MARK
            )
            return mean
        return collectives.sync_full_precision(
            blocks, self.config, average=self.average, reduce_dtype=self.reduce_dtype,
            sharded=sharded,
        )  # fmt: skip


def _bytegrad_key(path, value) -> bool:
    del value
    return getattr(path[-1], "tuple_name", None) == ByteGradState.__name__


def _is_mark(eqn) -> bool:
    return eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == MARK


def _has_mark(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if _is_mark(eqn):
            return True
        if any(_has_mark(sub) for sub in jex.core.jaxprs_in_params(eqn.params)):
            return True
    return False


class _Rewrite:
    """One rewrite of a loss's trace: the marks become the exchange (``LoopSync``)."""

    def __init__(self, sync: LoopSync, mesh, dims, moments: dict | None = None,
                 keys: dict | None = None):  # fmt: skip
        self.sync, self.mesh, self.dims = sync, mesh, dims
        # Per marked leaf, what its exchange also takes (``LoopSync.b1``'s ``m``, a rounding
        # key), as the current scope sees it: outside a loop whole (one key), inside a loop's
        # body its slice (this iteration's key).
        self.moments = dict(moments or {})
        self.keys = dict(keys or {})

    def eval(self, jaxpr, consts, args, origin: dict) -> list:
        """``jaxpr`` on ``consts`` and ``args``, as JAX's own interpreter runs it, but with
        the calls that hold a mark rebuilt. ``origin`` maps a variable to ``(leaf, kind)``:
        the param leaf it is (``"whole"``), a loop's slice of (``"slice"``), or a loop closes
        over (``"const"``)."""

        def run(eqn, ins):
            outs = self._eqn(eqn, ins, [_get(origin, v) for v in eqn.invars])
            if eqn.primitive.name in _PASS and _get(origin, eqn.invars[0]) is not None:
                origin[eqn.outvars[0]] = origin[eqn.invars[0]]
            return outs

        return interpret.evaluate(jaxpr, consts, args, run)

    def _eqn(self, eqn, ins, origins) -> list:
        name = eqn.primitive.name
        if _is_mark(eqn):
            return self._mark(ins, origins)
        subs = list(jex.core.jaxprs_in_params(eqn.params))
        if subs and any(_has_mark(s) for s in subs):
            if name == "scan":
                return self._scan(eqn, ins, origins)
            if name in ("jit", "pjit", "closed_call", "core_call"):
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                inner_origin = _inner(getattr(inner, "jaxpr", inner), origins)
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
        nc, nk = _scan_counts(p)
        consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        body = p["jaxpr"]
        # The loop slices its xs: a marked slice of a leaf is one layer of it.
        sliced = [
            None if o is None or o[1] != "whole" else (o[0], "slice") for o in origins[nc + nk :]
        ]
        whole = [None if o is None else (o[0], "const") for o in origins[:nc]]
        inner_origin = _inner(body.jaxpr, [*whole, *[None] * nk, *sliced])
        # The moments of the leaves the loop slices are sliced with them, and their keys split
        # into one per iteration, as extra xs.
        outer, outer_keys = self.moments, self.keys
        leaves = {o[0] for o in sliced if o is not None}
        slid = sorted(leaves & set(outer))
        keyed = sorted(leaves & set(outer_keys))

        def step(carry, x):
            x, extra, keys = x
            self.moments = {**outer, **dict(zip(slid, extra, strict=True))}
            self.keys = {**outer_keys, **dict(zip(keyed, keys, strict=True))}
            try:
                outs = self.eval(body.jaxpr, body.consts, [*consts, *carry, *x], dict(inner_origin))
            finally:
                self.moments, self.keys = outer, outer_keys
            return outs[:nk], outs[nk:]

        extra = [outer[leaf] for leaf in slid]
        keys = [jax.random.split(outer_keys[leaf], p["length"]) for leaf in keyed]
        carry, ys = jax.lax.scan(
            step, list(init), (list(xs), extra, keys), length=p["length"], reverse=p["reverse"],
            unroll=p["unroll"],
        )  # fmt: skip
        return [*carry, *ys]

    def _remat(self, eqn, ins, origins) -> list:
        inner = eqn.params["jaxpr"]
        inner_origin = _inner(getattr(inner, "jaxpr", inner), origins)

        def run(*args):
            return self.eval(_open(inner), _consts(inner), list(args), dict(inner_origin))

        policy, prevent_cse = eqn.params.get("policy"), eqn.params.get("prevent_cse", True)
        return jax.checkpoint(run, policy=policy, prevent_cse=prevent_cse)(*ins)

    def _mark(self, ins, origins) -> list:
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
        moments = [self.moments[leaf] for leaf in leaves] if self.sync.b1 is not None else []
        # One key per call: the sync draws each bucket's and device's own from it. It goes in
        # as its data, with its implementation beside.
        key, impl = [], None
        if self.sync.takes_key:
            layer_key = self.keys[leaves[0]]
            key, impl = [jax.random.key_data(layer_key)], jax.random.key_impl(layer_key)
        exchanging = _exchanging(self, tuple(dims), len(moments), impl)
        return list(exchanging(*ins, *moments, *key))


def _exchanging(rewrite: _Rewrite, dims: tuple, moments: int = 0, impl=None):
    """The mark of a layer whose split dimensions are ``dims``: an identity whose backward
    averages the layer's gradient between nodes. After the layer's leaves it takes
    ``moments`` of them, which its backward exchanges with the gradient (``LoopSync.b1``),
    then, given the key implementation ``impl``, its rounding key's data; their cotangents
    are zero."""
    sync, mesh, local_axis = rewrite.sync, rewrite.mesh, rewrite.sync.config.local_axis
    node_axis = sync.config.node_axis
    count = len(dims)
    keyed = impl is not None

    def mean(cts, extra):
        pairs = zip(cts, dims, strict=True)
        specs = tuple(shards.spec(d, np.ndim(x), local_axis) for x, d in pairs)
        abstract = jax.sharding.get_abstract_mesh()

        def run_blocks(*xs):
            blocks, ms = list(xs[:count]), list(xs[count : count + moments]) or None
            key = jax.random.wrap_key_data(xs[-1], impl=impl) if keyed else None
            return tuple(sync.exchange(blocks, dims, ms, key))

        in_specs = specs + specs[:moments] + ((P(),) if keyed else ())
        run = jax.shard_map(
            run_blocks, mesh=abstract if abstract.axis_names else mesh,
            in_specs=in_specs, out_specs=specs, axis_names={local_axis},
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
        zeros = [jax.numpy.zeros_like(m) for m in extra[:moments]]
        if keyed:  # an integer input's cotangent
            zeros.append(np.zeros(np.shape(extra[-1]), jax.dtypes.float0))
        return (*mean(cts, extra), *zeros)

    mark.defvjp(fwd, bwd)
    return mark


def _scan_counts(params) -> tuple[int, int]:
    """A scan equation's numbers of consts and carries: JAX 0.10 names them, JAX 0.12 gives
    the flat trees of (consts, carry, xs) as ``ft_in``."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def _get(origin: dict, v):
    return None if isinstance(v, jex.core.Literal) else origin.get(v)


def _open(closed):
    return getattr(closed, "jaxpr", closed)


def _consts(closed):
    return list(getattr(closed, "consts", ()))


def _inner(jaxpr, origins) -> dict:
    return {v: o for v, o in zip(jaxpr.invars, origins, strict=True) if o is not None}


def _find(jaxpr, origin: dict, found: list) -> None:
    """Marks ``found[leaf]`` for each param leaf (``origin``) a mark in ``jaxpr`` takes,
    directly or as a loop's slice."""
    for eqn in jaxpr.eqns:
        origins = [_get(origin, v) for v in eqn.invars]
        if _is_mark(eqn):
            for o in origins:
                if o is not None:
                    found[o] = True
            continue
        if eqn.primitive.name in _PASS and origins and origins[0] is not None:
            origin[eqn.outvars[0]] = origins[0]
        for sub in jex.core.jaxprs_in_params(eqn.params):
            sub = getattr(sub, "jaxpr", sub)
            if len(sub.invars) == len(eqn.invars):
                _find(sub, _inner(sub, origins), found)


def marked_leaves(fn, params_count: int, *args) -> tuple[bool, ...]:
    """Per param leaf (the first ``params_count`` leaves of ``args``), whether ``fn`` marks it
    (``exchange_in_loop``), read from one trace of ``fn``."""
    closed = jax.make_jaxpr(fn)(*args)
    found = [False] * params_count
    invars = closed.jaxpr.invars[:params_count]
    _find(closed.jaxpr, {v: i for i, v in enumerate(invars)}, found)
    return tuple(found)


def with_exchange(fn, sync: LoopSync, mesh, dims, params_count: int, moments=None, keys=None):
    """``fn`` (whose first ``params_count`` leaves are the params, one array over the node,
    each split along ``dims``) with each ``exchange_in_loop`` mark it calls replaced by the
    exchange of ``sync``. The marked leaves (``marked_leaves``) come unvaried over the nodes,
    the others varying. ``moments``: with ``sync.b1``, per marked leaf index, its ``m``, shaped
    and split as the leaf; ``keys``: with ``sync.takes_key``, per marked leaf index, its
    rounding key (a scanned stack's is split into one per layer)."""

    def rewritten(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if not _has_mark(closed.jaxpr):
            outs = jex.core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
        else:
            why = sync.refusal()
            if why is not None:
                raise ValueError(
                    f"exchange_in_loop: this step's sync cannot run inside the loop with {why}; "
                    "remove the mark (its gradient then crosses after the backward pass)"
                )
            invars = closed.jaxpr.invars[:params_count]
            origin = {v: (i, "whole") for i, v in enumerate(invars)}
            rewrite = _Rewrite(sync, mesh, dims, moments, keys)
            outs = rewrite.eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), origin)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return rewritten


def rewriter(sync: LoopSync, mesh, dims, opt_state=None):
    """``(fn, args) -> (fn rewritten, marked)``, for ``ModelState.value_and_grad_rows``:
    ``fn``'s marks found on ``args`` (the params varying first) and replaced by ``sync``'s
    exchange; ``fn`` itself where it marks nothing. ``opt_state``: the optimizer's state,
    from which the exchange takes what it needs (``LoopSync.from_state``)."""
    moments, key = sync.from_state(opt_state)

    def rewrite(fn, args):
        count = len(dims)
        marked = marked_leaves(fn, count, *args)
        if not any(marked):
            return fn, marked
        ms = keys = None
        if sync.b1 is not None:
            ms = {i: m for i, (m, done) in enumerate(zip(moments, marked, strict=True)) if done}
        if sync.takes_key:
            base = jax.random.fold_in(key, _LOOP_KEYS)
            keys = {i: jax.random.fold_in(base, i) for i, done in enumerate(marked) if done}
        return with_exchange(fn, sync, mesh, dims, count, ms, keys), marked

    return rewrite
