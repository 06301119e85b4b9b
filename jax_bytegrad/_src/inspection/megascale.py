"""Transfers between TPU slices: the Megascale ``send``s of a multi-slice program, and which
devices a program's ids name.

Across TPU slices XLA writes no collective. It compiles one program per slice (its
``num_partitions`` is the chips of one slice, whose device ids count from 0 within the slice)
and hands what crosses slices to the Megascale runtime over DCN as ``send`` / ``recv`` pairs
with ``is_host_transfer=true``, tagged by frontend attributes::

    %send = (u8[16,8,128]{2,1,0:T(8,128)(4,1)}, u32[]{:S(2)}, token[]) send(%codes, %token),
      channel_id=4, is_host_transfer=true, frontend_attributes={
      _xla_host_transfer_handler_name="xla_megascale_runtime",
      _xla_megascale_reduce_operation="SUM", _xla_megascale_target="{1,2}x{0:7}",
      _xla_megascale_transfer_type="ALL_REDUCE"}

``_xla_megascale_transfer_type`` names the collective (``ALL_REDUCE``, ``REDUCE_SCATTER``,
``ALL_GATHER``, ``ALL_TO_ALL``; a ``ppermute``'s is ``ONE_TO_ONE``, or none), and
``_xla_megascale_target`` its members in one of three forms:

- ``"{1,2}x{0:7}"``: slices 1 and 2 (``slice_index + 1``), and within each the devices 0 to 7
  of the program; each device's group is itself and the devices of the same id in the other
  slices;
- ``{{100000,200000},{100001,200001}}``: the groups, by global device id;
- ``{{100000->200000},{200000->100000}}``: a permute's pairs, by global device id.

The sent side is what counts: each ``send`` is one collective of its kind whose payload is
the ``send``'s array as written (already padded to TPU tiles where XLA reshaped it, as a
scalar becomes ``f32[1,1,128]``); the ``recv`` is the same transfer seen from the other end.
"""

import dataclasses
import itertools
import re
from collections.abc import Mapping, Sequence

# Megascale transfer types and the collective kind each is counted as.
TRANSFER_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_GATHER": "all-gather",
    "ALL_TO_ALL": "all-to-all",
    # A ppermute's (low_precision_decentralized's ring between slices); its target is pairs.
    "ONE_TO_ONE": "collective-permute",
}
_TYPE_RE = re.compile(r'\b_xla_megascale_transfer_type="([A-Z_]+)"')
_TARGET_RE = re.compile(r"\b_xla_megascale_target=")
_RANGE_RE = re.compile(r"\{(?P<slices>[\d,\s]*)\}x\{(?P<ids>[\d,:\s]*)\}")


@dataclasses.dataclass(frozen=True)
class Target:
    """The members of one Megascale transfer.

    Attributes:
      slices: the range form's slice numbers (``slice_index + 1``), in the order written.
      program_ids: the range form's device ids within each slice, as the program numbers them.
      groups: the explicit form's groups, by global device id.
      pairs: a permute's ``(source, target)`` pairs, by global device id.
    """

    slices: tuple[int, ...] = ()
    program_ids: tuple[int, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()


def is_transfer(opcode: str, attributes: str) -> bool:
    """Whether an instruction is the sent side of a transfer between TPU slices."""
    return (
        opcode == "send"
        and "is_host_transfer=true" in attributes
        and _TARGET_RE.search(attributes) is not None
    )


def transfer(name: str, attributes: str) -> tuple[str, Target]:
    """The collective kind and members of a Megascale ``send``.

    Args:
      name: the instruction's name, for errors.
      attributes: the text after its operands.

    Returns:
      ``(kind, target)``: one of ``stats``' collective kinds, and the members.

    Raises:
      ValueError: for a transfer type or target this reader does not know.
    """
    target = _target(name, attributes)
    found = _TYPE_RE.search(attributes)
    if found is None:
        if target.pairs:
            return "collective-permute", target
        raise ValueError(
            f"communication_stats: Megascale send {name!r} names no transfer type and no "
            f"pairs: {attributes[:300]!r}"
        )
    if found[1] not in TRANSFER_KINDS:
        raise ValueError(
            f"communication_stats: Megascale send {name!r} has transfer type {found[1]!r}, "
            f"which is none of {sorted(TRANSFER_KINDS)}; its bytes between slices cannot be "
            "counted (please report it with the HLO line)"
        )
    return TRANSFER_KINDS[found[1]], target


def _target(name: str, attributes: str) -> Target:
    start = _TARGET_RE.search(attributes)
    if start is None:
        raise ValueError(f"communication_stats: Megascale send {name!r} names no target")
    text = attributes[start.end() :]
    if text.startswith('"'):
        value = text[1 : text.index('"', 1)]
        match = _RANGE_RE.fullmatch(value.strip())
        if match is None:
            raise ValueError(
                f"communication_stats: cannot read Megascale target {value!r} of {name!r}; "
                'expected "{1,2}x{0:7}"'
            )
        slices = tuple(int(v) for v in match["slices"].split(",") if v.strip())
        ids: list[int] = []
        for item in match["ids"].split(","):
            low, _, high = item.strip().partition(":")
            if low:
                ids += range(int(low), int(high or low) + 1)
        return Target(slices=slices, program_ids=tuple(ids))
    depths = itertools.accumulate({"{": 1, "}": -1}.get(char, 0) for char in text)
    end = next((i for i, depth in enumerate(depths) if depth == 0), len(text))
    inner = re.findall(r"\{([^{}]*)\}", text[1:end])
    if any("->" in group for group in inner):
        pairs = tuple((int(s), int(t)) for group in inner for s, t in [group.split("->")])
        return Target(pairs=pairs)
    return Target(groups=tuple(tuple(int(v) for v in g.split(",") if v.strip()) for g in inner))


@dataclasses.dataclass(frozen=True)
class DeviceIds:
    """Which mesh position each device id of a compiled program names.

    Attributes:
      program: ``program[k]`` is the flat (row-major) mesh position of the program's device
        id ``k``. In a multi-slice program the ids count one slice's devices, in the order of
        the executable's device assignment; this maps the first slice's.
      slices: per Megascale slice number (``slice_index + 1``), the mesh positions of that
        slice's devices in the program's id order; empty outside multi-slice programs.
      global_ids: per device's own ``id``, its mesh position.
    """

    program: tuple[int, ...]
    slices: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    global_ids: Mapping[int, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_devices(cls, devices: Sequence, positions: Sequence[int]) -> "DeviceIds":
        """From the executable's device assignment and each device's mesh position.

        Devices that carry more than one ``slice_index`` make a multi-slice program: its ids
        count the devices of one slice in assignment order.
        """
        positions = tuple(int(p) for p in positions)
        slice_of = [getattr(device, "slice_index", None) for device in devices]
        global_ids = {int(device.id): p for device, p in zip(devices, positions, strict=True)}
        if None in slice_of or len(set(slice_of)) < 2:
            return cls(positions, {}, global_ids)
        slices: dict[int, list[int]] = {}
        for index, p in zip(slice_of, positions, strict=True):
            slices.setdefault(int(index) + 1, []).append(p)
        first = int(slice_of[0]) + 1
        return cls(tuple(slices[first]), {s: tuple(v) for s, v in slices.items()}, global_ids)

    def position(self, program_id: int) -> int:
        """The mesh position of the program's device ``program_id``."""
        if not 0 <= program_id < len(self.program):
            raise ValueError(
                f"communication_stats: the HLO names device {program_id} but the program's "
                f"mesh has {len(self.program)} devices; pass the mesh the function was "
                "compiled for as mesh=..."
            )
        return self.program[program_id]

    def members(self, target: Target) -> tuple[tuple[tuple[int, ...], ...], tuple]:
        """``(groups, pairs)`` of a Megascale target, as mesh positions."""
        if target.pairs:
            return (), tuple((self._global(s), self._global(t)) for s, t in target.pairs)
        if target.groups:
            return tuple(tuple(self._global(d) for d in g) for g in target.groups), ()
        missing = [s for s in target.slices if s not in self.slices]
        if missing:
            raise ValueError(
                f"communication_stats: the HLO sends to TPU slices {missing} (slice_index + 1), "
                f"but the mesh holds slices {sorted(self.slices)}; pass the mesh of TPU devices "
                "the function was compiled for as mesh=..."
            )
        groups = []
        for k in target.program_ids:
            self.position(k)
            groups.append(tuple(self.slices[s][k] for s in target.slices))
        return tuple(groups), ()

    def _global(self, device_id: int) -> int:
        if device_id not in self.global_ids:
            raise ValueError(
                f"communication_stats: the HLO sends to device id {device_id}, which is not in "
                "the mesh; pass the mesh the function was compiled for as mesh=..."
            )
        return self.global_ids[device_id]
