"""Would DiLoCo pay on this link? An estimate from ``autotune``'s timed ByteGrad step.

Follows DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023): the nodes exchange every H steps instead of every step. The estimate is a
model of bytes on the wire, not a measurement of DiLoCo:

    bytes per exchange, per node    2 (n - 1) / n * P * b      (b bytes per parameter)
    ByteGrad's exchange             bytes(ByteGrad's bits) / link
    compute                         the timed ByteGrad step - ByteGrad's exchange (>= 0)
    DiLoCo, per inner step          compute + bytes(the outer bits) / link / H

with ``b = bits / 8 + 8 / block_size`` for codes (a float32 scale and zero point per block:
1.0078 at 8 bits with blocks of 1024, 0.5156 at 4 bits with blocks of 512) and 4 for float32.
Subtracting the whole exchange from the timed step assumes it does not overlap the compute, as
on CPU hosts (XLA:CPU runs a program's collectives one after another). Where it overlaps
(GPUs), the compute is underestimated: pass ``compute_s``, a DiLoCo inner step timed the same
way (it sends nothing between nodes).

With ``background=True`` (CPU hosts), the exchange runs beside the next ``delay`` inner steps,
and only what they do not cover waits, once per H:

    DiLoCo in the background        compute + max(outer - delay * compute, 0) / H

``background_delay`` is the smallest delay that covers it. The exchange's own compute
(quantizing, the outer step), which slows the steps beside it, is not in either model.
"""

import math
from typing import NamedTuple

from jax_bytegrad._src import checks
from jax_bytegrad._src.sync.config import check_block_size

# DiLoCo changes the optimization (docs/diloco.md: a few to 30% of loss in short runs), so a
# small speed-up does not pay for it: it pays from this estimated speed-up on.
PAYS_AT = 1.5
FLOAT32 = 32  # the ``bits`` of a float32 exchange between nodes


def wire_bytes_per_param(bits: int, block_size: int | None = None) -> float:
    """Bytes per parameter on the wire between nodes: ``bits / 8`` plus a float32 scale and
    zero point per block of ``block_size`` (None: the default for ``bits``); 4 at 32 bits.

    Examples:
      >>> from jax_bytegrad._src.algorithms.diloco.estimate import wire_bytes_per_param
      >>> round(wire_bytes_per_param(8), 4), round(wire_bytes_per_param(4), 4)
      (1.0078, 0.5156)
    """
    if bits == FLOAT32:
        return 4.0
    return bits / 8 + 8 / check_block_size(block_size, "wire_bytes_per_param", bits)


def exchange_bytes(params: int, nodes: int, bytes_per_param: float) -> float:
    """Bytes each node sends between nodes to average ``params`` parameters over ``nodes``."""
    return 2 * (nodes - 1) / nodes * params * bytes_per_param


def check_link(link_bytes_per_s, inner_steps, where: str) -> None:
    """Raises a ``ValueError`` for a link that is not a positive number, or H < 1."""
    if isinstance(link_bytes_per_s, bool) or not (
        isinstance(link_bytes_per_s, (int, float)) and link_bytes_per_s > 0
    ):
        raise ValueError(
            f"{where}: link_bytes_per_s must be a positive number of bytes per second "
            f"(1 Gbit/s is 1.25e8), got {link_bytes_per_s!r}"
        )
    checks.integer(inner_steps, "inner_steps", where, why=" (DiLoCo's H)")


class DiLoCoEstimate(NamedTuple):
    """ByteGrad every step against DiLoCo every H steps, on one measured link.

    Attributes:
      inner_steps: H.
      bits: the outer exchange's bits (32: float32).
      link_bytes_per_s: the link between nodes, bytes per second per node.
      bytegrad_step_s: the timed ByteGrad step.
      exchange_s: ByteGrad's exchange per step on the link.
      compute_s: a step without an exchange between nodes (the timed step less its exchange,
        or as given).
      outer_s: one DiLoCo outer exchange on the link.
    """

    inner_steps: int
    bits: int
    link_bytes_per_s: float
    bytegrad_step_s: float
    exchange_s: float
    compute_s: float
    outer_s: float

    @property
    def diloco_step_s(self) -> float:
        """A DiLoCo inner step, its outer exchange spread over H steps."""
        return self.compute_s + self.outer_s / self.inner_steps

    @property
    def background_delay(self) -> int | None:
        """The smallest ``delay`` whose inner steps outlast one outer exchange, for
        ``background=True``; None where H - 1 steps do not (or the compute is 0)."""
        if self.compute_s <= 0:
            return None
        delay = max(1, math.ceil(self.outer_s / self.compute_s))
        return delay if delay < self.inner_steps else None

    def background_step_s(self, delay: int) -> float:
        """A DiLoCo inner step with its exchange in the background beside ``delay`` inner
        steps: what they do not cover waits, once per H."""
        uncovered = max(self.outer_s - delay * self.compute_s, 0.0)
        return self.compute_s + uncovered / self.inner_steps

    @property
    def speedup(self) -> float:
        """ByteGrad's step over DiLoCo's (NaN where DiLoCo's is 0)."""
        step = self.diloco_step_s
        return self.bytegrad_step_s / step if step > 0 else math.nan

    @property
    def pays(self) -> bool:
        """Whether the estimated speed-up reaches ``PAYS_AT``."""
        return self.speedup >= PAYS_AT

    def verdict(self) -> str:
        """One sentence: the two step times and whether DiLoCo would pay."""
        how = "would pay" if self.pays else f"would not pay (under {PAYS_AT}x)"
        said = (
            f"DiLoCo at H={self.inner_steps} ({self.bits}-bit outer exchange) would take about "
            f"{1e3 * self.diloco_step_s:.1f} ms per inner step against ByteGrad's "
            f"{1e3 * self.bytegrad_step_s:.1f} ms every step ({self.speedup:.2f}x): it {how}; "
            f"ByteGrad's exchange is {1e3 * self.exchange_s:.1f} ms of it on this link"
        )
        delay = self.background_delay
        if delay is not None:
            said += (
                f"; in the background (CPU hosts), delay={delay} would hide the outer "
                f"exchange: about {1e3 * self.background_step_s(delay):.1f} ms per inner step"
            )
        return said


def estimate_diloco(
    bytegrad_step_s: float,
    *,
    params: int,
    nodes: int,
    link_bytes_per_s: float,
    inner_steps: int = 50,
    bits: int = 8,
    bytegrad_bits: int = 8,
    block_size: int | None = None,
    bytegrad_block_size: int | None = None,
    compute_s: float | None = None,
) -> DiLoCoEstimate:
    """Estimates a DiLoCo inner step against a timed ByteGrad step (module docstring).

    Args:
      bytegrad_step_s: the ByteGrad step's seconds, timed on the link (``autotune``'s best).
      params: the model's parameter count.
      nodes: the nodes that average.
      link_bytes_per_s: each node's link to the others, in bytes per second (measured, e.g.
        with ``benchmarks/network.py``; 1 Gbit/s is 1.25e8).
      inner_steps: DiLoCo's H.
      bits: DiLoCo's outer exchange: 8, 4 or 32.
      bytegrad_bits: the timed ByteGrad step's bits.
      block_size, bytegrad_block_size: their quantization blocks (None: the defaults).
      compute_s: a step's seconds without the exchange between nodes; None: the timed step
        less ByteGrad's exchange on the link.

    Returns:
      A ``DiLoCoEstimate``: ``diloco_step_s``, ``speedup``, ``pays``, ``verdict()``.

    Raises:
      ValueError: for a link that is not a positive number, fewer than 2 nodes or H < 1.

    Examples:
      >>> from jax_bytegrad._src.algorithms.diloco.estimate import estimate_diloco
      >>> e = estimate_diloco(2.5, params=25_000_000, nodes=2, link_bytes_per_s=1.25e7)
      >>> round(e.exchange_s, 2), round(e.diloco_step_s, 3), e.pays   # 100 Mbit/s
      (2.02, 0.525, True)
      >>> e.background_delay, round(e.background_step_s(e.background_delay), 3)
      (5, 0.484)
      >>> estimate_diloco(0.2, params=25_000_000, nodes=2, link_bytes_per_s=1.25e10).pays
      False
    """
    check_link(link_bytes_per_s, inner_steps, "estimate_diloco")
    if nodes < 2:
        raise ValueError(f"estimate_diloco: DiLoCo averages between nodes, got nodes={nodes}")
    per = wire_bytes_per_param(bytegrad_bits, bytegrad_block_size)
    exchange_s = exchange_bytes(params, nodes, per) / link_bytes_per_s
    if compute_s is None:
        compute_s = max(bytegrad_step_s - exchange_s, 0.0)
    outer = exchange_bytes(params, nodes, wire_bytes_per_param(bits, block_size))
    return DiLoCoEstimate(
        inner_steps, bits, float(link_bytes_per_s), bytegrad_step_s, exchange_s, compute_s,
        outer / link_bytes_per_s,
    )  # fmt: skip
