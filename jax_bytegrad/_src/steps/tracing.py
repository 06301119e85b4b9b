"""A function traced once: its result computed from its jaxpr, which the caller reads too.

The data-parallel step reads two things from the traces of what it runs, without tracing them
twice: the order in which the backward pass produces the gradients (so that each bucket
crosses between nodes as soon as it is complete), and, with ``shard=``, whether the optimizer
is elementwise (``shards.check_elementwise``).
"""

import jax
import jax.extend


def traced(fn, *args):
    """``fn(*args)``, traced once: its jaxpr, and its result computed from that jaxpr."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    return closed, jax.tree.unflatten(jax.tree.structure(shape), out)


def traced_gradient(grad_fn, params, *args):
    """``grad_fn(params, *args)`` (whose result ends with the gradient), traced once; the
    params' leaf indices in the order its backward pass produces their gradients (ties: last
    leaf first), read from that trace; and the trace itself.

    The sync of each bucket of the gradient runs in this order (``buckets.ready_order``), so
    that the first bucket to cross between nodes is the first one complete.
    """
    closed, out = traced(grad_fn, params, *args)
    produced = {}
    for index, equation in enumerate(closed.jaxpr.eqns):
        for var in equation.outvars:
            produced[id(var)] = index
    leaves = len(jax.tree.leaves(params))
    ranks = [produced.get(id(var), -1) for var in closed.jaxpr.outvars[-leaves:]]
    order = tuple(sorted(range(leaves), key=lambda i: (ranks[i], -i)))
    return out, order, closed
