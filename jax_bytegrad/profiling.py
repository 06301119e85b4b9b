"""What a compiled step sends: bytes per collective kind, mesh axis and dtype, read from HLO."""

from jax_bytegrad._src.hlo import HloInstruction as HloInstruction
from jax_bytegrad._src.hlo import array_shapes as array_shapes
from jax_bytegrad._src.hlo import hlo_instructions as hlo_instructions
from jax_bytegrad._src.stats import CollectiveTraffic as CollectiveTraffic
from jax_bytegrad._src.stats import CommunicationStats as CommunicationStats
from jax_bytegrad._src.stats import communication_stats as communication_stats

__all__ = [
    "CollectiveTraffic",
    "CommunicationStats",
    "HloInstruction",
    "array_shapes",
    "communication_stats",
    "hlo_instructions",
]
