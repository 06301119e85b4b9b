"""Bytes moved by the collectives of a compiled JAX function, per collective kind and mesh axis.

Reads the optimized HLO that XLA will actually run, so it sees what the compiler did: collectives
it combined, bfloat16 reductions it promoted, and the all-reduce that ``jax.grad`` hides inside
``shard_map`` for a replicated parameter. Costs follow the bandwidth term of the standard
ring/pairwise algorithms (Thakur et al., 2005), as used to account for traffic in Bagua
(Gan et al., VLDB 2022).

References:
  Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
  MPICH", IJHPCA 2005.
  Patarasuk and Yuan, "Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations",
  JPDC 2009.
  Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
"""

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

# Display and sort order of the collective kinds.
_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
# An HLO instruction line: `[ROOT] %name = shape opcode(operands), attributes`.
_INSTRUCTION_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<opcode>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
# A computation header: `[ENTRY] %name (params) -> shape {`.
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)")
_ARRAY_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_IOTA_GROUPS_RE = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
# Newer XLA names the groups by mesh axes: `mesh['node'=2,'local'=4] {'node'}`, optionally with
# the device order as an iota (`<=[8]T(...)`) and sub-axes (`'x':(2)4`: size 4, after 2).
_MESH_GROUPS_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]\s*(?:<=\[(?P<dims>[\d,\s]+)\](?:T\((?P<perm>[\d,\s]+)\))?)?"
    r"\s*\{(?P<group>[^{}]*)\}"
)
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
      count: number of collective instructions in the compiled HLO.
      payload_bytes: per-device operand bytes, summed over the instructions.
      bytes_sent: bytes each device sends, summed over the instructions (see
        ``communication_stats`` for the formulas).
    """

    kind: str
    axes: str
    dtype: str
    count: int
    payload_bytes: int
    bytes_sent: float


@dataclasses.dataclass(frozen=True)
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
    """

    rows: tuple[CollectiveTraffic, ...]
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    branches: tuple[tuple["CommunicationStats", ...], ...] = ()
    unconditional: "CommunicationStats | None" = None

    @property
    def total_bytes(self) -> float:
        """Bytes each device sends over all collectives."""
        return float(sum(row.bytes_sent for row in self.rows))

    @property
    def total_payload_bytes(self) -> int:
        """Per-device operand bytes over all collectives."""
        return sum(row.payload_bytes for row in self.rows)

    def bytes_by_axis(self) -> dict[str, float]:
        """Bytes sent per device, keyed by axes label (``"node"``, ``"local"``, ``"node+local"``).

        The values sum to ``total_bytes``. Use ``bytes_on`` for all traffic that crosses one axis.
        """
        totals: dict[str, float] = {}
        for row in self.rows:
            totals[row.axes] = totals.get(row.axes, 0.0) + row.bytes_sent
        return totals

    def bytes_on(self, axis_name: str) -> float:
        """Bytes sent per device by collectives whose groups span ``axis_name``.

        For ``"node"`` this is the inter-node traffic: it includes collectives over
        ``"node+local"``.

        Args:
          axis_name: a mesh axis name.

        Returns:
          The bytes each device sends through collectives whose groups vary along the axis.

        Raises:
          ValueError: if ``axis_name`` is not a mesh axis.
        """
        if axis_name not in self.axis_names:
            raise ValueError(
                f"bytes_on: axis {axis_name!r} is not in the mesh axes {self.axis_names}; "
                "pass one of them"
            )
        return float(sum(row.bytes_sent for row in self.rows if axis_name in row.axes.split("+")))

    def __str__(self) -> str:
        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes, strict=True))
        header = ("kind", "axes", "dtype", "count", "payload", "sent/device")

        def cells(kind: str, axes: str, dtype: str, count: int, payload: float, sent: float):
            return (kind, axes, dtype, str(count), _format_bytes(payload), _format_bytes(sent))

        lines = [cells(*dataclasses.astuple(row)) for row in self.rows]
        count = sum(row.count for row in self.rows)
        total = cells("total", "", "", count, self.total_payload_bytes, self.total_bytes)
        table = [header, *lines, total]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]

        def fmt(line: Sequence[str]) -> str:
            left = [cell.ljust(w) for cell, w in zip(line[:3], widths[:3], strict=True)]
            right = [cell.rjust(w) for cell, w in zip(line[3:], widths[3:], strict=True)]
            return "  ".join(left + right).rstrip()

        rule = "-" * len(fmt(header))
        body = [fmt(line) for line in lines] or ["(no collectives)"]
        return "\n".join(
            [f"Communication per device (mesh {mesh})", fmt(header), rule, *body, rule, fmt(total)]
        )


@dataclasses.dataclass(frozen=True)
class HloInstruction:
    """One instruction line of an HLO module's text.

    Attributes:
      computation: the name of the computation that holds it (``""`` before any header).
      entry: whether that computation is the module's ``ENTRY``.
      name: the instruction's name, without ``%``.
      shape: its result shape as printed, e.g. ``"f32[16]{0}"`` or a tuple of shapes.
      opcode: e.g. ``"fusion"``, ``"all-reduce-start"``, ``"conditional"``.
      args: the text after ``opcode(``: the operands, the closing paren, the attributes.
    """

    computation: str
    entry: bool
    name: str
    shape: str
    opcode: str
    args: str


def hlo_instructions(hlo_text: str) -> list[HloInstruction]:
    """Every instruction of an HLO module's text, with the computation that holds it.

    Args:
      hlo_text: the text of an HLO module, e.g. ``jitted.lower(x).compile().as_text()``.

    Returns:
      The instructions in text order.

    Examples:
      >>> hlo = "ENTRY %main (p: f32[4]) -> f32[4] {\\n  ROOT %p = f32[4]{0} parameter(0)\\n}"
      >>> [(i.computation, i.entry, i.name, i.opcode) for i in hlo_instructions(hlo)]
      [('main', True, 'p', 'parameter')]
    """
    out, computation, entry = [], "", False
    for line in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # `/*index=5*/` markers in long tuples
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            header = _COMPUTATION_RE.match(line)
            computation = header.group("name") if header else line.split()[0]
            entry = line.startswith("ENTRY")
            continue
        match = _INSTRUCTION_RE.match(line)
        if match is not None:
            out.append(
                HloInstruction(computation, entry, *match.group("name", "shape", "opcode", "rest"))
            )
    return out


def array_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """The ``(element type, dimensions)`` of every array shape written in HLO ``text``.

    Dynamic dimensions print as ``<=N``; their bound is returned.

    Examples:
      >>> array_shapes("(f32[2,3]{1,0}, u8[<=8]{0}) tuple(...)")
      [('f32', (2, 3)), ('u8', (8,))]
    """
    return [
        (dtype, tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()))
        for dtype, dims in _ARRAY_SHAPE_RE.findall(text)
    ]


def conditional_branches(instructions: Sequence[HloInstruction]) -> list[tuple[str, ...]]:
    """For each ``conditional`` instruction, the names of its branch computations, in order.

    Reads both printed forms: ``branch_computations={%a, %b}`` and
    ``true_computation=%a, false_computation=%b`` (the branch for ``True`` is index 1 in
    ``lax.cond``, so the pair is returned as ``(false, true)``).
    """
    out = []
    for instruction in instructions:
        if instruction.opcode != "conditional":
            continue
        listed = _braced(instruction.args, "branch_computations")
        if listed is not None:
            out.append(tuple(b.strip().lstrip("%") for b in listed[1:-1].split(",") if b.strip()))
            continue
        pair = re.search(
            r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", instruction.args
        )
        if pair is None:
            raise ValueError(
                f"communication_stats: cannot find the branches of conditional "
                f"{instruction.name!r}: {instruction.args[:200]!r}"
            )
        out.append((pair.group(2), pair.group(1)))
    return out


def called_computations(instructions: Sequence[HloInstruction], root: str) -> set[str]:
    """``root`` and every computation it calls, directly or not (fusions, reducers, branches)."""
    names = {i.computation for i in instructions}
    calls: dict[str, set[str]] = {}
    for instruction in instructions:
        named = set(re.findall(r"%([\w.\-]+)", instruction.args)) & names
        calls.setdefault(instruction.computation, set()).update(named - {instruction.computation})
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += calls.get(name, ())
    return seen


@dataclasses.dataclass(frozen=True)
class _Collective:
    """One collective instruction parsed from HLO text."""

    kind: str
    payload_bytes: int
    dtypes: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...] | None  # None: one group of all devices
    pairs: tuple[tuple[int, int], ...] = ()  # collective-permute only
    computation: str = ""  # the computation that holds it


def _format_bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B" if float(n).is_integer() else f"{n:.2f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.2f} {unit}"


def _element_bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    match = re.match(r"[a-z]+?(\d+)", dtype)
    if match is None:  # token, opaque: no data
        return 0
    return int(match.group(1))


def _shape_bytes(shape: str) -> tuple[int, list[str]]:
    """Bytes and element types of an HLO shape string, tuples included."""
    total, dtypes = 0, []
    for dtype, dims in array_shapes(shape):
        bits = _element_bits(dtype)
        if bits == 0:
            continue
        # Dynamic dimensions hold their bound.
        total += -(-int(np.prod(dims)) * bits // 8)
        dtypes.append(dtype)
    return total, dtypes


def _split_top_level(text: str) -> tuple[list[str], str]:
    """Splits `a, b(c, d), e), rest` into the top-level items before the closing paren, and rest."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "({[":
            depth += 1
        elif char in ")}]":
            if depth == 0:
                items.append(text[start:i])
                return [item.strip() for item in items if item.strip()], text[i + 1 :]
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    raise ValueError(f"communication_stats: unbalanced operand list in HLO: {text[:200]!r}")


def _braced(text: str, key: str) -> str | None:
    """The balanced `{...}` value of `key=` in an attribute string, or None if absent."""
    match = re.search(rf"\b{key}=", text)
    if match is None or text[match.end() : match.end() + 1] != "{":
        return None
    depth = 0
    for i in range(match.end(), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[match.end() : i + 1]
    raise ValueError(f"communication_stats: unbalanced braces after {key}= in HLO: {text[:200]!r}")


def _parse_replica_groups(text: str) -> tuple[tuple[int, ...], ...] | None:
    """Parses an HLO replica-group list, explicit or iota.

    Explicit: ``{{0,4},{1,5}}``. Iota: ``[G,S]<=[d0,d1,...]T(p0,p1,...)``, meaning
    ``iota(prod(d)).reshape(d).transpose(p).reshape(G, S)``: G groups of S devices. An empty list
    ``{}`` means one group of all devices and returns None.
    """
    text = text.strip()
    if text.startswith("mesh["):
        return _parse_mesh_groups(text)
    if text.startswith("{"):
        groups = tuple(
            tuple(int(v) for v in inner.split(",") if v.strip())
            for inner in re.findall(r"\{([^{}]*)\}", text[1:-1])
        )
        return groups or None
    match = _IOTA_GROUPS_RE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"communication_stats: cannot parse replica groups {text!r}; expected "
            "{{0,1},{2,3}} or the iota form [2,2]<=[4] / [2,2]<=[2,2]T(1,0)"
        )
    out_shape, dims, perm = (
        [int(v) for v in group.split(",")] if group else None for group in match.groups()
    )
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if perm is not None:
        ids = ids.transpose(perm)
    ids = ids.reshape(out_shape[0], -1) if len(out_shape) == 2 else ids.reshape(1, -1)
    return tuple(tuple(int(v) for v in group) for group in ids)


def _parse_mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Parses ``mesh['a'=2,'b'=4] {'a'}``: one group per value of the axes not named.

    Device ids run over the mesh in row-major order, or in the order of the optional iota
    (``<=[8]T(1,0)``). A named sub-axis ``'a':(p)s`` is the size-``s`` slice of axis ``a``
    that follows a slice of size ``p``.
    """
    match = _MESH_GROUPS_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"communication_stats: cannot parse replica groups {text!r}")
    names, sizes = [], []
    for item in re.findall(r"'?([^',=\s]+)'?\s*=\s*(\d+)", match.group("axes")):
        names.append(item[0])
        sizes.append(int(item[1]))
    ids = np.arange(int(np.prod(sizes)))
    if match.group("dims"):
        dims = [int(v) for v in match.group("dims").split(",")]
        ids = ids.reshape(dims)
        if match.group("perm"):
            ids = ids.transpose([int(v) for v in match.group("perm").split(",")])
    # Split each axis into (before, named part, after) sub-axes; a whole axis is (1, size, 1).
    split = {name: (1, size, 1) for name, size in zip(names, sizes, strict=True)}
    chosen = []
    for ref in re.findall(r"'?([^',:\s]+)'?(?::\((\d+)\)(\d+))?", match.group("group")):
        name, before, size = ref
        if name not in split:
            raise ValueError(f"communication_stats: unknown mesh axis {name!r} in {text!r}")
        if size:
            total = split[name][1]
            split[name] = (int(before), int(size), total // (int(before) * int(size)))
        chosen.append(name)
    shape = [part for name in names for part in split[name]]
    grid = ids.reshape(shape)
    middle = [3 * names.index(name) + 1 for name in chosen]
    rest = [axis for axis in range(grid.ndim) if axis not in middle]
    groups = grid.transpose(rest + middle).reshape(-1, int(np.prod([shape[a] for a in middle])))
    return tuple(tuple(int(v) for v in group) for group in groups)


def _parse_collectives(hlo_text: str) -> list[_Collective]:
    """Every collective instruction of an HLO module, async `-start` forms once, `-done` never."""
    return _collectives(hlo_instructions(hlo_text))


def _collectives(instructions: Sequence[HloInstruction]) -> list[_Collective]:
    collectives = []
    shapes: dict[tuple[str, str], str] = {}  # (computation, instruction name) -> shape
    for instruction in instructions:
        where, shape = instruction.computation, instruction.shape
        shapes[where, instruction.name] = shape
        kind = instruction.opcode.removesuffix("-start")
        if kind not in _KINDS:
            continue
        operands, attributes = _split_top_level(instruction.args)
        if kind == "collective-permute" and len(operands) == 4:
            # The in-place form also passes the output buffer and slice offsets.
            operands = operands[:1]
        payload, dtypes = 0, []
        for operand in operands:
            if not _ARRAY_SHAPE_RE.search(operand):  # `%name` only: look its shape up
                operand = shapes.get((where, operand.split()[-1].lstrip("%")), "")
            nbytes, types = _shape_bytes(operand)
            if not types:
                raise ValueError(
                    f"communication_stats: cannot find the shape of operand {operand!r} of "
                    f"{instruction.name!r}; pass the text of the whole HLO module"
                )
            payload += nbytes
            dtypes += types
        groups, pairs = None, ()
        if kind == "collective-permute":
            pairs_text = _braced(attributes, "source_target_pairs") or "{}"
            pairs = tuple(
                (int(s), int(t)) for s, t in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", pairs_text)
            )
        else:
            groups_text = _braced(attributes, "replica_groups")
            mesh_groups = _MESH_GROUPS_RE.search(attributes)
            if groups_text is None and mesh_groups is not None:
                groups_text = mesh_groups.group(0)
            elif groups_text is None:
                iota = re.search(r"\breplica_groups=(" + _IOTA_GROUPS_RE.pattern + ")", attributes)
                groups_text = iota.group(1) if iota else "{}"
            groups = _parse_replica_groups(groups_text)
        collectives.append(
            _Collective(kind, payload, tuple(dict.fromkeys(dtypes)), groups, pairs, where)
        )
    return collectives


def _bytes_sent(collective: _Collective, num_devices: int) -> float:
    """Bytes the busiest device sends for one collective; see `communication_stats`."""
    b = collective.payload_bytes
    if collective.kind == "collective-permute":
        sends: dict[int, int] = {}
        for source, target in collective.pairs:
            if source != target:
                sends[source] = sends.get(source, 0) + 1
        return float(max(sends.values(), default=0) * b)
    groups = collective.groups or (tuple(range(num_devices)),)
    g = max(len(group) for group in groups)
    if collective.kind == "all-reduce":
        return 2 * (g - 1) * b / g
    if collective.kind == "all-gather":
        return float((g - 1) * b)  # B_out = g * B_in, so (g-1)/g * B_out
    return (g - 1) * b / g  # reduce-scatter (B_in), all-to-all


def _axes_label(collective: _Collective, coords: np.ndarray, axis_names: Sequence[str]) -> str:
    """Names of the mesh axes along which members of a group (or permute pair) differ."""
    num_devices = coords.shape[0]
    if collective.kind == "collective-permute":
        groups: Iterable[Sequence[int]] = [pair for pair in collective.pairs if pair[0] != pair[1]]
    else:
        groups = collective.groups or (tuple(range(num_devices)),)
    varies = np.zeros(len(axis_names), dtype=bool)
    for group in groups:
        if max(group, default=-1) >= num_devices:
            raise ValueError(
                f"communication_stats: the HLO names device {max(group)} but the mesh has "
                f"{num_devices} devices; pass the mesh the function was compiled for as mesh=..."
            )
        members = coords[list(group)]
        varies |= (members != members[:1]).any(axis=0)
    names = [name for name, v in zip(axis_names, varies, strict=True) if v]
    return "+".join(names) if names else NO_AXES


def _stats_from_hlo(
    hlo_text: str,
    axis_names: Sequence[str],
    axis_sizes: Sequence[int],
    positions: Sequence[int] | None = None,
) -> CommunicationStats:
    """Summarises the collectives of HLO text over a mesh.

    Args:
      hlo_text: the text of an HLO module.
      axis_names: the mesh axis names.
      axis_sizes: the mesh axis sizes.
      positions: ``positions[i]`` is the flat (row-major) mesh position of HLO device id ``i``;
        None means the identity.
    """
    num_devices = int(np.prod(axis_sizes))
    if positions is None:
        positions = range(num_devices)
    coords = np.stack(np.unravel_index(np.asarray(positions, dtype=np.int64), axis_sizes), -1)
    instructions = hlo_instructions(hlo_text)
    collectives = _collectives(instructions)

    def summary(selected: Iterable[_Collective], **extra) -> CommunicationStats:
        return _summary(selected, coords, axis_names, axis_sizes, **extra)

    reached = [
        [called_computations(instructions, branch) for branch in branches]
        for branches in conditional_branches(instructions)
    ]
    in_any = set().union(*(names for conditional in reached for names in conditional))
    return summary(
        collectives,
        branches=tuple(
            tuple(summary(c for c in collectives if c.computation in names) for names in branches)
            for branches in reached
        ),
        unconditional=summary(c for c in collectives if c.computation not in in_any),
    )


def _summary(
    collectives: Iterable[_Collective],
    coords: np.ndarray,
    axis_names: Sequence[str],
    axis_sizes: Sequence[int],
    **extra,
) -> CommunicationStats:
    """One row per (kind, axes, dtype) of the given collectives."""
    num_devices = coords.shape[0]
    totals: dict[tuple[str, str, str], list] = {}
    for collective in collectives:
        key = (
            collective.kind,
            _axes_label(collective, coords, axis_names),
            ",".join(collective.dtypes),
        )
        entry = totals.setdefault(key, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += collective.payload_bytes
        entry[2] += _bytes_sent(collective, num_devices)
    order = {name: i for i, name in enumerate(axis_names)}

    def sort_key(key: tuple[str, str, str]) -> tuple:
        kind, axes, dtype = key
        return (_KINDS.index(kind), [order.get(a, -1) for a in axes.split("+")], dtype)

    rows = tuple(
        CollectiveTraffic(*key, count, payload, sent)
        for key, (count, payload, sent) in sorted(totals.items(), key=lambda kv: sort_key(kv[0]))
    )
    return CommunicationStats(rows, tuple(axis_names), tuple(int(s) for s in axis_sizes), **extra)


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

    HLO device ids are positions in the executable's device assignment, which for a ``jit`` over
    a ``Mesh`` is ``mesh.devices.flat``. Each group is labelled with the names of the mesh axes
    along which its members differ, joined by ``"+"``: ``"node"``, ``"local"``, ``"node+local"``.

    Args:
      jitted_fn: a ``jax.jit``-wrapped function, e.g. of a ``jax.shard_map``. A
        ``jax.stages.Lowered`` or ``jax.stages.Compiled`` is accepted too (then pass no args).
      *args: positional arguments to lower ``jitted_fn`` with (arrays or
        ``jax.ShapeDtypeStruct``).
      mesh: the mesh used to name the axes. By default, the mesh of the executable's
        ``NamedSharding`` inputs or outputs.
      **kwargs: keyword arguments to lower ``jitted_fn`` with.

    Returns:
      A ``CommunicationStats`` with one row per (kind, axes, dtype); ``print`` it for a table.

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
    positions = None
    if isinstance(mesh, jax.sharding.Mesh) and assignment is not None and len(assignment) > 1:
        index = {device: i for i, device in enumerate(mesh.devices.flat)}
        missing = [device for device in assignment if device not in index]
        if missing or len(assignment) != mesh.size:
            raise ValueError(
                f"communication_stats: the function was compiled for {len(assignment)} devices "
                f"{list(assignment)[:8]}, which the mesh {dict(mesh.shape)} does not match; "
                "pass the mesh the function runs on as mesh=..."
            )
        positions = [index[device] for device in assignment]
    return _stats_from_hlo(compiled.as_text(), axis_names, axis_sizes, positions)
