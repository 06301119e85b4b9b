"""Where a data-parallel step keeps its state within a node: one object per ``shard=`` setting.

Follows ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020) within a node, as PyTorch FSDP's hybrid sharding (HSDP) does, and
GSPMD's way of gathering a sharded weight where it is used (Xu et al., "GSPMD: General and
Scalable Parallelization for ML Computation Graphs", 2021), as MaxText and Levanter rely on.

Four placements, each the whole answer for its setting (``placement_of``):

    Replicated (shard=None)      every device holds the whole state; the step is manual over
                                 both mesh axes; the sync sums within the node itself
    OptimizerSharded ("optimizer")
                                 params whole, optimizer state in blocks: each device updates
                                 its blocks and the new params are gathered within the node
    ParamsSharded ("params")     params and state rest in blocks; the step is manual over
                                 "node" only, and XLA's partitioner gathers each layer within
                                 the node where the model uses it: inside the model's
                                 ``jax.checkpoint`` and inside a ``lax.scan`` body, never all
                                 at once. Its gradient arrives as the node's sum in blocks
                                 (a reduce-scatter within the node), and the update runs in a
                                 ``shard_map`` over "local" on those blocks.
    FullSharded ("full")         as "params", with each leaf split across the nodes too: the
                                 loss gets each layer gathered across the nodes as codes, and
                                 its gradient reduce-scattered across them as codes,
                                 both where the loss marks the layer (``exchange_in_loop``),
                                 else before and after the loss.

Each gives the step its specs (computed from the params' shapes alone, so no call order
matters), the loss's gradient, the update's frame, and its compiler options; the sync side
gets the matching layout as ``shards.Sharded``. The step (``data_parallel.py``) asks them and
never branches on the setting.
"""

import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.extend
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.mesh import replicate, state_specs
from jax_bytegrad._src.sharding import rule
from jax_bytegrad._src.sharding.rule import Shard
from jax_bytegrad._src.sync import shards
from jax_bytegrad._src.sync.config import platform_of
from jax_bytegrad._src.sync.shards import Sharded

# With shard="params" on GPUs: the largest combined reduce-scatter within the node. XLA:GPU's
# combiner (30 MiB) would merge the gradient's reduce-scatters after the last one, holding every
# exchange between nodes back (benchmarks/RESULTS.md, "Sharded state within a node").
RS_COMBINE_BYTES = 4 * 2**20
# XLA:GPU's collective pipeliner for all-gathers in a loop, by the option's name in newer
# XLAs (JAX 0.12's) and in older ones (JAX 0.10's): it issues the next iteration's gather
# in this one, beside its gemms.
PIPELINED_ALL_GATHER = (
    {"xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_ON"},
    {"xla_gpu_enable_pipelined_all_gather": True},
)


def _project(spec: P, keep: frozenset) -> P:
    """``spec`` with the mesh axes outside ``keep`` dropped (a ``shard_map`` manual over
    ``keep`` only names those; the partitioner carries the rest)."""

    def one(entry):
        names = entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()
        kept = tuple(n for n in names if n in keep)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    entries = [one(e) for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _place_split(params, specs, mesh: Mesh):
    """``params`` (host arrays) placed as ``specs`` split them, each device given its block."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, s), lambda i, x=x: x[i]
        ),
        params,
        specs,
    )


def _project_all(tree, keep: frozenset):
    return jax.tree.map(lambda s: _project(s, keep), tree, is_leaf=lambda x: isinstance(x, P))


class StateLayout(NamedTuple):
    """A state's global specs, from its params' shapes alone (``DataParallelStep._layout``).

    Attributes:
      key: what it was computed from: the params' structure, shapes and dtypes
        (``shapes_key``), and the marks the state's residuals are laid out for.
      dims: per leaf, the dimension split within the node, or None (none split).
      params: the params' specs.
      opt_state: the optimizer state's specs.
      updates: the specs of each device's update (None: the whole of every leaf).
      accumulated: the accumulator's specs (None without accumulation).
    """

    key: Any
    dims: tuple[int | None, ...] | None
    params: Any
    opt_state: Any
    updates: Any
    accumulated: Any


def shapes_key(params) -> tuple:
    """What a ``StateLayout`` is computed from: the params' structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple((np.shape(x), np.dtype(x.dtype)) for x in leaves)


class Placement:
    """Replicated state (``shard=None``): the base every placement refines.

    Attributes:
      mesh: the step's mesh.
      axes: ``(node_axis, local_axis)``.
      local: devices per node.
    """

    shard: Shard | None = None
    # Whether a layer marked ``exchange_in_loop`` can cross between nodes inside the backward
    # loop: only where the loss gets each layer's node sums (``ParamsSharded``).
    exchanges_in_loop = False
    # Whether the loss gets the params gathered across nodes, and its gradient reduce-scattered
    # across them (``FullSharded``): the step then needs its optimizer's sync settings.
    gathers_across_nodes = False

    def __init__(self, mesh: Mesh, axes: tuple[str, str]):
        self.mesh, self.axes = mesh, axes
        self.local = int(mesh.shape[axes[1]])

    # The layout, from the params' shapes alone. -----------------------------------------

    def dims(self, params) -> tuple[int | None, ...] | None:
        """Per leaf, the dimension split within the node (None: whole); None when nothing is."""
        return None

    def param_specs(self, params):
        """Where each parameter rests, as global specs over the mesh."""
        return jax.tree.map(lambda _: P(), params)

    def update_specs(self, params):
        """What each device's update of each parameter is (its block, or all of it)."""
        return jax.tree.map(lambda _: P(), params)

    def state_specs(self, opt_state, params):
        """The optimizer state's global specs."""
        del params
        return state_specs(opt_state, node_axis=self.axes[0], local_axis=self.axes[1])

    def accumulator_specs(self, params):
        """The accumulator's spec per leaf, with a leading axis of rows (the rows are what
        that axis is split over): here one row per device."""
        return jax.tree.map(lambda _: P(self.axes), params)

    def place(self, params):
        """``params`` (host arrays) placed where they rest."""
        return replicate(params, self.mesh)

    # The program. --------------------------------------------------------------------------

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The mesh axes the step's ``shard_map`` is manual over."""
        return self.axes

    def shard_map(self, fn, in_specs, out_specs):
        """``fn`` mapped over the mesh, given global specs."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def value_and_grad(self, model, loss_fn, has_aux: bool):
        """``(params, batch, *model_inputs) -> ((loss, aux, model_state), grads)``: the loss
        of this device's rows, and its own gradient (the sync sums it)."""
        return model.value_and_grad(loss_fn, has_aux, self.axes)

    def check_gradient(self, closed, params, dims, where: str) -> None:
        """Looks at the traced gradient ``closed`` for what the placement cannot do well."""

    def accumuland(self, grads, dims):
        """What the accumulator adds each micro-step: here each device's own gradient."""
        return grads

    def sharded(self, dims, accumulating: bool, exchanged: tuple[bool, ...] = ()) -> Sharded | None:
        """The layout the optimizer's sync is told (``sharded=``); None: replicated.
        ``exchanged``: the leaves the backward loop averaged already (``Sharded.exchanged``)."""
        return None

    def node_mean(self, grads, dims):
        """In the update's frame, the mean over the node's devices of the gradient
        ``value_and_grad`` gave: here all of it, on every device (DiLoCo's inner step)."""
        return jax.lax.pmean(grads, self.axes[1])

    def node_sum_of_alike(self, tree):
        """What a sync told ``sharded(dims, True)`` takes for a value that every device of
        the node holds alike (in this device's blocks where split): here the value itself,
        which the sync sums within the node."""
        return tree

    def check_update(self, closed, where: str) -> None:
        """Looks at the traced update ``closed`` of this device's params for what the
        placement cannot run (on blocks: anything not elementwise)."""

    def own(self, params, dims):
        """The params the optimizer updates on this device."""
        return params

    def finish(self, params, dims):
        """The updated params as they rest."""
        return params

    def in_update_frame(self, update, trees, in_specs, out_specs):
        """``update(*trees)`` where the optimizer runs (here: in the step's own frame)."""
        del in_specs, out_specs
        return update(*trees)

    def check_step(self, algorithm: str, optimizers: dict, loop_syncs: dict) -> None:
        """Raises ``ValueError`` where a step of ``optimizers`` (by phase) whose backward
        loop exchanges on ``loop_syncs`` (``LoopSync`` by phase) cannot run here."""

    def compiler_options(self) -> dict | None:
        return None


class OptimizerSharded(Placement):
    """``shard="optimizer"``: params whole, optimizer state in blocks (ZeRO-1/2 within the
    node). The sync reduce-scatters each bucket within the node in this device's rows, crosses
    between nodes, and the new blocks are gathered within the node."""

    shard = "optimizer"

    def dims(self, params):
        return rule.split_dims(params, self.local)

    def update_specs(self, params):
        return rule.leaf_specs(params, self.axes[1], self.local)

    def state_specs(self, opt_state, params):
        return rule.split_state_specs(
            opt_state, params, axis=self.axes[1], parts=self.local, devices=self.axes
        )

    def accumulator_specs(self, params):
        """One row per node, each split within the node as its leaf is."""
        return jax.tree.map(
            lambda x, s: P(self.axes[0], *s), params, self.update_specs(params),
            is_leaf=lambda x: isinstance(x, P),
        )  # fmt: skip

    def accumuland(self, grads, dims):
        # The accumulator is split within the node too (ZeRO-2): the node's sum, in blocks.
        leaves, treedef = jax.tree.flatten(grads)
        sums = [shards.node_sum(x, d, self.axes[1]) for x, d in zip(leaves, dims, strict=True)]
        return jax.tree.unflatten(treedef, sums)

    def sharded(self, dims, accumulating, exchanged=()):
        return Sharded(self.axes[1], dims, summed=accumulating, exchanged=exchanged)

    def node_mean(self, grads, dims):
        local = self.axes[1]
        sums = self._per_leaf(lambda x, d: shards.node_sum(x, d, local), grads, dims)
        return jax.tree.map(lambda x: x / np.asarray(self.local, x.dtype), sums)

    def node_sum_of_alike(self, tree):
        # The node's sum of L equal blocks: exact where L is a power of two.
        return jax.tree.map(lambda x: x * np.asarray(self.local, x.dtype), tree)

    def check_update(self, closed, where):
        shards.check_elementwise(closed.jaxpr, where)

    def own(self, params, dims):
        return self._per_leaf(lambda x, d: shards.own_block(x, d, self.axes[1]), params, dims)

    def finish(self, params, dims):
        return self._per_leaf(lambda x, d: shards.gather_block(x, d, self.axes[1]), params, dims)

    @staticmethod
    def _per_leaf(fn, tree, dims):
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, [fn(x, d) for x, d in zip(leaves, dims, strict=True)])


class ParamsSharded(OptimizerSharded):
    """``shard="params"``: params and state in blocks (ZeRO-3 within the node, HSDP).

    The step is manual over "node" only. Within it each parameter is one array over the node,
    split over "local" by its sharding, and the loss runs once per device's rows under
    ``jax.vmap``: XLA's partitioner inserts each layer's gather where the model uses it (inside
    its remat region, inside a scan body), and the transpose of that gather, the node's sum
    in blocks, is the gradient. The optimizer's update then runs in a ``shard_map`` over
    "local" on each device's blocks, where the sync crosses between nodes.
    """

    shard = "params"
    exchanges_in_loop = True

    def param_specs(self, params):
        return rule.leaf_specs(params, self.axes[1], self.local)

    def place(self, params):
        return _place_split(params, self.param_specs(params), self.mesh)

    @property
    def manual_axes(self):
        return self.axes[:1]

    def shard_map(self, fn, in_specs, out_specs):
        keep = frozenset(self.manual_axes)
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=_project_all(in_specs, keep),
            out_specs=_project_all(out_specs, keep),
            axis_names=keep,
        )

    def value_and_grad(self, model, loss_fn, has_aux, exchange=None):
        """With ``exchange`` (``loop_exchange.rewriter``), the layers the loss marks with
        ``exchange_in_loop`` are averaged between nodes inside the backward pass, and the
        function returns ``(outputs, grads, marked, residuals)`` (``value_and_grad_rows``);
        without it, ``(outputs, grads)``."""
        run = model.value_and_grad_rows(loss_fn, has_aux, self.axes, self.local, exchange)
        if exchange is not None:
            return run
        return lambda *args: run(*args)[:2]

    def check_gradient(self, closed, params, dims, where):
        warn_scanned_whole(closed, params, dims, where)

    def accumuland(self, grads, dims):
        return grads  # the node's sums already, in blocks

    def node_mean(self, grads, dims):
        return jax.tree.map(lambda x: x / np.asarray(self.local, x.dtype), grads)

    def sharded(self, dims, accumulating, exchanged=()):
        return Sharded(self.axes[1], dims, summed=True, exchanged=exchanged)

    def own(self, params, dims):
        return params  # the update's frame holds this device's blocks

    def finish(self, params, dims):
        return params

    def in_update_frame(self, update, trees, in_specs, out_specs):
        """``update(*trees)`` in a ``shard_map`` manual over "local" too: each device's
        blocks, as the sync and the optimizer expect them."""
        keep = frozenset(self.axes[1:])
        project = lambda tree: _project_all(tree, keep)  # noqa: E731
        mesh = jax.sharding.get_abstract_mesh()
        return jax.shard_map(update, mesh=mesh, in_specs=project(in_specs),
                             out_specs=project(out_specs), axis_names=keep)(*trees)  # fmt: skip

    def compiler_options(self):
        if platform_of(self.mesh) == "gpu":
            return {"xla_gpu_reduce_scatter_combine_threshold_bytes": RS_COMBINE_BYTES}
        return None


@functools.cache
def pipelined_all_gather(device) -> dict | None:
    """The first of ``PIPELINED_ALL_GATHER`` that the XLA compiling for ``device`` takes
    (a small program compiled with each, once per process), or None."""
    one = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    x = jax.ShapeDtypeStruct((8,), np.float32, sharding=one)
    for options in PIPELINED_ALL_GATHER:
        try:
            jax.jit(lambda a: a + 1).trace(x).lower().compile(options)
        except jax.errors.JaxRuntimeError:  # not an option of this XLA
            continue
        return options
    return None


class FullSharded(Placement):
    """``shard="full"``: params and state in blocks over every device of the mesh, nodes
    included (FSDP's FULL_SHARD, ZeRO-3 across nodes).

    Each leaf is split along one dimension over ``(local, node)``, local-major (device ``(k,
    j)`` holds block ``j K + k``: a device's part of every node's piece lies together, so
    neither the gather nor the reduce-scatter moves values in memory first), and the step is
    manual over both axes: each device holds its block of each leaf. The loss gets the
    whole leaves gathered where it uses them (``loop_gather.gatherer``: the layers marked
    ``exchange_in_loop`` at the mark, inside the scan body and the checkpoint, the rest
    before the loss), as codes between nodes where the sync compresses
    (``sync/across_nodes.py``), and their gradient comes back reduce-scattered within the
    node and across the nodes: each device's blocks of the mean, so the optimizer's sync has
    nothing left to send for them (``Sharded.exchanged``), and each device updates its
    blocks. Leaves the devices cannot split stay whole and cross on the sync, as
    ``shard="optimizer"``'s do.
    """

    shard = "full"
    exchanges_in_loop = True
    gathers_across_nodes = True

    def __init__(self, mesh: Mesh, axes: tuple[str, str]):
        super().__init__(mesh, axes)
        self.parts = int(mesh.shape[axes[0]]) * self.local

    def dims(self, params):
        return rule.split_dims(params, self.parts)

    def param_specs(self, params):
        return rule.leaf_specs(params, self.axes[::-1], self.parts)

    def update_specs(self, params):
        return self.param_specs(params)

    def state_specs(self, opt_state, params):
        return rule.split_state_specs(
            opt_state, params, axis=self.axes[::-1], parts=self.parts, devices=self.axes
        )

    def place(self, params):
        return _place_split(params, self.param_specs(params), self.mesh)

    def value_and_grad(self, model, loss_fn, has_aux, exchange=None):
        """With ``exchange`` (``loop_gather.gatherer``), the loss gathers this device's
        blocks where it uses them, and the run returns ``(outputs, grads, marked,
        residuals)``; without it, ``(outputs, grads)`` of the blocks as they are (a trace
        that only reads the loss's marks)."""
        return model.value_and_grad(loss_fn, has_aux, self.axes, exchange)

    def accumulator_specs(self, params):
        """A split leaf's gradient comes as this device's block of the mean over every
        device, each micro-step: one row, split as the param; a leaf kept whole comes as each
        device's own, one row per device, as the replicated step's."""
        return jax.tree.map(
            lambda s: P(self.axes) if s == P() else P(None, *s), self.param_specs(params),
            is_leaf=lambda x: isinstance(x, P),
        )  # fmt: skip

    def sharded(self, dims, accumulating, exchanged=()):
        # A split leaf's gradient is every device's mean already, in its block, which the
        # sync passes on; a leaf kept whole comes as each device's own, which the sync
        # averages as "optimizer"'s: to the sync, every leaf is whole.
        crossed = tuple(d is not None for d in dims)
        return Sharded(self.axes[1], (None,) * len(dims), summed=False, exchanged=crossed)

    def compiler_options(self):
        # Each layer's weights cross between nodes where the loop uses them; pipelined, the
        # forward loop gathers the next layer's beside this one's gemms. Deviceless, scanned
        # 7B on 2 x 8 H100s: 434 -> 527 of 1123 gemms beside the exchanges between nodes at
        # 8 bits, 0 -> 155 at 4, with the same memory and bytes (benchmarks/RESULTS.md).
        if platform_of(self.mesh) == "gpu":
            return pipelined_all_gather(self.mesh.devices.flat[0])
        return None

    def node_mean(self, grads, dims):
        raise ValueError(
            "shard='full' splits the params across nodes: a node holds no whole model to "
            "step on its own (DiLoCo, decentralized); use shard='params'"
        )

    def check_update(self, closed, where):
        shards.check_elementwise(closed.jaxpr, where)

    def check_step(self, algorithm, optimizers, loop_syncs):
        # The gradient crosses between nodes in the loss's backward pass: each phase needs
        # its optimizer's sync settings (a Strategy of gradient_allreduce, bytegrad or qadam
        # gives them), and its codes a wire that reduce-scatters them: the integer wire
        # where their sum over the nodes fits it, else the scatter-gather wire.
        where, nodes = f"{algorithm} (shard='full')", int(self.mesh.shape[self.axes[0]])
        if any(phase not in loop_syncs for phase in optimizers):
            raise ValueError(
                f"{where}: the gradient crosses between nodes inside the loss's backward pass, "
                "on the optimizer's sync settings, which this step was not given; build it "
                "with Strategy('gradient_allreduce' | 'bytegrad' | 'qadam', shard='full')"
            )
        for sync in loop_syncs.values():
            if not sync.compressed:
                continue
            wire = sync.config.wire_for(nodes)
            if wire == "ring":
                raise ValueError(
                    f"{where}: the gradient's codes are reduce-scattered between nodes on "
                    "wire='allreduce' (integer sums) or wire='scatter_gather', not "
                    "wire='ring'; pass one of them, or wire='auto'"
                )
            if wire == "allreduce":
                sync.config.codec.check_integer(nodes, f"{where}, {nodes} nodes")


PLACEMENTS = {
    None: Placement,
    "optimizer": OptimizerSharded,
    "params": ParamsSharded,
    "full": FullSharded,
}


def placement_of(shard: Shard | None, mesh: Mesh, axes: tuple[str, str]) -> Placement:
    """The placement object of a ``shard=`` setting."""
    return PLACEMENTS[shard](mesh, axes)


def check_shard(shard, flatten: bool, where: str, per_node: bool = False) -> None:
    """Validates ``shard=``; ``per_node``: for a step that keeps a whole model on each node
    (DiLoCo), which ``"full"`` cannot give."""
    if shard is not None:
        checks.one_of(shard, rule.SHARDS, "shard", where)
        if per_node and shard == "full":
            raise ValueError(
                f"{where}: shard='full' splits the params across nodes, and this algorithm "
                "keeps a whole model on each node (its inner steps run within the node); use "
                "shard='params' (the state split within the node)"
            )
        if flatten:
            raise ValueError(
                f"{where}: shard={shard!r} splits each parameter within the node and "
                "flatten=True makes them one vector; use one of them"
            )


# A stacked leaf split along the dimension a scan runs over -----------------------------------

# Primitives that pass a value through unchanged in shape (a dtype cast, a copy).
_PASS = frozenset({"convert_element_type", "copy", "copy_p", "pvary", "pcast"})


def _scanned(eqn) -> list[bool]:
    """Per operand of a ``scan`` equation, whether the loop runs over it (its body sees one
    slice, of one dimension less) rather than taking it whole (a const, the carry)."""
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    pairs = zip(eqn.invars, body.invars, strict=True)
    return [len(b.aval.shape) == len(v.aval.shape) - 1 for v, b in pairs]


def _scanned_whole(jaxpr, leaf_of: dict, dims) -> set[int]:
    """Indices of the split leaves that a ``scan`` in ``jaxpr`` runs over along their split
    dimension (0): XLA's partitioner then gathers the whole stack before the loop."""
    found = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [leaf_of.get(id(v)) for v in eqn.invars]
        if name in _PASS and ins[0] is not None:
            leaf_of[id(eqn.outvars[0])] = ins[0]
            continue
        scanned = _scanned(eqn) if name == "scan" else [False] * len(ins)
        pairs = zip(ins, scanned, strict=True)
        found |= {i for i, s in pairs if s and i is not None and dims[i] == 0}
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if len(sub.invars) == len(eqn.invars):  # a call: its inputs are the operands
                # The scanned operands are slices inside: not the leaves any more.
                pairs = zip(sub.invars, ins, scanned, strict=True)
                inner = {id(v): i for v, i, s in pairs if i is not None and not s}
                found |= _scanned_whole(sub, inner, dims)
    return found


def warn_scanned_whole(closed, params, dims, where: str) -> None:
    """Warns, naming the leaves, when the traced gradient ``closed`` (whose first inputs are
    ``params``' leaves) scans over a leaf along the dimension ``shard="params"`` splits it on:
    that leaf is gathered whole within the node before the loop."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(params)]
    leaf_of = {id(v): i for i, v in enumerate(closed.jaxpr.invars[: len(paths)])}
    whole = sorted(_scanned_whole(closed.jaxpr, leaf_of, dims))
    if whole:
        names = ", ".join(f"params{paths[i]}" for i in whole[:4])
        warnings.warn(
            f"{where}: shard='params' splits {names} along its first dimension, which "
            "jax.lax.scan runs over, so each is gathered whole within the node before the loop "
            "(no memory saved for it): its other dimensions are not divisible by the devices "
            "per node, or smaller than the number of layers. Make a dimension other than the "
            "first the largest one divisible by the devices per node",
            stacklevel=4,
        )
