"""QAdam: Adam whose momentum crosses the network 8- or 4-bit after a float32 warm-up.

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
        m = compressed_mean(b1 m + (1 - b1) g_local),    m_hat = m / (1 - b1^t)
        second_moment="gradient" (the default at 8 bits): v = b2 v + (1 - b2) g_est^2,
            g_est = (m - b1 m_prev) / (1 - b1) from this step's and the last step's decoded
            momenta: the mean gradient, up to the exchange's error / (1 - b1); and
            update = m_hat / (sqrt(v / (1 - b2^t)) + eps)
        second_moment="momentum" (the default at 4 bits): v = b2 v + (1 - b2) m_hat^2,
            the same update
        second_moment="momentum_max": momentum's v, but v / (1 - b2^t) never falls
        second_moment="floor": v frozen, update = m_hat / (sqrt(max(v_hat, m_hat^2)) + eps)
        second_moment="frozen" (Bagua's): v and its bias correction stay as they were at
            t = warmup_steps, update = m_hat / (sqrt(v / (1 - b2^warmup_steps)) + eps)

    m (and so m_prev) is identical on every replica after the compressed mean, so every rule
    keeps the replicas identical and adds no communication. A frozen v diverges where
    gradients grow after the warm-up (steps of m / sqrt(v_frozen)). Measured in
    benchmarks/RESULTS.md, "QAdam's second moment after warm-up", with Adam's eps: at 8 bits
    the gradient rule ended within 7% of Adam's train loss on every task there, where
    m_hat^2, which misses most of the gradient's noise, gave larger steps and 0.3-1.0x
    Adam's loss; at 4 bits the recovered gradient's error, 17x larger, swells v (1.3-1.5x
    Adam's loss) and the momentum rule stays the default.

    refresh (optional: nu_refresh_interval=k, nu_refresh_growth=g), at the steps
    t = warmup_steps + k (1 + g + ... + g^j), j = 0, 1, ...: the warm-up step again,
        float32 mean gradient into m and v, and v's correction is 1 - b2^(number of
        updates v has had): t with the rules that follow the momenta; with "frozen" and "floor",
        warmup_steps plus the refreshes so far, this one included.

Beyond Bagua, ``bits=4`` sends 4-bit codes and ``error_feedback=True`` keeps, per device,
what the momentum's two compressions left unsent and adds it back at the next compressed
step (1-bit Adam's worker and server errors), exactly as ``bytegrad`` does for gradients:
the same ``collectives.compressed_mean`` with residuals in the state. Warm-up and refresh
steps send float32 and carry the residuals over untouched.

``qadam(...)`` as one optax transformation holds both phases in one compiled program
(``lax.cond`` on the step count: a refresh is a step that takes the warm-up branch), so
neither the switch nor a refresh recompiles or changes the state's shapes. Step builders that
know the step count on the host compile one program per phase instead (``phase="warmup"`` /
``"compressed"``, ``phase_schedule``; ``Strategy("qadam")`` does), so that no float32
collective or Adam pass of the other phase sits in the program.
"""

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jax_bytegrad._src import checks
from jax_bytegrad._src.algorithms.qadam.schedule import (
    Phase,
    check_refresh,
    check_warmup_steps,
    refresh_counter,
)
from jax_bytegrad._src.axes import LOCAL_AXIS, NODE_AXIS
from jax_bytegrad._src.sync import collectives, shards
from jax_bytegrad._src.sync.config import (
    DEFAULT_MESSAGE_BYTES,
    Bits,
    BucketBytes,
    Implementation,
    Residuals,
    SyncConfig,
    Wire,
    platform_of,
    sync_config,
)

SecondMoment = Literal["gradient", "momentum", "momentum_max", "floor", "frozen"]
SECOND_MOMENTS: tuple[str, ...] = ("gradient", "momentum", "momentum_max", "floor", "frozen")
# The rules whose v is updated on every compressed step (its correction is then 1 - b2^t).
_FOLLOWING = ("momentum", "gradient", "momentum_max")


def _check_second_moment(second_moment, where: str) -> None:
    if second_moment is not None and second_moment not in SECOND_MOMENTS:
        raise ValueError(
            f"{where}: second_moment={second_moment!r} is not a rule QAdam knows; use one of "
            f"{', '.join(map(repr, SECOND_MOMENTS))}, or None for the default ('gradient' "
            "at 8 bits: Adam's v on the gradient the decoded momenta imply; 'momentum' at 4 "
            "bits); 'frozen' is Bagua's"
        )


def _bias_correction(moment, decay: float, count: jax.Array):
    """``moment / (1 - decay^count)`` as ``optax.tree.bias_correction`` computes it.

    The power is taken in float32 (then the division in the moment's dtype), written out
    so that it also traces under ``jax_numpy_dtype_promotion="strict"``.
    """
    correction = 1 - jnp.power(jnp.float32(decay), count.astype(jnp.float32))
    return jax.tree.map(lambda t: t / correction.astype(t.dtype), moment)


def _follow_momentum(rule: str, nu, mu_hat, b2: float, count: jax.Array):
    """``v`` after a compressed step under ``rule``, as a raw moment corrected by ``1 - b2^t``.

    ``mu_hat`` is the same on every replica (the decoded mean), so this needs no
    communication and keeps the replicas identical. ``"momentum"`` is Adam's update with
    ``mu_hat^2`` in place of ``g^2``; ``"momentum_max"`` also keeps the bias-corrected ``v``
    from ever falling (AMSGrad's max, on ``v_hat``), so no step exceeds the frozen rule's.
    """
    ema = jax.tree.map(lambda v, m: b2 * v + (1 - b2) * (m * m).astype(v.dtype), nu, mu_hat)
    if rule == "momentum":
        return ema
    # v_hat(t-1) = v(t-1) / (1 - b2^(t-1)); rescaled to the correction of step t.
    t = count.astype(jnp.float32)
    b2_ = jnp.float32(b2)
    keep = (1 - jnp.power(b2_, t)) / (1 - jnp.power(b2_, jnp.maximum(t - 1, 1)))
    return jax.tree.map(lambda v, e: jnp.maximum(v * keep.astype(v.dtype), e), nu, ema)


def _follow_gradient(nu, mu_old, mu_new, b1: float, b2: float):
    """``v`` after a compressed step, Adam's update on the gradient the momenta imply.

    Every replica holds the same ``mu_old`` (the state's) and the same decoded ``mu_new``,
    the compressed mean of the devices' ``b1 mu_old + (1 - b1) g_local``; so
    ``(mu_new - b1 mu_old) / (1 - b1)`` is the mean gradient, up to the exchange's error
    divided by ``1 - b1``, and the same bits everywhere. That error only adds to ``v`` (a
    slightly smaller step). It is computed in float32 whatever the moments' dtype, since the
    subtraction cancels most of ``mu_new``'s leading digits.
    """
    f32 = jnp.float32

    def one(v, old, new):
        g = (new.astype(f32) - f32(b1) * old.astype(f32)) / f32(1 - b1)
        return (f32(b2) * v.astype(f32) + f32(1 - b2) * g * g).astype(v.dtype)

    return jax.tree.map(one, nu, mu_old, mu_new)


def _check_per_device(updates, node_axis: str, local_axis: str, sharded, where: str) -> None:
    """Raises unless every float gradient is typed as varying over both mesh axes (over the
    node axis, for the node sums a ``shard="params"`` step hands over: ``shards.Sharded``)."""
    axes = shards.layout_of(sharded).varying_axes(node_axis, local_axis)
    averaged = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree.leaves_with_path(updates)
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)
        and not axes <= checks.varying_axes(leaf)
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
      nu: second moment, like the params; after warm-up it follows the decoded momentum
        (``"momentum"``, ``"momentum_max"``) or the gradient two consecutive decoded momenta
        imply (``"gradient"``), or (``"frozen"``, ``"floor"``) stays as at step
        ``warmup_steps`` but on refresh steps. How many updates it has had follows from ``count``.
      residuals: error feedback's residuals of the momentum exchange, laid out as
        ``ByteGradState``'s; unlike the rest of the state they differ between devices.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    residuals: Residuals = Residuals()


def _phases(config: SyncConfig, b1: float, b2: float, second_moment: str, where: str):
    """QAdam's two steps by phase, ``{"warmup": full_precision, "compressed": compressed}``,
    each ``(updates, mu, nu, residuals, count, order, sharded) -> (mu, nu, residuals)``:
    Adam's moments of the float32 mean gradient, or the momentum updated with each device's
    own gradient and averaged compressed (``second_moment`` says what ``nu`` follows then)."""
    follows = second_moment in _FOLLOWING

    def full_precision(updates, mu, nu, residuals, count, order, sharded):
        del count
        # Leaves the step averaged inside the backward loop (``exchange_in_loop``) pass on.
        grads = collectives.sync_full_precision(updates, config, order=order, sharded=sharded)
        mu = optax.tree.update_moment(grads, mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, nu, b2, 2)
        return mu, nu, residuals

    def compressed(updates, mu, nu, residuals, count, order, sharded):
        # The momentum each device adds its gradient to (``shards.Whole.momentum_within``).
        layout = shards.layout_of(sharded)
        within = layout.run(layout.momentum_within, mu)
        local_mu = optax.tree.update_moment(updates, within, b1, 1)
        mu_old = mu
        # The layers the step exchanged inside the backward loop (``exchange_in_loop``) come
        # as the mean momentum already: they pass on as they are.
        local_mu = layout.exchanged_from(updates, local_mu)

        # Without error feedback the state's residuals are empty, as sync_mean's are.
        feedback = residuals if config.error_feedback else None
        mu, residuals = collectives.sync_mean(
            local_mu, config, residuals=feedback, order=order, sharded=sharded, where=where
        )
        if second_moment == "gradient":
            nu = _follow_gradient(nu, mu_old, mu, b1, b2)
        elif follows:
            nu = _follow_momentum(second_moment, nu, _bias_correction(mu, b1, count), b2, count)
        return mu, nu, residuals

    return {"warmup": full_precision, "compressed": compressed}


def scale_by_qadam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    warmup_steps: int,
    second_moment: SecondMoment | None = None,
    nu_refresh_interval: int | None = None,
    nu_refresh_growth: float = 2.0,
    sync: SyncConfig | None = None,
    mesh: Mesh | None = None,
    phase: Phase | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Rescales per-device gradients by QAdam, doing its own communication.

    For ``warmup_steps`` steps it is Adam on the float32 mean gradient. After that only
    the momentum crosses the network, and the second moment follows the gradient that two
    consecutive decoded momenta imply, or the decoded momentum itself (``second_moment``;
    Bagua froze it). Each device updates the momentum with its own
    gradient, and the momenta are averaged with ``compressed_mean`` (8-bit between nodes,
    about 4x fewer bytes than a float32 all-reduce; 4-bit with ``bits=4``, about 8x fewer). With
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
      warmup_steps: steps of plain Adam before compression starts, >= 1; 10-30% of the
        run is a good default.
      second_moment: what ``v`` does after warm-up. None (default) is ``"gradient"`` at
        8 bits and ``"momentum"`` at 4, as measured (docs/qadam.md). ``"gradient"`` keeps
        Adam's update with ``g_est^2``, where ``g_est = (m - b1 m_prev) / (1 - b1)`` comes
        from two consecutive decoded momenta (the mean gradient up to the codes' error over
        ``1 - b1``, so ``v`` is Adam's plus a small positive term); ``"momentum"`` Adam's
        update with the decoded momentum ``m_hat^2`` in place of ``g^2`` (it misses most of
        the gradient's noise: larger steps than Adam's); ``"momentum_max"`` is
        ``"momentum"`` whose bias-corrected ``v`` never falls; ``"floor"`` keeps ``v``
        frozen but bounds each step by the learning rate; ``"frozen"`` is Bagua's (it
        diverges where gradients grow after warm-up).
      nu_refresh_interval: None (default) sends no float32 step after warm-up. An int
        k >= 1 runs the warm-up step again (float32 gradient into ``m`` and ``v``), k steps
        after warm-up and then at gaps growing by ``nu_refresh_growth``.
      nu_refresh_growth: each gap between refreshes over the previous one, >= 1 (1.0: a
        refresh every k steps).
      sync: the momentum exchange's settings, a ``SyncConfig`` (its ``hierarchical``
        and axes apply to the float32 warm-up mean too; ``bits=4`` halves the bytes, see
        docs/qadam.md for what it costs in accuracy; ``error_feedback`` keeps each
        device's compression errors of the momentum and adds them back at the next
        compressed step, as ``bytegrad(error_feedback=True)`` does, for (1 + 1/n) N/L
        float32 values per device, and needs ``mesh``). None for the defaults.
      mesh: the mesh the step runs on; error feedback sizes the residuals by it.
      phase: None (default) picks the phase from the step count inside the program, so
        both phases' communication sits in one ``lax.cond``. ``"warmup"`` or
        ``"compressed"`` compiles that phase alone, for a step that picks the phase on the
        host (``phase_schedule``; ``data_parallel_step`` with one optimizer per phase). The
        state and the result are the same either way.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a ``ScaleByQAdamState``;
      its ``update`` also takes ``gradient_order``, as ``bytegrad``'s does.

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
    checks.real(b1, "b1", where, minimum=0.0, below=1.0)
    checks.real(b2, "b2", where, minimum=0.0, below=1.0)
    checks.real(eps, "eps", where, minimum=0.0)
    check_warmup_steps(warmup_steps, where)
    _check_second_moment(second_moment, where)
    check_refresh(nu_refresh_interval, nu_refresh_growth, where)
    if phase is not None:
        checks.one_of(phase, ("warmup", "compressed"), "phase", where)
    config = sync_config(sync, where)
    if second_moment is None:
        # The gradient's v is Adam's up to the codes' error over 1 - b1, which for the widths
        # the codecs call coarse (4 and 2 bits) swells v: the momentum's then (module docstring).
        second_moment = "momentum" if config.codec.format.coarse else "gradient"
    shape = config.mesh_shape(mesh, where)
    node_axis, local_axis = config.axes

    def init_fn(params):
        return ScaleByQAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params),
            residuals=collectives.mesh_residuals(params, config, shape, platform_of(mesh)),
        )

    follows = second_moment in _FOLLOWING
    refresh = refresh_counter(warmup_steps, nu_refresh_interval, float(nu_refresh_growth), where)
    phases = _phases(config, b1, b2, second_moment, where)

    def update_fn(updates, state, params=None, *, gradient_order=None, sharded=None, **extra):
        del params, extra
        collectives.axis_sizes(node_axis, local_axis, where)
        # Leaves exchanged inside the backward loop come averaged already: not checked (as
        # None, an empty subtree, the others keep their paths for the error).
        unexchanged = shards.layout_of(sharded).exchanged_from(None, updates)
        _check_per_device(unexchanged, node_axis, local_axis, sharded, where)
        count_inc = optax.safe_increment(state.count)
        full = count_inc <= warmup_steps
        # A frozen v froze at step warmup_steps, and so does its correction. Bagua keeps
        # raising the correction with t, which inflates the step by up to
        # 1/sqrt(1 - b2^warmup_steps). The momentum rules update v every step.
        nu_updates = count_inc if follows else jnp.minimum(count_inc, warmup_steps)
        if refresh is not None:
            # A refresh is a warm-up step (the same branch, so no float32 collective is
            # added to the program), and v's correction counts the updates v has had.
            is_refresh, refreshes = refresh(count_inc)
            full = full | is_refresh
            nu_updates = nu_updates if follows else nu_updates + refreshes
        args = (updates, state.mu, state.nu, state.residuals, count_inc)
        context = dict(order=gradient_order, sharded=sharded)
        run = {k: functools.partial(f, **context) for k, f in phases.items()}
        if phase is None:
            mu, nu, residuals = jax.lax.cond(full, run["warmup"], run["compressed"], *args)
        else:
            mu, nu, residuals = run[phase](*args)
        mu_hat = _bias_correction(mu, b1, count_inc)
        nu_hat = _bias_correction(nu, b2, nu_updates)
        if second_moment == "floor" and phase != "warmup":
            # No compressed step moves a weight by more than the learning rate.
            floored = jax.tree.map(lambda v, m: jnp.maximum(v, m * m), nu_hat, mu_hat)
            if phase is None:  # warm-up steps keep Adam's v_hat
                floored = jax.tree.map(lambda a, b: jnp.where(full, a, b), nu_hat, floored)
            nu_hat = floored
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        nu = optax.tree.cast_like(nu, state.nu)
        return updates, ScaleByQAdamState(count=count_inc, mu=mu, nu=nu, residuals=residuals)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _decay_and_scale(learning_rate, weight_decay: float, mask) -> optax.GradientTransformation:
    """``add_decayed_weights`` then ``scale_by_learning_rate``, as one transformation whose state
    is the learning rate's: the decay keeps no state, so QAdam's chain has the same structure
    with or without it (and the layout its checkpoints always had)."""
    decay = optax.add_decayed_weights(weight_decay, mask)
    scale = optax.scale_by_learning_rate(learning_rate)

    def update_fn(updates, state, params=None):
        if weight_decay:
            updates, _ = decay.update(updates, decay.init(params), params)
        return scale.update(updates, state, params)

    return optax.GradientTransformation(scale.init, update_fn)


def qadam(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    *,
    warmup_steps: int,
    second_moment: SecondMoment | None = None,
    nu_refresh_interval: int | None = None,
    nu_refresh_growth: float = 2.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    node_axis: str = NODE_AXIS,
    local_axis: str = LOCAL_AXIS,
    hierarchical: bool = True,
    bits: Bits = 8,
    error_feedback: bool = False,
    mesh: Mesh | None = None,
    block_size: int | None = None,
    bucket_bytes: BucketBytes = "auto",
    message_bytes: int | None = DEFAULT_MESSAGE_BYTES,
    wire: Wire = "auto",
    implementation: Implementation | None = None,
    phase: Phase | None = None,
) -> optax.GradientTransformation:
    """QAdam: Adam whose momentum crosses the network 8-bit (or 4-bit) after a float32 warm-up.

    ``chain(scale_by_qadam, add_decayed_weights, scale_by_learning_rate)``. It averages
    the gradients itself, so hand it per-device gradients:
    ``data_parallel_step(loss_fn, qadam(...), mesh)``. Weight decay is decoupled (as in
    AdamW) and applies in both phases.

    Args:
      learning_rate: a float or an optax schedule ``step -> lr``.
      warmup_steps: steps of plain float32 Adam before compression starts, >= 1; 10-30%
        of the run is a good default (see ``scale_by_qadam``).
      second_moment: None (default: ``"gradient"`` at 8 bits, ``"momentum"`` at 4),
        ``"gradient"``, ``"momentum"``, ``"momentum_max"``, ``"floor"`` or ``"frozen"``
        (Bagua's): what the second moment does after warm-up (see ``scale_by_qadam``).
      nu_refresh_interval: None (default): no float32 step after warm-up. An int k >= 1:
        float32 refreshes of ``m`` and ``v``, k steps after warm-up and then at gaps
        growing by ``nu_refresh_growth`` (see ``refresh_steps``).
      nu_refresh_growth: each gap between refreshes over the previous one, >= 1.
      b1: decay of the first moment.
      b2: decay of the second moment (during warm-up).
      eps: added to the square root of the bias-corrected second moment.
      weight_decay: decoupled weight decay, >= 0 (0: none; the chain's structure is the
        same, as ``optax.adamw``'s).
      mask: which params to decay, as for ``optax.add_decayed_weights``.
      node_axis, local_axis, hierarchical, bits, error_feedback, block_size, bucket_bytes,
        message_bytes, wire, implementation: the momentum exchange's settings, each
        documented in ``SyncConfig`` (``hierarchical`` and the axes apply to the float32
        warm-up mean too; ``error_feedback`` needs ``mesh``; see ``scale_by_qadam``).
      mesh: the mesh the step runs on; error feedback sizes the residuals by it.
      phase: None, ``"warmup"`` or ``"compressed"``: see ``scale_by_qadam``.

    Returns:
      An ``optax.GradientTransformation``: ``chain(scale_by_qadam, decay_and_scale)``, the
      decoupled weight decay and the learning rate, whatever the arguments: its state is
      ``(ScaleByQAdamState, the learning rate's state)``. To skip non-finite updates, wrap it:
      ``jax_bytegrad.skip_nonfinite(qadam(...))`` (its update is the same on every replica,
      so every replica skips the same steps).

    Raises:
      ValueError: for bad arguments (here), error feedback without ``mesh``; at trace
        time, outside ``shard_map``, for an axis the mesh lacks, or for gradients that are
        already averaged across devices.

    Examples:
      >>> import jax.numpy as jnp, jax_bytegrad
      >>> from jax_bytegrad import qadam
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> step = jax_bytegrad.data_parallel_step(
      ...     lambda w, b: jnp.mean((b * w) ** 2), qadam(1e-2, warmup_steps=2), mesh)
      >>> state = step.init(jnp.ones(4))
      >>> for _ in range(3):
      ...     state, metrics = step(state, jnp.ones((8, 4)))
      >>> int(state.opt_state[0].count)
      3

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022;
      and those of ``scale_by_qadam``.
    """
    where = "qadam"
    if not callable(learning_rate):
        checks.real(learning_rate, "learning_rate", where, minimum=0.0, why=" or a schedule")
    checks.real(weight_decay, "weight_decay", where, minimum=0.0)
    sync = SyncConfig(
        node_axis=node_axis,
        local_axis=local_axis,
        hierarchical=hierarchical,
        bits=bits,
        block_size=block_size,
        bucket_bytes=bucket_bytes,
        message_bytes=message_bytes,
        implementation=implementation,
        error_feedback=error_feedback,
        wire=wire,
        where=where,
    )
    return optax.chain(
        scale_by_qadam(
            b1,
            b2,
            eps,
            warmup_steps=warmup_steps,
            second_moment=second_moment,
            nu_refresh_interval=nu_refresh_interval,
            nu_refresh_growth=nu_refresh_growth,
            sync=sync,
            mesh=mesh,
            phase=phase,
        ),
        _decay_and_scale(learning_rate, weight_decay, mask),
    )
