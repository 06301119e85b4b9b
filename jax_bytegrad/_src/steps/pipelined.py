"""A pipelined data-parallel ByteGrad step: the compressed sync's compute runs beside its wire.

Follows the bucketed, overlapped gradient sync of PyTorch DDP and Bagua (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020; Gan et al.,
"Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022), on XLA:CPU.

``data_parallel_step`` with ``optax.chain(bytegrad(...), optimizer)`` compiles one program.
XLA:CPU runs the collectives of a program one after another, each blocking, and overlaps
little compute with them, so that step takes the sum of its parts: the backward pass, the
codec's compute and the wire (benchmarks/RESULTS.md, "Line rate"). Two programs dispatched from
different threads do run at once (JAX uses the calling thread as the execution stream). So
this step cuts the same computation into programs at its collectives:

    grad            forward, backward, buckets (and the integer wire's block bounds)
    per bucket: its pieces of at most ``bucket_bytes`` (a leaf larger than that is cut too)
      integer wire: encode -> psum of the codes -> decode
      scatter-gather and ring wires: quantize -> all_to_all -> average -> all_gather -> decode
    update          the optimizer on the mean, and the new parameters

The programs that hold collectives (the wire programs) run on one dispatch thread of their
own, in the same order on every process and one at a time (Gloo tags every operation alike);
the others (the compute programs) on the caller's thread. Piece k's exchange is then on the
wire while piece k + 1 is encoded and piece k - 1 decoded: a software pipeline, each piece
one stage behind the one before it. A program of fewer than about 1000 flops (a collective
alone) runs inline on the thread that calls it, so the dispatch thread blocks in each
exchange while the caller's thread goes on.

The stages are the wire's own (``codecs.integer.integer_bounds``, ``integer_encode``,
``integer_decode``; ``wire.sg_encode``, ``sg_average``, ``sg_decode``), with the same keys,
so the step computes the same values as ``data_parallel_step`` with
``optax.chain(bytegrad(...), optimizer)``, bit for bit (tests/test_pipelined.py), and holds
the same ``TrainState``: a checkpoint of one restores into the other.

Where it overlaps: with one device per process (one JAX process per host, the layout of CPU
clusters and of benchmarks/network.py). A process with several devices runs every program
over all of its devices, one program at a time in dispatch order (XLA's PJRT CPU client
gang-schedules them), so there the programs run one after another, correct but not
overlapped. The backward pass is not overlapped with the sync: the gradient is one program.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import buckets as bucketing
from jax_bytegrad._src import checks, collective_ops
from jax_bytegrad._src import wire as wires
from jax_bytegrad._src.codecs.integer import (
    allreduce_width,
    decode_factors,
    dither_seed,
    integer_bounds,
    integer_decode,
    integer_encode,
)
from jax_bytegrad._src.collectives import bucket_layout
from jax_bytegrad._src.config import Residuals, SyncConfig
from jax_bytegrad._src.programs import Dispatcher, Program, Schedule, Value, aval, execute
from jax_bytegrad._src.quantization import resolve_implementation
from jax_bytegrad._src.sharding import StateSpecs
from jax_bytegrad._src.steps.base import (
    LoweredPrograms,
    TrainState,
    TrainStep,
    count,
    global_batch,
)
from jax_bytegrad._src.transforms import ByteGradState, bytegrad

# Private helpers: the stages of one step ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Group:
    """Who compresses with whom, as the one-program sync has it (``wire.sum_flat``).

    Attributes:
      axis: the axes the codes are exchanged or summed over.
      gather: the scatter-gather wire's all_gather axes (the same devices).
      size: devices in the group.
      scatter: whether a float32 reduce-scatter within the node comes first.
    """

    axis: Any
    gather: Any
    size: int
    scatter: bool

    @property
    def plain(self) -> bool:
        """One device in the group: nothing is compressed."""
        return self.size == 1


def _group(sync: SyncConfig, n: int, local: int) -> _Group:
    axes = sync.axes
    if not sync.hierarchical:
        return _Group(axes, axes, n * local, False)
    # With one device per node, the integer sum over both axes types its result replicated
    # over both; the scatter-gather wire gathers over both for the same reason.
    summed = sync.node_axis if local > 1 or sync.wire != "allreduce" else axes
    return _Group(summed, sync.node_axis if local > 1 else axes, n, local > 1)


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


def _chunks(sync: SyncConfig, group: _Group, local: int, padded: int, b: int) -> list[_Chunk]:
    """The pieces of bucket ``b`` (``padded`` values per device): at most ``bucket_bytes``
    of float32 each, of whole blocks (integer wire) or whole messages (scatter-gather)."""
    block = sync.block_size
    size = padded // local if group.scatter else padded
    wanted = 1 if sync.bucket_bytes is None else max(1, -(-padded * 4 // sync.bucket_bytes))
    if sync.wire == "allreduce" or group.plain:
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


class _Stages:
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
        # The wire this mesh runs ("auto" resolved), as the one-program step picks it.
        sync = sync.replace(wire=sync.wire_for(sync.group_size(self.n, self.local)))
        self.sync = sync
        self.axes = sync.axes
        self.layout = layout
        self.group = _group(sync, self.n, self.local)
        self.weight = 1.0 / (self.n * self.local) if average else 1.0
        resolve_implementation(sync.implementation)  # refuses "pallas" where it cannot run
        self.codec = sync.codec
        self.integer = sync.wire == "allreduce"
        self.feedback, self.stochastic = sync.error_feedback, sync.stochastic
        self.block = sync.block_size
        self.width = None
        if self.integer and not self.group.plain:
            self.width = allreduce_width(sync.bits, self.group.size)
        self.buckets = range(len(layout.buckets))
        self.chunks = [
            _chunks(sync, self.group, self.local, layout.padded_sizes[b], b) for b in self.buckets
        ]
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
        stages = [
            self._integer(c) if self.integer else self._scatter_gather(c)
            for pieces in self.chunks
            for c in pieces
        ]
        tasks += _pipeline(stages)
        if self.group.scatter:
            tasks += [self._gather(b) for b in self.buckets]
        return [*tasks, last]

    def _pieces(self):
        """The pieces' last values, by bucket: what the decode reads."""
        if self.integer:
            return [[(f"total{c.tag}", f"factors{c.bucket}") for c in cs] for cs in self.chunks]
        return [[(f"gathered{c.tag}",) for c in cs] for cs in self.chunks]

    def _decode(self, c: _Chunk, *values):
        """Piece c's part of the mean from its last values (``_pieces``): flat for the
        integer wire, (peers, blocks, block) for the scatter-gather wire."""
        if self.integer:
            total, factors = values
            return self._decode_sum(total, factors[:, c.start : c.stop])
        (gathered,) = values
        parts = [wires.sg_decode(g, codec=self.codec, block_size=self.block) for g in gathered]
        return jnp.concatenate(parts, axis=1)

    def _decode_sum(self, total, factors):
        return integer_decode(total, factors, width=self.width)

    def _decode_factors(self, agreed):
        return decode_factors(
            agreed, width=self.width, group_size=self.group.size, weight=self.weight,
            stochastic=self.stochastic,
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
                outs += [integer_bounds(x, block) for x in buckets]
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
            return (integer_bounds(x + send[0] if feedback else x, block),)

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

    def _integer(self, c: _Chunk) -> list[Program]:
        """encode -> psum (-> decode) of one piece (``wire.integer_sum``'s stages)."""
        group, width, block = self.group, self.width, self.block
        feedback, stochastic, tag = self.feedback, self.stochastic, c.tag
        s, e = c.start * block, c.stop * block

        def encode(*args):
            args = list(args)
            res = args.pop(0) if feedback else None
            x, agreed = args.pop(0), args.pop(0)
            key = self._key(args.pop(0) if stochastic else None, c.bucket)
            x = x[s:e] if res is None else x[s:e] + res[s:e]
            codes, kept = integer_encode(
                x, agreed[c.start : c.stop], block_size=block, width=width,
                stochastic=stochastic, seed=None if key is None else dither_seed(key),
                first_block=c.start, feedback=feedback,
            )  # fmt: skip
            return (codes,) if res is None else (res.at[s:e].set(kept), codes)

        def psum(codes):
            return (jax.lax.psum(codes, group.axis),)

        keys = ["keys"] if stochastic else []
        inputs = [self._source(c.bucket), f"agreed{c.bucket}", *keys]
        return [
            Program(
                f"encode{tag}", "compute", encode, inputs, [f"codes{tag}"],
                chains=self._residuals(c.bucket),
            ),
            Program(f"psum{tag}", "wire", psum, [f"codes{tag}"], [f"total{tag}"]),
            *self._piece_decode(c),
        ]  # fmt: skip

    def _piece_decode(self, c: _Chunk) -> list[Program]:
        """After a reduce-scatter within the node: piece c's decode, beside the wire."""
        if not self.group.scatter:
            return []
        values = self._pieces()[c.bucket][c.index]
        return [
            Program(
                f"decode{c.tag}", "compute", lambda *v: (self._decode(c, *v),), values,
                [f"part{c.tag}"],
            )
        ]  # fmt: skip

    def _source(self, b: int) -> str:
        return f"shard{b}" if self.group.scatter else f"buf{b}"

    def _scatter_gather(self, c: _Chunk) -> list[Program]:
        """quantize -> all_to_all -> average -> all_gather -> decode of one piece (the
        stages of ``wire._scatter_gather_piece``, for each message piece it holds)."""
        sync, group, codec, block = self.sync, self.group, self.codec, self.block
        feedback, stochastic, tag = self.feedback, self.stochastic, c.tag
        exchange = wires.code_exchange(sync.wire, sync.message_bytes)
        held = slice(c.start, c.stop)

        def piece_key(keys, j):
            key = self._key(keys, c.bucket)
            return None if key is None else jax.random.fold_in(key, j)

        def rows(x):  # (peers, blocks per peer, block), as scatter_gather_sum_flat has it
            return x.reshape(group.size, -1, block)

        def quantize(*rest):
            rest = list(rest)
            send = rows(rest.pop(0)) if feedback else None
            x = rows(rest.pop(0))
            keys = rest.pop(0) if stochastic else None
            messages, kept = [], []
            for j, blocks in c.pieces:
                part = None if send is None else send[:, blocks]
                message, new = wires.sg_encode(
                    x[:, blocks], part, key=piece_key(keys, j), codec=codec
                )
                messages.append(message)
                kept.append(new)
            if send is None:
                return (tuple(messages),)
            send = send.at[:, held].set(jnp.concatenate(kept, axis=1))
            return send.reshape(-1), tuple(messages)

        def all_to_all(messages):
            return (tuple(exchange(m, group.axis) for m in messages),)

        def average(*args):
            args = list(args)
            mean = args.pop(0).reshape(-1, block) if feedback else None
            received = args.pop(0)
            keys = args.pop(0) if stochastic else None
            messages, kept = [], []
            for (j, blocks), got in zip(c.pieces, received, strict=True):
                message, new = wires.sg_average(
                    got, None if mean is None else mean[blocks], weight=self.weight,
                    key=piece_key(keys, j), codec=codec, block_size=block,
                )  # fmt: skip
                messages.append(message)
                kept.append(new)
            if mean is None:
                return (tuple(messages),)
            mean = mean.at[held].set(jnp.concatenate(kept, axis=0))
            return mean.reshape(-1), tuple(messages)

        def all_gather(messages):
            gather = jax.lax.all_gather
            return (tuple(gather(m, group.gather, axis=0, to="invarying") for m in messages),)

        b = c.bucket
        keys = ["keys"] if stochastic else []
        mean = [f"mean{b}"] if feedback else []
        return [
            Program(f"quantize{tag}", "compute", quantize, [self._source(b), *keys],
                     [f"message{tag}"], chains=self._residuals(b)),
            Program(f"all_to_all{tag}", "wire", all_to_all, [f"message{tag}"],
                     [f"received{tag}"]),
            Program(f"average{tag}", "compute", average, [f"received{tag}", *keys],
                     [f"average{tag}"], chains=mean),
            Program(f"all_gather{tag}", "wire", all_gather, [f"average{tag}"],
                     [f"gathered{tag}"]),
            *self._piece_decode(c),
        ]  # fmt: skip

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


def _sync_kwargs(sync: SyncConfig) -> dict[str, Any]:
    return {f.name: getattr(sync, f.name) for f in dataclasses.fields(sync)}


def _state_inputs(residuals) -> dict[str, Any]:
    """Error feedback's residuals as the version 0 of their chains."""
    out = {}
    for b, (send, mean) in enumerate(residuals):
        out[f"send{b}@0"], out[f"mean{b}@0"] = send, mean
    return out


def _residual_names(schedule: Schedule) -> list[str]:
    return list(schedule.last.values())


def _new_residuals(schedule: Schedule, values: dict, old) -> Residuals:
    """The residuals after a step: each chain's last version (the integer wire never
    writes its empty second one)."""
    return Residuals(
        tuple(values.get(schedule.last.get(f"{k}{b}"), old_one) for k, old_one in
              zip(("send", "mean"), pair, strict=True))
        for b, pair in enumerate(old)
    )  # fmt: skip


class _Scheduled:
    """The program of a pipelined step: its schedule's programs, run and lowered as one.

    ``program(named, batch)`` runs one step (``execute``) and returns ``(values,
    new_params)``: the last leaf is the update's, which the next step waits on.
    """

    def __init__(self, step: "PipelinedStep"):
        self._step = step

    def __call__(self, named, batch):
        schedule = self._step._schedule
        keep = ["new_params", "new_inner", "new_key", "loss", "aux", *_residual_names(schedule)]
        values = execute(schedule, {**named, "batch": batch}, self._step._wire, keep)
        return values, values["new_params"]

    def lower(self, named, batch) -> LoweredPrograms:
        schedule = self._step._schedule
        return LoweredPrograms({
            task.name: task.jitted.lower(*[schedule.values[n].aval for n in task.input_names])
            for task in schedule.tasks
        })  # fmt: skip


class PipelinedStep(TrainStep):
    """The ``TrainStep`` of ``pipelined_step``: several programs per step, two threads.

    ``step(state, batch)`` returns once every exchange of the step has finished, so that no
    collective of this step is in flight when the caller's code runs; the last program (the
    optimizer update) may still be computing. ``lower(state, batch)`` gives a
    ``LoweredPrograms`` (each program's ``Lowered`` in ``.programs``, in dispatch order);
    ``communication_stats`` sums their collectives as ``{"step": ...}``.
    """

    def __init__(self, loss_fn, optimizer, mesh, *, sync, average, seed, has_aux, donate,
                 flatten):  # fmt: skip
        super().__init__(
            "pipelined_step", mesh, loss_fn, axes=sync.axes, has_aux=has_aux, flatten=flatten,
            donate=donate,
        )  # fmt: skip
        self.sync = sync
        self._optimizer = optimizer
        self._average = average
        # The state is the one-program step's: bytegrad's state, then the optimizer's.
        self._chain = optax.chain(
            bytegrad(mesh=mesh, average=average, seed=seed, **_sync_kwargs(sync)), optimizer
        )
        self._state_specs = StateSpecs(self._axes)
        self._schedule = None
        self._wire = Dispatcher(f"{self.algorithm}-wire")

    def _abstract_opt_state(self, params):
        return jax.eval_shape(self._chain.init, params)

    def _optimizer_init(self):
        return self._chain.init

    def _build(self, key) -> _Scheduled:
        return _Scheduled(self)

    def _inputs(self, state: TrainState, batch) -> tuple[dict[str, Any], Any]:
        """The schedule's inputs by name, and the batch (planning the schedule once)."""
        batch = global_batch(batch, self.mesh, self._axes)
        specs = self._state_specs(state.opt_state)
        sync_state, inner = state.opt_state
        named = {"params": state.params, "key": sync_state.key, "inner": inner}
        named.update(_state_inputs(sync_state.residuals))
        if self._schedule is None:
            self._schedule = self._plan(state.params, specs[1], {**named, "batch": batch})
        return named, batch

    def _plan(self, params, inner_specs, values: dict[str, Any]) -> Schedule:
        """The step's programs, built (traced, not compiled) from the abstract inputs."""
        inputs = {}
        for name, value in values.items():
            spec = {"params": P(), "key": P(), "inner": inner_specs}.get(name, P(self._axes))
            if name != "inner":
                spec = jax.tree.map(lambda _, s=spec: s, value)
            inputs[name] = Value(spec, jax.tree.map(aval, value))
        leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(params)]
        layout = bucket_layout(leaves, self.sync, self.sync.mesh_shape(self.mesh, self.algorithm))
        stages = _Stages(self.mesh, self.sync, layout, average=self._average, step=self)
        return Schedule(stages.tasks(), inputs, self.mesh, self._axes, donate_state=self._donate)

    def _outputs(self, state: TrainState, out) -> tuple[TrainState, dict[str, Any]]:
        values, new_params = out
        residuals = _new_residuals(self._schedule, values, state.opt_state[0].residuals)
        opt_state = (ByteGradState(key=values["new_key"], residuals=residuals), values["new_inner"])
        metrics = {"loss": values["loss"]}
        if self.has_aux:
            metrics["aux"] = values["aux"]
        return TrainState(count(int(state.step) + 1), new_params, opt_state, {}), metrics

    def close(self) -> None:
        """Stops the dispatch thread (after what it was given has run). Calling it again does
        nothing."""
        self._closed = True
        self._wire.close()


class PipelinedMean:
    """The sync alone, pipelined: ``compressed_mean`` of each device's own gradient, called
    outside ``jit`` (for benchmarks/network.py and the tests).

    ``mean(grads, key=None, residuals=None)``: ``grads`` a pytree of (devices, ...) arrays
    sharded over the config's axes, row i device i's gradient; ``key`` the replicated key of
    stochastic rounding; ``residuals`` error feedback's, as ``compressed_mean`` takes them
    stacked over the devices (not donated). Returns the mean, replicated (and the new
    residuals).
    """

    def __init__(self, mesh: Mesh, sync: SyncConfig, *, average: bool = True):
        self.mesh, self.sync, self.average = mesh, sync, average
        self._wire = Dispatcher("pipelined-mean-wire")
        self._schedule = None

    def __call__(self, grads, key=None, residuals=None):
        residuals = () if residuals is None else tuple(residuals)
        values = {"grads": grads, **({} if key is None else {"key": key})}
        values.update(_state_inputs(residuals))
        if self._schedule is None:
            leaves = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in jax.tree.leaves(grads)]
            layout = bucket_layout(
                leaves, self.sync, self.sync.mesh_shape(self.mesh, "pipelined_step")
            )
            stages = _Stages(self.mesh, self.sync, layout, average=self.average)
            inputs = {}
            for name, v in values.items():
                spec = P() if name == "key" else P(self.sync.axes)
                inputs[name] = Value(jax.tree.map(lambda _, s=spec: s, v), jax.tree.map(aval, v))
            self._schedule = Schedule(
                stages.tasks(), inputs, self.mesh, self.sync.axes, donate_state=False
            )
        schedule = self._schedule
        out = execute(schedule, values, self._wire, ["mean", *_residual_names(schedule)])
        mean = jax.tree.unflatten(jax.tree.structure(grads), out["mean"])
        if not self.sync.error_feedback:
            return mean
        return mean, _new_residuals(schedule, out, residuals)

    def close(self) -> None:
        self._wire.close()


# The builder ---------------------------------------------------------------------------------


def pipelined_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    sync: SyncConfig | None = None,
    average: bool = True,
    seed: int = 0,
    has_aux: bool = False,
    donate: bool = True,
    flatten: bool = False,
) -> PipelinedStep:
    """Builds a ByteGrad train step whose compressed sync runs its codec beside the wire.

    The same step as ``data_parallel_step(loss_fn, optax.chain(bytegrad(...), optimizer),
    mesh)``, bit for bit, with the same ``TrainState``, cut into programs at the sync's
    collectives (module docstring): the wire programs run on a dispatch thread of the
    step's own, one at a time and in the same order on every process, while the caller's
    thread runs the codec of the pieces before and after. Each bucket crosses the wire in
    pieces of at most ``sync.bucket_bytes`` of float32 (a leaf larger than that is cut too),
    so a smaller bucket overlaps more and pays more exchanges. ``step(state, batch)``
    returns once the step's last exchange has finished. Use it as a context manager, or
    call ``close()``, to stop the thread.

    It overlaps where each process has one device (one process per host); see the module
    docstring. ``Strategy("bytegrad", pipeline=True)`` builds it.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
        computed on one device's slice of the batch.
      optimizer: the optax optimizer applied to the mean gradient (``optax.adam(1e-3)``).
      mesh: from ``make_mesh``.
      sync: the compressed sync's settings (``SyncConfig``, both wires, error feedback and
        stochastic rounding included); None for the defaults.
      average: divide the sum by the device count (default), as ``bytegrad``'s.
      seed: seeds the PRNG key of stochastic rounding, as ``bytegrad``'s.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      donate: donate the params and optimizer-state buffers to the update program.
      flatten: keep the params, gradient and optimizer state as one float32 vector.

    Returns:
      A ``PipelinedStep`` (a ``TrainStep``): ``init``, ``step``, ``params``, ``lower`` (a
      ``LoweredPrograms``: one ``Lowered`` per program, by name, in ``.programs``),
      ``communication_stats``, ``phase_counts``, ``close``.

    Raises:
      ValueError: for a bad argument, or a mesh that lacks the config's axes.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> loss_fn = lambda w, b: jnp.mean((b * w) ** 2)
      >>> with jax_bytegrad.pipelined_step(loss_fn, optax.sgd(0.1), mesh) as step:
      ...     state = step.init(jnp.ones(4))
      ...     state, metrics = step(state, jnp.ones((8, 4)))
      >>> float(metrics["loss"]), int(state.step)
      (1.0, 1)

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
      VLDB 2020.
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    where = "pipelined_step"
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(
            f"{where}: optimizer must be an optax.GradientTransformation such as "
            f"optax.adam(1e-3), got {type(optimizer).__name__}"
        )
    sync = SyncConfig.resolve(where, sync, {})
    checks.boolean(average, "average", where)
    checks.integer(seed, "seed", where, minimum=0)
    sync.mesh_shape(mesh, where)
    return PipelinedStep(
        loss_fn,
        optimizer,
        mesh,
        sync=sync,
        average=average,
        seed=seed,
        has_aux=has_aux,
        donate=donate,
        flatten=flatten,
    )
