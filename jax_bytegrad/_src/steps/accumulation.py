"""Gradient accumulation in a data-parallel step: the exchange between nodes once per k micro-steps.

Follows ``optax.MultiSteps`` (the gradient accumulation of large-batch training; Goyal et al.,
"Accurate, Large Minibatch SGD", 2017): the gradients of k micro-steps are averaged (or
summed) and the optimizer runs once on the result, the step of a k times larger batch. Inside a
``shard_map`` of one's own, ``optax.MultiSteps`` runs its inner optimizer, and so the sync
between nodes, on every micro-step, and keeps the k-th result. A train step given one picks a
program per micro-step on the host instead:

    accumulate (micro-steps i = 0 .. k-2): acc = acc + (g - acc) / (i + 1)     no exchange
    apply (micro-step k - 1):  g = acc + (g - acc) / k;  the optimizer on g;  acc = 0

(``acc + g`` with ``use_grad_mean=False``). The accumulator is each device's own, in
``StepState.extra["accumulated"]``: each device's gradient, or with ``shard=`` its block of
its node's sum (a reduce-scatter within the node each micro-step, as ZeRO-2 accumulates), so
the accumulator is split within the node too. Between nodes, the traffic is the optimizer's
once per k micro-steps: ``communication_stats`` gives the ``"accumulate"`` phase (nothing
between nodes) and the optimizer's, and ``phase_counts`` how often each ran.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ACCUMULATED = "accumulated"


def _default_skip(fn) -> bool:
    return getattr(fn, "__qualname__", "").startswith("MultiSteps.__init__.")


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """How a step accumulates micro-steps (from an ``optax.MultiSteps``).

    Attributes:
      every_k: ``every_k(gradient_step) -> k``, the micro-steps of each gradient step.
      mean: average the micro-steps' gradients (else sum them).
      dtype: the accumulator's dtype.
    """

    every_k: Callable[[int], int]
    mean: bool = True
    dtype: np.dtype = np.dtype(np.float32)
    # The first micro-step of each gradient step so far (grown as asked).
    _starts: list = dataclasses.field(default_factory=lambda: [0], compare=False, repr=False)

    @classmethod
    def of(cls, multi_steps: optax.MultiSteps, where: str):
        """``(inner optimizer, Accumulation)`` of an ``optax.MultiSteps``.

        Raises:
          ValueError: for a ``should_skip_update_fn``: it decides on the device which
            micro-steps count, and the step picks each micro-step's program on the host.
        """
        try:
            every_k = multi_steps._every_k_schedule
            mean = multi_steps._use_grad_mean
            dtype = multi_steps._accumulator_dtype
            skip = multi_steps._should_skip_update_fn
        except AttributeError as error:  # pragma: no cover - an optax that moved them
            raise ValueError(
                f"{where}: this optax.MultiSteps does not say how it accumulates ({error}); "
                "pass the inner optimizer and accumulate=k"
            ) from None
        if not _default_skip(skip):
            raise ValueError(
                f"{where}: optax.MultiSteps(should_skip_update_fn=...) decides on the device "
                "which micro-steps count, and this step picks each micro-step's program (with "
                "or without the exchange between nodes) on the host; wrap the inner optimizer "
                "in jax_bytegrad.skip_nonfinite(...) instead"
            )
        return multi_steps.inner_opt, cls(every_k, bool(mean), np.dtype(dtype))

    @classmethod
    def every(cls, every_k_schedule, where: str):
        """The mean over ``every_k_schedule`` micro-steps, as ``optax.MultiSteps`` takes it:
        an int k, or ``gradient_step -> k``; for a step whose optimizer is not the user's to
        wrap (``Strategy("qadam", every_k_schedule=k)``). Raises ``ValueError`` for
        anything else."""
        if callable(every_k_schedule):
            return cls(every_k_schedule)
        k = every_k_schedule
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 1:
            return cls(lambda _: int(k))
        raise ValueError(
            f"{where}: every_k_schedule must be an int >= 1 or a function of the gradient "
            f"step giving one, as optax.MultiSteps takes it; got {k!r}"
        )

    def k_of(self, gradient_step: int) -> int:
        k = int(np.asarray(self.every_k(np.int32(gradient_step))))
        if k < 1:
            raise ValueError(f"every_k_schedule({gradient_step}) gave {k}; it must be >= 1")
        return k

    def position(self, taken: int) -> tuple[int, int, int]:
        """``(gradient step, micro-step index i, k)`` of the micro-step after ``taken``."""
        starts = self._starts
        while starts[-1] <= taken:
            starts.append(starts[-1] + self.k_of(len(starts) - 1))
        g = int(np.searchsorted(starts, taken, side="right")) - 1
        return g, taken - starts[g], starts[g + 1] - starts[g]

    def fold(self, acc, grads, micro):
        """The accumulator after adding ``grads`` at micro-step index ``micro`` (a traced
        scalar), as ``optax.MultiSteps`` adds them."""

        def one(a, g):
            g = g.astype(a.dtype)
            if not self.mean:
                return a + g
            return a + (g - a) / (micro + 1).astype(a.dtype)

        return jax.tree.map(one, acc, grads)


def shapes(params, mesh: Mesh, accumulation: Accumulation, specs) -> dict:
    """``extra["accumulated"]`` as placed ``ShapeDtypeStruct``s: rows of each leaf, placed
    as ``specs`` (the placement's ``accumulator_specs``) say, as many as the devices their
    first entry splits them over (one per device, one per node where the state is split
    within it, one where it is split over every device)."""

    def rows(spec: P) -> int:
        axes = spec[0] if len(spec) else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        return int(np.prod([mesh.shape[a] for a in axes]))

    return jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(
            (rows(spec), *np.shape(x)), accumulation.dtype, sharding=NamedSharding(mesh, spec)
        ),
        params,
        specs,
    )


def zeros(abstract):
    """Placed zeros of ``shapes``'s result."""
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    return jax.jit(
        lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract),
        out_shardings=shardings,
    )()


def specs(abstract):
    """The ``shard_map`` specs of ``shapes``'s result."""
    return jax.tree.map(lambda x: x.sharding.spec, abstract)
