"""The ``exchange_in_loop`` marks in a loss's trace, and the error-feedback residuals they need.

A step whose sync runs inside the backward loop (``loop_exchange``) reads here which param
leaves the loss marks, call by call, with the length of the loop that slices them
(``mark_calls``), and lays out each marked layer's error-feedback residuals in the optimizer
state's ``residuals``, after the sync's own (``initial_residuals``, ``fed_residuals``; with
the state split across nodes, each split leaf's, ``gathered_residuals``): as
1-bit Adam's per-worker errors (Tang et al., "1-bit Adam", ICML 2021), one per device, here
per layer, stacked as the layers are. In the step they sit in ``jax.Ref``s (``Slot``), whose
rows each layer's backward reads and overwrites in place.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend as jex
import optax

from jax_bytegrad._src.sync import across_nodes, collectives
from jax_bytegrad._src.sync.config import Residuals, SyncConfig, platform_of

MARK = "jax_bytegrad_exchange_in_loop"
# Primitives that pass a value through unchanged in shape (a copy, a type cast over axes).
PASS = frozenset({"copy", "copy_p", "pvary", "pcast"})


def is_mark(eqn) -> bool:
    """Whether ``eqn`` is an ``exchange_in_loop`` call."""
    return eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == MARK


def scan_counts(params) -> tuple[int, int]:
    """A scan equation's numbers of consts and carries: JAX 0.10 names them, JAX 0.12 gives
    the flat trees of (consts, carry, xs) as ``ft_in``."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def origin_of(origin: dict, v):
    """What ``origin`` says ``v`` is (None for a literal or a value it does not know)."""
    return None if isinstance(v, jex.core.Literal) else origin.get(v)


def inner_origins(jaxpr, origins) -> dict:
    """``origins`` (one per input of a call) keyed by ``jaxpr``'s inputs, the known ones."""
    return {v: o for v, o in zip(jaxpr.invars, origins, strict=True) if o is not None}


class Call(NamedTuple):
    """One ``exchange_in_loop`` call in a loss's trace: the param ``leaves`` it marks, and the
    ``length`` of the loop whose body slices them (None: marked whole, outside a loop)."""

    leaves: tuple[int, ...]
    length: int | None


def _find(jaxpr, origin: dict, calls: list) -> None:
    """Appends to ``calls`` each mark in ``jaxpr`` as a ``Call``. ``origin`` maps a variable to
    ``(leaf, length)``: the param leaf it is (length None), or a loop's slice of it."""
    for eqn in jaxpr.eqns:
        origins = [origin_of(origin, v) for v in eqn.invars]
        if is_mark(eqn):
            found = [o for o in origins if o is not None]
            length = next((o[1] for o in found if o[1] is not None), None)
            calls.append(Call(tuple(o[0] for o in found), length))
            continue
        if eqn.primitive.name in PASS and origins and origins[0] is not None:
            origin[eqn.outvars[0]] = origins[0]
        if eqn.primitive.name == "scan":
            # The loop slices its xs: a leaf there is one layer per iteration.
            nc, nk = scan_counts(eqn.params)
            length = eqn.params["length"]
            origins = [
                o if i < nc + nk or o is None or o[1] is not None else (o[0], length)
                for i, o in enumerate(origins)
            ]
        for sub in jex.core.jaxprs_in_params(eqn.params):
            sub = getattr(sub, "jaxpr", sub)
            if len(sub.invars) == len(eqn.invars):
                _find(sub, inner_origins(sub, origins), calls)


def mark_calls(fn, params_count: int, *args) -> tuple[Call, ...]:
    """The ``exchange_in_loop`` calls of ``fn`` on the params (the first ``params_count``
    leaves of ``args``), read from one trace of ``fn``, in the order of their first leaves.

    Raises:
      ValueError: for a leaf that two calls mark.
    """
    closed = jax.make_jaxpr(fn)(*args)
    calls = []
    invars = closed.jaxpr.invars[:params_count]
    _find(closed.jaxpr, {v: (i, None) for i, v in enumerate(invars)}, calls)
    leaves = [leaf for call in calls for leaf in call.leaves]
    if len(set(leaves)) != len(leaves):
        raise ValueError(
            "exchange_in_loop: a param leaf is marked by two calls; mark each layer's params "
            "once, where the scan body gets them"
        )
    return tuple(sorted((c for c in calls if c.leaves), key=lambda c: c.leaves[0]))


def marked_leaves(calls: tuple[Call, ...], params_count: int) -> tuple[bool, ...]:
    """Per param leaf, whether one of ``calls`` marks it."""
    marked = {leaf for call in calls for leaf in call.leaves}
    return tuple(i in marked for i in range(params_count))


def residual_sizes(calls: tuple[Call, ...], shapes: list, config: SyncConfig,
                   mesh_shape: tuple[int, int], platform: str | None = None) -> tuple:  # fmt: skip
    """Error feedback's per-device residual lengths for the marked layers: per call, one
    ``(send, mean)`` pair per bucket of its layer's exchange (``collectives.residual_sizes``
    of the layer's whole leaves), times the layers its loop runs. ``shapes``: the params'
    (whole) shapes and dtypes, one per leaf."""
    out = []
    for call in calls:
        layer = [shapes[i] for i in call.leaves]
        if call.length is not None:
            layer = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in layer]
        times = call.length or 1
        pairs = collectives.residual_sizes(layer, config, mesh_shape, platform)
        out.append(tuple((send * times, mean * times) for send, mean in pairs))
    return tuple(out)


def initial_residuals(params, calls: tuple[Call, ...], config: SyncConfig, mesh) -> Residuals:
    """Zero error-feedback residuals of every device of ``mesh`` (as
    ``collectives.mesh_residuals``) for a loss that marks ``calls``: the sync's own for the
    unmarked leaves of ``params``, then each marked layer's (``residual_sizes``), as
    ``fed_residuals`` splits them."""
    mesh_shape, platform = tuple(mesh.shape[a] for a in config.axes), platform_of(mesh)
    shapes = jax.tree.leaves(params)
    marked = marked_leaves(calls, len(shapes))
    rest = [x for x, done in zip(shapes, marked, strict=True) if not done]
    own = collectives.residual_sizes(rest, config, mesh_shape, platform)
    loop = residual_sizes(calls, shapes, config, mesh_shape, platform)
    return _zeros((*own, *(pair for pairs in loop for pair in pairs)), mesh_shape)


def gathered_sizes(shapes: list, dims, local: int) -> tuple:
    """Error feedback's per-device residual lengths for a state split across nodes
    (``shard="full"``): per leaf split over every device (``dims`` not None), one ``(send,
    mean)`` pair: its run of pieces (``across_nodes.residual_size``) and no ``mean`` (its
    gradient is coded once, as on the integer wire), in the ``sizes`` form
    ``fed_residuals`` takes. ``shapes``: the params' whole shapes, one per leaf."""
    return tuple(
        ((across_nodes.residual_size(x.shape, local), 0),)
        for x, dim in zip(shapes, dims, strict=True)
        if dim is not None
    )


def gathered_residuals(params, dims, config: SyncConfig, mesh) -> Residuals:
    """Zero error-feedback residuals of every device of ``mesh`` for a state split across
    nodes (``shard="full"``): the sync's own for the leaves of ``params`` kept whole
    (``dims`` None), then each split leaf's (``gathered_sizes``), as ``fed_residuals`` splits
    them. Every split leaf's gradient crosses in the loss's backward pass, wherever the loss
    marks it, so the params' shapes alone lay them out."""
    mesh_shape, platform = tuple(mesh.shape[a] for a in config.axes), platform_of(mesh)
    shapes = jax.tree.leaves(params)
    rest = [x for x, dim in zip(shapes, dims, strict=True) if dim is None]
    own = collectives.residual_sizes(rest, config, mesh_shape, platform) if rest else ()
    gathered = gathered_sizes(shapes, dims, mesh_shape[1])
    return _zeros((*own, *(pair for pairs in gathered for pair in pairs)), mesh_shape)


def _zeros(sizes, mesh_shape: tuple[int, int]) -> Residuals:
    """Zero residuals of per-device ``(send, mean)`` lengths ``sizes``, each vector the
    concatenation of every device's own (``collectives.mesh_residuals``)."""
    devices, f32 = mesh_shape[0] * mesh_shape[1], jax.numpy.float32
    return Residuals(
        (jax.numpy.zeros(devices * send, f32), jax.numpy.zeros(devices * mean, f32))
        for send, mean in sizes
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slot:
    """A marked layer's error-feedback residual, in a ``jax.Ref`` that the layer's backward
    reads and overwrites in place: ``ref[(:,) * axes + index]``, ``index`` the row of each
    loop the layer is in (``()`` for none) after ``axes`` whole leading axes (the node's
    devices', for the replicated step's). A residual passed in beside the params instead
    comes back as a cotangent: a second stack, written while the first is read. A pytree,
    so that a ``jax.custom_vjp`` takes it as an argument."""

    ref: Any
    index: tuple = ()
    axes: int = dataclasses.field(default=0, metadata={"static": True})

    def at(self, i) -> "Slot":
        """The slot of iteration ``i`` of a loop over this slot's rows."""
        return Slot(self.ref, (*self.index, i), self.axes)

    def _key(self):
        key = (slice(None),) * self.axes + self.index
        return key if key else ...

    def read(self):
        return self.ref[self._key()]

    def write(self, value) -> None:
        self.ref[self._key()] = value


def at_row(tree, i):
    """``tree``'s slots (``Slot.at``) for iteration ``i`` of a loop."""
    return jax.tree.map(lambda s: s.at(i), tree, is_leaf=lambda x: isinstance(x, Slot))


def held(carried, shapes) -> tuple[list, Callable[[], Residuals]]:
    """Each vector of ``carried``'s pairs in a ``jax.Ref`` of its shape in ``shapes`` (one per
    vector, in order), and ``fed()``, which gives them back as ``carried`` holds them once
    the backward has overwritten them."""
    vectors = (x for pair in carried for x in pair)
    refs = [jax.new_ref(x.reshape(s)) for x, s in zip(vectors, shapes, strict=True)]

    def fed() -> Residuals:
        kept = [jax.ref.freeze(ref).reshape(-1) for ref in refs]
        return Residuals(zip(kept[::2], kept[1::2], strict=True))

    return refs, fed


def slots(carried, calls, sizes, local: int) -> tuple[dict, Callable[[], Residuals]]:
    """Per marked call (by its first leaf), its residual vectors in ``Slot``s, each vector
    (the node's ``local`` devices' own, concatenated) in a ``jax.Ref`` shaped ``(local,
    length, n)`` for a loop's call (read at ``[:, i]``) or ``(local, n)``; and ``fed()``
    (``held``)."""
    shapes = []
    for call, pairs in zip(calls, sizes, strict=True):
        shape = (local, -1) if call.length is None else (local, call.length, -1)
        shapes += [shape] * (2 * len(pairs))
    refs, fed = held(carried, shapes)
    made, out = iter(refs), {}
    for call, pairs in zip(calls, sizes, strict=True):
        axes = int(call.length is not None)
        out[call.leaves[0]] = [Slot(next(made), axes=axes) for _ in range(2 * len(pairs))]
    return out, fed


def fed_residuals(residuals, sizes, local: int, where: str = MARK) -> Residuals:
    """The marked layers' residuals: the last pairs (``sizes``) of the optimizer state's
    ``residuals``, after the sync's own, in the step's frame (each vector the node's
    ``local`` devices' own).

    Raises:
      ValueError: where the state holds no residuals of these sizes for the marked layers.
    """
    want = tuple(pair for pairs in sizes for pair in pairs)
    got = tuple(tuple(int(x.size) // local for x in pair) for pair in residuals or ())
    if len(got) < len(want) or got[len(got) - len(want) :] != want:
        raise ValueError(
            f"{where}: error feedback inside the loop keeps residuals for each marked layer, "
            f"of per-device sizes {want}, after the sync's own; this state's residuals are "
            f"{got}. Build the state with step.init(params, batch) (and restore with "
            "step.state_shapes(params, batch)): the batch shows the step where the loss marks"
        )
    return Residuals(residuals[len(residuals) - len(want) :])


def feeding(update, fed: Residuals | None):
    """``update(grads, opt_state, params)`` seeing the sync's own residuals only, the marked
    layers' (the last of the state's) replaced by ``fed``, their new ones, after it;
    ``update`` itself for None."""
    if fed is None:
        return update

    def run(grads, opt_state, params):
        residuals = optax.tree.get(opt_state, "residuals")
        own = Residuals(residuals[: len(residuals) - len(fed)])
        updates, opt_state = update(grads, optax.tree.set(opt_state, residuals=own), params)
        residuals = Residuals((*optax.tree.get(opt_state, "residuals"), *fed))
        return updates, optax.tree.set(opt_state, residuals=residuals)

    return run


def with_fed(opt_state, fed: Residuals | None):
    """``opt_state`` with its last residuals, the marked layers' (or a ``shard="full"``
    step's split leaves'), replaced by ``fed``, their new ones; as it is for None."""
    if fed is None:
        return opt_state
    residuals = optax.tree.get(opt_state, "residuals")
    kept = residuals[: len(residuals) - len(fed)]
    return optax.tree.set(opt_state, residuals=Residuals((*kept, *fed)))
