"""Model state and per-device randomness for every train step: BatchNorm statistics, dropout keys.

Follows how data-parallel trainers treat a model's buffers: PyTorch DDP's ``broadcast_buffers``
(Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB
2020) takes every buffer from rank 0 before each forward pass; cross-replica BatchNorm (Flax's
``axis_name``, PyTorch's ``SyncBatchNorm``) averages the statistics over the replicas. A step
built with ``model_state=`` offers both, as ``state_sync="mean"`` or ``"first"``.

The loss function opts in by keyword: with ``model_state=`` given to the builder it is called
``loss_fn(params, batch, model_state=...)`` and returns ``(out, new_model_state)``, where
``out`` is what it returns without state (``loss``, or ``(loss, aux)`` with ``has_aux``); with
``rng_seed=`` it also gets ``key=``, a PRNG key that differs per device and per step:

    key = fold_in(fold_in(state.rng, state.step), device_index)

``state.rng`` is ``jax.random.key(rng_seed)`` and never changes, so a run restarted from a
checkpoint replays the keys of the steps it repeats. ``device_index`` is the device's index
over both mesh axes (``jax.lax.axis_index((node_axis, local_axis))``). ``step_key`` computes
it, inside the step and outside (``TrainStep.device_key``). Without either keyword the step's
programs are what they were: no input, no output and no collective is added.
"""

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.mesh import replicate
from jax_bytegrad._src.steps import remat_order
from jax_bytegrad._src.sync.patterns import make_varying

StateSync = Literal["mean", "first"]
# Their names in ``StepState.extra``.
MODEL_STATE, RNG = "model_state", "rng"
STATE_SYNCS = ("mean", "first")


def step_key(rng: jax.Array, step, device) -> jax.Array:
    """The key that device ``device`` gets at step ``step`` of a step built with ``rng_seed=``.

    Args:
      rng: ``state.rng`` (``jax.random.key(rng_seed)``).
      step: the step count the key is for (``int(state.step)`` before the step).
      device: the device's index over both mesh axes, row-major (node, then local).

    Returns:
      A typed PRNG key, the one the loss function got as ``key=``.
    """
    return jax.random.fold_in(jax.random.fold_in(rng, step), device)


def refuse_aux(out, has_aux: bool, where: str = "train step") -> None:
    """Raises for a loss function's output that is ``(loss, aux)`` when the step was built
    without ``has_aux``: a tuple or list whose first element is a scalar (a Python number, a
    0-d array or tracer). jax.grad's own error there ("Gradient only defined for
    scalar-output functions") names neither the cause nor the builder's argument."""
    if has_aux or not isinstance(out, (tuple, list)) or not out:
        return
    first = out[0]
    if isinstance(first, (int, float)) or getattr(first, "shape", None) == ():
        raise ValueError(
            f"{where}: loss_fn returned a {type(out).__name__} of {len(out)} whose first "
            "element is a scalar, as (loss, aux) is, but the step was built without has_aux: "
            "pass has_aux=True to the step builder (e.g. strategy.train_step(loss_fn, "
            "optimizer, has_aux=True)) to get aux back from each step, or return the loss alone"
        )


def checked_loss(loss_fn, has_aux: bool):
    """``loss_fn``, its output checked by `refuse_aux`: for steps that call it themselves."""

    def loss(*args, **kwargs):
        out = loss_fn(*args, **kwargs)
        refuse_aux(out, has_aux)
        return out

    return loss


def _dtype(leaf):
    """The dtype ``leaf`` gets on the devices (Python numbers included); None for no array."""
    try:
        return jnp.result_type(leaf)
    except TypeError:
        return None


def _host_copy(tree):
    return jax.tree.map(lambda x: np.array(x, dtype=_dtype(x), copy=True), jax.device_get(tree))


def _check_leaves(model_state, where: str) -> None:
    for path, leaf in jax.tree.leaves_with_path(model_state):
        dtype = _dtype(leaf)
        if dtype is None or not (
            jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
        ):
            raise ValueError(
                f"{where}: model_state leaf {jax.tree_util.keystr(path)} is "
                f"{type(leaf).__name__} of dtype {dtype}; model_state holds numeric or bool "
                "arrays (batch statistics, counters); keep PRNG keys out of it and pass "
                "rng_seed=... for per-device keys"
            )


def _sync_leaf(x, axes, how: str):
    varying = checks.varying_axes(x) & set(axes)
    if not varying:
        return x  # the loss left it unchanged: the same on every device already
    missing = tuple(a for a in axes if a not in varying)
    x = jax.lax.pcast(x, missing, to="varying") if missing else x
    if how == "mean" and jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, axes)
    # Device 0's value, as DDP's broadcast_buffers: one psum of it and zeros elsewhere.
    first = jax.lax.axis_index(axes) == 0
    wide = x.astype(np.int32) if x.dtype == np.bool_ else x
    total = jax.lax.psum(jnp.where(first, wide, jnp.zeros_like(wide)), axes)
    return total.astype(x.dtype)


def _sync_rows(x, node_axis: str, how: str):
    """``_sync_leaf`` of a leaf with one row per device of this node (``value_and_grad_rows``):
    the rows' mean (float leaves, ``"mean"``) or the first row, then synced over the nodes."""
    mean = how == "mean" and jnp.issubdtype(x.dtype, jnp.inexact)
    return _sync_leaf(jnp.mean(x, axis=0) if mean else x[0], (node_axis,), how)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelState:
    """What a step's loss function takes beyond ``(params, batch)``, and how it is carried.

    Attributes:
      initial: the model state to start from (``init`` places it replicated); None for none.
      seed: the seed of ``state.rng``; None for no key.
      sync: how the devices' new model states become one: ``"mean"`` averages float leaves
        over the mesh (cross-replica BatchNorm) and takes the rest from device 0;
        ``"first"`` takes every leaf from device 0 (DDP's ``broadcast_buffers``).
    """

    initial: Any = None
    seed: int | None = None
    sync: str = "mean"

    @classmethod
    def of(cls, model_state, rng_seed, state_sync, where: str) -> "ModelState":
        """Validates the builders' three keywords; raises ``ValueError`` naming a bad one."""
        if model_state is not None:
            _check_leaves(model_state, where)
            model_state = _host_copy(model_state)
        if rng_seed is not None:
            checks.integer(rng_seed, "rng_seed", where, minimum=0, or_none=True)
        checks.one_of(state_sync, STATE_SYNCS, "state_sync", where)
        return cls(model_state, rng_seed, state_sync)

    @property
    def has_state(self) -> bool:
        return self.initial is not None

    @property
    def has_rng(self) -> bool:
        return self.seed is not None

    @property
    def enabled(self) -> bool:
        return self.has_state or self.has_rng

    def refuse(self, where: str, why: str) -> None:
        """Raises for a step that cannot carry model state or keys."""
        if self.enabled:
            raise ValueError(
                f"{where} does not take model_state= or rng_seed= ({why}); use "
                "gradient_allreduce, bytegrad (pipeline=False), qadam or the decentralized pair"
            )

    def place(self, mesh: Mesh) -> dict[str, Any]:
        """What a new ``StepState`` adds to its ``extra``: the model state and the key,
        both replicated over ``mesh``."""
        out = {}
        if self.has_state:
            out[MODEL_STATE] = replicate(_host_copy(self.initial), mesh)
        if self.has_rng:
            seed, replicated = self.seed, NamedSharding(mesh, P())
            out[RNG] = jax.jit(lambda: jax.random.key(seed), out_shardings=replicated)()
        return out

    def place_shapes(self, mesh: Mesh) -> dict[str, Any]:
        """``place``'s entries as ``jax.ShapeDtypeStruct`` leaves; allocates nothing."""
        replicated = NamedSharding(mesh, P())
        out = {}
        if self.has_state:
            out[MODEL_STATE] = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=replicated),
                self.initial,
            )
        if self.has_rng:
            seed = self.seed
            out[RNG] = jax.jit(lambda: jax.random.key(seed), out_shardings=replicated).eval_shape()
        return out

    def carried(self, state, model_state) -> dict[str, Any]:
        """The ``extra`` entries of the state after a step: the new model state, the key."""
        out = {MODEL_STATE: model_state} if self.has_state else {}
        return {**out, RNG: state.rng} if self.has_rng else out

    def inputs(self, state) -> tuple:
        """The step program's extra inputs: the model state, then the key and the step."""
        out = (state.model_state,) if self.has_state else ()
        if self.has_rng:
            out += (state.rng, np.uint32(int(state.step) % (1 << 32)))
        return out

    def num_inputs(self) -> int:
        return int(self.has_state) + 2 * int(self.has_rng)

    def _loss(self, loss_fn, has_aux: bool):
        """``loss(params, batch, model_state, key) -> (value, (aux, new_model_state))``: the
        user's loss function called as this step calls it, its result checked."""
        has_state, has_rng, where = self.has_state, self.has_rng, "train step"
        expected = jax.tree.structure(self.initial) if has_state else None

        def loss(params, batch, model_state, key):
            kwargs = {"model_state": model_state} if has_state else {}
            if has_rng:
                kwargs["key"] = key
            out = loss_fn(params, batch, **kwargs)
            if has_state:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise ValueError(
                        f"{where}: with model_state=..., loss_fn must return (loss, "
                        "new_model_state) (or ((loss, aux), new_model_state) with has_aux); "
                        f"got {type(out).__name__}"
                    )
                out, model_state = out
                got = jax.tree.structure(model_state)
                if got != expected:
                    raise ValueError(
                        f"{where}: loss_fn returned a model state of structure {got}, but "
                        f"model_state= has structure {expected}; return the state it was "
                        "given, updated"
                    )
            refuse_aux(out, has_aux, where)
            value, aux = out if has_aux else (out, None)
            return value, (aux, model_state)

        return loss

    def _split_inputs(self, inputs):
        """``(model_state, (rng, step))`` from the step program's extra inputs."""
        inputs = list(inputs)
        model_state = inputs.pop(0) if self.has_state else None
        return model_state, (tuple(inputs) if self.has_rng else None)

    def value_and_grad(self, loss_fn, has_aux: bool, axes: tuple[str, str], exchange=None):
        """``(params, batch, *inputs) -> ((loss, aux, model_state), grads)`` for one device;
        ``inputs`` as ``inputs`` gives them, ``model_state`` synced over ``axes`` (None
        without state).

        With ``exchange`` (``(fn, args) -> (fn, marked, fed)``,
        ``loop_gather.gatherer``), ``params`` are this device's blocks, which the rewritten
        loss gathers where it uses them; ``grads`` are then this device's blocks of the mean,
        and the run returns ``(outputs, grads, marked, residuals)`` as ``value_and_grad_rows``
        does (``residuals``: with error feedback, the gathered leaves' new ones, ``fed()``
        after the gradient)."""
        loss = self._loss(loss_fn, has_aux)

        def run(params, batch, *inputs):
            model_state, rng = self._split_inputs(inputs)
            key = None if rng is None else step_key(*rng, jax.lax.axis_index(axes))
            fn, marked, fed = loss, (), None
            if exchange is not None:
                params = make_varying(params, axes)
                fn, marked, fed = exchange(loss, (params, batch, model_state, key))
            if exchange is not None:
                # Each remat'd layer's backward releases its weight gradients with the
                # gradient for the layer below, as with ``value_and_grad_rows``: a list of
                # layers then peaks as a scanned stack does.
                fn = remat_order.tie_remat_backward(fn)
            grad_fn = jax.value_and_grad(fn, has_aux=True)
            (value, (aux, model_state)), grads = grad_fn(params, batch, model_state, key)
            # The backward wrote the gathered leaves' new residuals where it read the old.
            residuals = None if fed is None else fed()
            if self.has_state:
                model_state = jax.tree.map(lambda x: _sync_leaf(x, axes, self.sync), model_state)
            if exchange is not None:
                return (value, aux, model_state), grads, marked, residuals
            return (value, aux, model_state), grads

        return run

    def value_and_grad_rows(self, loss_fn, has_aux: bool, axes: tuple[str, str], local: int,
                            exchange=None):  # fmt: skip
        """``value_and_grad`` for a step manual over the node axis only: ``batch`` is the
        node's rows, and the loss runs once per device's rows under ``jax.vmap``, with the
        key that device would get, so each device's loss, dropout and batch statistics are
        what they are in the step manual over both axes. ``grads`` is the sum over the node's
        devices; the loss and aux are their means, the model state synced over ``axes``.

        Each top-level ``jax.checkpoint`` the loss calls finishes its backward (weight
        gradients included) before the layer below starts its own (``remat_order``): an
        unrolled list of layers then peaks as a scanned stack does.

        ``params`` come unvaried over the node axis. With ``exchange`` (``(fn, args) -> (fn,
        marked, fed)``, ``loop_exchange.rewriter``), the leaves the loss marks with
        ``exchange_in_loop`` stay so and ``exchange`` rewrites the marks; ``grads`` holds
        their means over every device then, and the run returns ``marked`` (per leaf; empty
        without marks) and the marked layers' new error-feedback residuals (``fed()`` after
        the gradient; None without)."""
        loss = self._loss(loss_fn, has_aux)

        def total(params, rows, model_state, keys):
            per_row = jax.vmap(loss, in_axes=(None, 0, None, None if keys is None else 0))
            values, (aux, model_state) = per_row(params, rows, model_state, keys)
            return jnp.sum(values), (values, aux, model_state)

        def run(params, batch, *inputs):
            model_state, rng = self._split_inputs(inputs)
            rows = jax.tree.map(lambda x: x.reshape(local, -1, *x.shape[1:]), batch)
            keys = None
            if rng is not None:
                first = jax.lax.axis_index(axes[0]) * local
                keys = jax.vmap(lambda j: step_key(*rng, first + j))(jnp.arange(local))
            varying = make_varying(params, axes[:1])
            loss, marked, fed = total, (), None
            if exchange is not None:
                loss, marked, fed = exchange(total, (varying, rows, model_state, keys))
            if any(marked):
                leaves, treedef = jax.tree.flatten(params)
                mixed = [x if m else v for x, v, m in
                         zip(leaves, jax.tree.leaves(varying), marked, strict=True)]  # fmt: skip
                varying = jax.tree.unflatten(treedef, mixed)
            # Over all of the node's rows at once: a layer's weight gradients are then the
            # node's sums, split as the params are, when the barrier holds them.
            grad_fn = jax.value_and_grad(remat_order.tie_remat_backward(loss), has_aux=True)
            (_, (values, aux, model_state)), grads = grad_fn(varying, rows, model_state, keys)
            # The backward wrote the marked layers' new residuals where it read the old.
            residuals = None if fed is None else fed()
            mean = lambda x: jnp.mean(x, axis=0)  # noqa: E731
            aux = None if aux is None else jax.tree.map(mean, aux)
            if self.has_state:
                model_state = jax.tree.map(lambda x: _sync_rows(x, axes[0], self.sync), model_state)
            return (mean(values), aux, model_state), grads, marked, residuals

        return run
