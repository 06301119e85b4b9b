"""What a compiled program computes beside each of its collectives: gemms and their FLOPs.

Overlap is work beside an exchange, not bytes started early: a collective can start before the
last matrix product and still have nothing scheduled between its start and its done. This
reads the schedule of an optimized module (``compiled.as_text()`` prints each computation of a
scheduled module in the order it runs) and, for each collective, adds up the matrix products
and convolutions (gemms) that run between its ``-start`` and its ``-done``: an async collective
is in flight over the instructions between its two halves, a synchronous one over none.

A loop body counts as many times as the loop runs: its trip count comes from the while loop's
``known_trip_count`` (which XLA:CPU and XLA:GPU write into its backend config), or from its
induction variable (``known_init_step``) and a condition that compares it with one constant.
Where neither gives it, the body counts once and the figures say so (``trip_counts_known``).
A collective inside a loop body counts the work beside it in the body, once per iteration.
Collectives inside the branches of a conditional are left out: which branch runs is not in the
schedule; a branch's gemms count as the branch with the most FLOPs.

FLOPs are those of the products themselves, ``2 * M * N * K`` (a convolution: twice its output
elements times the kernel elements that feed each one); the elementwise work fused around
them is not counted.
"""

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

from jax_bytegrad._src.inspection import hlo

# Custom calls that are gemms or convolutions: cuBLAS/cuBLASLt, cuDNN, oneDNN matmuls.
_GEMM_TARGET_RE = re.compile(r'custom_call_target="[^"]*(gemm|cublas|matmul)', re.I)
_CONV_TARGET_RE = re.compile(r'custom_call_target="[^"]*(cudnn|conv)', re.I)
_CALLS_RE = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_TRIP_COUNT_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INIT_STEP_RE = re.compile(r'"known_init_step":\{"init":"(-?\d+)","step":"(-?\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One collective over a mesh axis, and the gemms scheduled beside it.

    Attributes:
      name: the instruction that starts it (its ``-start``, or the collective itself).
      kind: ``"all-reduce"``, ``"reduce-scatter"``, ... (as ``CollectiveTraffic.kind``).
      computation: the computation that schedules it: the ENTRY, or a loop body.
      runs: how many times it runs per call of the program: the product of the trip counts
        of the loops around it; None when one of them is unknown.
      bytes_sent: bytes per device that cross the axis's links, per run.
      gemms_beside: gemms that run while it is in flight, per run (0 for a synchronous one).
      flops_beside: their FLOPs, per run.
    """

    name: str
    kind: str
    computation: str
    runs: int | None
    bytes_sent: float
    gemms_beside: int
    flops_beside: float


@dataclasses.dataclass(frozen=True)
class Overlap:
    """How much of a program's compute runs beside its collectives over one mesh axis.

    Attributes:
      axis: the mesh axis.
      gemms: the gemms the program runs per call (matrix products and convolutions: dots,
        cuBLAS and cuDNN calls, fusions that hold one), a loop's as many times as it runs.
      flops: their FLOPs.
      gemms_beside: of ``gemms``, those that run while at least one collective over ``axis``
        is in flight: the compute the traffic can hide behind.
      flops_beside: their FLOPs.
      exchanges: one ``Exchange`` per collective whose bytes cross ``axis``, in HLO order.
      bytes_sent: bytes per device and call that cross ``axis``'s links, a collective in a
        loop once per iteration (collectives inside conditionals left out).
      early_bytes: of those, the bytes of collectives that start before the program's last
        gemm, read in the ENTRY's order (a collective inside a loop by the loop's place, so
        the collectives of a loop that runs the last gemm do not count). A secondary figure:
        starting early is not running beside compute (``gemms_beside`` says that).
      trip_counts_known: False when some loop's trip count is unknown: its body is then
        counted once, and the figures are lower bounds.
    """

    axis: str
    gemms: int
    flops: float
    gemms_beside: int
    flops_beside: float
    exchanges: tuple[Exchange, ...]
    bytes_sent: float
    early_bytes: float
    trip_counts_known: bool = True

    @property
    def gemm_share(self) -> float:
        """``gemms_beside / gemms`` (0 without gemms)."""
        return self.gemms_beside / self.gemms if self.gemms else 0.0

    @property
    def flops_share(self) -> float:
        """``flops_beside / flops`` (0 without FLOPs)."""
        return self.flops_beside / self.flops if self.flops else 0.0

    @property
    def early_share(self) -> float:
        """``early_bytes / bytes_sent`` (0 when nothing is sent)."""
        return self.early_bytes / self.bytes_sent if self.bytes_sent else 0.0

    def __str__(self) -> str:
        bound = "" if self.trip_counts_known else " (a loop of unknown trip count counted once)"
        return (
            f"{self.axis}: {self.gemms_beside} of {self.gemms} gemms ({self.flops_share:.1%} of "
            f"{_format_flops(self.flops)}) run beside its {len(self.exchanges)} collectives"
            f"{bound}; {self.early_share:.0%} of their bytes start before the last gemm"
        )


def _format_flops(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if n < 1000 or unit == "P":
            break
        n /= 1000
    return f"{n:.0f} FLOP" if not unit else f"{n:.2f} {unit}FLOP"


@dataclasses.dataclass(frozen=True)
class _Work:
    gemms: int = 0
    flops: float = 0.0

    def __add__(self, other: "_Work") -> "_Work":
        return _Work(self.gemms + other.gemms, self.flops + other.flops)

    def times(self, n: int) -> "_Work":
        return _Work(self.gemms * n, self.flops * n)


def _prod(values) -> int:
    return math.prod(int(v) for v in values)


class _Program:
    """The computations of a module, the work each instruction runs, and the loops' counts."""

    def __init__(self, instructions: Sequence[hlo.HloInstruction]):
        self.computations: dict[str, list[hlo.HloInstruction]] = {}
        self.shapes: dict[tuple[str, str], str] = {}
        self.entry = ""
        for i in instructions:
            self.computations.setdefault(i.computation, []).append(i)
            self.shapes[i.computation, i.name] = i.shape
            self.entry = i.computation if i.entry else self.entry
        self.unknown_loops: set[str] = set()
        self._work: dict[str, _Work] = {}
        self._trips: dict[str, int | None] = {}
        # Each computation's callers: (calling computation, its position there, times per run).
        self.callers: dict[str, list[tuple[str, int, int | None]]] = {}
        for name, sequence in self.computations.items():
            for k, i in enumerate(sequence):
                for callee, times in self.callees(i):
                    self.callers.setdefault(callee, []).append((name, k, times))

    def callees(self, i: hlo.HloInstruction) -> list[tuple[str, int | None]]:
        """The computations ``i`` runs, each with how many times per run of ``i`` (a branch of
        a conditional: None)."""
        if i.opcode == "while":
            trips = self.trip_count(i)
            names = [re.search(rf"\b{key}=%?([\w.\-]+)", i.args) for key in ("body", "condition")]
            return [(m[1], 1 if trips is None else trips) for m in names if m is not None]
        if i.opcode == "conditional":
            return [(branch, None) for branch in hlo.conditional_branches([i])[0]]
        return [(m, 1) for m in _CALLS_RE.findall(i.args) if m in self.computations]

    def trip_count(self, i: hlo.HloInstruction) -> int | None:
        """The trip count of while loop ``i``, or None (noted in ``unknown_loops``)."""
        if i.name not in self._trips:
            self._trips[i.name] = self._read_trip_count(i)
        return self._trips[i.name]

    def _read_trip_count(self, i: hlo.HloInstruction) -> int | None:
        known = _TRIP_COUNT_RE.search(i.args)
        if known is not None:
            return int(known[1])
        init_step = _INIT_STEP_RE.search(i.args)
        condition = re.search(r"\bcondition=%?([\w.\-]+)", i.args)
        if init_step is not None and condition is not None:
            init, step = int(init_step[1]), int(init_step[2])
            reached = hlo.called_computations(
                [j for c in self.computations.values() for j in c], condition[1]
            )
            body = [j for c in reached for j in self.computations.get(c, ())]
            compares = [j for j in body if j.opcode == "compare"]
            bounds = [
                int(m[1])
                for j in body
                if j.opcode == "constant" and re.fullmatch(r"[su]\d+\[\]", j.shape.strip())
                for m in [re.match(r"\s*(-?\d+)\)", j.args)]
                if m is not None
            ]
            # `i < N` with i running from init by step: the one shape of loop counted here.
            if (
                step > 0
                and len(compares) == 1
                and "direction=LT" in compares[0].args
                and len(bounds) == 1
            ):
                return max(0, -(-(bounds[0] - init) // step))
        self.unknown_loops.add(i.name)
        return None

    def _operand_dims(self, computation: str, operand: str) -> tuple[int, ...]:
        if not hlo.array_shapes(operand):  # `%name` only: look its shape up
            operand = self.shapes.get((computation, operand.split()[-1].lstrip("%")), "")
        shapes = hlo.array_shapes(operand)
        return shapes[0][1] if shapes else ()

    def _own(self, i: hlo.HloInstruction) -> _Work:
        """The gemm ``i`` itself runs, if it is one (not what it calls)."""
        call = i.opcode == "custom-call"
        is_gemm = i.opcode == "dot" or (call and _GEMM_TARGET_RE.search(i.args) is not None)
        is_conv = i.opcode == "convolution" or (call and _CONV_TARGET_RE.search(i.args) is not None)
        if not (is_gemm or is_conv):
            return _Work()
        outputs = hlo.array_shapes(i.shape)
        out = _prod(outputs[0][1]) if outputs else 0
        operands, attributes = hlo.split_top_level(i.args)
        dims = [self._operand_dims(i.computation, o) for o in operands[:2]]
        if is_gemm:
            contracting = re.search(r"\blhs_contracting_dims=\{([\d,\s]*)\}", attributes)
            if contracting is None:  # a library call: its backend config names them
                contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attributes)
            axes = re.findall(r"\d+", contracting[1]) if contracting else []
            inner = _prod(dims[0][int(a)] for a in axes if dims and int(a) < len(dims[0]))
        else:
            kernel = dims[1] if len(dims) > 1 else ()
            labels = re.search(r"\bdim_labels=[^_\s]+_([^\-\s]+)->", attributes)
            o = labels[1].find("o") if labels else -1
            inner = _prod(kernel) // kernel[o] if kernel and 0 <= o < len(kernel) else 0
        return _Work(1, 2.0 * out * inner)

    def work(self, i: hlo.HloInstruction) -> _Work:
        """The gemms instruction ``i`` runs, with those of the computations it calls."""
        total = self._own(i)
        branches = []
        for callee, times in self.callees(i):
            if times is None:
                branches.append(self.computation_work(callee))
            else:
                total += self.computation_work(callee).times(times)
        return total + max(branches, key=lambda w: w.flops, default=_Work())

    def computation_work(self, name: str) -> _Work:
        if name not in self._work:
            self._work[name] = sum((self.work(i) for i in self.computations.get(name, ())), _Work())
        return self._work[name]

    def runs(self, name: str) -> tuple[int, bool] | None:
        """How many times computation ``name`` runs per call (unknown trip counts as 1), and
        whether that is exact; None inside a conditional's branch."""
        if name == self.entry:
            return 1, True
        total, exact, found = 0, True, False
        for caller, k, times in self.callers.get(name, ()):
            above = self.runs(caller)
            if times is None or above is None:
                continue
            instruction = self.computations[caller][k]
            loop_unknown = instruction.opcode == "while" and instruction.name in self.unknown_loops
            total += above[0] * times
            exact = exact and above[1] and not loop_unknown
            found = True
        return (total, exact) if found else None

    def entry_position(self, name: str, position: int) -> int | None:
        """Position in the ENTRY of the instruction that runs ``name``'s ``position``."""
        while name != self.entry:
            callers = self.callers.get(name)
            if not callers:
                return None
            name, position, _ = callers[0]
        return position


def overlap_by_axis(
    instructions: Sequence[hlo.HloInstruction],
    collectives: Sequence[hlo.Collective],
    link_bytes: Mapping[str, Sequence[float]],
    axis_names: Sequence[str],
) -> tuple[Overlap, ...]:
    """One ``Overlap`` per mesh axis, from a scheduled module's instructions.

    Args:
      instructions: the module's instructions (``hlo.hlo_instructions``).
      collectives: its collectives (``hlo.collectives``).
      link_bytes: per collective name, the bytes per device that cross each axis's links.
      axis_names: the mesh axis names, in the order of ``link_bytes``' values.
    """
    program = _Program(instructions)
    total = program.computation_work(program.entry)
    place, intervals = _places(program, collectives), _intervals(program)
    entry = program.computations.get(program.entry, ())
    gemm_positions = [k for k, i in enumerate(entry) if program.work(i).gemms]
    last_gemm = gemm_positions[-1] if gemm_positions else -1
    out = []
    for index, axis in enumerate(axis_names):
        exchanges, covered, sent, early = [], {}, 0.0, 0.0
        for c in collectives:
            computation, start = place[c.name]
            nbytes = link_bytes[c.name][index]
            runs = program.runs(computation)
            if not nbytes or runs is None or start not in intervals:
                continue
            begin, end = intervals[start]
            sequence = program.computations[computation]
            beside = sum((program.work(i) for i in sequence[begin + 1 : end]), _Work())
            covered.setdefault(computation, set()).update(range(begin + 1, end))
            exchanges.append(
                Exchange(start, c.kind, computation, runs[0] if runs[1] else None,
                         nbytes, beside.gemms, beside.flops)
            )  # fmt: skip
            sent += nbytes * runs[0]
            at = program.entry_position(computation, begin)
            early += nbytes * runs[0] if at is not None and at < last_gemm else 0.0
        beside = _beside(program, program.entry, covered, {})
        out.append(
            Overlap(axis, total.gemms, total.flops, beside.gemms, beside.flops, tuple(exchanges),
                    sent, early, not program.unknown_loops)
        )  # fmt: skip
    return tuple(out)


def runs_per_call(
    instructions: Sequence[hlo.HloInstruction], collectives: Sequence[hlo.Collective]
) -> dict[str, int]:
    """Per collective name, how many times it runs per call of the program: a loop body's as
    many times as the loop runs; once where that is unknown, or inside a conditional's branch."""
    program = _Program(instructions)
    place = _places(program, collectives)
    runs = {c.name: program.runs(place[c.name][0]) for c in collectives}
    return {name: 1 if r is None else max(r[0], 1) for name, r in runs.items()}


def _places(program: _Program, collectives: Sequence[hlo.Collective]) -> dict[str, tuple]:
    """Where each collective is scheduled, ``(computation, start instruction)``: its own, or,
    wrapped in an async computation, that of the ``async-start`` that runs it."""
    place = {c.name: (c.computation, c.name) for c in collectives}
    wrapped = {}
    for name, sequence in program.computations.items():
        for i in sequence:
            called = _CALLS_RE.search(i.args)
            if i.opcode == "async-start" and called is not None:
                wrapped[called[1]] = (name, i.name)
    place.update({c.name: wrapped[c.computation] for c in collectives if c.computation in wrapped})
    return place


def _intervals(program: _Program) -> dict[str, tuple[int, int]]:
    """Each instruction's ``(start, done)`` positions in its computation: an async start's
    done, and for any other instruction its own position twice."""
    out = {}
    for sequence in program.computations.values():
        position = {i.name: k for k, i in enumerate(sequence)}
        for done, start in hlo.async_done(sequence).items():
            if start in position:
                out[start] = (position[start], position[done])
        out.update({i.name: (k, k) for k, i in enumerate(sequence) if i.name not in out})
    return out


def _beside(program: _Program, name: str, covered: dict[str, set[int]], memo: dict) -> _Work:
    """The gemms of computation ``name`` that run while a collective is in flight: all the work
    of an instruction inside a collective's interval, and what such intervals cover in the
    computations the others call (a loop's body once per iteration)."""
    if name in memo:
        return memo[name]
    total, inside = _Work(), covered.get(name, set())
    for k, i in enumerate(program.computations.get(name, ())):
        if k in inside:
            total += program.work(i)
            continue
        branches = []
        for callee, times in program.callees(i):
            work = _beside(program, callee, covered, memo)
            if times is None:
                branches.append(work)
            else:
                total += work.times(times)
        total += max(branches, key=lambda w: w.flops, default=_Work())
    memo[name] = total
    return total
