"""What a compiled step sends: bytes per collective kind, mesh axis and dtype, read from HLO."""

from jax_bytegrad._src.stats import CollectiveTraffic as CollectiveTraffic
from jax_bytegrad._src.stats import CommunicationStats as CommunicationStats
from jax_bytegrad._src.stats import HloInstruction as HloInstruction
from jax_bytegrad._src.stats import communication_stats as communication_stats
from jax_bytegrad._src.stats import hlo_instructions as hlo_instructions

__all__ = [
    "CollectiveTraffic",
    "CommunicationStats",
    "HloInstruction",
    "communication_stats",
    "hlo_instructions",
]
