"""Decentralized SGD and low-precision decentralized SGD over a ("node", "local") mesh.

Follows Bagua's ``DecentralizedAlgorithm`` and ``LowPrecisionDecentralizedAlgorithm`` (Gan et
al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022), which
implement D-PSGD (Lian et al., "Can Decentralized Algorithms Outperform Centralized
Algorithms?", NeurIPS 2017) and its compressed-difference variant (Tang et al.,
"Communication Compression for Decentralized Training", NeurIPS 2018).

Both average WEIGHTS with peers rather than gradients, so replicas differ from device to
device. The steps here therefore keep one copy of the parameters (and of the optimizer
state) per device, stacked on a leading axis of size ``num_nodes * devices_per_node`` that is
sharded over ``("node", "local")``. Per device, inside ``jax.shard_map``:

    decentralized_step:               x <- mix(x) + u,   u = optimizer(grad f(x))
    low_precision_decentralized_step: x_half = x + u, then the compressed ring update below

``mix`` is the mean over every device (``peer_selection_mode="all"``) or the mean with one
peer that changes each round (``"shift_one"``, through ``ppermute``). With
``hierarchical=True`` (the default) devices first average within their node in float32,
every step, and only nodes gossip with each other. Each round, and the local steps between
rounds, is its own program, picked on the host from the step count. See
docs/decentralized.md.
"""

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.axes import LOCAL_AXIS, NODE_AXIS
from jax_bytegrad._src.codecs.arrays import (
    Implementation,
    dequantize,
    quantize,
    resolve_implementation,
)
from jax_bytegrad._src.steps.base import (
    Program,
    StepState,
    TrainStep,
    abstract,
    count,
    device_mean,
    global_batch,
)
from jax_bytegrad._src.steps.model_state import ModelState, StateSync
from jax_bytegrad._src.sync.buckets import flatten_float32, unflatten_like
from jax_bytegrad._src.sync.config import (
    DEFAULT_BLOCK_SIZES,
    DEFAULT_MESSAGE_BYTES,
    check_block_size,
    platform_of,
)
from jax_bytegrad._src.sync.patterns import (
    gather_flat,
    make_varying,
    scatter_flat,
    split_ppermute,
)

PeerSelectionMode = Literal["all", "shift_one"]
_RING_KEYS = ("weight", "left_peer_weight", "right_peer_weight")


# Private helpers -------------------------------------------------------------------------


def shift_one_schedule(num_peers: int) -> list[list[tuple[int, int]]]:
    """Pairings of ``shift_one``: one perfect matching per round, every pair within a cycle.

    A round-robin tournament (the circle method): with an even ``num_peers`` each of the
    ``num_peers - 1`` rounds pairs every peer with exactly one other, and over a full cycle
    every peer meets every other peer once. With an odd count a phantom peer is added and
    whoever draws it sits the round out (keeps its own weights); the cycle has
    ``num_peers`` rounds.

    Args:
      num_peers: how many peers gossip (nodes, or devices with ``hierarchical=False``).

    Returns:
      A list of rounds, each a list of ``(a, b)`` pairs with ``a < b``.

    Raises:
      ValueError: for ``num_peers < 1``.

    Examples:
      >>> from jax_bytegrad._src.algorithms.decentralized.step import shift_one_schedule
      >>> shift_one_schedule(4)
      [[(0, 3), (1, 2)], [(1, 3), (0, 2)], [(2, 3), (0, 1)]]
    """
    n = checks.integer(num_peers, "num_peers", "shift_one_schedule")
    if n == 1:
        return [[]]
    m = n if n % 2 == 0 else n + 1  # m - 1 is the phantom when n is odd
    rounds = []
    for r in range(m - 1):
        pairs = [(r, m - 1)]
        for k in range(1, m // 2):
            pairs.append(((r + k) % (m - 1), (r - k) % (m - 1)))
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a < n and b < n])
    return rounds


def _pair_mean(tree, pairs, axis, num_peers, message_bytes):
    """Mean of each peer's value with its partner's; peers left out of ``pairs`` keep theirs."""
    perm = [(a, b) for a, b in pairs] + [(b, a) for a, b in pairs]
    if not perm:
        return tree
    paired = np.zeros(num_peers, bool)
    for a, b in pairs:
        paired[a] = paired[b] = True
    received = split_ppermute(tree, axis, perm, message_bytes)
    if paired.all():
        return jax.tree.map(lambda x, y: (x + y) / np.asarray(2, x.dtype), tree, received)
    has_peer = jnp.asarray(paired)[jax.lax.axis_index(axis)]
    return jax.tree.map(
        lambda x, y: jnp.where(has_peer, (x + y) / np.asarray(2, x.dtype), x), tree, received
    )


def consensus_params(stacked_params):
    """Mean over devices of per-device parameters: the model to evaluate or checkpoint.

    Args:
      stacked_params: ``state.params`` of a decentralized step (leading axis = devices).

    Returns:
      The parameters averaged over the leading axis, in their own dtypes.
    """
    return jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), stacked_params)


class _PeerStep(TrainStep):
    """One copy of the model per device; a program per gossip round and one for local steps.

    A subclass sets ``_rounds``, how many distinct gossip programs there are; a step
    communicates when its count is a multiple of ``interval`` and runs round
    ``(count // interval) % rounds``. The settings both builders take are checked here, in
    the builder's name (``where``).
    """

    _rounds = 1

    def __init__(self, where, algorithm, loss_fn, optimizer, mesh, *, axes, hierarchical,
                 interval, message_bytes, has_aux, donate, flatten, model):  # fmt: skip
        n, local = checks.mesh_axes(mesh, *axes, where)
        checks.boolean(hierarchical, "hierarchical", where)
        why = " (communicate every k steps)"
        checks.integer(interval, "communication_interval", where, why=why)
        checks.integer(message_bytes, "message_bytes", where, or_none=True)
        super().__init__(
            algorithm, mesh, loss_fn, axes=axes, has_aux=has_aux, flatten=flatten,
            donate=donate, model=model,
        )  # fmt: skip
        self.optimizer = optimizer
        self._interval = interval
        self.phases = ("gossip", "local") if interval > 1 else ("gossip",)
        self._hierarchical, self._message_bytes = hierarchical, message_bytes
        # Who gossips: the nodes, each after its devices' float32 mean, or every device.
        self._peers, self._peer_axis = (n, axes[0]) if hierarchical else (n * local, axes)

    def _phase(self, steps_taken):
        if steps_taken % self._interval:
            return "local", 0
        return "gossip", 1 + (steps_taken // self._interval) % self._rounds

    def _extra(self, params) -> dict[str, Any]:
        return {}

    def _extra_shapes(self, params) -> dict[str, Any]:
        """One device's ``_extra``, as ``ShapeDtypeStruct`` leaves."""
        return {}

    def _stacked(self, tree):
        """``tree``'s leaves as ``ShapeDtypeStruct``, one per device stacked on a leading axis."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((self._devices, *x.shape), x.dtype), tree
        )

    def _per_device_rows(self, tree, rows=None):
        """Places one value per device, stacked on a new leading axis sharded over the axes.

        Every process passes the same ``tree``. ``rows(value, device_index) -> row`` picks what
        a device holds (default: the value itself).
        """
        sharding = NamedSharding(self.mesh, P(self._axes))
        flat_devices = np.asarray(self.mesh.devices).reshape(-1)
        mine = [i for i, d in enumerate(flat_devices) if d.process_index == jax.process_index()]

        def place(x):
            local = np.stack([x if rows is None else rows(x, i) for i in mine])
            shape = (self._devices, *local.shape[1:])
            return jax.make_array_from_process_local_data(sharding, local, shape)

        return jax.tree.map(lambda x: place(np.asarray(x)), tree)

    def _state_shapes(self, params):
        sharding = NamedSharding(self.mesh, P(self._axes))
        trees = (params, jax.eval_shape(self.optimizer.init, params), self._extra_shapes(params))
        return StepState(count(0), *(abstract(self._stacked(t), sharding) for t in trees))

    def _expected_opt_state(self, params):
        for path, leaf in jax.tree.leaves_with_path(params):
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != self._devices:
                return (
                    f"its parameter {jax.tree_util.keystr(path)} has shape {np.shape(leaf)}, "
                    f"not one copy per device stacked on a leading axis of {self._devices}"
                )
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), params)
        return self._stacked(jax.eval_shape(self.optimizer.init, one))

    def _init(self, params):
        trees = (params, self.optimizer.init(params))
        return StepState(count(0), *map(self._per_device_rows, trees), self._extra(params))

    def _per_device(self, choice: int) -> Callable:
        """``(params, updates, extra) -> (params, extra)``: the exchange of round ``choice``
        (0: a local step), given this device's weights and its optimizer's updates."""
        raise NotImplementedError

    def _build(self, choice):
        per_device = self._per_device(choice)
        has_aux, model = self.has_aux, self.model
        grad_fn = model.value_and_grad(self.loss_fn, has_aux, self._axes)

        def step(params, opt_state, extra, *rest):
            *model_inputs, batch = rest
            params, opt_state, extra = jax.tree.map(lambda a: a[0], (params, opt_state, extra))
            (loss, aux, model_state), grads = grad_fn(params, batch, *model_inputs)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            params, extra = per_device(params, updates, extra)
            out = jax.tree.map(lambda a: a[None], (params, opt_state, extra, loss))
            out += (jax.tree.map(lambda a: a[None], aux),) if has_aux else ()
            return out + ((model_state,) if model.has_state else ())

        specs = P(self._axes)
        model_specs = (P(),) * model.num_inputs()
        fn = jax.jit(
            jax.shard_map(
                step,
                mesh=self.mesh,
                in_specs=(specs,) * 3 + model_specs + (specs,),
                out_specs=(specs,) * (4 + has_aux) + (P(),) * model.has_state,
            ),
            donate_argnums=(0, 1, 2, *[3] * model.has_state) if self._donate else (),
        )
        return Program(fn, self._inputs, self._outputs)

    def _inputs(self, state, batch):
        batch = global_batch(batch, self.mesh, self._axes)
        extra = {k: state.extra[k] for k in self._extra_keys}  # the model's travel apart
        return (state.params, state.opt_state, extra, *self.model.inputs(state), batch)

    def _outputs(self, state, out):
        metrics = {"loss": device_mean(out[3])}
        if self.has_aux:
            metrics["aux"] = device_mean(out[4])
        extra = {**out[2], **self.model.carried(state, out[-1] if self.model.has_state else None)}
        return StepState(state.step, out[0], out[1], extra), metrics

    def _params(self, state):
        return consensus_params(state.params)


# Decentralized SGD -----------------------------------------------------------------------


class _Decentralized(_PeerStep):
    def __init__(self, peer_selection_mode, **kwargs):
        super().__init__(**kwargs)
        rounds = [None] if peer_selection_mode == "all" else shift_one_schedule(self._peers)
        self._mixes = [self._mix([]), *map(self._mix, rounds)]  # the local steps' first
        self._rounds = len(rounds)

    def _mix(self, pairs):
        """The mix of a round: the node's mean, then the mean over every peer (``pairs``
        None) or with each one's partner in ``pairs`` (none: a local step)."""
        local_axis, axis, peers = self._axes[1], self._peer_axis, self._peers

        def mixed(x):
            x = jax.lax.pmean(x, local_axis) if self._hierarchical else x
            if pairs is None:
                return make_varying(jax.lax.pmean(x, axis), self._axes)
            mean = _pair_mean(x, pairs, axis, peers, self._message_bytes)
            return make_varying(mean, self._axes)

        return mixed

    def _per_device(self, choice):
        mix = self._mixes[choice]
        return lambda params, updates, extra: (optax.apply_updates(mix(params), updates), extra)


def decentralized_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    hierarchical: bool = True,
    peer_selection_mode: PeerSelectionMode = "all",
    communication_interval: int = 1,
    message_bytes: int | None = DEFAULT_MESSAGE_BYTES,
    has_aux: bool = False,
    donate: bool = True,
    node_axis: str = NODE_AXIS,
    local_axis: str = LOCAL_AXIS,
    flatten: bool = False,
    model_state: Any = None,
    rng_seed: int | None = None,
    state_sync: StateSync = "mean",
) -> TrainStep:
    """Builds a decentralized SGD (D-PSGD) train step: average weights with peers, then step.

    Each device differentiates ``loss_fn`` at its own weights ``x`` on its slice of the
    batch, averages its weights with its peers, and applies the optimizer's update to the
    averaged weights: ``x <- mix(x) + optimizer(grad f(x))``. The gradient is never
    communicated. The optimizer runs locally (``optax.sgd(lr)`` gives Lian et al.'s
    ``x <- mix(x) - lr * g``); do not put ``bytegrad()`` or ``gradient_allreduce()`` in it.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), on one device's slice.
      optimizer: any optax transformation, applied per device.
      mesh: from ``make_mesh``.
      hierarchical: average within each node in float32 every step, and gossip only between
        nodes (default). With False, every device is a peer of its own.
      peer_selection_mode: ``"all"``: the mean over every peer; ``"shift_one"``: the mean
        with one peer, a different one each communication round (a round-robin tournament:
        every pair of peers meets once per cycle; docs/decentralized.md).
      communication_interval: gossip every k steps; steps in between are local (apart from
        the node average with ``hierarchical``).
      message_bytes: bytes per message of the exchanges with peers; None for one message
        per leaf. It changes the speed, never the result.
      has_aux, donate, node_axis, local_axis, flatten, model_state, rng_seed, state_sync: as
        for ``data_parallel_step``; the model state is replicated (one copy for every
        device, synced after each step), not stacked like the params.

    Returns:
      A ``TrainStep``. ``state.params`` holds one copy per device (leading axis);
      ``step.params(state)`` is their mean. ``metrics["loss"]`` is the mean over devices of
      each device's loss at its own weights, before the exchange.

    Raises:
      ValueError: at build time for axis names the mesh lacks, an unknown
        ``peer_selection_mode``, or a non-positive ``communication_interval``; when called,
        for a batch that does not split over the devices or integer parameters.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> step = jax_bytegrad.decentralized_step(lambda w, b: jnp.mean((b * w) ** 2),
      ...     optax.sgd(0.1), mesh, peer_selection_mode="shift_one")
      >>> state, metrics = step(step.init(jnp.ones(4)), jnp.ones((8, 4)))
      >>> state.params.shape, float(metrics["loss"])
      ((1, 4), 1.0)

    References:
      Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms? A Case
      Study for Decentralized Parallel Stochastic Gradient Descent", NeurIPS 2017.
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    where = "decentralized_step"
    checks.one_of(peer_selection_mode, ("all", "shift_one"), "peer_selection_mode", where)
    return _Decentralized(
        peer_selection_mode,
        where=where,
        algorithm="decentralized",
        loss_fn=loss_fn,
        optimizer=optimizer,
        mesh=mesh,
        axes=(node_axis, local_axis),
        hierarchical=hierarchical,
        interval=communication_interval,
        message_bytes=message_bytes,
        has_aux=has_aux,
        donate=donate,
        flatten=flatten,
        model=ModelState.of(model_state, rng_seed, state_sync, where),
    )


# Low-precision decentralized SGD ---------------------------------------------------------


class _LowPrecision(_PeerStep):
    """The ring of 8-bit differences; ``state.extra`` holds ``weight`` (w) and the replicas of
    the neighbours' (l, r), each this device's part of the flat float32 parameters."""

    _extra_keys = _RING_KEYS

    def __init__(self, *, block_size, implementation, **kwargs):
        super().__init__(**kwargs)
        self._parts = self.mesh.shape[self._axes[1]] if self._hierarchical else 1
        self._block_size, self._implementation = block_size, implementation

    def _extra_shapes(self, params):
        size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        shard = jax.ShapeDtypeStruct((-(-size // self._parts),), jnp.float32)
        return dict.fromkeys(_RING_KEYS, shard)

    def _extra(self, params):
        flat = np.asarray(flatten_float32(params))
        shard = -(-flat.size // self._parts)
        flat = np.pad(flat, (0, shard * self._parts - flat.size))

        def rows(x, device):
            part = device % self._parts  # its part of its node's vector (flat: the whole)
            return x[part * shard : (part + 1) * shard]

        return {key: self._per_device_rows(flat, rows) for key in _RING_KEYS}

    def _exchange(self, own, w, left, right):
        """One ring round: sends ``Q(z)`` to both neighbours and applies the codes it sent
        to ``w`` and those it received to the replicas; afterwards ``x == w``."""
        peers, axis = self._peers, self._peer_axis
        impl = resolve_implementation(self._implementation)
        from_left = [(i, (i + 1) % peers) for i in range(peers)]  # i sends to its right
        from_right = [(i, (i - 1) % peers) for i in range(peers)]
        z = (w + left + right) * np.float32(1.0 / 3.0) - w + (own - w)
        q = quantize(z, block_size=self._block_size, implementation=impl)

        def received(perm):
            sent = split_ppermute(q, axis, perm, self._message_bytes)
            return dequantize(sent, implementation=impl)

        left = left + received(from_left)
        right = right + received(from_right)
        x = w + dequantize(q, implementation=impl)
        return make_varying((x, x, left, right), self._axes)

    def _per_device(self, choice):
        hierarchical, local_axis, local = self._hierarchical, self._axes[1], self._parts

        def update(params, updates, extra):
            w, left, right = (extra[key] for key in _RING_KEYS)
            params = optax.apply_updates(params, updates)
            flat = flatten_float32(params)
            own = flat
            if hierarchical:  # each device of a node runs the ring on its 1/L of the mean
                own = scatter_flat(flat, local_axis, local) / np.float32(local)
            if choice:
                own, w, left, right = self._exchange(own, w, left, right)
            else:
                own, w, left, right = make_varying((own, w, left, right), self._axes)
            if hierarchical:
                own = gather_flat(own, local_axis, flat.size, invariant=False)
            extra = dict(zip(_RING_KEYS, (w, left, right), strict=True))
            return unflatten_like(own, params), extra

        return update


def low_precision_decentralized_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    hierarchical: bool = True,
    communication_interval: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZES[8],
    implementation: Implementation | None = None,
    message_bytes: int | None = DEFAULT_MESSAGE_BYTES,
    has_aux: bool = False,
    donate: bool = True,
    node_axis: str = NODE_AXIS,
    local_axis: str = LOCAL_AXIS,
    flatten: bool = False,
    model_state: Any = None,
    rng_seed: int | None = None,
    state_sync: StateSync = "mean",
) -> TrainStep:
    """Builds a low-precision decentralized SGD train step: a ring exchanging 8-bit differences.

    Peers sit on a ring (nodes with ``hierarchical=True``, devices otherwise). Each keeps
    its own weights ``w`` after the last exchange and replicas ``l``, ``r`` of its two
    neighbours' ``w``. One step, on every peer, in Bagua's order:

        x  = x + optimizer(grad f(x))           # the local step
        z  = (w + l + r) / 3 - w + (x - w)      # mix with the replicas, as a difference
        q  = Q(z)                               # 8-bit, block-wise (jax_bytegrad.quantize)
        send q to both neighbours; receive q_left, q_right
        l += D(q_left);  r += D(q_right);  x = w + D(q);  w = x

    Only 8-bit differences cross the wire, and since each replica is updated with the
    exact codes its owner applied to itself, ``l`` of every peer stays bit-identical to its
    left neighbour's ``w``. With ``hierarchical=True`` the node first averages ``x`` in
    float32 (a reduce-scatter: each of its L devices runs the ring on its 1/L of the
    vector) and gathers the result back. Steps between communication rounds are local.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), on one device's slice.
      optimizer: any optax transformation, applied per device.
      mesh: from ``make_mesh``.
      hierarchical: ring over nodes after a float32 node average (default); False makes
        every device a ring member.
      communication_interval: exchange every k steps (Bagua's op takes the same option).
      block_size: quantization block size, a power of two >= 128.
      implementation: quantization kernels (see ``quantize``).
      message_bytes, has_aux, donate, node_axis, local_axis, flatten, model_state, rng_seed,
        state_sync: as for ``decentralized_step`` (messages to the neighbours).

    Returns:
      A ``TrainStep``. ``state.extra`` holds ``weight``, ``left_peer_weight`` and
      ``right_peer_weight``, one row per device; ``step.params(state)`` is the mean model.

    Raises:
      ValueError: at build time for axis names the mesh lacks, a bad ``block_size`` or
        ``communication_interval``; when called, for a batch that does not split over the
        devices or integer parameters.
      NotImplementedError: for ``implementation="pallas"`` on a mesh of another platform
        than GPUs (a TPU mesh), or where no supported GPU is.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> step = jax_bytegrad.low_precision_decentralized_step(
      ...     lambda w, b: jnp.mean((b * w) ** 2), optax.sgd(0.1), mesh, block_size=128)
      >>> state, metrics = step(step.init(jnp.ones(4)), jnp.ones((8, 4)))
      >>> state.extra["weight"].shape
      (1, 4)

    References:
      Tang et al., "Communication Compression for Decentralized Training", NeurIPS 2018.
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    where = "low_precision_decentralized_step"
    check_block_size(block_size, where)
    resolve_implementation(implementation, platform_of(mesh))
    return _LowPrecision(
        block_size=block_size,
        implementation=implementation,
        where=where,
        algorithm="low_precision_decentralized",
        loss_fn=loss_fn,
        optimizer=optimizer,
        mesh=mesh,
        axes=(node_axis, local_axis),
        hierarchical=hierarchical,
        interval=communication_interval,
        message_bytes=message_bytes,
        has_aux=has_aux,
        donate=donate,
        flatten=flatten,
        model=ModelState.of(model_state, rng_seed, state_sync, where),
    )
