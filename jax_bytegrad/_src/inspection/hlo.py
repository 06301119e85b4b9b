"""A parser of HLO module text: its instructions, computations, shapes and collectives.

Reads the text XLA prints for an optimized module (``compiled.as_text()``), the program it will
actually run. ``stats`` turns the collectives found here into the traffic each device sends;
benchmarks read the instructions to see what the compiler fused.
"""

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from jax_bytegrad._src.inspection import megascale

# The collective kinds, in display and sort order.
COLLECTIVE_KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
)
# An HLO instruction line: `[ROOT] %name = shape opcode(operands), attributes`.
_INSTRUCTION_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<opcode>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
# A computation header: `[ENTRY] %name (params) -> shape {`.
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)")
_ARRAY_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
# An array shape with its layout: `f32[8,8,128]{2,1,0:T(8,128)}`, the tiles after the colon.
_LAYOUT_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^{}]*)\})?")
_IOTA_GROUPS_RE = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
# Newer XLA names the groups by mesh axes: `mesh['node'=2,'local'=4] {'node'}`, optionally with
# the device order as an iota (`<=[8]T(...)`) and sub-axes (`'x':(2)4`: size 4, after 2).
_MESH_GROUPS_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]\s*(?:<=\[(?P<dims>[\d,\s]+)\](?:T\((?P<perm>[\d,\s]+)\))?)?"
    r"\s*\{(?P<group>[^{}]*)\}"
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
class Collective:
    """One collective instruction parsed from HLO text.

    Attributes:
      kind: one of ``COLLECTIVE_KINDS`` (async ``-start`` forms are folded into their kind; a
        Megascale ``send`` between TPU slices is the kind of its transfer type).
      payload_bytes: per-device operand bytes, of the shapes as written.
      dtypes: the operands' element types, each once, in operand order.
      groups: the replica groups; None for one group of all devices.
      pairs: the ``(source, target)`` pairs of a collective-permute; empty for other kinds.
      computation: the name of the computation that holds it.
      name: the instruction's name (of the ``-start`` of an async collective).
      padded_bytes: ``payload_bytes`` with each array rounded up to its layout's tiles (TPU
        layouts such as ``T(8,128)``); ``payload_bytes`` where the layout names none.
      target: for a Megascale ``send`` between TPU slices, its members (``groups`` and
        ``pairs`` are then empty: its ids are not the program's); None for a collective.
    """

    kind: str
    payload_bytes: int
    dtypes: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...] | None
    pairs: tuple[tuple[int, int], ...] = ()
    computation: str = ""
    name: str = ""
    padded_bytes: int = 0
    target: megascale.Target | None = None


def async_done(instructions: Sequence[HloInstruction]) -> dict[str, str]:
    """For each async ``-done`` instruction, the name of the ``-start`` it completes."""
    out = {}
    for i in instructions:
        if i.opcode.endswith("-done"):
            operand = re.match(r"\s*%?([\w.\-]+)", i.args)
            if operand is not None:
                out[i.name] = operand.group(1)
    return out


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


def _padded_bytes(shape: str) -> int:
    """Bytes of an HLO shape string with each array rounded up to its layout's first tile.

    ``f32[2,500,1]{1,2,0:T(1,128)}`` is laid out minor dimension last as ``[2, 1, 500]``, and
    the tile ``(1, 128)`` rounds its two minor dimensions up to ``[1, 512]``: 4096 bytes.
    """
    total = 0
    for dtype, dims_text, layout in _LAYOUT_SHAPE_RE.findall(shape):
        bits = _element_bits(dtype)
        if bits == 0:
            continue
        dims = [int(d.strip().lstrip("<=")) for d in dims_text.split(",") if d.strip()]
        order, _, rest = (layout or "").partition(":")
        minor_to_major = [int(v) for v in order.split(",") if v.strip()]
        tile = re.match(r"T\(([\d,\s]+)\)", rest)
        if tile is not None and sorted(minor_to_major) == list(range(len(dims))):
            sizes = [int(v) for v in tile[1].split(",")]
            # Major to minor, with leading 1s where the tile has more dimensions.
            laid = [1] * (len(sizes) - len(dims)) + [dims[d] for d in reversed(minor_to_major)]
            for j, size in enumerate(reversed(sizes), 1):
                laid[-j] = -(-laid[-j] // size) * size
            dims = laid
        total += -(-int(np.prod(dims)) * bits // 8)
    return total


def split_top_level(text: str) -> tuple[list[str], str]:
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


def parse_replica_groups(text: str) -> tuple[tuple[int, ...], ...] | None:
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


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of an HLO module, async `-start` forms once, `-done` never."""
    return collectives(hlo_instructions(hlo_text))


def collectives(instructions: Sequence[HloInstruction]) -> list[Collective]:
    """Every collective among ``instructions``, async ``-start`` forms once, ``-done`` never."""
    found = []
    shapes: dict[tuple[str, str], str] = {}  # (computation, instruction name) -> shape
    for instruction in instructions:
        where, shape = instruction.computation, instruction.shape
        shapes[where, instruction.name] = shape
        kind = instruction.opcode.removesuffix("-start")
        if kind == "send":
            operands, attributes = split_top_level(instruction.args)
            if megascale.is_transfer(kind, attributes):
                found.append(_megascale_send(instruction, attributes))
            continue
        if kind not in COLLECTIVE_KINDS:
            continue
        operands, attributes = split_top_level(instruction.args)
        if kind == "collective-permute" and len(operands) == 4:
            # The in-place form also passes the output buffer and slice offsets.
            operands = operands[:1]
        payload, padded, dtypes = 0, 0, []
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
            padded += _padded_bytes(operand)
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
            groups = parse_replica_groups(groups_text)
        found.append(
            Collective(
                kind, payload, tuple(dict.fromkeys(dtypes)), groups, pairs, where,
                instruction.name, padded,
            )
        )  # fmt: skip
    return found


def _megascale_send(instruction: HloInstruction, attributes: str) -> Collective:
    """A Megascale ``send`` between TPU slices as one collective of its transfer's kind: the
    array it sends, as written (its result's first element)."""
    kind, target = megascale.transfer(instruction.name, attributes)
    arrays = [
        (dtype, dims, layout)
        for dtype, dims, layout in _LAYOUT_SHAPE_RE.findall(instruction.shape)
        if _element_bits(dtype)
    ]
    if not arrays:
        raise ValueError(
            f"communication_stats: Megascale send {instruction.name!r} sends no array: "
            f"{instruction.shape!r}"
        )
    dtype, dims, layout = arrays[0]
    written = f"{dtype}[{dims}]" + (f"{{{layout}}}" if layout else "")
    payload, _ = _shape_bytes(written)
    return Collective(
        kind, payload, (dtype,), None, (), instruction.computation, instruction.name,
        _padded_bytes(written), target,
    )  # fmt: skip
