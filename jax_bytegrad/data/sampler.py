"""Load-balanced sampling: every replica gets samples of similar cost at every step.

Follows Bagua's ``LoadBalancingDistributedSampler`` and ``LoadBalancingDistributedBatchSampler``
(Gan et al., VLDB 2022). Samples are sorted by a complexity (sequence length, say), with
optional noise of scale ``random_level`` drawn from ``seed + epoch``; the sorted list is cut
into consecutive groups of ``num_replicas``, and the group order is shuffled. Step ``k`` of
every replica then takes one sample from group ``k``: similar costs, so no replica waits long
for the slowest one. In a JAX program the wait is padding: one compiled step runs every
device on the same padded shape, so the longest sequence of the step sets every device's cost.

A replica is one slice of the global batch, which is one device of the ("node", "local")
mesh: ``replica_ranks(mesh)`` lists the replicas this process feeds, in the order that
``jax_bytegrad.sharding.shard_batch`` places its rows.

Differences from Bagua, on purpose:
- Without ``drop_last``, the last short group is padded with its sorted neighbours (the
  group is ``sorted[n - R:]``, repeating ``R - n % R`` samples), so it stays balanced; Bagua
  wraps around to the cheapest samples.
- With ``drop_last`` and ``shuffle``, the ``n % R`` dropped samples are drawn at random each
  epoch; Bagua drops the most complex ones, the same ones every epoch at ``random_level=0``.
- The noise is uniform on ``[0, random_level * (max - min))``, real rather than integer.
- The batch sampler pads a short replica's batch list by repeating its batches cyclically,
  and ``drop_last`` truncates; Bagua's padding slice with a negative length lengthens the
  lists instead. With ``shuffle``, the batch order is shuffled, the same way on every replica.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jax_bytegrad._src import checks
from jax_bytegrad._src.axes import LOCAL_AXIS, NODE_AXIS


def replica_ranks(
    mesh, *, per_device: int = 1, node_axis: str = NODE_AXIS, local_axis: str = LOCAL_AXIS
) -> range:
    """The replicas this process feeds, in ``shard_batch``'s row order.

    ``shard_batch`` splits the global batch over the devices in (node, local) order, and a
    process passes only the rows of its own devices. With ``per_device=1`` a replica is a
    device's slice; with ``per_device=B`` a replica is one row of a global batch of ``B``
    rows per device (the sampler then balances every row of a step, which is what padding
    in a single SPMD program needs; see docs/data.md).

    Args:
      mesh: from ``jax_bytegrad.make_mesh``.
      per_device: replicas per device.
      node_axis: the mesh axis between nodes.
      local_axis: the mesh axis within a node.

    Returns:
      A ``range`` of replica ranks, ``per_device`` times this process's device count long.

    Raises:
      ValueError: for a mesh without the axes, or one where this process's devices are not
        one run of consecutive slices (``make_mesh`` never builds such a mesh).

    Examples:
      >>> import jax_bytegrad
      >>> from jax_bytegrad.data import replica_ranks
      >>> replica_ranks(jax_bytegrad.make_mesh(1, 1))
      range(0, 1)
      >>> replica_ranks(jax_bytegrad.make_mesh(1, 1), per_device=4)
      range(0, 4)
    """
    import jax

    per_device = checks.integer(per_device, "per_device", "replica_ranks")
    checks.mesh_axes(mesh, node_axis, local_axis, "replica_ranks")
    grid = np.moveaxis(
        mesh.devices,
        (mesh.axis_names.index(node_axis), mesh.axis_names.index(local_axis)),
        (0, 1),
    )
    grid = grid.reshape(grid.shape[0] * grid.shape[1], -1)[:, 0]
    mine = [i for i, d in enumerate(grid) if d.process_index == jax.process_index()]
    if not mine or mine != list(range(mine[0], mine[0] + len(mine))):
        raise ValueError(
            f"replica_ranks: this process's devices are at batch slices {mine}, not one "
            "consecutive run; build the mesh with jax_bytegrad.make_mesh"
        )
    return range(mine[0] * per_device, (mine[-1] + 1) * per_device)


class LoadBalancingSampler:
    """Bagua's load-balanced distributed sampler, for a plain loop, JAX devices and grain.

    Args:
      dataset: the samples (``len`` and ``[i]``); read once, by ``complexity_fn``.
      complexity_fn: a sample's cost, a real number (its length, say).
      num_replicas: how many slices each step is split into (devices of the mesh).
      rank: the replica ``__iter__`` serves; ``indices(rank)`` and ``local_batches`` serve
        any.
      shuffle: shuffle the group order (and draw the noise) from ``seed + epoch``.
      seed: the same on every process.
      drop_last: drop ``len(dataset) % num_replicas`` samples instead of padding.
      random_level: in [0, 1]; 0 balances best, 1 adds noise as wide as the complexity range.

    Raises:
      ValueError: for an empty dataset, ``num_replicas < 1``, a rank outside
        ``[0, num_replicas)``, ``random_level`` outside [0, 1], a non-finite complexity,
        or ``drop_last`` with fewer samples than replicas.

    Examples:
      >>> s = LoadBalancingSampler([5, 1, 4, 2, 3, 6], lambda x: x, num_replicas=2, seed=0)
      >>> order = s.order()  # row k: the samples of step k, one per replica
      >>> [sorted(int(s.dataset[i]) for i in row) for row in order]  # doctest: +SKIP
      [[3, 4], [1, 2], [5, 6]]
      >>> sorted(np.concatenate([s.indices(0), s.indices(1)]).tolist())
      [0, 1, 2, 3, 4, 5]
    """

    def __init__(
        self,
        dataset: Sequence,
        complexity_fn: Callable[[Any], float],
        num_replicas: int,
        rank: int = 0,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0.0,
    ):
        num_replicas = checks.integer(num_replicas, "num_replicas", "LoadBalancingSampler")
        if (
            isinstance(rank, bool)
            or not isinstance(rank, int | np.integer)
            or not (0 <= rank < num_replicas)
        ):
            raise ValueError(
                f"LoadBalancingSampler: rank must be an int in [0, {num_replicas}), got {rank!r}"
            )
        if (
            isinstance(random_level, bool)
            or not isinstance(random_level, int | float)
            or not (0.0 <= random_level <= 1.0)
        ):
            raise ValueError(
                f"LoadBalancingSampler: random_level must be a number in [0, 1], got "
                f"{random_level!r}; 0 balances best, 1 adds the most noise"
            )
        seed = checks.integer(seed, "seed", "LoadBalancingSampler", minimum=0)
        n = len(dataset)
        if n == 0:
            raise ValueError("LoadBalancingSampler: the dataset is empty")
        if drop_last and n < num_replicas:
            raise ValueError(
                f"LoadBalancingSampler: drop_last with {n} samples and {num_replicas} replicas "
                "leaves nothing; pass drop_last=False"
            )
        complexities = np.array([complexity_fn(dataset[i]) for i in range(n)], dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(complexities))
        if bad.size:
            raise ValueError(
                f"LoadBalancingSampler: complexity_fn gave {complexities[bad[0]]} for sample "
                f"{bad[0]}; it must return a finite number"
            )
        self.dataset = dataset
        self.complexities = complexities
        self.num_replicas = num_replicas
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.random_level = float(random_level)
        self.epoch = 0
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)
        self.total_size = self.num_samples * num_replicas
        self._cache: tuple[int, np.ndarray] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order ``__iter__`` and ``order()`` give (call it each epoch)."""
        self.epoch = checks.integer(epoch, "epoch", "LoadBalancingSampler.set_epoch", minimum=0)

    def __len__(self) -> int:
        return self.num_samples

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The epoch's samples, shape (num_samples, num_replicas): row k is step k's group.

        The same on every process: it depends on the complexities, ``seed`` and ``epoch``
        only. Column ``r`` is replica ``r``'s samples in order.
        """
        epoch = self.epoch if epoch is None else epoch
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n, replicas = len(self.complexities), self.num_replicas
        rng = np.random.default_rng(self.seed + epoch)
        keys = self.complexities
        if self.shuffle and self.random_level > 0:
            spread = float(keys.max() - keys.min())
            keys = keys + rng.uniform(0.0, self.random_level * spread, size=n)
        ranked = np.argsort(keys, kind="stable")
        extra = n % replicas
        if self.drop_last and extra:
            if self.shuffle:
                ranked = np.delete(ranked, rng.choice(n, size=extra, replace=False))
            else:
                ranked = ranked[: n - extra]
        elif extra:
            tail = ranked[n - replicas :] if n >= replicas else np.resize(ranked, replicas)
            ranked = np.concatenate([ranked[: n - extra], tail])
        groups = ranked.reshape(self.num_samples, replicas)
        if self.shuffle:
            groups = groups[rng.permutation(self.num_samples)]
        self._cache = (epoch, groups)
        return groups

    def indices(self, rank: int | None = None) -> np.ndarray:
        """Replica ``rank``'s samples this epoch (default: this sampler's rank)."""
        return self.order()[:, self.rank if rank is None else rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def _steps(self, batch_size: int, drop_remainder: bool) -> int:
        return (
            self.num_samples // batch_size if drop_remainder else -(-self.num_samples // batch_size)
        )

    def _step_indices(
        self, order: np.ndarray, step: int, batch_size: int, replicas: Sequence[int]
    ) -> np.ndarray:
        rows = np.arange(step * batch_size, (step + 1) * batch_size) % self.num_samples
        return order[rows][:, list(replicas)].T.reshape(-1)

    def local_batches(
        self,
        batch_size: int,
        replicas: Sequence[int] | None = None,
        *,
        drop_remainder: bool = False,
    ) -> Iterator[np.ndarray]:
        """This epoch's per-step sample indices for ``replicas``, as ``shard_batch`` wants them.

        Each step yields ``len(replicas) * batch_size`` indices: ``batch_size`` of replica
        ``replicas[0]``, then of ``replicas[1]``, and so on. With ``replicas =
        replica_ranks(mesh)``, gather those samples and pass them to ``shard_batch``: each
        device receives its own replica's samples.

        Args:
          batch_size: samples per replica per step.
          replicas: the replicas to serve; default ``[rank]``.
          drop_remainder: drop the last step if it is short; otherwise it is completed with
            each replica's first samples of the epoch.
        """
        batch_size = checks.integer(batch_size, "batch_size", "local_batches")
        replicas = [self.rank] if replicas is None else list(replicas)
        order = self.order()
        for step in range(self._steps(batch_size, drop_remainder)):
            yield self._step_indices(order, step, batch_size, replicas)

    def grain_sampler(
        self,
        batch_size: int,
        replicas: Sequence[int] | None = None,
        *,
        num_epochs: int | None = 1,
        drop_remainder: bool = False,
    ):
        """A grain ``Sampler`` over the stream of ``local_batches``, epoch after epoch.

        Use it with ``shard_options=grain.sharding.NoSharding()``: the sampler already serves
        this process's replicas, so grain's ``Batch(len(replicas) * batch_size)`` gives the
        same local batches as ``local_batches``. Epochs count from this sampler's
        ``epoch``.
        """
        return _GrainSampler(self, batch_size, replicas, num_epochs, drop_remainder)


class _GrainSampler:
    """grain's ``Sampler`` protocol: ``__getitem__(position) -> RecordMetadata``, ``__len__``."""

    def __init__(self, sampler, batch_size, replicas, num_epochs, drop_remainder):
        self.sampler = sampler
        self.batch_size = checks.integer(batch_size, "batch_size", "grain_sampler")
        self.replicas = [sampler.rank] if replicas is None else list(replicas)
        if num_epochs is not None:
            checks.integer(num_epochs, "num_epochs", "grain_sampler")
        self.num_epochs = num_epochs
        self.first_epoch = sampler.epoch
        self.per_step = len(self.replicas) * self.batch_size
        self.per_epoch = sampler._steps(self.batch_size, drop_remainder) * self.per_step

    def __len__(self) -> int:
        import sys

        return sys.maxsize if self.num_epochs is None else self.num_epochs * self.per_epoch

    def __getitem__(self, position: int):
        from grain import RecordMetadata

        if position < 0 or position >= len(self):
            raise IndexError(f"grain_sampler: position {position} out of range {len(self)}")
        epoch, within = divmod(position, self.per_epoch)
        step, j = divmod(within, self.per_step)
        replica = self.replicas[j // self.batch_size]
        row = (step * self.batch_size + j % self.batch_size) % self.sampler.num_samples
        key = int(self.sampler.order(self.first_epoch + epoch)[row, replica])
        return RecordMetadata(index=position, record_key=key, rng=None)

    def __repr__(self) -> str:
        s = self.sampler
        return (
            f"LoadBalancingSampler.grain_sampler(n={len(s.complexities)}, num_replicas="
            f"{s.num_replicas}, seed={s.seed}, random_level={s.random_level}, batch_size="
            f"{self.batch_size}, replicas={self.replicas}, num_epochs={self.num_epochs})"
        )


def token_budget_batches(complexities: Sequence[float], max_tokens: float) -> Callable:
    """A ``batch_fn`` that sorts a replica's samples and packs them under a padded budget.

    A batch takes samples in increasing complexity while ``rows * longest <= max_tokens``:
    short sequences go many to a batch, long ones few, and each batch pads to little.

    Args:
      complexities: each sample's cost (``sampler.complexities``).
      max_tokens: the padded size a batch may reach; a single longer sample is a batch alone.

    Returns:
      ``batch_fn(indices) -> list[list[int]]``.
    """
    costs = np.asarray(complexities, dtype=np.float64)
    if not max_tokens > 0:
        raise ValueError(f"token_budget_batches: max_tokens must be positive, got {max_tokens!r}")

    def batch_fn(indices):
        batches, current = [], []
        for i in sorted(indices, key=lambda i: (costs[i], i)):
            if current and (len(current) + 1) * costs[i] > max_tokens:
                batches.append(current)
                current = []
            current.append(int(i))
        if current:
            batches.append(current)
        return batches

    return batch_fn


class LoadBalancingBatchSampler:
    """Variable-size batches from a ``LoadBalancingSampler``, the same count on every replica.

    ``batch_fn`` cuts each replica's samples into batches (``token_budget_batches`` groups
    similar lengths). Replicas with fewer batches repeat theirs cyclically up to the most
    any replica has; with ``drop_last``, all stop at the fewest.

    Args:
      sampler: a ``LoadBalancingSampler`` built with ``drop_last=False``.
      batch_fn: ``batch_fn(indices) -> list[list[int]]``.
      drop_last: truncate to the fewest batches instead of padding to the most.

    Raises:
      ValueError: for another kind of sampler, a sampler with ``drop_last``, or a
        ``batch_fn`` that returns no batch or an empty one.
    """

    def __init__(
        self, sampler: LoadBalancingSampler, batch_fn: Callable, *, drop_last: bool = False
    ):
        if not isinstance(sampler, LoadBalancingSampler):
            raise ValueError(
                f"LoadBalancingBatchSampler: sampler must be a LoadBalancingSampler, got "
                f"{type(sampler).__name__}"
            )
        if sampler.drop_last:
            raise ValueError(
                "LoadBalancingBatchSampler: build the sampler with drop_last=False; this "
                "sampler's own drop_last decides what happens to uneven batch counts"
            )
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = bool(drop_last)
        self._cache: tuple[int, list] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def all_batches(self) -> list[list[list[int]]]:
        """Every replica's batches this epoch: ``all_batches()[replica][step]``."""
        epoch = self.sampler.epoch
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        order = self.sampler.order()
        per_replica = []
        for replica in range(self.sampler.num_replicas):
            batches = [list(b) for b in self.batch_fn(order[:, replica].tolist())]
            if not batches or not all(batches):
                raise ValueError(
                    f"LoadBalancingBatchSampler: batch_fn returned {len(batches)} batches for "
                    f"replica {replica}, some empty; it must return non-empty batches"
                )
            per_replica.append(batches)
        counts = [len(b) for b in per_replica]
        total = min(counts) if self.drop_last else max(counts)
        per_replica = [[b[i % len(b)] for i in range(total)] for b in per_replica]
        if self.sampler.shuffle:
            perm = np.random.default_rng([self.sampler.seed + epoch, 1]).permutation(total)
            per_replica = [[b[i] for i in perm] for b in per_replica]
        self._cache = (epoch, per_replica)
        return per_replica

    def __len__(self) -> int:
        return len(self.all_batches()[0])

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.all_batches()[self.sampler.rank])

    def local_batches(self, replicas: Sequence[int]) -> Iterator[list[list[int]]]:
        """Per step, the batch of each of ``replicas`` (e.g. ``replica_ranks(mesh)``)."""
        batches = self.all_batches()
        for step in range(len(batches[0])):
            yield [batches[r][step] for r in replicas]
