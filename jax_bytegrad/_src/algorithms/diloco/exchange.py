"""DiLoCo's exchanges between nodes and its outer step: inside a step's program, or in the
background, in a program of its own beside the next inner steps.

``Exchanges`` is mixed into the DiLoCo ``TrainStep`` (``step.py``), whose layout
(``sharding/diloco.py``), schedule (``schedule.py``), placement and settings it reads.
Per device, in the placement's update frame (``sharding/placement.py``), an exchange of fragment f:

    delta = global_f - x_f                 the pseudo-gradient of the node's pieces x_f
    mean  = mean over nodes of delta       sync_mean (8- or 4-bit codes) or float32
    global_f = global_f + outer(mean)      every device, the same codes: the same bits

Inside a step (``delay`` 0, 1, or tau > 1 in chunks, one per step) it is part of that step's
program; a program's collectives run where XLA puts them, on XLA:CPU blocking. In the
background (``background=True``) the step that ends the fragment's H steps outputs a copy of
x_f, and ``_Started`` hands it to the exchange's own program, which a dispatch thread of the
step's (``runtime/programs.py``) runs: XLA:CPU runs programs from two threads at once (with one
device per process). The exchange returns, per node, ``global_f - x_f`` as it started (what
lands), and the tau-th step after adds it to the node's pieces after its own update. Every
collective between processes then runs on the dispatch thread: Gloo cannot tell two threads'
collectives apart, so the steps report their loss over the process's devices
(``steps.base.process_mean``), and a caller must run no collective between processes of its
own while an exchange is in flight, except on values the step returned (docs/diloco.md).
"""

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src.algorithms.diloco.schedule import LAND, START
from jax_bytegrad._src.runtime.programs import Dispatcher, LoweredPrograms
from jax_bytegrad._src.sharding.diloco import (
    GLOBAL,
    LANDING,
    OUTER,
    RECEIVED,
    RESIDUALS,
    STARTED,
    merged,
)
from jax_bytegrad._src.steps.base import Program
from jax_bytegrad._src.steps.tracing import traced
from jax_bytegrad._src.sync.collectives import sync_full_precision, sync_mean
from jax_bytegrad._src.sync.config import SyncConfig
from jax_bytegrad._src.sync.patterns import make_varying


class Exchanges:
    """The exchanges and outer steps of the DiLoCo ``TrainStep`` (``step._DiLoCo``), which
    mixes them in: the update of a step that exchanges inside its program, and the programs
    of an exchange in the background."""

    # Inside a step. ------------------------------------------------------------------------

    def _update(self, events, grads, opt_state, params, *extra):
        """In the placement's update frame: the inner update of this device's params (its
        blocks with ``shard=``) from the node's mean gradient, and the exchanges ``events``
        (``Schedule.events``; None: none). Returns the params as they rest, the inner state and,
        with ``events``, the new ``extra``."""
        placement, dims = self.placement, self._layout.dims
        grads = placement.node_mean(grads, dims)
        own = placement.own(params, dims)
        inner = functools.partial(self._inner, grads, opt_state)
        if events is None:
            new, opt_state = inner(own)
            return placement.finish(new, dims), opt_state
        extra = dict(extra[0])
        if self.delay == 0:
            ((f, _),) = events
            new, opt_state = inner(own)
            fresh = self._land(f, self._mean(f, {(f, 0): self._send(f, 0, new, extra)}), extra)
            return placement.finish(self._merged(new, fresh, f), dims), opt_state, extra
        # The exchanges read only this step's inputs and the state: XLA may run them beside
        # the update. A chunk's means wait in ``extra`` for the fragment's last chunk.
        landed = []
        for f, k in events:
            start = self._started(f, k, own, extra)
            means = self._send(f, k, start, extra)
            if k < self.delay - 1:
                if means is not None:
                    received = list(extra[RECEIVED])
                    received[self._layout.slots[(f, k)]] = means
                    extra[RECEIVED] = tuple(received)
                continue
            got = {(f, k): means}
            if self._pending:  # the fragment's other chunks
                slots = self._layout.slots.items()
                got |= {e: extra[RECEIVED][i] for e, i in slots if e[0] == f and e[1] < k}
            landed.append((f, start, self._land(f, self._mean(f, got), extra)))
        new, opt_state = inner(own)
        for f, start, fresh in landed:
            # The fragment restarts from the new global params plus the node's own steps
            # since its exchange started.
            step = jax.tree.map(jnp.subtract, self._fragment(new, f), self._fragment(start, f))
            new = self._merged(new, jax.tree.map(jnp.add, fresh, step), f)
        return placement.finish(new, dims), opt_state, extra

    def _started(self, f, k, own, extra):
        """This device's params (full tree) when fragment ``f``'s exchange started: ``own``
        in its first step (kept in ``extra`` while the exchange is in flight), then the kept
        ones."""
        if k > 0:
            return jax.tree.map(lambda x: x[0], extra[STARTED])
        if self._pending:  # this node's row of the stacked params, as pieces cut it
            started = jax.tree.map(lambda x: x[0], extra[STARTED])
            started = self._merged(started, self._fragment(own, f), f)
            extra[STARTED] = jax.tree.map(lambda x: x[None], started)
        return own

    def _send(self, f, k, start, extra):
        """Chunk ``k`` of fragment ``f``'s exchange: the means over nodes of its pieces'
        pseudo-gradient (the global params minus ``start``), a tuple (None: an empty chunk).
        Updates ``extra``'s residuals."""
        chunk = self._layout.chunks[f][k]
        if not chunk:
            return None
        start = jax.tree.leaves(start)
        return self._send_pieces(f, k, [p.of(start) for p in chunk], extra)

    def _send_pieces(self, f, k, start, extra):
        """``_send`` from the chunk's pieces of the node's params (``start``, a list)."""
        chunk, placement = self._layout.chunks[f][k], self.placement
        theirs = jax.tree.leaves(extra[GLOBAL])
        delta = [jnp.subtract(p.of(theirs), x) for p, x in zip(chunk, start, strict=True)]
        delta = placement.node_sum_of_alike(make_varying(delta, self._axes))
        sharded = placement.sharded(tuple(self._layout.dims[p.leaf] for p in chunk), True)
        if self.sync is None:
            node_axis, local_axis = self._axes
            config = SyncConfig(node_axis=node_axis, local_axis=local_axis, where="diloco")
            return tuple(sync_full_precision(delta, config, sharded=sharded))
        slot = self._layout.slots[(f, k)]
        residuals = list(extra[RESIDUALS]) if self._feedback else [None] * (slot + 1)
        means, residuals[slot] = sync_mean(
            delta, self.sync, residuals=residuals[slot], sharded=sharded, where="diloco"
        )
        if self._feedback:
            extra[RESIDUALS] = tuple(residuals)
        return tuple(means)

    def _mean(self, f, means):
        """Fragment ``f``'s mean pseudo-gradient (leaves outside ``f`` None), from its
        chunks' means (``{(f, k): means of its pieces}``): a leaf cut in runs of rows is
        joined again."""
        runs: dict[int, list] = {}
        for k, chunk in enumerate(self._layout.chunks[f]):
            for p, mean in zip(chunk, means.get((f, k)) or (), strict=True):
                runs.setdefault(p.leaf, []).append((p.dim, mean))
        leaves = [None] * self._treedef.num_leaves
        for leaf, run in runs.items():
            dim = run[0][0]  # None: one piece, the whole leaf
            leaves[leaf] = run[0][1] if dim is None else jnp.concatenate([m for _, m in run], dim)
        return jax.tree.unflatten(self._treedef, leaves)

    def _land(self, f, mean, extra):
        """Fragment ``f``'s outer step from the nodes' ``mean`` pseudo-gradient, on this
        device's (blocks of the) global params; updates ``extra``, returns the new global
        fragment."""
        theirs = self._fragment(extra[GLOBAL], f)
        outer_states = list(extra[OUTER])
        closed, (updates, outer_states[f]) = traced(
            self.outer.update, mean, outer_states[f], theirs
        )
        self.placement.check_update(closed, "diloco (the outer optimizer)")
        fresh = optax.apply_updates(theirs, updates)
        extra[GLOBAL] = self._merged(extra[GLOBAL], fresh, f)
        extra[OUTER] = tuple(outer_states)
        return fresh

    # In the background. -------------------------------------------------------------------

    def _background_update(self, events, grads, opt_state, params, *landing):
        """``_update`` in the background: the inner update, then for a fragment that lands
        here its ``landing`` (the new global pieces minus the node's when the exchange
        started) added to the node's pieces, and for one whose exchange starts here a copy of
        the node's pieces (the exchange's input, a buffer no later step donates). Returns the
        params as they rest, the inner state and, with a start, that copy."""
        placement, dims = self.placement, self._layout.dims
        own = placement.own(params, dims)
        new, opt_state = self._inner(placement.node_mean(grads, dims), opt_state, own)
        started, lands = (), iter(landing)
        for f, what in events:  # a start and a landing are of two fragments: disjoint pieces
            pieces, leaves = self._layout.fragments[f], jax.tree.leaves(new)
            if what == LAND:
                added = zip(pieces, next(lands), strict=True)
                new = merged(new, [jnp.add(p.of(leaves), x) for p, x in added], pieces)
            else:
                started = (tuple(p.of(leaves) for p in pieces),)
        return placement.finish(new, dims), opt_state, *started

    def _exchange(self, f, extra, started):
        """Fragment ``f``'s exchange in the background, in the update frame: the outer step
        from the node's pieces ``started``; returns the new ``extra`` and ``landing``."""
        extra = dict(extra)
        means = self._send_pieces(f, 0, started, extra)
        fresh = self._land(f, self._mean(f, {(f, 0): means}), extra)
        landing = tuple(map(jnp.subtract, jax.tree.leaves(fresh), started))
        return extra, landing

    def _pieces_specs(self, f: int):
        """The specs of fragment ``f``'s pieces of a node's params in the update frame (as
        their leaves'): one node's, and stacked over nodes as the state keeps them."""
        update = jax.tree.leaves(self._layout.extra[GLOBAL], is_leaf=lambda x: isinstance(x, P))
        one = tuple(update[p.leaf] for p in self._layout.fragments[f])
        return one, self._layout.extra[LANDING][f]

    def _build_background(self, events) -> Program:
        """The program of a step that starts or lands an exchange in the background: the
        inner step, and with a start the exchange's own program, on the dispatch thread."""
        start = next((f for f, what in events if what == START), None)
        land = [f for f, what in events if what == LAND]
        held = [self._pieces_specs(f) for f in land]
        given = [] if start is None else [self._pieces_specs(start)]
        update = functools.partial(self._background_update, events)
        step = self._step_fn(update, held, given, rows=True, donated=2)
        inputs = self._inputs(land, () if start is None else self._exchanged_keys)
        if start is not None:
            step = _Started(step, self._build_exchange(start), self._dispatcher, len(land))
        return Program(step, inputs, self._outputs(start=start))

    def _build_exchange(self, f: int):
        """The jitted exchange of fragment ``f`` in the background: ``(extra, started) ->
        (extra, landing)``, ``extra`` the global params, outer states and residuals."""
        placement = self.placement
        specs = {k: self._layout.extra[k] for k in self._exchanged_keys}
        one, stacked = self._pieces_specs(f)

        def per_device(extra, started):
            started = jax.tree.map(lambda x: x[0], started)
            body = functools.partial(self._exchange, f)
            extra, landing = placement.in_update_frame(
                body, (extra, started), (specs, one), (specs, one)
            )
            return extra, jax.tree.map(lambda x: x[None], landing)

        return self._jit(per_device, (specs, stacked), (specs, stacked), 2)


class _Started:
    """A step that starts an exchange in the background: its inner step on the caller's
    thread, then the exchange dispatched by the dispatch thread, from the copy the step made.

    The call returns once both are dispatched (JAX runs them asynchronously): the next steps
    on the caller's thread read nothing the exchange writes, so XLA:CPU runs them beside it.
    Waiting for the dispatch keeps the order of dispatch the same on every process.
    """

    def __init__(self, step, exchange, dispatcher: Dispatcher, landing: int):
        self.step, self.exchange, self.dispatcher = step, exchange, dispatcher
        self._at = 2 + landing  # where the exchange's state sits in the arguments

    def _split(self, args):
        return (*args[: self._at], *args[self._at + 1 :]), args[self._at]

    def __call__(self, *args):
        step_args, extra = self._split(args)
        out = self.step(*step_args)
        exchanged = self.dispatcher.submit(self.exchange, extra, out[2]).result()
        # The step's own outputs last: the next step waits for them alone where it waits
        # (``base.StepsInFlight``), not for the exchange.
        return exchanged, out

    def lower(self, *args) -> LoweredPrograms:
        step_args, extra = self._split(args)
        started = self.step.eval_shape(*step_args)[2]
        return LoweredPrograms(
            {"step": self.step.lower(*step_args), "exchange": self.exchange.lower(extra, started)}
        )
