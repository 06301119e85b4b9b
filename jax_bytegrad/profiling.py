"""What a compiled step sends and holds: bytes per collective kind, mesh axis and dtype, read
from HLO; the memory each device needs, from XLA's analysis; and ``HEADER_WIDTH``, the float32
values of each block's header on the wire."""

from jax_bytegrad._src.codecs import HEADER_WIDTH as HEADER_WIDTH
from jax_bytegrad._src.inspection.hlo import HloInstruction as HloInstruction
from jax_bytegrad._src.inspection.hlo import array_shapes as array_shapes
from jax_bytegrad._src.inspection.hlo import hlo_instructions as hlo_instructions
from jax_bytegrad._src.inspection.memory import MemoryStats as MemoryStats
from jax_bytegrad._src.inspection.memory import memory_stats as memory_stats
from jax_bytegrad._src.inspection.overlap import Exchange as Exchange
from jax_bytegrad._src.inspection.overlap import Overlap as Overlap
from jax_bytegrad._src.inspection.stats import CollectiveTraffic as CollectiveTraffic
from jax_bytegrad._src.inspection.stats import CommunicationStats as CommunicationStats
from jax_bytegrad._src.inspection.stats import communication_stats as communication_stats

__all__ = [
    "HEADER_WIDTH",
    "CollectiveTraffic",
    "CommunicationStats",
    "Exchange",
    "HloInstruction",
    "MemoryStats",
    "Overlap",
    "array_shapes",
    "communication_stats",
    "hlo_instructions",
    "memory_stats",
]
