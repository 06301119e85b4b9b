"""The pipelined step's programs: one train step (or the sync alone) cut into programs at its
collectives, in the order the caller's thread walks them (``Stages``).

``pipelined.py`` schedules them, the wire programs on a dispatch thread of their own;
see its module docstring for why and where that overlaps. Each piece's programs are the
stages of its wire (``wire.integer_stages``, ``wire.scatter_gather_stages``) for its
bucket's ``config.BucketPlan``, which the one-program step runs inline, with the same keys
(``collectives.bucket_keys``): the values are the one-program step's, bit for
bit. What is this step's own: the pieces (``bucket_bytes`` of each bucket per exchange), their
software-pipelined order, and one pmax for every bucket's integer-wire bounds.
"""

import dataclasses
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_bytegrad._src.codecs import resolve_implementation
from jax_bytegrad._src.runtime.programs import Program, Schedule
from jax_bytegrad._src.steps.model_state import checked_loss
from jax_bytegrad._src.sync import buckets as bucketing
from jax_bytegrad._src.sync import patterns
from jax_bytegrad._src.sync import wire as wires
from jax_bytegrad._src.sync.collectives import bucket_keys
from jax_bytegrad._src.sync.config import Group, Residuals, SyncConfig, SyncPlan

# The values the programs pass each other, by name. ----------------------------------------


class Whole(enum.Enum):
    """The values of the step as a whole (one each, not one per bucket)."""

    PARAMS = enum.auto()  # the params, replicated
    KEY = enum.auto()  # ByteGrad's key of the state; the sync alone: compressed_mean's key
    INNER = enum.auto()  # the optimizer's state
    BATCH = enum.auto()  # the global batch
    GRADS = enum.auto()  # the sync alone: each device's gradient
    DEVICE_LOSS = enum.auto()  # each device's loss (and aux), before their mean
    DEVICE_AUX = enum.auto()
    LOSS = enum.auto()  # the mean loss (and aux) over the devices: the metrics
    AUX = enum.auto()
    NEW_PARAMS = enum.auto()  # the state after the step
    NEW_INNER = enum.auto()
    NEW_KEY = enum.auto()
    MEAN = enum.auto()  # the sync alone: the mean, a pytree like the gradient


class Of(enum.Enum):
    """What a value of one bucket is (``Bucket``)."""

    BUCKET = enum.auto()  # the float32 bucket of the gradient
    SHARD = enum.auto()  # its reduce-scatter within the node: this device's 1/L of the sum
    KEY = enum.auto()  # its rounding key on this device (``collectives.bucket_keys``), as data
    BOUNDS = enum.auto()  # integer wire: this device's block bounds of what it compresses
    AGREED = enum.auto()  # the group's pmax of those
    FACTORS = enum.auto()  # the decode factors of the agreed bounds
    MEAN = enum.auto()  # the bucket's mean (or sum), whole, replicated
    SEND_RESIDUAL = enum.auto()  # error feedback's residuals (chains): a ``Residuals`` pair
    MEAN_RESIDUAL = enum.auto()


class Bucket(NamedTuple):
    """The name of a value of one bucket: ``Bucket(Of.SHARD, b)``."""

    of: Of
    bucket: int


class Piece(NamedTuple):
    """The name of a value of one piece of a bucket: the output of its wire plan's stage
    named ``stage`` (``wire.Stage.name``: ``"encode"``, ``"psum"``, ``"decode"``, ...)."""

    stage: str
    bucket: int
    index: int


# A ``Residuals`` pair's names, in its order.
_RESIDUALS = (Of.SEND_RESIDUAL, Of.MEAN_RESIDUAL)


def residual_values(residuals: Residuals) -> dict[Bucket, jax.Array]:
    """Error feedback's residuals by name: the chains the pieces' programs update."""
    return {
        Bucket(of, b): residual
        for b, pair in enumerate(residuals)
        for of, residual in zip(_RESIDUALS, pair, strict=True)
    }


def residual_names(schedule: Schedule, residuals: Residuals) -> list:
    """The names of the residuals' values after a step: each chain's last version."""
    return [schedule.latest(name) for name in residual_values(residuals)]


def new_residuals(schedule: Schedule, values: dict, residuals: Residuals) -> Residuals:
    """The residuals after a step, from its ``values`` (``residual_names`` among them)."""
    return Residuals(
        tuple(values[schedule.latest(Bucket(of, b))] for of in _RESIDUALS)
        for b in range(len(residuals))
    )


# The pieces. --------------------------------------------------------------------------------


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


def _chunks(
    sync: SyncConfig, group: Group, local: int, padded: int, b: int, limit: int | None
) -> list[_Chunk]:
    """The pieces of bucket ``b`` (``padded`` values per device): at most ``limit`` bytes (the
    bucket size) of float32 each, of whole blocks (integer wire) or whole messages
    (scatter-gather)."""
    block = sync.block_size
    size = padded // local if group.scatter else padded
    wanted = 1 if limit is None else max(1, -(-padded * 4 // limit))
    if group.wire == "allreduce" or group.plain:
        blocks = size // block
        parts = 1 if group.plain else min(wanted, blocks)
        return [_Chunk(b, i, s, e) for i, (s, e) in enumerate(_split(blocks, parts))]
    per_peer = size // (group.size * block)
    pieces = patterns.message_slices(per_peer, sync.codec.code_bytes(block), sync.message_bytes)
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

    The values are named by ``Whole`` (the step's own), ``Bucket`` and ``Piece``. What
    bucket b's group compresses is ``Bucket(Of.BUCKET, b)``, or after a reduce-scatter within
    the node ``Bucket(Of.SHARD, b)``; its residuals are chains (``Program``) that each
    piece's encode updates in place. The wire plan's own names (``wire.Stage``: ``"x"``,
    ``"key"``, a stage's output) become the bucket's or the piece's (``_name``).

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

    def __init__(self, mesh, sync: SyncConfig, plan: SyncPlan, *, average: bool, step=None):
        self.n, self.local = (mesh.shape[a] for a in sync.axes)
        self.sync = sync
        self.axes = sync.axes
        self.plan = plan  # its weight is the mean's: average's
        self.layout = layout = plan.layout
        self.group = sync.group(self.n, self.local)
        self.weight = 1.0 / (self.n * self.local) if average else 1.0
        resolve_implementation(sync.implementation)  # refuses "pallas" where it cannot run
        self.integer = self.group.wire == "allreduce"
        self.feedback, self.stochastic = sync.error_feedback, sync.stochastic
        self.block = sync.block_size
        self.width = next((bucket.width for bucket in plan.buckets), None)
        self.ops = next((bucket.integer for bucket in plan.buckets), None)
        self.buckets = range(len(layout.buckets))
        limit, _ = sync.bucket_grain(next((p.platform for p in plan.buckets), "cpu"))
        self.chunks = [
            _chunks(sync, self.group, self.local, layout.padded_sizes[b], b, limit)
            for b in self.buckets
        ]
        self.plans = {}  # each piece's wire plan, by tag, built once
        self.step = step is not None
        self.has_aux = self.step and step.has_aux
        if self.step:
            loss_fn = checked_loss(step.loss_fn, step.has_aux)
            self.grad_fn = jax.value_and_grad(loss_fn, has_aux=step.has_aux)
            self.optimizer, self.donate = step._optimizer, step._donate
        # The integer wire's bounds are of x + residual: known in the gradient's program
        # unless a float32 reduce-scatter within the node comes first.
        self.bounds_in_grad = self.integer and not self.group.plain and not self.group.scatter

    def programs(self) -> list[Program]:
        """Every program of the step, in the order the caller's thread walks them."""
        programs = [self._grad()]
        if self.group.scatter:
            programs += [self._scatter(b) for b in self.buckets]
        last = self._update() if self.step else self._mean()
        metrics = [self._metrics()] if self.step or (self.integer and not self.group.plain) else []
        if self.group.plain:
            return [*programs, *metrics, *[self._plain(b) for b in self.buckets], last]
        if self.integer and self.group.scatter:
            programs += [self._bounds(b) for b in self.buckets]
        programs += metrics
        stages = [self._piece(c) for pieces in self.chunks for c in pieces]
        programs += _pipeline(stages)
        if self.group.scatter:
            programs += [self._gather(b) for b in self.buckets]
        return [*programs, last]

    def _plan(self, c: _Chunk) -> tuple:
        """The wire's stages for piece c, as the one-program sync runs them."""
        if c.tag not in self.plans:
            bucket, feedback = self.plan.buckets[c.bucket], self.feedback
            if self.integer:
                plan = wires.integer_stages(bucket, start=c.start, stop=c.stop, feedback=feedback)
            else:
                plan = wires.scatter_gather_stages(bucket, held=c.pieces, feedback=feedback)
            self.plans[c.tag] = plan
        return self.plans[c.tag]

    def _name(self, c: _Chunk, name: str) -> Bucket | Piece:
        """The schedule's name of a value a plan names: the bucket's own, or piece c's."""
        b = c.bucket
        source = Bucket(Of.SHARD if self.group.scatter else Of.BUCKET, b)
        of_bucket = {
            "x": source, "key": Bucket(Of.KEY, b), "agreed": Bucket(Of.AGREED, b),
            "factors": Bucket(Of.FACTORS, b), "send": Bucket(Of.SEND_RESIDUAL, b),
            "mean": Bucket(Of.MEAN_RESIDUAL, b),
        }  # fmt: skip
        return of_bucket.get(name, Piece(name, b, c.index))

    def _run(self, c: _Chunk, stage: wires.Stage, given: dict) -> dict:
        """One stage of piece c's plan on the schedule's values, as ``wire.run`` runs it in
        one program: its new values, by the schedule's names. The bucket's key comes as key
        data (None for nearest rounding)."""
        key = None
        if self.stochastic and "key" in stage.reads:
            key = jax.random.wrap_key_data(given[Bucket(Of.KEY, c.bucket)])
        names = (*stage.chains, *stage.reads)
        outs = stage.fn(*[key if n == "key" else given[self._name(c, n)] for n in names])
        names = [self._name(c, name) for name in (*stage.chains, stage.name)]
        return dict(zip(names, outs, strict=True))

    def _inputs(self, c: _Chunk, stage: wires.Stage) -> list:
        """The schedule's names of what a stage of piece c reads (no key for nearest
        rounding)."""
        return [self._name(c, n) for n in stage.reads if n != "key" or self.stochastic]

    def _join(self, parts) -> jax.Array:
        """A bucket (or shard) from its pieces' parts of the mean: flat for the integer wire,
        (peers, blocks, block) for the scatter-gather wire."""
        if self.integer:
            return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        return (parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)).reshape(-1)

    def _residuals(self, b: int) -> tuple[Bucket, ...]:
        return (Bucket(Of.SEND_RESIDUAL, b),) if self.feedback else ()

    # Before the pieces. ----------------------------------------------------------------------

    def _grad(self) -> Program:
        """Forward, backward, the buckets; the key of the step and each bucket's; the
        integer wire's bounds."""
        axes, layout, feedback = self.axes, self.layout, self.feedback
        block = self.block

        def grad(given):
            out = {}
            if self.step:
                # Varying params: as in data_parallel_step, no hidden float32 all-reduce.
                params = jax.lax.pcast(given[Whole.PARAMS], axes, to="varying")
                value, grads = self.grad_fn(params, given[Whole.BATCH])
                loss, aux = value if self.has_aux else (value, None)
                # As bytegrad's update (``transforms.py``): the state's next key, and this step's.
                new_key, step_key = jax.random.split(given[Whole.KEY])
            else:  # the sync alone: each device's own gradient, and compressed_mean's key
                grads = jax.tree.map(lambda x: x[0], given[Whole.GRADS])
                step_key = given.get(Whole.KEY)
            vectors = bucketing.to_buckets(jax.tree.leaves(grads), layout)
            out.update((Bucket(Of.BUCKET, b), x) for b, x in enumerate(vectors))
            if self.step:
                out[Whole.DEVICE_LOSS], out[Whole.NEW_KEY] = loss[None], new_key
            if self.has_aux:
                out[Whole.DEVICE_AUX] = jax.tree.map(lambda a: a[None], aux)
            if self.stochastic:
                for b, key in bucket_keys(step_key, axes, self.buckets).items():
                    out[Bucket(Of.KEY, b)] = jax.random.key_data(key)
            if self.bounds_in_grad:
                for b, x in enumerate(vectors):
                    x = x + given[Bucket(Of.SEND_RESIDUAL, b)] if feedback else x
                    out[Bucket(Of.BOUNDS, b)] = self.ops.bounds(self.sync.codec, x, block)
            return out

        inputs = [Whole.PARAMS, Whole.KEY, Whole.BATCH] if self.step else [Whole.GRADS]
        inputs += [Whole.KEY] if self.stochastic and not self.step else []
        reads = [r for b in self.buckets for r in self._residuals(b)] if self.bounds_in_grad else []
        return Program("grad", "compute", grad, inputs, reads=reads)

    def _scatter(self, b: int) -> Program:
        local_axis = self.sync.local_axis

        def scatter(given):
            x = given[Bucket(Of.BUCKET, b)]
            shard = jax.lax.psum_scatter(x, local_axis, scatter_dimension=0, tiled=True)
            return {Bucket(Of.SHARD, b): shard}

        return Program(f"scatter{b}", "wire", scatter, [Bucket(Of.BUCKET, b)])

    def _bounds(self, b: int) -> Program:
        block, feedback = self.block, self.feedback

        def bounds(given):
            x = given[Bucket(Of.SHARD, b)]
            x = x + given[Bucket(Of.SEND_RESIDUAL, b)] if feedback else x
            return {Bucket(Of.BOUNDS, b): self.ops.bounds(self.sync.codec, x, block)}

        return Program(
            f"bounds{b}", "compute", bounds, [Bucket(Of.SHARD, b)], reads=self._residuals(b)
        )

    def _metrics(self) -> Program:
        """The mean loss (and aux) over the devices; the integer wire's agreed bounds and
        decode factors."""
        axes, group = self.axes, self.group.axis
        agree = self.integer and not self.group.plain

        def metrics(given):
            out = {}
            if self.step:
                out[Whole.LOSS] = jax.lax.pmean(given[Whole.DEVICE_LOSS][0], axes)
            if self.has_aux:
                mean = lambda a: jax.lax.pmean(a[0], axes)  # noqa: E731
                out[Whole.AUX] = jax.tree.map(mean, given[Whole.DEVICE_AUX])
            if agree:
                # One pmax for every bucket: the maximum is exact, so this is each bucket's.
                bounds = [given[Bucket(Of.BOUNDS, b)] for b in self.buckets]
                cuts = np.cumsum([x.shape[0] for x in bounds])[:-1].tolist()
                agreed = jnp.split(jax.lax.pmax(jnp.concatenate(bounds), group), cuts)
                # The decode's factors: an output of this program, so the decoding programs
                # read them as data (wire.py's pmax of them is for one program).
                out.update((Bucket(Of.AGREED, b), a) for b, a in enumerate(agreed))
                for b, a in enumerate(agreed):
                    out[Bucket(Of.FACTORS, b)] = self.ops.factors(
                        self.sync.codec, a, width=self.width, group_size=self.group.size,
                        weight=self.weight,
                    )  # fmt: skip
            return out

        inputs = [Whole.DEVICE_LOSS] if self.step else []
        inputs += [Whole.DEVICE_AUX] if self.has_aux else []
        inputs += [Bucket(Of.BOUNDS, b) for b in self.buckets] if agree else []
        return Program("metrics", "wire", metrics, inputs)

    def _plain(self, b: int) -> Program:
        """One device per group, nothing compressed: the bucket's float32 sum, as is (error
        feedback's residuals are empty then, and stay as they are)."""

        def total(given):
            out, _ = wires.sum_flat(
                given[Bucket(Of.BUCKET, b)], self.plan.buckets[b], key=None, residual=None
            )
            return {Bucket(Of.MEAN, b): out}

        return Program(f"sum{b}", "wire", total, [Bucket(Of.BUCKET, b)])

    # The pieces. -----------------------------------------------------------------------------

    def _piece(self, c: _Chunk) -> list[Program]:
        """Piece c's programs: one per stage of the wire's plan, but the decode (after a
        reduce-scatter within the node, a program beside the wire; otherwise in the last
        program)."""
        *stages, decode = self._plan(c)
        programs = [self._stage(c, stage) for stage in stages]
        return programs + ([self._stage(c, decode)] if self.group.scatter else [])

    def _stage(self, c: _Chunk, stage: wires.Stage) -> Program:
        """One stage of piece c's plan as a program."""

        def run(given):
            return self._run(c, stage, given)

        return Program(
            f"{stage.name}{c.tag}", stage.kind, run, self._inputs(c, stage),
            chains=[self._name(c, n) for n in stage.chains],
        )  # fmt: skip

    # After the pieces. -----------------------------------------------------------------------

    def _gather(self, b: int) -> Program:
        """After a reduce-scatter within the node: the bucket's mean from its shards."""
        local_axis = self.sync.local_axis
        parts = [Piece("decode", b, c.index) for c in self.chunks[b]]

        def gather(given):
            shard = self._join([given[name] for name in parts])
            return {Bucket(Of.MEAN, b): patterns.gather_invariant(shard, local_axis)}

        return Program(f"gather{b}", "wire", gather, parts)

    def _tail(self) -> list:
        """What the last program reads the means from: each bucket's, or (decoded there)
        what each piece's decode reads, each value once."""
        if self.group.plain or self.group.scatter:
            return [Bucket(Of.MEAN, b) for b in self.buckets]
        reads = [self._inputs(c, self._plan(c)[-1]) for chunks in self.chunks for c in chunks]
        return list(dict.fromkeys(name for names in reads for name in names))

    def _means(self, given: dict) -> list[jax.Array]:
        """Every bucket's mean, from the last program's values (``_tail``)."""
        if self.group.plain or self.group.scatter:
            return [given[Bucket(Of.MEAN, b)] for b in self.buckets]
        if self.integer:
            # The bucket's sum decoded at once, as sum_shard does: the same fusion.
            return [
                self.ops.decode(
                    self.sync.codec,
                    self._join([given[Piece("psum", b, c.index)] for c in chunks]),
                    given[Bucket(Of.FACTORS, b)],
                    width=self.width,
                )
                for b, chunks in enumerate(self.chunks)
            ]
        decoded = [
            [self._run(c, self._plan(c)[-1], given)[Piece("decode", b, c.index)] for c in chunks]
            for b, chunks in enumerate(self.chunks)
        ]
        return [self._join(parts) for parts in decoded]

    def _update(self) -> Program:
        """The optimizer on the mean gradient, and the new parameters."""
        layout, optimizer = self.layout, self.optimizer

        def update(given):
            params, inner = given[Whole.PARAMS], given[Whole.INNER]
            leaves, treedef = jax.tree.flatten(params)
            grads = bucketing.from_buckets(self._means(given), leaves, layout)
            updates, inner = optimizer.update(jax.tree.unflatten(treedef, grads), inner, params)
            return {Whole.NEW_PARAMS: optax.apply_updates(params, updates), Whole.NEW_INNER: inner}

        return Program(
            "update", "compute", update, [*self._tail(), Whole.PARAMS, Whole.INNER],
            donate=(Whole.PARAMS, Whole.INNER) if self.donate else (),
        )  # fmt: skip

    def _mean(self) -> Program:
        """The sync alone: the mean as a pytree like the gradient, replicated."""
        layout = self.layout

        def mean(given):
            leaves = [None] * len(layout.shapes)  # every leaf is a float leaf
            return {Whole.MEAN: bucketing.from_buckets(self._means(given), leaves, layout)}

        return Program("mean", "compute", mean, self._tail())
