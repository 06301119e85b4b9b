"""Input pipelines: Bagua's cached dataset and load-balanced sampler, for grain or a plain loop.

``CachedDataset`` caches preprocessed samples in a ``SqliteStore`` (embedded, one host) or a
``RedisStore`` (servers, sharded); ``LoadBalancingSampler`` and ``LoadBalancingBatchSampler``
give every device samples of similar cost at each step. See docs/data.md.
"""

from jax_bytegrad.data.cache import CachedDataset as CachedDataset
from jax_bytegrad.data.cache import fingerprint as fingerprint
from jax_bytegrad.data.sampler import LoadBalancingBatchSampler as LoadBalancingBatchSampler
from jax_bytegrad.data.sampler import LoadBalancingSampler as LoadBalancingSampler
from jax_bytegrad.data.sampler import replica_ranks as replica_ranks
from jax_bytegrad.data.sampler import token_budget_batches as token_budget_batches
from jax_bytegrad.data.stores import RedisServer as RedisServer
from jax_bytegrad.data.stores import RedisStore as RedisStore
from jax_bytegrad.data.stores import SqliteStore as SqliteStore

__all__ = [
    "CachedDataset",
    "LoadBalancingBatchSampler",
    "LoadBalancingSampler",
    "RedisServer",
    "RedisStore",
    "SqliteStore",
    "fingerprint",
    "replica_ranks",
    "token_budget_batches",
]
