"""Each remat'd layer's whole backward in one piece: its weight gradients before the layers
below it run theirs.

A model written as a Python list of ``jax.checkpoint``-ed layers unrolls into one program.
XLA's scheduler is free there to run the data-gradient chain through every layer first and
every weight gradient after it; each deferred weight gradient keeps its recomputed
activations and its incoming cotangents alive until then. On a 30B-shaped Llama list
(``benchmarks/transformer_memory.py``, 60 layers, 2 x 8 H100s) that held 58 GiB per device
at the peak: every layer's recomputed SwiGLU products, their cotangents and its attention
tensors, all waiting for weight-gradient gemms scheduled after the last layer's data
gradient. A ``lax.scan`` over the same layers cannot do that: each iteration's backward
finishes before the next starts. This is the same failure as MaxText's unrolled layers
under XLA's latency-hiding scheduler (openxla/xla#45753, #45929).

``tie_remat_backward`` gives the unrolled list what the loop gives the stack: it rewrites the
top-level ``jax.checkpoint`` calls of a loss (those with the default policy, which saves
only the layer's inputs) into a ``jax.custom_vjp`` with the same forward and residuals,
whose backward recomputes the layer once the cotangent has arrived and releases all of the
layer's input cotangents together, behind one ``optimization_barrier``: the gradient for the
layer below is not available before this layer's weight gradients exist. The values are the
same; only the order XLA may choose changes. Checkpoints nested in other calls (a ``jit``,
a ``scan`` body) and those with a saving policy are left as they are.
"""

import jax
import jax.extend as jex
import jax.numpy as jnp

from jax_bytegrad._src.steps import interpret

_REMAT = "remat2"  # the primitive jax.checkpoint binds


def _is_float(x) -> bool:
    return x is not None and jnp.issubdtype(x.dtype, jnp.inexact)


def _barrier(xs: list) -> list:
    """``xs`` through one ``optimization_barrier``: XLA makes them all before any is used.
    Integer cotangents (float0) and Nones pass by."""
    idx = [i for i, x in enumerate(xs) if _is_float(x)]
    held = jax.lax.optimization_barrier([xs[i] for i in idx])
    out = list(xs)
    for i, x in zip(idx, held, strict=True):
        out[i] = x
    return out


def _tied(jaxpr):
    """The checkpointed call ``jaxpr`` as a ``custom_vjp`` whose backward is one piece."""
    run = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(jaxpr, ()))

    @jax.custom_vjp
    def tied(*args):
        return run(*args)

    def fwd(*args):
        return run(*args), args  # as jax.checkpoint with no policy: the inputs, nothing else

    def bwd(args, cts):
        # The recomputation waits for the cotangent (and is not merged with the forward).
        held = _barrier([*args, *cts])
        args, cts = held[: len(args)], held[len(args) :]
        _, vjp = jax.vjp(run, *args)
        return tuple(_barrier(list(vjp(cts))))

    tied.defvjp(fwd, bwd)
    return tied


def _tieable(eqn) -> bool:
    """A ``jax.checkpoint`` call that saves its inputs only (no policy), with no consts."""
    params = eqn.params
    return (
        eqn.primitive.name == _REMAT
        and params.get("policy") is None
        and not params["jaxpr"].constvars
    )


def _eval(jaxpr, consts, args) -> list:
    """``jaxpr`` evaluated on ``consts`` and ``args`` as JAX's own interpreter does, with
    each ``_tieable`` call replaced by its ``_tied`` form."""

    def run(eqn, ins):
        return _tied(eqn.params["jaxpr"])(*ins) if _tieable(eqn) else interpret.bind(eqn, ins)

    return interpret.evaluate(jaxpr, consts, args, run)


def tie_remat_backward(fn):
    """``fn`` (arrays in, arrays out) with each top-level default-policy ``jax.checkpoint``
    it calls rewritten so that the call's backward releases its input cotangents together.

    Args:
      fn: a function of pytrees of arrays (a loss), traced once per call.

    Returns:
      A function of the same arguments and values.
    """

    def tied(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return tied
