"""QAdam: Adam with a frozen second moment and 8- or 4-bit compressed momentum.

Follows Bagua's QAdam (Gan et al., "Bagua: Scaling up Distributed Learning with System
Relaxations", VLDB 2022), which builds on 1-bit Adam (Tang et al., "1-bit Adam:
Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021).
The optional second-moment refresh follows 0/1 Adam (Lu et al., "Maximizing
Communication Efficiency for Large-scale Training via 0/1 Adam", ICLR 2023).
Per replica, inside ``jax.shard_map``, with the step ``t`` counted from 1:

    warm-up (t <= warmup_steps), plain Adam on the float32 mean gradient:
        g = full-precision mean of the per-device gradients
        m = b1 m + (1 - b1) g,    v = b2 v + (1 - b2) g^2
        update = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    compression (t > warmup_steps), only the momentum is communicated, 8-bit (or 4-bit):
        m = compressed_mean(b1 m + (1 - b1) g_local)
        v and its bias correction stay as they were at t = warmup_steps
        update = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^warmup_steps)) + eps)

    refresh (optional: nu_refresh_interval=k, nu_refresh_growth=g), at the steps
    t = warmup_steps + k (1 + g + ... + g^j), j = 0, 1, ...: the warm-up step again,
        float32 mean gradient into m and v, and v's correction is 1 - b2^(number of
        updates v has had): warmup_steps plus the refreshes so far, this one included.

Beyond Bagua, ``bits=4`` sends 4-bit codes and ``error_feedback=True`` keeps, per device,
what the momentum's two compressions left unsent and adds it back at the next compressed
step (1-bit Adam's worker and server errors), exactly as ``bytegrad`` does for gradients:
the same ``collectives.compressed_mean`` with residuals in the state. Warm-up and refresh
steps send float32 and carry the residuals over untouched.

Both phases live in one compiled program (``lax.cond`` on the step count: a refresh is a
step that takes the warm-up branch), so neither the switch nor a refresh recompiles or
changes the state's shapes.
"""

import itertools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jax_bytegrad._src import checks as _checks
from jax_bytegrad._src import collectives
from jax_bytegrad._src.quantization import Bits, Implementation, check_block_size
from jax_bytegrad._src.transforms import check_error_feedback, check_sync_args, mesh_residuals

_INT32_MAX = int(np.iinfo(np.int32).max)
# Longest refresh schedule compiled into a step: growth 1.001 from k = 1 needs ~15,000.
_MAX_REFRESH_TABLE = 1 << 16


def _check_decay(value, name: str, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise ValueError(f"{where}: {name} must be a float in [0, 1), got {value!r}")


def _check_non_negative(value, name: str, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0.0:
        raise ValueError(f"{where}: {name} must be a float >= 0, got {value!r}")


def _check_warmup_steps(warmup_steps, where: str) -> None:
    if (
        isinstance(warmup_steps, bool)
        or not isinstance(warmup_steps, numbers.Integral)
        or not 1 <= warmup_steps <= _INT32_MAX
    ):
        raise ValueError(
            f"{where}: warmup_steps must be an int in [1, {_INT32_MAX}], got {warmup_steps!r}; "
            "QAdam freezes the second moment after warm-up, so it needs at least one full "
            "precision step (15-25% of the run is a good default)"
        )


def _check_refresh(interval, growth, where: str) -> None:
    if interval is not None and (
        isinstance(interval, bool)
        or not isinstance(interval, numbers.Integral)
        or not 1 <= interval <= _INT32_MAX
    ):
        raise ValueError(
            f"{where}: nu_refresh_interval must be None or an int in [1, {_INT32_MAX}], got "
            f"{interval!r}; it is the number of compressed steps after warm-up before the "
            "first float32 refresh of the second moment (None: never refresh)"
        )
    if (
        isinstance(growth, bool)
        or not isinstance(growth, numbers.Real)
        or not 1.0 <= growth < float("inf")
    ):
        raise ValueError(
            f"{where}: nu_refresh_growth must be a finite float >= 1, got {growth!r}; each "
            "gap between refreshes is this many times the previous one (1.0: a fixed interval)"
        )


def _schedule(warmup_steps: int, interval: int, growth: float):
    """Yields the refresh steps ``warmup_steps + round(k (1 + g + ... + g^j))``, forever."""
    offset, gap = 0.0, float(interval)
    while True:
        offset += gap
        # Round half up on the running sum: it grows by >= 1 per refresh, so the steps
        # strictly increase; integer k and g give the exact sums.
        yield warmup_steps + math.floor(offset + 0.5)
        gap *= growth


def _refresh_counter(warmup_steps: int, interval: int, growth: float, where: str):
    """``t -> (is t a refresh step, refreshes up to and including t)``, traced on device.

    A fixed interval is a modulus; a growing one looks ``t`` up in the schedule up to
    int32's end, computed here once (a few dozen steps for g = 2) and compiled in as a
    constant, so no step's program depends on where the run stands. None when no refresh
    fits in int32 steps.
    """
    if growth == 1.0:

        def count(t):
            since = jnp.maximum(t - warmup_steps, 0)
            return (since > 0) & (since % interval == 0), since // interval

        return count

    table = np.fromiter(
        itertools.islice(
            itertools.takewhile(
                lambda step: step <= _INT32_MAX, _schedule(warmup_steps, interval, growth)
            ),
            _MAX_REFRESH_TABLE + 1,
        ),
        np.int32,
    )
    if table.size > _MAX_REFRESH_TABLE:
        raise ValueError(
            f"{where}: nu_refresh_growth={growth!r} with nu_refresh_interval={interval!r} "
            f"schedules more than {_MAX_REFRESH_TABLE} refreshes; pass "
            "nu_refresh_growth=1.0 for a fixed interval, or a growth of at least 1.001"
        )
    if table.size == 0:
        return None  # the first refresh would fall beyond int32's last step

    def count(t):
        steps = jnp.asarray(table)  # a constant of the traced program
        done = jnp.searchsorted(steps, t, side="right").astype(jnp.int32)
        last = steps[jnp.maximum(done - 1, 0)]
        return (done > 0) & (last == t), done

    return count


def _bias_correction(moment, decay: float, count: jax.Array):
    """``moment / (1 - decay^count)`` as ``optax.tree.bias_correction`` computes it.

    The power is taken in float32 (then the division in the moment's dtype), written out
    so that it also traces under ``jax_numpy_dtype_promotion="strict"``.
    """
    correction = 1 - jnp.power(jnp.float32(decay), count.astype(jnp.float32))
    return jax.tree.map(lambda t: t / correction.astype(t.dtype), moment)


def _check_per_device(updates, node_axis: str, local_axis: str, where: str) -> None:
    """Raises unless every float gradient is typed as varying over both mesh axes."""
    axes = {node_axis, local_axis}
    averaged = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(updates)
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)
        and not axes <= _checks.varying_axes(leaf)
    ]
    if averaged:
        raise ValueError(
            f"{where}: the gradients {', '.join(averaged[:3])} are not per-device: they are "
            f"typed as identical across the mesh axes ({node_axis!r}, {local_axis!r}), so "
            "something already averaged them. QAdam averages the gradients itself (float32 "
            "during warm-up, the 8-bit momentum after it), so chaining it after bytegrad() or "
            "gradient_allreduce() would communicate twice. Pass the raw per-device gradients: "
            "use jax_bytegrad.qadam(...) as the whole optimizer, e.g. "
            "data_parallel_step(loss_fn, qadam(...), mesh). (With shard_map(check_vma=False) "
            "the gradients carry no such typing; use check_vma=True.)"
        )


class ScaleByQAdamState(NamedTuple):
    """State of ``scale_by_qadam``, identical on every replica.

    Attributes:
      count: int32 scalar, the number of steps taken; step ``t = count + 1`` is a warm-up
        step while ``t <= warmup_steps``.
      mu: first moment, like the params; after warm-up the compressed mean of the
        devices' local momenta (the float32 one on a refresh step).
      nu: second moment, like the params; frozen from step ``warmup_steps`` on, except on
        refresh steps. How many updates it has had follows from ``count``.
      residuals: error feedback's residuals of the momentum exchange, as in
        ``ByteGradState``: one (send, mean) pair of float32 vectors per bucket, every
        device's own in mesh order (sharded over ("node", "local"); see
        ``transforms.state_specs``); empty without error feedback. Unlike the rest of the
        state they differ between devices.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    residuals: tuple = ()


def refresh_steps(
    warmup_steps: int, nu_refresh_interval: int, nu_refresh_growth: float, num_steps: int
) -> list[int]:
    """The steps ``t <= num_steps`` (counted from 1) on which QAdam refreshes its ``v``.

    They are ``warmup_steps + round(k (1 + g + ... + g^j))`` for ``j = 0, 1, ...``, with
    ``k = nu_refresh_interval`` and ``g = nu_refresh_growth``: the first ``k`` steps after
    warm-up, then gaps ``k g``, ``k g^2``, ... (halves round up). Every gap is at least 1.

    Args:
      warmup_steps: QAdam's warm-up length.
      nu_refresh_interval: the first gap, an int >= 1.
      nu_refresh_growth: each gap over the previous one, a float >= 1.
      num_steps: the last step to list.

    Returns:
      The refresh steps, ascending.

    Raises:
      ValueError: for a bad interval or growth.

    Examples:
      >>> refresh_steps(10, 4, 2.0, 60)
      [14, 22, 38]
    """
    where = "refresh_steps"
    _check_warmup_steps(warmup_steps, where)
    _check_refresh(nu_refresh_interval, nu_refresh_growth, where)
    return list(
        itertools.takewhile(
            lambda step: step <= num_steps,
            _schedule(warmup_steps, nu_refresh_interval, nu_refresh_growth),
        )
    )


def scale_by_qadam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    warmup_steps: int,
    nu_refresh_interval: int | None = None,
    nu_refresh_growth: float = 2.0,
    node_axis: str = "node",
    local_axis: str = "local",
    hierarchical: bool = True,
    bits: Bits = 8,
    error_feedback: bool = False,
    mesh: Mesh | None = None,
    block_size: int | None = None,
    bucket_bytes: int | None = collectives.DEFAULT_BUCKET_BYTES,
    message_bytes: int | None = collectives.DEFAULT_MESSAGE_BYTES,
    implementation: Implementation | None = None,
) -> optax.GradientTransformation:
    """Rescales per-device gradients by QAdam, doing its own communication.

    For ``warmup_steps`` steps it is Adam on the float32 mean gradient. After that the
    second moment and its bias correction are frozen, and only the momentum crosses the
    network: each device updates the momentum with its own gradient, and the momenta are
    averaged with ``compressed_mean`` (8-bit between nodes, about 4x fewer bytes than a
    float32 all-reduce; 4-bit with ``bits=4``, about 8x fewer). With
    ``nu_refresh_interval``, a few later steps (ever further apart, see ``refresh_steps``)
    are warm-up steps again: float32 mean gradient, and the second moment updated as Adam
    would. Every replica ends the step with bit-identical updates and state (but for the
    error-feedback residuals, which are each device's own). It must receive per-device
    gradients inside ``jax.shard_map``: put it first in the chain, with no ``bytegrad()``
    or ``gradient_allreduce()`` before it.

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment (during warm-up).
      eps: added to the square root of the bias-corrected second moment.
      warmup_steps: steps of plain Adam before compression starts, >= 1. The frozen second
        moment must have settled by then; 15-25% of the run is a good default.
      nu_refresh_interval: None (default) never updates the second moment after warm-up.
        An int k >= 1 refreshes it, in float32, k steps after warm-up and then at gaps
        growing by ``nu_refresh_growth``.
      nu_refresh_growth: each gap between refreshes over the previous one, >= 1 (1.0: a
        refresh every k steps).
      node_axis: mesh axis between nodes (slow links): the compressed hop.
      local_axis: mesh axis within a node (fast links): float32.
      hierarchical: reduce within each node before the inter-node hop (default), for the
        float32 warm-up mean and the compressed momentum alike; False reduces over both
        axes as one group.
      bits: bits per code of the momentum between nodes, 8 or 4 (packed two per byte:
        half the bytes; see docs/qadam.md for what it costs in accuracy).
      error_feedback: keep each device's compression errors of the momentum and add them
        back at the next compressed step, as ``bytegrad(error_feedback=True)`` does. Costs
        (1 + 1/n) N/L float32 values per device (N parameters, n nodes of L devices,
        hierarchical). Needs ``mesh``.
      mesh: the mesh the step runs on; error feedback sizes the residuals by it.
      block_size: elements per quantization block, a power of two >= 128 (>= 256 for 4
        bits); None for ``DEFAULT_BLOCK_SIZES[bits]``.
      bucket_bytes: float32 bytes per communication bucket; None for a single bucket.
      message_bytes: bytes per message of the exchanges between nodes; None for one message
        per peer. It changes the speed, never the result.
      implementation: quantization kernels: ``"xla"``, ``"pallas"`` or None for the best.

    Returns:
      An ``optax.GradientTransformation`` whose state is a ``ScaleByQAdamState``.

    Raises:
      ValueError: for bad arguments (here), error feedback without ``mesh``; at trace
        time, outside ``shard_map``, for an axis the mesh lacks, or for gradients that are
        already averaged across devices.

    Examples:
      >>> import optax, jax_bytegrad
      >>> tx = optax.chain(jax_bytegrad.scale_by_qadam(warmup_steps=100), optax.scale(-1e-3))

    References:
      Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
      Convergence Speed", ICML 2021.
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
      Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1
      Adam", ICLR 2023.
    """
    where = "scale_by_qadam"
    _check_decay(b1, "b1", where)
    _check_decay(b2, "b2", where)
    _check_non_negative(eps, "eps", where)
    _check_warmup_steps(warmup_steps, where)
    _check_refresh(nu_refresh_interval, nu_refresh_growth, where)
    check_sync_args(
        where,
        node_axis=node_axis,
        local_axis=local_axis,
        hierarchical=hierarchical,
        block_size=block_size,
        bucket_bytes=bucket_bytes,
        message_bytes=message_bytes,
        implementation=implementation,
        bits=bits,
    )
    block_size = check_block_size(block_size, where, bits)
    mesh_shape = check_error_feedback(error_feedback, mesh, node_axis, local_axis, where)
    # What the momentum exchange is sized and run with; the residuals must match it.
    layout = dict(
        hierarchical=hierarchical, bits=bits, block_size=block_size, bucket_bytes=bucket_bytes
    )

    def init_fn(params):
        return ScaleByQAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params),
            residuals=mesh_residuals(params, mesh_shape, **layout) if error_feedback else (),
        )

    refresh = (
        None
        if nu_refresh_interval is None
        else _refresh_counter(warmup_steps, nu_refresh_interval, float(nu_refresh_growth), where)
    )

    def full_precision(updates, mu, nu, residuals):
        grads = collectives.full_precision_mean(
            updates, node_axis=node_axis, local_axis=local_axis, hierarchical=hierarchical
        )
        mu = optax.tree.update_moment(grads, mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, nu, b2, 2)
        return mu, nu, residuals

    def compressed(updates, mu, nu, residuals):
        local_mu = optax.tree.update_moment(updates, mu, b1, 1)
        mu = collectives.compressed_mean(
            local_mu,
            node_axis=node_axis,
            local_axis=local_axis,
            message_bytes=message_bytes,
            implementation=implementation,
            residuals=residuals if error_feedback else None,
            **layout,
        )
        if error_feedback:
            mu, residuals = mu
        return mu, nu, residuals

    def update_fn(updates, state, params=None):
        del params
        collectives.axis_sizes(node_axis, local_axis, where)
        _check_per_device(updates, node_axis, local_axis, where)
        count_inc = optax.safe_increment(state.count)
        full = count_inc <= warmup_steps
        # v froze at step warmup_steps, and so does its correction. Bagua keeps raising the
        # correction with t, which inflates the step by up to 1/sqrt(1 - b2^warmup_steps).
        nu_updates = jnp.minimum(count_inc, warmup_steps)
        if refresh is not None:
            # A refresh is a warm-up step (the same branch, so no float32 collective is
            # added to the program), and v's correction counts the updates v has had.
            is_refresh, refreshes = refresh(count_inc)
            full = full | is_refresh
            nu_updates = nu_updates + refreshes
        mu, nu, residuals = jax.lax.cond(
            full, full_precision, compressed, updates, state.mu, state.nu, state.residuals
        )
        mu_hat = _bias_correction(mu, b1, count_inc)
        nu_hat = _bias_correction(nu, b2, nu_updates)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        nu = optax.tree.cast_like(nu, state.nu)
        return updates, ScaleByQAdamState(count=count_inc, mu=mu, nu=nu, residuals=residuals)

    return optax.GradientTransformation(init_fn, update_fn)


def qadam(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    *,
    warmup_steps: int,
    nu_refresh_interval: int | None = None,
    nu_refresh_growth: float = 2.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    node_axis: str = "node",
    local_axis: str = "local",
    hierarchical: bool = True,
    bits: Bits = 8,
    error_feedback: bool = False,
    mesh: Mesh | None = None,
    block_size: int | None = None,
    bucket_bytes: int | None = collectives.DEFAULT_BUCKET_BYTES,
    message_bytes: int | None = collectives.DEFAULT_MESSAGE_BYTES,
    implementation: Implementation | None = None,
) -> optax.GradientTransformation:
    """QAdam: Adam whose momentum crosses the network 8-bit (or 4-bit) after a float32 warm-up.

    ``chain(scale_by_qadam, add_decayed_weights, scale_by_learning_rate)``. It averages
    the gradients itself, so hand it per-device gradients:
    ``data_parallel_step(loss_fn, qadam(...), mesh)``. Weight decay is decoupled (as in
    AdamW) and applies in both phases.

    Args:
      learning_rate: a float or an optax schedule ``step -> lr``.
      warmup_steps: steps of plain float32 Adam before compression starts, >= 1; 15-25%
        of the run is a good default (see ``scale_by_qadam``).
      nu_refresh_interval: None (default): the second moment stays frozen after warm-up.
        An int k >= 1: float32 refreshes of it, k steps after warm-up and then at gaps
        growing by ``nu_refresh_growth`` (see ``refresh_steps``).
      nu_refresh_growth: each gap between refreshes over the previous one, >= 1.
      b1: decay of the first moment.
      b2: decay of the second moment (during warm-up).
      eps: added to the square root of the bias-corrected second moment.
      weight_decay: decoupled weight decay, >= 0; 0 leaves it out of the chain.
      mask: which params to decay, as for ``optax.add_decayed_weights``.
      node_axis: mesh axis between nodes (slow links): the compressed hop.
      local_axis: mesh axis within a node (fast links): float32.
      hierarchical: reduce within each node before the inter-node hop (default).
      bits: bits per code of the momentum between nodes, 8 or 4.
      error_feedback: keep and re-add each device's compression errors of the momentum
        (see ``scale_by_qadam``); needs ``mesh``.
      mesh: the mesh the step runs on; error feedback sizes the residuals by it.
      block_size: elements per quantization block, a power of two >= 128 (>= 256 for 4
        bits); None for the default of ``bits``.
      bucket_bytes: float32 bytes per communication bucket; None for a single bucket.
      message_bytes: bytes per message of the exchanges between nodes; None for one message
        per peer. It changes the speed, never the result.
      implementation: quantization kernels: ``"xla"``, ``"pallas"`` or None for the best.

    Returns:
      An ``optax.GradientTransformation``; its state's first element is a
      ``ScaleByQAdamState``.

    Raises:
      ValueError: for bad arguments (here), error feedback without ``mesh``; at trace
        time, outside ``shard_map``, for an axis the mesh lacks, or for gradients that are
        already averaged across devices.

    Examples:
      >>> import jax.numpy as jnp, jax_bytegrad
      >>> from jax_bytegrad import qadam
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> tx = qadam(1e-2, warmup_steps=2)
      >>> step = jax_bytegrad.data_parallel_step(
      ...     lambda w, b: jnp.mean((b * w) ** 2), tx, mesh, donate=False)
      >>> w, state = jnp.ones(4), tx.init(jnp.ones(4))
      >>> for _ in range(3):
      ...     w, state, loss = step(w, state, jnp.ones((8, 4)))
      >>> int(state[0].count)
      3

    References:
      Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
      Convergence Speed", ICML 2021.
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
      Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1
      Adam", ICLR 2023.
    """
    where = "qadam"
    if not callable(learning_rate) and (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, numbers.Real)
        or not learning_rate >= 0.0
    ):
        raise ValueError(
            f"{where}: learning_rate must be a float >= 0 or a schedule, got {learning_rate!r}"
        )
    _check_non_negative(weight_decay, "weight_decay", where)
    transforms = [
        scale_by_qadam(
            b1,
            b2,
            eps,
            warmup_steps=warmup_steps,
            nu_refresh_interval=nu_refresh_interval,
            nu_refresh_growth=nu_refresh_growth,
            node_axis=node_axis,
            local_axis=local_axis,
            hierarchical=hierarchical,
            bits=bits,
            error_feedback=error_feedback,
            mesh=mesh,
            block_size=block_size,
            bucket_bytes=bucket_bytes,
            message_bytes=message_bytes,
            implementation=implementation,
        )
    ]
    if weight_decay:
        transforms.append(optax.add_decayed_weights(weight_decay, mask))
    transforms.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*transforms)
