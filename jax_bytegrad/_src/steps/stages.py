"""The pipelined step's programs: one train step (or the sync alone) cut into programs at its
collectives, in the order the caller's thread walks them (``Stages``).

``steps/pipelined.py`` schedules them, the wire programs on a dispatch thread of their own;
see its module docstring for why and where that overlaps. Each piece's programs are the
stages of its wire's plan (``wire.integer_plan``, ``wire.scatter_gather_plan``), which the
one-program step runs inline, with the same keys: the values are the one-program step's, bit
for bit. What is this step's own: the pieces (``bucket_bytes`` of each bucket per exchange),
their software-pipelined order, and one pmax for every bucket's integer-wire bounds.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_bytegrad._src import buckets as bucketing
from jax_bytegrad._src import codecs, collective_ops
from jax_bytegrad._src import wire as wires
from jax_bytegrad._src.codecs.integer import allreduce_width
from jax_bytegrad._src.config import SyncConfig
from jax_bytegrad._src.programs import Program
from jax_bytegrad._src.quantization import resolve_implementation


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """A piece of a bucket that crosses the wire in one exchange program.

    Attributes:
      bucket: the bucket's index.
      index: the piece's index in the bucket.
      start, stop: its range of blocks (integer wire: of the group's vector; scatter-gather:
        of each peer's row of it).
      pieces: scatter-gather: the message pieces it holds, as (index in the bucket, block
        slice) pairs.
    """

    bucket: int
    index: int
    start: int
    stop: int
    pieces: tuple = ()

    @property
    def tag(self) -> str:
        return f"{self.bucket}.{self.index}"


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges of about equal size covering ``range(count)``."""
    return [(count * i // parts, count * (i + 1) // parts) for i in range(parts)]


def _chunks(sync: SyncConfig, group: wires.Group, local: int, padded: int, b: int) -> list[_Chunk]:
    """The pieces of bucket ``b`` (``padded`` values per device): at most ``bucket_bytes``
    of float32 each, of whole blocks (integer wire) or whole messages (scatter-gather)."""
    block = sync.block_size
    size = padded // local if group.scatter else padded
    wanted = 1 if sync.bucket_bytes is None else max(1, -(-padded * 4 // sync.bucket_bytes))
    if group.wire == "allreduce" or group.plain:
        blocks = size // block
        parts = 1 if group.plain else min(wanted, blocks)
        return [_Chunk(b, i, s, e) for i, (s, e) in enumerate(_split(blocks, parts))]
    per_peer = size // (group.size * block)
    pieces = collective_ops.message_slices(per_peer, block * sync.bits // 8, sync.message_bytes)
    chunks = []
    for i, (s, e) in enumerate(_split(len(pieces), min(wanted, len(pieces)))):
        held = tuple((j, pieces[j]) for j in range(s, e))
        chunks.append(_Chunk(b, i, held[0][1].start, held[-1][1].stop, held))
    return chunks


def _pipeline(stages: list[list[Program]]) -> list[Program]:
    """The pieces' stages as a software pipeline: stage k of piece c at tick c + k.

    In each tick the wire programs are submitted first, the oldest piece's first (the order
    of the exchanges); then the compute programs, the newest piece's first, so that the
    caller's thread dispatches the next encode before it waits for an exchange to decode.
    """
    depth = max(len(s) for s in stages)
    order = []
    for tick in range(len(stages) + depth - 1):
        now = [s[tick - c] for c, s in enumerate(stages) if 0 <= tick - c < len(s)]
        order += [p for p in now if p.kind == "wire"]
        order += [p for p in reversed(now) if p.kind == "compute"]
    return order


class Stages:
    """The programs of one train step (or of the sync alone) for ``layout``, in the order
    the caller's thread walks them.

    ``buf{b}`` is the vector bucket b's group compresses (the bucket, or its shard after a
    reduce-scatter within the node); ``send{b}`` / ``mean{b}`` are its residuals, chains
    (``Program``) that each piece's encode updates in place. Other values are named
    ``{stage}{b}.{i}`` for piece i.

    Where the mean is decoded: as in the one-program step, so that XLA:CPU fuses the same
    operations and contracts the same fused multiply-adds. After a reduce-scatter within
    the node, each piece is decoded in a program of its own, beside the wire, and the
    float32 all-gather within the node separates the decode from the optimizer, as it does
    in one program. Otherwise the one-program step fuses the decode into the optimizer's
    first pass, so the last program decodes every piece itself: a decode fused into a pass
    the optimizer makes anyway reads a byte or two per value instead of four.

    Args:
      mesh: the mesh.
      sync: the sync's settings.
      layout: the buckets of the gradient.
      average: divide by the device count.
      step: the ``PipelinedStep`` whose loss and optimizer the first and last programs
        run; None for the sync alone (``PipelinedMean``): each device's gradient in, the
        mean out.
    """

    def __init__(self, mesh, sync: SyncConfig, layout, *, average: bool, step=None):
        self.n, self.local = (mesh.shape[a] for a in sync.axes)
        self.sync = sync
        self.axes = sync.axes
        self.layout = layout
        self.group = wires.group_of(sync, self.n, self.local)
        self.weight = 1.0 / (self.n * self.local) if average else 1.0
        resolve_implementation(sync.implementation)  # refuses "pallas" where it cannot run
        self.integer = self.group.wire == "allreduce"
        self.feedback, self.stochastic = sync.error_feedback, sync.stochastic
        self.block = sync.block_size
        self.width = None
        if self.integer and not self.group.plain:
            self.width = allreduce_width(sync.bits, self.group.size)
        self.buckets = range(len(layout.buckets))
        self.chunks = [
            _chunks(sync, self.group, self.local, layout.padded_sizes[b], b) for b in self.buckets
        ]
        self.plans = {}  # each piece's wire plan, by tag, built once
        self.step = step is not None
        self.has_aux = self.step and step.has_aux
        if self.step:
            self.grad_fn = jax.value_and_grad(step.loss_fn, has_aux=step.has_aux)
            self.optimizer, self.donate = step._optimizer, step._donate
        # The integer wire's bounds are of x + residual: known in the gradient's program
        # unless a float32 reduce-scatter within the node comes first.
        self.bounds_in_grad = self.integer and not self.group.plain and not self.group.scatter

    def tasks(self) -> list[Program]:
        tasks = [self._grad()]
        if self.group.scatter:
            tasks += [self._scatter(b) for b in self.buckets]
        last = self._update() if self.step else self._mean()
        metrics = [self._metrics()] if self.step or (self.integer and not self.group.plain) else []
        if self.group.plain:
            return [*tasks, *metrics, *[self._plain(b) for b in self.buckets], last]
        if self.integer and self.group.scatter:
            tasks += [self._bounds(b) for b in self.buckets]
        tasks += metrics
        stages = [self._piece(c) for pieces in self.chunks for c in pieces]
        tasks += _pipeline(stages)
        if self.group.scatter:
            tasks += [self._gather(b) for b in self.buckets]
        return [*tasks, last]

    def _plan(self, c: _Chunk) -> tuple:
        """The wire's stages for piece c, as the one-program sync runs them."""
        if c.tag not in self.plans:
            if self.integer:
                self.plans[c.tag] = wires.integer_plan(
                    self.group, codec=self.sync.codec, block_size=self.block, start=c.start,
                    stop=c.stop, feedback=self.feedback,
                )  # fmt: skip
            else:
                self.plans[c.tag] = wires.scatter_gather_plan(
                    self.sync, self.group, weight=self.weight, held=c.pieces,
                    feedback=self.feedback,
                )  # fmt: skip
        return self.plans[c.tag]

    def _name(self, c: _Chunk, name: str) -> str:
        """The schedule's name of a value a plan names: the bucket's own, or piece c's."""
        b = c.bucket
        of_bucket = {
            "x": self._source(b), "key": "keys", "agreed": f"agreed{b}",
            "factors": f"factors{b}", "send": f"send{b}", "mean": f"mean{b}",
        }  # fmt: skip
        return of_bucket.get(name, f"{name}{c.tag}")

    def _decode_reads(self, c: _Chunk) -> tuple[str, ...]:
        """Piece c's last values: what its decode reads."""
        return tuple(self._name(c, n) for n in self._plan(c)[-1].reads)

    def _pieces(self):
        """The pieces' last values, by bucket (``_decode_reads``)."""
        return [[self._decode_reads(c) for c in cs] for cs in self.chunks]

    def _decode(self, c: _Chunk, *values):
        """Piece c's part of the mean from its last values (``_pieces``): flat for the
        integer wire, (peers, blocks, block) for the scatter-gather wire."""
        return self._plan(c)[-1].fn(*values)[0]

    def _decode_sum(self, total, factors):
        return codecs.integer_decode(self.sync.codec, total, factors, width=self.width)

    def _decode_factors(self, agreed):
        return codecs.decode_factors(
            self.sync.codec, agreed, width=self.width, group_size=self.group.size,
            weight=self.weight,
        )  # fmt: skip

    def _join(self, parts) -> jax.Array:
        """A bucket (or shard) from its pieces' parts of the mean."""
        if self.integer:
            return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        return (parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)).reshape(-1)

    def _residuals(self, b: int) -> tuple[str, ...]:
        return (f"send{b}",) if self.feedback else ()

    # Before the pieces. ----------------------------------------------------------------------

    def _grad(self) -> Program:
        """Forward, backward, the buckets; the key of the step; the integer wire's bounds."""
        axes, layout, feedback = self.axes, self.layout, self.feedback
        stochastic, block, num = self.stochastic, self.block, len(self.buckets)

        def grad(*args):
            args = list(args)
            sends = args[:num] if self.bounds_in_grad and feedback else ()
            args = args[len(sends) :]
            if self.step:
                params, key, batch = args
                # Varying params: as in data_parallel_step, no hidden float32 all-reduce.
                out, grads = self.grad_fn(jax.lax.pcast(params, axes, to="varying"), batch)
                loss, aux = out if self.has_aux else (out, None)
                new_key, step_key = jax.random.split(key)
            else:  # the sync alone: each device's own gradient, and compressed_mean's key
                grads = jax.tree.map(lambda x: x[0], args[0])
                step_key = args[1] if stochastic else None
            buckets = bucketing.to_buckets(jax.tree.leaves(grads), layout)
            outs = [*buckets]
            if self.step:
                outs += [loss[None], new_key]
            if self.has_aux:
                outs.append(jax.tree.map(lambda a: a[None], aux))
            if stochastic:
                # As sync_mean: each device's key, then one per bucket.
                device = jax.random.fold_in(step_key, jax.lax.axis_index(axes))
                keys = [jax.random.key_data(jax.random.fold_in(device, b)) for b in range(num)]
                outs.append(jnp.stack(keys))
            if self.bounds_in_grad:
                if feedback:
                    buckets = [x + r for x, r in zip(buckets, sends, strict=True)]
                outs += [codecs.integer_bounds(self.sync.codec, x, block) for x in buckets]
            return tuple(outs)

        inputs = ["params", "key", "batch"] if self.step else ["grads"]
        inputs += ["key"] if stochastic and not self.step else []
        outputs = [f"buf{b}" for b in self.buckets]
        outputs += ["loss_d", "new_key"] if self.step else []
        outputs += ["aux_d"] if self.has_aux else []
        outputs += ["keys"] if stochastic else []
        outputs += [f"bounds{b}" for b in self.buckets] if self.bounds_in_grad else []
        reads = [f"send{b}" for b in self.buckets] if self.bounds_in_grad and feedback else []
        return Program("grad", "compute", grad, inputs, outputs, reads=reads)

    def _scatter(self, b: int) -> Program:
        local_axis = self.sync.local_axis

        def scatter(x):
            return (jax.lax.psum_scatter(x, local_axis, scatter_dimension=0, tiled=True),)

        return Program(f"scatter{b}", "wire", scatter, [f"buf{b}"], [f"shard{b}"])

    def _bounds(self, b: int) -> Program:
        block, feedback = self.block, self.feedback

        def bounds(*args):
            *send, x = args
            return (codecs.integer_bounds(self.sync.codec, x + send[0] if feedback else x, block),)

        return Program(
            f"bounds{b}", "compute", bounds, [f"shard{b}"], [f"bounds{b}"],
            reads=self._residuals(b),
        )  # fmt: skip

    def _metrics(self) -> Program:
        """The mean loss (and aux) over the devices; the integer wire's agreed bounds and
        decode factors."""
        axes, group = self.axes, self.group.axis
        agree = self.integer and not self.group.plain

        def metrics(*rest):
            rest = list(rest)
            outs = [jax.lax.pmean(rest.pop(0)[0], axes)] if self.step else []
            if self.has_aux:
                outs.append(jax.tree.map(lambda a: jax.lax.pmean(a[0], axes), rest.pop(0)))
            if agree:
                # One pmax for every bucket: the maximum is exact, so this is each bucket's.
                cuts = np.cumsum([x.shape[0] for x in rest])[:-1].tolist()
                agreed = jnp.split(jax.lax.pmax(jnp.concatenate(rest), group), cuts)
                # The decode's factors: an output of this program, so the decoding programs
                # read them as data (wire.py's pmax of them is for one program).
                outs += [*agreed, *map(self._decode_factors, agreed)]
            return tuple(outs)

        inputs = ["loss_d"] if self.step else []
        outputs = ["loss"] if self.step else []
        inputs += ["aux_d"] if self.has_aux else []
        outputs += ["aux"] if self.has_aux else []
        if agree:
            inputs += [f"bounds{b}" for b in self.buckets]
            outputs += [f"agreed{b}" for b in self.buckets]
            outputs += [f"factors{b}" for b in self.buckets]
        return Program("metrics", "wire", metrics, inputs, outputs)

    def _plain(self, b: int) -> Program:
        """One device per group, nothing compressed: the bucket's float32 sum, as is (error
        feedback's residuals are empty then, and stay as they are)."""
        sync = self.sync

        def total(x):
            out, _ = wires.sum_flat(
                x, sync, n=self.n, local=self.local, weight=self.weight, key=None, residual=None
            )
            return (out,)

        return Program(f"sum{b}", "wire", total, [f"buf{b}"], [f"avg{b}"])

    # The pieces. -----------------------------------------------------------------------------

    def _key(self, keys, b: int):
        return None if keys is None else jax.random.wrap_key_data(keys[b])

    def _piece(self, c: _Chunk) -> list[Program]:
        """Piece c's programs: one per stage of the wire's plan, but the decode (after a
        reduce-scatter within the node, a program beside the wire; otherwise in the last
        program)."""
        return [self._stage(c, stage) for stage in self._plan(c)[:-1]] + self._piece_decode(c)

    def _stage(self, c: _Chunk, stage) -> Program:
        """One stage of piece c's plan as a program; the bucket's key is read from the
        stacked keys."""
        reads = [n for n in stage.reads if n != "key" or self.stochastic]

        def run(*args):
            chained, rest = args[: len(stage.chains)], args[len(stage.chains) :]
            given = dict(zip(reads, rest, strict=True))
            given["key"] = self._key(given.get("key"), c.bucket)
            return stage.fn(*chained, *(given[n] for n in stage.reads))

        return Program(
            f"{stage.name}{c.tag}", stage.kind, run, [self._name(c, n) for n in reads],
            [self._name(c, stage.name)], chains=[self._name(c, n) for n in stage.chains],
        )  # fmt: skip

    def _piece_decode(self, c: _Chunk) -> list[Program]:
        """After a reduce-scatter within the node: piece c's decode, beside the wire."""
        if not self.group.scatter:
            return []
        values = self._decode_reads(c)
        return [
            Program(
                f"decode{c.tag}", "compute", lambda *v: (self._decode(c, *v),), values,
                [f"part{c.tag}"],
            )
        ]  # fmt: skip

    def _source(self, b: int) -> str:
        return f"shard{b}" if self.group.scatter else f"buf{b}"

    # After the pieces. -----------------------------------------------------------------------

    def _gather(self, b: int) -> Program:
        """After a reduce-scatter within the node: the bucket's mean from its shards."""
        local_axis = self.sync.local_axis

        def gather(*parts):
            return (collective_ops.gather_invariant(self._join(parts), local_axis),)

        parts = [f"part{c.tag}" for c in self.chunks[b]]
        return Program(f"gather{b}", "wire", gather, parts, [f"avg{b}"])

    def _tail(self):
        """The last program's view of the means: its input names, and a function of those
        inputs that gives the mean of every bucket."""
        if self.group.plain or self.group.scatter:
            return [f"avg{b}" for b in self.buckets], list
        pieces = self._pieces()
        names = [name for by_bucket in pieces for values in by_bucket for name in values]

        def means(values):
            values, out = list(values), []
            for chunks, by_bucket in zip(self.chunks, pieces, strict=True):
                held = [[values.pop(0) for _ in names] for names in by_bucket]
                if self.integer:
                    # The bucket's sum decoded at once, as integer_sum does: the same fusion.
                    out.append(self._decode_sum(self._join([h[0] for h in held]), held[0][1]))
                else:
                    parts = [self._decode(c, *h) for c, h in zip(chunks, held, strict=True)]
                    out.append(self._join(parts))
            return out

        # A bucket's decode factors are read by each of its pieces: pass each value once.
        unique = list(dict.fromkeys(names))
        return unique, lambda values: means([values[unique.index(n)] for n in names])

    def _update(self) -> Program:
        """The optimizer on the mean gradient, and the new parameters."""
        layout, optimizer = self.layout, self.optimizer
        names, means = self._tail()

        def update(*args):
            *values, params, inner = args
            leaves, treedef = jax.tree.flatten(params)
            grads = bucketing.from_buckets(means(values), leaves, layout)
            updates, inner = optimizer.update(jax.tree.unflatten(treedef, grads), inner, params)
            return optax.apply_updates(params, updates), inner

        return Program(
            "update", "compute", update, [*names, "params", "inner"], ["new_params", "new_inner"],
            donate=(len(names), len(names) + 1) if self.donate else (),
        )  # fmt: skip

    def _mean(self) -> Program:
        """The sync alone: the mean as a pytree like the gradient, replicated."""
        layout = self.layout
        names, means = self._tail()

        def mean(*values):
            leaves = [None] * len(layout.shapes)  # every leaf is a float leaf
            return (bucketing.from_buckets(means(values), leaves, layout),)

        return Program("mean", "compute", mean, names, ["mean"])


# The step -----------------------------------------------------------------------------------
