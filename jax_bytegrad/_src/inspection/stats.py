"""Bytes moved by the collectives of a compiled JAX function, per collective kind and mesh axis.

Reads the optimized HLO that XLA will actually run, so it sees what the compiler did: collectives
it combined, bfloat16 reductions it promoted, and the all-reduce that ``jax.grad`` hides inside
``shard_map`` for a replicated parameter. Costs follow the bandwidth term of the standard
ring/pairwise algorithms (Thakur et al., 2005), as used to account for traffic in Bagua
(Gan et al., VLDB 2022).

Which links the bytes cross is a model, one per collective kind. The mesh's first axis is the
outermost (a ``("node", "local")`` mesh holds each node's devices together), and a message
between two devices crosses the links of the first axis on which their coordinates differ:
between nodes when their nodes differ, within a node otherwise.

- all-reduce, reduce-scatter, all-gather: a ring over each group's devices in mesh order, as
  NCCL's ring algorithm lays it out (a node's devices next to each other); each device sends
  its whole share (the formulas of ``communication_stats``) to the next one, and only the hops
  from one node to the next leave a node. A flat all-reduce of ``B`` bytes over ``n`` nodes of
  ``L`` devices thus leaves each node once: ``2 (nL - 1) / (nL) * B`` per node, against
  ``2 (n - 1) / n * B`` for a hierarchical one (reduce-scatter within the node, all-reduce of
  ``B / L`` between nodes, all-gather within).
- all-to-all: pairwise; each device sends ``B / g`` straight to each other member.
- collective-permute: each pair sends ``B`` straight from source to target.

Between TPU slices XLA writes no collective but Megascale ``send``s over DCN (``megascale``):
each counts as one collective of its transfer's kind over the devices it joins, on the axes
along which they differ (``"node"`` on a mesh from ``make_mesh``), with the same formulas; the
other end's ``recv`` is not counted again.

``CollectiveTraffic.link_bytes`` and ``CommunicationStats.bytes_on`` are per device: what
crosses an axis's links over the devices that send (times the devices per node: what each node
sends to the others). Other algorithms (NCCL's trees, a backend that reduces within each host
first) cross differently; ``bytes_sent`` is what each device sends over any link.

References:
  Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
  MPICH", IJHPCA 2005.
  Patarasuk and Yuan, "Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations",
  JPDC 2009.
  Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
"""

import collections
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jax_bytegrad._src.inspection import hlo
from jax_bytegrad._src.inspection.megascale import DeviceIds
from jax_bytegrad._src.inspection.overlap import Overlap, overlap_by_axis, runs_per_call

# Label of a collective whose groups all have one member, or whose pairs are all i -> i.
NO_AXES = "-"


@dataclasses.dataclass(frozen=True)
class CollectiveTraffic:
    """Traffic of the collectives of one kind, over the same mesh axes, on the same dtype.

    Attributes:
      kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``, ``"all-to-all"`` or
        ``"collective-permute"`` (async ``-start`` forms are folded into their kind).
      axes: names of the mesh axes the groups span, in mesh order, joined by ``"+"``
        (``"node"``, ``"local"``, ``"node+local"``), or ``"-"`` when nothing leaves a device.
      dtype: HLO element type(s) of the operands, e.g. ``"f32"``, ``"u8"``, or ``"f32,s32"``
        for a variadic collective over mixed types.
      count: how many collectives of the compiled HLO run per call of the program: an
        instruction inside a loop's body counts as many times as the loop runs (once where
        the trip count is unknown; see ``Overlap.trip_counts_known``).
      payload_bytes: per-device operand bytes, summed over the collectives that run.
      bytes_sent: bytes each device sends, summed over the collectives that run (see
        ``communication_stats`` for the formulas), over any link.
      link_bytes: per mesh axis, in mesh order, the bytes per device that cross that axis's
        links (``("node", "local")``: between nodes, then between the devices of one node),
        under the model of the module docstring. They sum to what the average sending device
        sends: ``bytes_sent`` where every device sends alike.
      padding_bytes: what the layouts' tiles add to ``payload_bytes`` in memory (TPU tiles
        such as ``T(8,128)``; 0 elsewhere), summed like it; not in ``payload_bytes`` or
        ``bytes_sent``, which count the shapes as written.
    """

    kind: str
    axes: str
    dtype: str
    count: int
    payload_bytes: int
    bytes_sent: float
    link_bytes: tuple[float, ...]
    padding_bytes: int = 0


@dataclasses.dataclass(frozen=True, repr=False)
class CommunicationStats:
    """Per-device communication of one compiled function, one row per (kind, axes, dtype).

    ``rows`` count every collective of the program once, whichever branch of a ``lax.cond``
    (an HLO ``conditional``) it sits in. A program with conditionals, like a QAdam step that
    holds its warm-up and compressed phases, sends on each call only what lies outside every
    branch plus what the branch taken sends: ``unconditional`` and ``branches`` give those.

    Attributes:
      rows: the traffic rows, sorted by kind, axes and dtype.
      axis_names: the mesh axis names, in mesh order.
      axis_sizes: the mesh axis sizes, in mesh order.
      branches: for each ``conditional`` of the program, in HLO order, the traffic of each
        of its branches (with every computation the branch calls), in branch-index order.
        Empty for a program without conditionals, and in the per-branch figures themselves.
      unconditional: the traffic outside every branch, which each call sends; None in the
        per-branch figures themselves.
      overlap: one ``Overlap`` per mesh axis: for each collective over it, the gemms and
        FLOPs scheduled between its start and its done (a loop's once per iteration), and
        how many of the program's gemms run beside one. Empty where there is no schedule
        to read (figures merged over programs, or of one branch).
    """

    rows: tuple[CollectiveTraffic, ...]
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    branches: tuple[tuple["CommunicationStats", ...], ...] = ()
    unconditional: "CommunicationStats | None" = None
    overlap: tuple[Overlap, ...] = ()

    def overlap_on(self, axis_name: str) -> Overlap:
        """The ``Overlap`` of the collectives over ``axis_name``.

        Raises:
          ValueError: if ``axis_name`` is not a mesh axis, or these figures have no schedule.
        """
        for one in self.overlap:
            if one.axis == axis_name:
                return one
        raise ValueError(
            f"overlap_on: no schedule for axis {axis_name!r} (mesh axes {self.axis_names}); "
            "figures merged over several programs, or of one branch, have none"
        )

    @property
    def total_bytes(self) -> float:
        """Bytes each device sends over all collectives."""
        return float(sum(row.bytes_sent for row in self.rows))

    @property
    def total_payload_bytes(self) -> int:
        """Per-device operand bytes over all collectives."""
        return sum(row.payload_bytes for row in self.rows)

    @property
    def padding_bytes(self) -> int:
        """What the layouts' tiles add to ``total_payload_bytes`` (TPU layouts; else 0)."""
        return sum(row.padding_bytes for row in self.rows)

    def bytes_by_axis(self) -> dict[str, float]:
        """Bytes sent per device, keyed by axes label (``"node"``, ``"local"``, ``"node+local"``).

        The values sum to ``total_bytes``: a ``"node+local"`` collective counts whole here, on
        whatever link each byte goes. Use ``bytes_on`` for the bytes that cross one axis.
        """
        totals: dict[str, float] = {}
        for row in self.rows:
            totals[row.axes] = totals.get(row.axes, 0.0) + row.bytes_sent
        return totals

    def bytes_on(self, axis_name: str) -> float:
        """Bytes per device that cross ``axis_name``'s links, under the module's model.

        For ``"node"``: the bytes between nodes, a ``"node+local"`` collective counting only
        its hops from one node to another (a flat ring all-reduce of ``B`` bytes over 2 nodes
        of 4 devices: ``2 * 7/8 * B`` leave each node, ``2 * 7/8 * B / 4`` per device). For
        ``"local"``: the bytes between the devices of one node.

        Args:
          axis_name: a mesh axis name.

        Returns:
          The sum of the rows' ``link_bytes`` for the axis.

        Raises:
          ValueError: if ``axis_name`` is not a mesh axis.
        """
        if axis_name not in self.axis_names:
            raise ValueError(
                f"bytes_on: axis {axis_name!r} is not in the mesh axes {self.axis_names}; "
                "pass one of them"
            )
        index = self.axis_names.index(axis_name)
        return float(sum(row.link_bytes[index] for row in self.rows))

    def __repr__(self) -> str:
        # The table: steps hand these back in a dict, which a user prints, and the fields'
        # own repr runs to pages (one Exchange per collective, the rows twice over).
        return str(self)

    def __str__(self) -> str:
        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes, strict=True))
        header = ("kind", "axes", "dtype", "count", "payload", "sent/device")
        header += tuple(f"on {name}" for name in self.axis_names)

        def cells(kind, axes, dtype, count: int, payload: float, sent: float, links, *_):
            sizes = (_format_bytes(n) for n in (payload, sent, *links))
            return (kind, axes, dtype, str(count), *sizes)

        lines = [cells(*dataclasses.astuple(row)) for row in self.rows]
        count = sum(row.count for row in self.rows)
        on = [self.bytes_on(name) for name in self.axis_names]
        total = cells("total", "", "", count, self.total_payload_bytes, self.total_bytes, on)
        table = [header, *lines, total]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]

        def fmt(line: Sequence[str]) -> str:
            left = [cell.ljust(w) for cell, w in zip(line[:3], widths[:3], strict=True)]
            right = [cell.rjust(w) for cell, w in zip(line[3:], widths[3:], strict=True)]
            return "  ".join(left + right).rstrip()

        rule = "-" * len(fmt(header))
        body = [fmt(line) for line in lines] or ["(no collectives)"]
        overlap = [f"Overlap {one}" for one in self.overlap if one.bytes_sent]
        if self.padding_bytes:
            overlap.append(
                f"Tile padding: the payloads' layouts add {_format_bytes(self.padding_bytes)} "
                "in memory (counted as written, unpadded)"
            )
        return "\n".join(
            [
                f"Communication per device (mesh {mesh})",
                *overlap,
                fmt(header),
                rule,
                *body,
                rule,
                fmt(total),
            ]
        )


def _format_bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B" if float(n).is_integer() else f"{n:.2f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.2f} {unit}"


def _share(kind: str, g: int, b: int) -> float:
    """Bytes one device of a group of ``g`` sends for a collective of ``b`` payload bytes."""
    if kind == "all-reduce":
        return 2 * (g - 1) * b / g
    if kind == "all-gather":
        return float((g - 1) * b)  # B_out = g * B_in, so (g-1)/g * B_out
    return (g - 1) * b / g  # reduce-scatter (B_in), all-to-all


def _bytes_sent(collective: hlo.Collective, num_devices: int) -> float:
    """Bytes the busiest device sends for one collective; see `communication_stats`."""
    b = collective.payload_bytes
    if collective.kind == "collective-permute":
        sends = collections.Counter(s for s, t in collective.pairs if s != t)
        return float(max(sends.values(), default=0) * b)
    groups = collective.groups or (tuple(range(num_devices)),)
    return _share(collective.kind, max(len(group) for group in groups), b)


def _check_devices(devices: Sequence[int], num_devices: int) -> None:
    if max(devices, default=-1) >= num_devices:
        raise ValueError(
            f"communication_stats: the HLO names device {max(devices)} but the mesh has "
            f"{num_devices} devices; pass the mesh the function was compiled for as mesh=..."
        )


def _messages(collective: hlo.Collective, coords: np.ndarray):
    """``(sources, targets, bytes)`` of the messages of the module docstring's model."""
    b, num_devices = collective.payload_bytes, coords.shape[0]
    if collective.kind == "collective-permute":
        pairs = np.array([p for p in collective.pairs if p[0] != p[1]], np.int64).reshape(-1, 2)
        _check_devices(pairs.ravel().tolist(), num_devices)
        return pairs[:, 0], pairs[:, 1], np.full(len(pairs), float(b))
    parts = []
    for group in collective.groups or (tuple(range(num_devices)),):
        _check_devices(group, num_devices)
        g = len(group)
        if collective.kind == "all-to-all":  # pairwise: B / g to every other member
            members = np.asarray(group, np.int64)
            source, target = np.repeat(members, g), np.tile(members, g)
            keep = source != target
            source, target, size = source[keep], target[keep], b / g
        else:  # a ring in mesh order: each device's whole share goes to the next one
            source = np.asarray(sorted(group, key=lambda d: tuple(coords[d])), np.int64)
            target, size = np.roll(source, -1), _share(collective.kind, g, b)
        parts.append((source, target, np.full(len(source), float(size))))
    return tuple(np.concatenate(part) for part in zip(*parts, strict=True))


def _link_bytes(collective: hlo.Collective, coords: np.ndarray) -> tuple[float, ...]:
    """Per mesh axis, the bytes per sending device that cross its links (module docstring)."""
    sources, targets, sizes = _messages(collective, coords)
    differ = coords[sources] != coords[targets]
    moves = differ.any(axis=1)  # a ring of one device moves nothing
    links = np.zeros(coords.shape[1])
    # A message crosses the links of the outermost axis on which its two ends differ.
    np.add.at(links, np.argmax(differ[moves], axis=1), sizes[moves])
    return tuple(float(v) for v in links / max(len(np.unique(sources[moves])), 1))


def _axes_label(collective: hlo.Collective, coords: np.ndarray, axis_names: Sequence[str]) -> str:
    """Names of the mesh axes along which members of a group (or permute pair) differ."""
    num_devices = coords.shape[0]
    if collective.kind == "collective-permute":
        groups: Iterable[Sequence[int]] = [pair for pair in collective.pairs if pair[0] != pair[1]]
    else:
        groups = collective.groups or (tuple(range(num_devices)),)
    varies = np.zeros(len(axis_names), dtype=bool)
    for group in groups:
        _check_devices(group, num_devices)
        members = coords[list(group)]
        varies |= (members != members[:1]).any(axis=0)
    names = [name for name, v in zip(axis_names, varies, strict=True) if v]
    return "+".join(names) if names else NO_AXES


def stats_from_hlo(
    hlo_text: str,
    axis_names: Sequence[str],
    axis_sizes: Sequence[int],
    positions: Sequence[int] | None = None,
    *,
    ids: DeviceIds | None = None,
) -> CommunicationStats:
    """Summarises the collectives of HLO text over a mesh.

    Args:
      hlo_text: the text of an HLO module.
      axis_names: the mesh axis names.
      axis_sizes: the mesh axis sizes.
      positions: ``positions[i]`` is the flat (row-major) mesh position of HLO device id ``i``;
        None means the identity.
      ids: instead of ``positions``, what the program's device ids name, the Megascale
        transfers' slices and global ids included (``DeviceIds.of_devices``): needed for a
        multi-slice TPU program, whose ids count one slice's devices.

    Raises:
      ValueError: for HLO it cannot parse, or device ids the mesh does not hold.
    """
    num_devices = int(np.prod(axis_sizes))
    if ids is None:
        ids = DeviceIds(tuple(range(num_devices) if positions is None else positions))
    coords = np.stack(np.unravel_index(np.arange(num_devices), axis_sizes), -1)
    instructions = hlo.hlo_instructions(hlo_text)
    collectives = [_in_mesh(c, ids, num_devices) for c in hlo.collectives(instructions)]
    runs = runs_per_call(instructions, collectives)

    def summary(selected: Iterable[hlo.Collective], **extra) -> CommunicationStats:
        return _summary(selected, coords, axis_names, axis_sizes, runs, **extra)

    reached = [
        [hlo.called_computations(instructions, branch) for branch in branches]
        for branches in hlo.conditional_branches(instructions)
    ]
    in_any = set().union(*(names for conditional in reached for names in conditional))
    return summary(
        collectives,
        overlap=overlap_by_axis(
            instructions,
            collectives,
            {c.name: _link_bytes(c, coords) for c in collectives},
            axis_names,
        ),
        branches=tuple(
            tuple(summary(c for c in collectives if c.computation in names) for names in branches)
            for branches in reached
        ),
        unconditional=summary(c for c in collectives if c.computation not in in_any),
    )


def _in_mesh(collective: hlo.Collective, ids: DeviceIds, num_devices: int) -> hlo.Collective:
    """The collective with its groups (pairs) as flat mesh positions, not program ids."""
    if collective.target is not None:
        groups, pairs = ids.members(collective.target)
        if collective.kind == "collective-permute":
            groups = None
    elif collective.kind == "collective-permute":
        groups, pairs = None, tuple((ids.position(s), ids.position(t)) for s, t in collective.pairs)
    else:
        members = collective.groups or (tuple(range(len(ids.program))),)
        groups, pairs = tuple(tuple(ids.position(d) for d in g) for g in members), ()
    _check_devices([d for group in groups or pairs for d in group], num_devices)
    return dataclasses.replace(collective, groups=groups, pairs=pairs)


def _summary(
    collectives: Iterable[hlo.Collective],
    coords: np.ndarray,
    axis_names: Sequence[str],
    axis_sizes: Sequence[int],
    runs: dict[str, int],
    **extra,
) -> CommunicationStats:
    """One row per (kind, axes, dtype) of the given collectives, each counted as many times
    as it runs per call (``runs``)."""
    num_devices = coords.shape[0]
    rows = [
        CollectiveTraffic(
            collective.kind,
            _axes_label(collective, coords, axis_names),
            ",".join(collective.dtypes),
            times,
            times * collective.payload_bytes,
            times * _bytes_sent(collective, num_devices),
            tuple(times * b for b in _link_bytes(collective, coords)),
            times * (collective.padded_bytes - collective.payload_bytes),
        )
        for collective in collectives
        for times in [runs.get(collective.name, 1)]
    ]
    return _totals(rows, axis_names, axis_sizes, **extra)


def _totals(
    rows: Iterable[CollectiveTraffic],
    axis_names: Sequence[str],
    axis_sizes: Sequence[int],
    **extra,
) -> CommunicationStats:
    """The given rows summed per (kind, axes, dtype), sorted by kind, axes and dtype."""
    totals: dict[tuple[str, str, str], list] = {}
    for row in rows:
        entry = totals.setdefault(
            (row.kind, row.axes, row.dtype), [0, 0, 0.0, np.zeros(len(axis_names)), 0]
        )
        entry[0] += row.count
        entry[1] += row.payload_bytes
        entry[2] += row.bytes_sent
        entry[3] += row.link_bytes
        entry[4] += row.padding_bytes
    order = {name: i for i, name in enumerate(axis_names)}

    def sort_key(key: tuple[str, str, str]) -> tuple:
        kind, axes, dtype = key
        return (
            hlo.COLLECTIVE_KINDS.index(kind),
            [order.get(a, -1) for a in axes.split("+")],
            dtype,
        )

    merged = tuple(
        CollectiveTraffic(*key, count, payload, sent, tuple(float(v) for v in links), padding)
        for key, (count, payload, sent, links, padding) in sorted(
            totals.items(), key=lambda kv: sort_key(kv[0])
        )
    )
    return CommunicationStats(merged, tuple(axis_names), tuple(int(s) for s in axis_sizes), **extra)


def merge(all_stats: Sequence[CommunicationStats]) -> CommunicationStats:
    """The traffic of several programs that each run once per step, as one.

    Args:
      all_stats: the programs' figures, all over the same mesh.

    Returns:
      One row per (kind, axes, dtype), summed over the programs; no branches.

    Raises:
      ValueError: if ``all_stats`` is empty or its meshes differ.
    """
    meshes = {(one.axis_names, one.axis_sizes) for one in all_stats}
    if len(meshes) != 1:
        raise ValueError(
            f"communication_stats: cannot merge figures over the meshes {sorted(meshes)}; "
            "pass the figures of programs that run over one mesh"
        )
    ((axis_names, axis_sizes),) = meshes
    return _totals((row for one in all_stats for row in one.rows), axis_names, axis_sizes)


def _compiled_mesh(compiled: jax.stages.Compiled) -> tuple[Any, tuple | None]:
    """The mesh of the first NamedSharding of the executable, and its device assignment."""
    shardings = jax.tree.leaves(
        (compiled.input_shardings, compiled.output_shardings),
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )
    mesh = next((s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)), None)
    # HLO device ids index the executable's device assignment. jit takes it from the shardings
    # of its arguments and results, which must all agree; a NamedSharding's is its mesh's
    # devices in row-major order.
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh, tuple(mesh.devices.flat)
    return mesh, None


def communication_stats(
    jitted_fn: Callable[..., Any], *args: Any, mesh: jax.sharding.Mesh | None = None, **kwargs: Any
) -> CommunicationStats:
    """Bytes each device sends, per collective kind and mesh axis, in a compiled function.

    Compiles ``jitted_fn.lower(*args, **kwargs)`` and reads every all-reduce, reduce-scatter,
    all-gather, all-to-all and collective-permute (and their async ``-start`` forms, each counted
    once) from the optimized HLO. With ``B`` the per-device operand bytes (the payload) and ``g``
    the replica-group size, the bytes one device sends are those of the bandwidth-optimal ring or
    pairwise algorithms:

    - all-reduce: ``2 * (g - 1) / g * B`` (ring reduce-scatter then all-gather);
    - reduce-scatter: ``(g - 1) / g * B``, ``B`` being the unscattered input;
    - all-gather: ``(g - 1) / g * B_out = (g - 1) * B``, ``B_out = g * B`` being the output;
    - all-to-all: ``(g - 1) / g * B``;
    - collective-permute: ``B`` if the device sends to another device, 0 for a pair ``i -> i``.

    Groups of one device move nothing. Where groups (or senders) differ, the busiest device is
    reported. Each instruction counts once, so a collective inside a loop body counts once per
    compile, not per iteration.

    Of those, ``bytes_on(axis)`` (per row, ``link_bytes``) is what crosses the axis's links per
    device, under the module docstring's model: a flat all-reduce over 2 nodes of 4 devices
    sends ``2 * 7/8 * B`` per device, of which ``2/8`` cross between nodes (2 hops of 8).

    HLO device ids are positions in the executable's device assignment, which for a ``jit`` over
    a ``Mesh`` is ``mesh.devices.flat``; in a multi-slice TPU program they count one slice's
    devices, and what crosses slices is Megascale ``send``s, each counted as a collective of its
    transfer's kind over the slices it joins (on the "node" axis of ``make_mesh``'s mesh).
    Each group is labelled with the names of the mesh axes along which its members differ,
    joined by ``"+"``: ``"node"``, ``"local"``, ``"node+local"``.

    Args:
      jitted_fn: a ``jax.jit``-wrapped function, e.g. of a ``jax.shard_map``. A
        ``jax.stages.Lowered`` or ``jax.stages.Compiled`` is accepted too (then pass no args).
      *args: positional arguments to lower ``jitted_fn`` with (arrays or
        ``jax.ShapeDtypeStruct``).
      mesh: the mesh used to name the axes. By default, the mesh of the executable's
        ``NamedSharding`` inputs or outputs.
      **kwargs: keyword arguments to lower ``jitted_fn`` with.

    Returns:
      A ``CommunicationStats`` with one row per (kind, axes, dtype), and per mesh axis an
      ``Overlap``: the gemms and FLOPs the schedule runs between each collective's start and
      done, a loop's once per iteration (``overlap_on("node")``); ``print`` it for both.

    Raises:
      TypeError: if ``jitted_fn`` cannot be lowered.
      ValueError: if no mesh is given and none can be found, if the mesh does not hold the
        devices the function was compiled for, or if the HLO cannot be parsed.

    Examples:
      >>> import jax, numpy as np
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1, 1), ("node", "local"))
      >>> fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "local"), mesh=mesh,
      ...                            in_specs=P(), out_specs=P()))
      >>> stats = communication_stats(fn, np.ones(4, np.float32))
      >>> stats.bytes_on("node")
      0.0

    References:
      Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
      MPICH", IJHPCA 2005.
    """
    if isinstance(jitted_fn, jax.stages.Compiled | jax.stages.Lowered):
        if args or kwargs:
            raise ValueError(
                "communication_stats: got an already lowered or compiled function and arguments; "
                "pass the jitted function with its arguments, or the compiled one alone"
            )
        compiled = jitted_fn if isinstance(jitted_fn, jax.stages.Compiled) else jitted_fn.compile()
    elif hasattr(jitted_fn, "lower"):
        compiled = jitted_fn.lower(*args, **kwargs).compile()
    else:
        raise TypeError(
            f"communication_stats: {jitted_fn!r} has no .lower(); wrap it in jax.jit(...) first"
        )
    found_mesh, assignment = _compiled_mesh(compiled)
    mesh = mesh if mesh is not None else found_mesh
    if mesh is None:
        raise ValueError(
            "communication_stats: cannot find a mesh in the input or output shardings of the "
            "compiled function; pass mesh=..."
        )
    axis_names, axis_sizes = tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    ids = None
    if isinstance(mesh, jax.sharding.Mesh) and assignment is not None and len(assignment) > 1:
        index = {device: i for i, device in enumerate(mesh.devices.flat)}
        missing = [device for device in assignment if device not in index]
        if missing or len(assignment) != mesh.size:
            raise ValueError(
                f"communication_stats: the function was compiled for {len(assignment)} devices "
                f"{list(assignment)[:8]}, which the mesh {dict(mesh.shape)} does not match; "
                "pass the mesh the function runs on as mesh=..."
            )
        ids = DeviceIds.of_devices(assignment, [index[device] for device in assignment])
    elif isinstance(mesh, jax.sharding.Mesh):
        ids = DeviceIds.of_devices(list(mesh.devices.flat), range(mesh.size))
    return stats_from_hlo(compiled.as_text(), axis_names, axis_sizes, ids=ids)
