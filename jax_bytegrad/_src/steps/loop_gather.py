"""A state split over every device (``shard="full"``): each layer gathered where the loss uses it.

The same mark as ``loop_exchange`` (``exchange_in_loop``) says where a layer is gathered: each
device holds a block of it, and the rewrite (``gatherer``) makes the mark a ``jax.custom_vjp``
that gathers the layer across nodes there, as codes (``sync/across_nodes.py``), and whose
backward reduce-scatters its gradient across nodes; put inside the layer's ``jax.checkpoint``,
the gathered layer lives for that layer only, in the forward pass and again in the backward.
Unmarked leaves are gathered before the loss. Follows PyTorch FSDP's FULL_SHARD and DeepSpeed
ZeRO-3, with ZeRO++'s quantized weight gather (Wang et al., "ZeRO++: Extremely Efficient
Collective Communication for Giant Model Training", 2023).
"""

import jax
import numpy as np
import optax

from jax_bytegrad._src.steps import loop_marks
from jax_bytegrad._src.steps.loop_exchange import LOOP_KEYS, LoopSync, Rewrite
from jax_bytegrad._src.steps.loop_marks import Slot
from jax_bytegrad._src.sync import across_nodes
from jax_bytegrad._src.sync.patterns import make_varying


class _Gather(Rewrite):
    """A rewrite for a state split across nodes (``shard="full"``): each mark gathers its
    layer's blocks across the nodes where the loss uses them, and its backward reduce-scatters
    the layer's gradient across the nodes (``gathering``). Its keys and residuals are per
    leaf, not per call: each leaf crosses on its own."""

    def _mark(self, ins, origins) -> list:
        leaves, dims = self._marked(origins)
        # One gather per leaf: each weight's gradient then crosses as soon as it exists, and
        # its buffer goes, instead of the layer's all waiting for the last.
        out = []
        for x, leaf, dim in zip(ins, leaves, dims, strict=True):
            extra = (self.moments.get(leaf), self.keys.get(leaf), self.residuals.get(leaf))
            out.append(_gather_leaf(self.sync, self.mesh, x, dim, *extra))
        return out


def _devices(sync: LoopSync, mesh) -> int:
    """The devices of ``mesh`` that ``sync`` averages over: both of its axes."""
    return int(np.prod([mesh.shape[a] for a in sync.config.axes]))


def gathering(sync: LoopSync, dim: int | None, devices: int, *, moment: bool = False,
              impl=None, fed: bool = False):  # fmt: skip
    """For a state split over every device: ``(block, *extra) -> leaf``, each device's block
    of a leaf (split along ``dim`` over both mesh axes) gathered whole
    (``across_nodes.gather_weights``), typed as varying so that the cotangent that comes back
    is the device's own gradient. Its backward reduce-scatters that gradient, within the node
    and then across the nodes (``across_nodes.scatter_gradient``): the device's block of the
    mean over the ``devices``. A leaf kept whole (``dim`` None) is neither gathered nor
    reduced: its gradient comes back as the device's own, which the optimizer's sync averages
    (it is not in ``Sharded.exchanged``).

    ``extra``, in this order: with ``moment``, the leaf's ``m`` (a block, as the param), and
    the backward returns the mean momentum ``b1 m + (1 - b1) g`` instead, as ``qadam``'s
    compressed phase takes an exchanged layer (the gradient's codes cross, not the
    momentum's); given the key implementation ``impl``, the data of the leaf's rounding key;
    with ``fed`` (a split leaf only), the ``Slot`` of this device's error-feedback residual
    (``across_nodes.residual_size``), which the backward reads and overwrites with the new
    one. The cotangents of ``m``, the key and the slot are zero."""
    config = sync.config
    weight = 1.0 / devices if sync.average else 1.0
    keyed = impl is not None

    @jax.custom_vjp
    def gather(block, *extra):
        del extra
        leaf = across_nodes.gather_weights(block, dim, config, sync.compressed)
        return make_varying(leaf, config.axes)

    def fwd(block, *extra):
        return gather(block, *extra), extra

    def bwd(extra, ct):
        rest = list(extra)
        m = rest.pop(0) if moment else None
        key_data = rest.pop(0) if keyed else None
        slot = rest.pop(0) if fed else None
        zeros = [jax.numpy.zeros_like(m)] if moment else []
        if keyed:  # an integer input's cotangent
            zeros.append(np.zeros(np.shape(key_data), jax.dtypes.float0))
        zeros += [None] if fed else []  # the slot's (a ref and its row indices)
        if dim is None:  # a leaf kept whole: the optimizer's sync averages it (no residual)
            return (ct, *zeros)
        key = jax.random.wrap_key_data(key_data, impl=impl) if keyed else None
        residual = None if slot is None else slot.read()
        mean, kept = across_nodes.scatter_gradient(
            ct, dim, config, sync.compressed, weight, key=key,
            residual=None if residual is None else residual.reshape(-1),
        )  # fmt: skip
        if fed:
            slot.write(kept.reshape(residual.shape))
        if moment:
            mean = optax.tree.update_moment(mean, m, sync.b1, 1)
        return (make_varying(mean, config.axes), *zeros)

    gather.defvjp(fwd, bwd)
    return gather


def _gather_leaf(sync: LoopSync, mesh, block, dim, moment=None, key=None, residual=None):
    """``block`` gathered whole by ``gathering``, given what its backward also takes: the
    leaf's ``moment`` (with ``sync.b1``), its rounding ``key`` and the ``Slot`` of its
    error-feedback ``residual`` (each None where the sync takes none, or the leaf is kept
    whole)."""
    keyed = key is not None and dim is not None
    fed = residual is not None and dim is not None
    extra = [moment] if moment is not None else []
    extra += [jax.random.key_data(key)] if keyed else []
    extra += [residual] if fed else []
    impl = jax.random.key_impl(key) if keyed else None
    gather = gathering(
        sync, dim, _devices(sync, mesh), moment=moment is not None, impl=impl, fed=fed
    )
    return gather(block, *extra)


def gatherer(sync: LoopSync, mesh, dims, opt_state=None, micro=None):
    """``(fn, args) -> (fn rewritten, (), fed)``, for ``ModelState.value_and_grad`` of
    a state split over every device: ``fn`` takes each device's blocks of the params
    (``args[0]``), and the rewritten ``fn`` gathers them whole where the loss uses them: the
    layers it marks with ``exchange_in_loop`` at the mark (inside the scan body, inside the
    checkpoint), the other leaves before the loss. The gradient that comes back is each
    device's blocks of the mean over every device (``gathering``); with ``sync.b1``, of the
    mean momentum on the optimizer state's ``m``.

    With ``sync.takes_key`` each split leaf rounds on its own key, drawn from ``bytegrad``'s
    (a scanned stack's split into one per layer), and on one of its own per micro-step
    ``micro`` (an index, traced) of a step that accumulates. With ``sync.feeds_back``, the
    split leaves' residuals (``loop_marks.gathered_residuals``, the last of the state's) go
    into a ``jax.Ref`` each, one row per layer for a leaf a loop slices, which each layer's
    backward reads and overwrites in place (``Slot``), and ``fed()``, called after the
    gradient, gives the new ones as the state holds them; else ``fed`` is None. (A residual
    passed in beside the params, its new value coming back as its cotangent, is held twice
    in the backward pass: the old stack read while the new one is written, 32 GiB more per
    device at 70B on 4 x 8.)"""
    moments, key, state_residuals = sync.from_state(opt_state)
    devices = _devices(sync, mesh)
    split = [i for i, d in enumerate(dims) if d is not None]
    keys = {}
    if sync.takes_key:
        base = jax.random.fold_in(key, LOOP_KEYS)
        if micro is not None:
            base = jax.random.fold_in(base, micro)
        keys = {i: jax.random.fold_in(base, i) for i in split}

    def whole(x, dim):
        # A stand-in of the gathered leaf for the trace: the loss is traced on whole shapes.
        shape = list(np.shape(x))
        if dim is not None:
            shape[dim] *= devices
        return make_varying(jax.numpy.zeros(shape, x.dtype), sync.config.axes)

    def rewrite(fn, args):
        count = len(dims)
        leaves, treedef = jax.tree.flatten(args[0])
        wholes = [whole(x, d) for x, d in zip(leaves, dims, strict=True)]
        stand_in = jax.tree.unflatten(treedef, wholes)
        calls = loop_marks.mark_calls(fn, count, stand_in, *args[1:])
        marked = loop_marks.marked_leaves(calls, count)
        ms = {i: m for i, m in enumerate(moments)} if moments is not None else {}
        fed, own = None, {}
        if sync.feeds_back:
            sizes = loop_marks.gathered_sizes(wholes, dims, mesh.shape[sync.config.local_axis])
            residuals = loop_marks.fed_residuals(state_residuals, sizes, 1)
            # A leaf a loop slices keeps its residual as one row per layer, for the loop (its
            # pair's second vector is empty: the gradient is coded once).
            lengths = {leaf: call.length for call in calls for leaf in call.leaves}
            shapes = [(-1,) if lengths.get(i) is None else (lengths[i], -1) for i in split]
            refs, fed = loop_marks.held(residuals, [s for x in shapes for s in (x, (-1,))])
            own = {i: Slot(ref) for i, ref in zip(split, refs[::2], strict=True)}

        def gathered(params, *others):
            leaves = jax.tree.leaves(params)
            for i, done in enumerate(marked):  # one gather per leaf, as at a mark
                if not done:
                    leaves[i] = _gather_leaf(
                        sync, mesh, leaves[i], dims[i], ms.get(i), keys.get(i), own.get(i)
                    )
            closed, shape = jax.make_jaxpr(fn, return_shape=True)(stand_in, *others)
            invars = closed.jaxpr.invars[:count]
            origin = {v: (i, "whole") for i, v in enumerate(invars) if marked[i]}
            gather = _Gather(sync, mesh, dims, *({i: x for i, x in d.items() if marked[i]}
                                                 for d in (ms, keys, own)))  # fmt: skip
            args = [*leaves, *jax.tree.leaves(others)]
            outs = gather.eval(closed.jaxpr, closed.consts, args, origin)
            return jax.tree.unflatten(jax.tree.structure(shape), outs)

        return gathered, (), fed

    return rewrite
