"""Re-running a traced function equation by equation, with some equations replaced.

The two rewrites of a loss's trace (``remat_order``: each remat'd layer's backward tied;
``loop_exchange``: each ``exchange_in_loop`` mark made an exchange) run the jaxpr as JAX's
own interpreter does and differ only in which equations they rebuild. This is that
interpreter, once, with JAX 0.10's and 0.12's forms of an equation's bind parameters.
"""

from collections.abc import Callable, Sequence

import jax.extend as jex


def bind(eqn, ins: Sequence) -> list:
    """``eqn``'s primitive applied to ``ins`` as the trace recorded it: its outputs, a list."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # JAX 0.10 returns (subfuns, params); 0.12 the params alone.
    subfuns, bound = bound if isinstance(bound, tuple) else ((), bound)
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *ins, **bound)
    return outs if eqn.primitive.multiple_results else [outs]


def evaluate(jaxpr, consts: Sequence, args: Sequence, run: Callable[..., list] = bind) -> list:
    """``jaxpr`` on ``consts`` and ``args``, each equation run by ``run(eqn, ins)`` (``bind``
    by default, or a rewrite that falls back to it): the outputs, a list."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jex.core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        outs = run(eqn, [read(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jex.core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]
