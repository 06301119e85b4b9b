"""Decentralized SGD and low-precision decentralized SGD over a ("node", "local") mesh.

Follows Bagua's ``DecentralizedAlgorithm`` and ``LowPrecisionDecentralizedAlgorithm`` (Gan et
al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022), which
implement D-PSGD (Lian et al., "Can Decentralized Algorithms Outperform Centralized
Algorithms?", NeurIPS 2017) and its compressed-difference variant (Tang et al.,
"Communication Compression for Decentralized Training", NeurIPS 2018).

Both average WEIGHTS with peers rather than gradients, so replicas differ from device to
device. The step builders here therefore keep one copy of the parameters (and of the
optimizer state) per device, stacked on a leading axis of size ``num_nodes * devices_per_node``
that is sharded over ``("node", "local")``; ``data_parallel_step`` (replicated parameters)
cannot express that. Per device, inside ``jax.shard_map``:

    decentralized_step:               x <- mix(x) + u,   u = optimizer(grad f(x))
    low_precision_decentralized_step: x_half = x + u, then the compressed ring update below

``mix`` is the mean over every device (``peer_selection_mode="all"``) or the mean with one
peer that changes each round (``"shift_one"``, through ``ppermute``). With
``hierarchical=True`` (the default) devices first average within their node in float32,
every step, and only nodes gossip with each other. See docs/decentralized.md.
"""

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks as _checks
from jax_bytegrad._src.buckets import flatten_float32, unflatten_like
from jax_bytegrad._src.collectives import (
    DEFAULT_MESSAGE_BYTES,
    gather_flat,
    scatter_flat,
    split_ppermute,
)
from jax_bytegrad._src.parallel import StepsInFlight, compiler_options
from jax_bytegrad._src.quantization import (
    DEFAULT_BLOCK_SIZE,
    Implementation,
    check_block_size,
    dequantize,
    quantize,
    resolve_implementation,
)

PeerSelectionMode = Literal["all", "shift_one"]


# Private helpers -------------------------------------------------------------------------


def _check_step_args(
    where, mesh, axes, hierarchical, has_aux, communication_interval, message_bytes
) -> tuple[int, int]:
    """Validates the arguments both decentralized steps take; returns (nodes, per node)."""
    n, local = _checks.mesh_axes(mesh, *axes, where)
    _checks.boolean(hierarchical, "hierarchical", where)
    _checks.boolean(has_aux, "has_aux", where)
    _checks.positive_int(
        communication_interval, "communication_interval", where, why=" (communicate every k steps)"
    )
    _checks.positive_int(message_bytes, "message_bytes", where, or_none=True)
    return n, local


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
      >>> from jax_bytegrad import shift_one_schedule
      >>> shift_one_schedule(4)
      [[(0, 3), (1, 2)], [(1, 3), (0, 2)], [(2, 3), (0, 1)]]
    """
    _checks.positive_int(num_peers, "num_peers", "shift_one_schedule")
    n = int(num_peers)
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


def _missing_varying(tree, axes):
    """Casts each leaf to varying over whichever of ``axes`` it is not yet varying over."""

    def cast(x):
        vma = _checks.varying_axes(x)
        missing = tuple(a for a in axes if a not in vma)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


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


def _stack_per_device(tree, mesh: Mesh, axes, rows=None):
    """Places one value per device, stacked on a new leading axis sharded over ``axes``.

    Every process passes the same ``tree``. ``rows(value, device_index) -> row`` picks what
    a device holds (default: the value itself).
    """
    sharding = NamedSharding(mesh, P(axes))
    devices = int(np.prod([mesh.shape[a] for a in axes]))
    flat_devices = np.asarray(mesh.devices).reshape(-1)
    mine = [i for i, d in enumerate(flat_devices) if d.process_index == jax.process_index()]

    def place(x):
        x = np.asarray(x)
        local = np.stack([x if rows is None else rows(x, i) for i in mine])
        return jax.make_array_from_process_local_data(sharding, local, (devices, *local.shape[1:]))

    return jax.tree.map(place, tree)


def _host_selected_step(per_device, mesh, axes, state_specs, choose, *, has_aux, donate, where):
    """A step running one of several compiled programs, picked on the host by ``choose``.

    ``choose(step_count)`` names the program (a communication round, or none). Collectives
    inside ``lax.switch``/``lax.cond`` can deadlock XLA:CPU's thread pool, and a purely
    local step then compiles without any collective at all.
    """
    devices = mesh.shape[axes[0]] * mesh.shape[axes[1]]
    out_specs = (state_specs, P(axes), P(axes)) if has_aux else (state_specs, P(axes))
    programs = {}

    def program(choice):
        if choice not in programs:
            programs[choice] = jax.jit(
                jax.shard_map(
                    functools.partial(per_device, choice=choice),
                    mesh=mesh,
                    in_specs=(state_specs, P(axes)),
                    out_specs=out_specs,
                ),
                donate_argnums=(0,) if donate else (),
                compiler_options=compiler_options(mesh),
            )
        return programs[choice]

    def run(state, batch, method):
        count = int(state.step)
        fn = program(choose(count))
        if method is not None:
            return getattr(fn, method)(state._replace(step=None), batch)
        out = fn(state._replace(step=None), batch)
        return (out[0]._replace(step=count + 1), *out[1:])

    in_flight = StepsInFlight(mesh)

    def step(state, batch):
        _checks.batch_splits(batch, devices, where)
        _checks.not_deleted(state, where)
        in_flight.wait()
        out = run(state, batch, None)
        in_flight.track(out)
        return out

    step.lower = lambda state, batch: run(state, batch, "lower")
    return step


def _loss_aux_and_grad(loss_fn, has_aux: bool):
    """``jax.value_and_grad`` that returns ``(loss, aux, grads)``; ``aux`` is None without it."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def fn(params, batch):
        out, grads = grad_fn(params, batch)
        loss, aux = out if has_aux else (out, None)
        return loss, aux, grads

    return fn


def _step_outputs(new_state, loss, aux, has_aux: bool) -> tuple:
    """A per-device step's outputs, each with a leading device axis of one."""
    outs = (new_state, loss[None])
    return (*outs, jax.tree.map(lambda a: a[None], aux)) if has_aux else outs


def _ring_exchanger(ring_axis, peers: int, axes, block_size: int, impl, message_bytes):
    """One low-precision ring round, as ``exchange(x, w, l, r) -> (x, w, l, r)``.

    It sends ``Q(z)`` to both neighbours and applies the codes it sent to ``w`` and those it
    received to the replicas; afterwards ``x == w``.
    """
    from_left = [(i, (i + 1) % peers) for i in range(peers)]  # i sends to its right neighbour
    from_right = [(i, (i - 1) % peers) for i in range(peers)]

    def exchange(own, w, left, right):
        z = (w + left + right) * np.float32(1.0 / 3.0) - w + (own - w)
        q = quantize(z, block_size=block_size, implementation=impl)

        def received(perm):
            return dequantize(
                split_ppermute(q, ring_axis, perm, message_bytes), implementation=impl
            )

        left = left + received(from_left)
        right = right + received(from_right)
        x = w + dequantize(q, implementation=impl)
        return _missing_varying((x, x, left, right), axes)

    return exchange


def _ring_init(params, optimizer, mesh: Mesh, axes, *, parts: int):
    """The low-precision ring's first state: ``w = l = r`` = each device's part of the params.

    With ``parts`` > 1 the flat params are padded to ``parts`` equal shards and the device
    at position ``p`` within its node owns shard ``p``.
    """
    flat = np.asarray(flatten_float32(params))
    shard = -(-flat.size // parts)
    flat = np.pad(flat, (0, shard * parts - flat.size))
    local = mesh.shape[axes[1]]

    def rows(x, device):
        part = device % local if parts > 1 else 0
        return x[part * shard : (part + 1) * shard]

    return LowPrecisionDecentralizedState(
        params=_stack_per_device(params, mesh, axes),
        opt_state=_stack_per_device(optimizer.init(params), mesh, axes),
        weight=_stack_per_device(flat, mesh, axes, rows),
        left_peer_weight=_stack_per_device(flat, mesh, axes, rows),
        right_peer_weight=_stack_per_device(flat, mesh, axes, rows),
        step=0,
    )


def _check_float_params(params, where: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise ValueError(
                f"{where}: parameter {jax.tree_util.keystr(path)} has dtype "
                f"{jnp.result_type(leaf)}; only float parameters can be averaged, keep "
                "integer state outside the parameters"
            )


def consensus_params(stacked_params):
    """Mean over devices of per-device parameters: the model to evaluate or checkpoint.

    Args:
      stacked_params: ``state.params`` of a decentralized step (leading axis = devices).

    Returns:
      The parameters averaged over the leading axis, in their own dtypes.
    """
    return jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), stacked_params)


class DecentralizedTrainStep(NamedTuple):
    """What the decentralized step builders return.

    Attributes:
      init: ``init(params) -> state``: copies one set of parameters (the same on every
        process) to every device and initializes the optimizer on each.
      step: ``step(state, batch) -> (state, loss[, aux])``, jitted. ``loss`` has one entry
        per device (no global reduction: that would cost the all-reduce this avoids).
    """

    init: Callable[..., Any]
    step: Callable[..., Any]


# Decentralized SGD -----------------------------------------------------------------------


class DecentralizedState(NamedTuple):
    """State of ``decentralized_step``.

    Attributes:
      params: per-device parameters, stacked on a leading device axis.
      opt_state: per-device optimizer state, stacked likewise.
      step: the step count, a host int: it picks the program (communication round or
        local step) without a device round trip.
    """

    params: optax.Params
    opt_state: optax.OptState
    step: jax.Array


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
    node_axis: str = "node",
    local_axis: str = "local",
) -> DecentralizedTrainStep:
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
        with one peer, a different one each communication round (``shift_one_schedule``).
      communication_interval: gossip every k steps; steps in between are local (apart from
        the node average with ``hierarchical``).
      message_bytes: bytes per message of the exchanges with peers; None for one message
        per leaf. It changes the speed, never the result.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux comes back per device.
      donate: donate the state's buffers to the step.
      node_axis: the mesh axis between nodes.
      local_axis: the mesh axis within a node.

    Returns:
      A ``DecentralizedTrainStep(init, step)``; ``init(params)`` returns a
      ``DecentralizedState``.

    Raises:
      ValueError: at build time for axis names the mesh lacks, an unknown
        ``peer_selection_mode``, or a non-positive ``communication_interval``; when called,
        for a batch that does not split over the devices or integer parameters.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> from jax_bytegrad import decentralized_step
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> train = decentralized_step(lambda w, b: jnp.mean((b * w) ** 2), optax.sgd(0.1),
      ...                            mesh, peer_selection_mode="shift_one")
      >>> state, loss = train.step(train.init(jnp.ones(4)), jnp.ones((8, 4)))
      >>> state.params.shape, loss.shape
      ((1, 4), (1,))

    References:
      Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms? A Case
      Study for Decentralized Parallel Stochastic Gradient Descent", NeurIPS 2017.
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    where = "decentralized_step"
    axes = (node_axis, local_axis)
    n, local = _check_step_args(
        where, mesh, axes, hierarchical, has_aux, communication_interval, message_bytes
    )
    if peer_selection_mode not in ("all", "shift_one"):
        raise ValueError(
            f"{where}: peer_selection_mode must be 'all' or 'shift_one', got "
            f"{peer_selection_mode!r}"
        )
    devices = n * local
    gossip_axis, peers = (node_axis, n) if hierarchical else (axes, devices)
    grad_fn = _loss_aux_and_grad(loss_fn, has_aux)

    def mix_all(x):
        x = jax.lax.pmean(x, local_axis) if hierarchical else x
        return _missing_varying(jax.lax.pmean(x, gossip_axis), axes)

    def local_only(x):
        return _missing_varying(jax.lax.pmean(x, local_axis), axes) if hierarchical else x

    branches = [local_only]
    if peer_selection_mode == "all":
        branches.append(mix_all)
    else:
        for pairs in shift_one_schedule(peers):

            def mix_pairs(x, pairs=pairs):
                x = jax.lax.pmean(x, local_axis) if hierarchical else x
                mixed = _pair_mean(x, pairs, gossip_axis, peers, message_bytes)
                return _missing_varying(mixed, axes)

            branches.append(mix_pairs)
    rounds = len(branches) - 1

    def per_device(state, batch, *, choice):
        params, opt_state = jax.tree.map(lambda a: a[0], (state.params, state.opt_state))
        loss, aux, grads = grad_fn(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(branches[choice](params), updates)
        new = DecentralizedState(*jax.tree.map(lambda a: a[None], (params, opt_state)), step=None)
        return _step_outputs(new, loss, aux, has_aux)

    def branch_of(step_count: int) -> int:
        if step_count % communication_interval:
            return 0
        return 1 + (step_count // communication_interval) % rounds

    def init(params) -> DecentralizedState:
        _check_float_params(params, where)
        return DecentralizedState(
            params=_stack_per_device(params, mesh, axes),
            opt_state=_stack_per_device(optimizer.init(params), mesh, axes),
            step=0,
        )

    step = _host_selected_step(
        per_device,
        mesh,
        axes,
        DecentralizedState(P(axes), P(axes), None),
        branch_of,
        has_aux=has_aux,
        donate=donate,
        where=where,
    )
    return DecentralizedTrainStep(init=init, step=step)


# Low-precision decentralized SGD ---------------------------------------------------------


class LowPrecisionDecentralizedState(NamedTuple):
    """State of ``low_precision_decentralized_step``.

    The ring update works on the parameters flattened to one float32 vector. With
    ``hierarchical=True`` each device of a node owns 1/L of it (padded to a multiple of L),
    so the three replicas below cost 3/L of the model per device; otherwise each device
    owns the whole vector.

    Attributes:
      params: per-device parameters, stacked on a leading device axis.
      opt_state: per-device optimizer state, stacked likewise.
      weight: ``w``, this device's part of its weights after the last exchange.
      left_peer_weight: ``l``, the replica of the left ring neighbour's ``weight``.
      right_peer_weight: ``r``, the replica of the right ring neighbour's ``weight``.
      step: the step count, a host int: it picks the program (communication round or
        local step) without a device round trip.
    """

    params: optax.Params
    opt_state: optax.OptState
    weight: jax.Array
    left_peer_weight: jax.Array
    right_peer_weight: jax.Array
    step: jax.Array


def low_precision_decentralized_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    hierarchical: bool = True,
    communication_interval: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    implementation: Implementation | None = None,
    message_bytes: int | None = DEFAULT_MESSAGE_BYTES,
    has_aux: bool = False,
    donate: bool = True,
    node_axis: str = "node",
    local_axis: str = "local",
) -> DecentralizedTrainStep:
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
      message_bytes: bytes per message of the exchanges with neighbours; None for one
        message each. It changes the speed, never the result.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux comes back per device.
      donate: donate the state's buffers to the step.
      node_axis: the mesh axis between nodes.
      local_axis: the mesh axis within a node.

    Returns:
      A ``DecentralizedTrainStep(init, step)``; ``init(params)`` returns a
      ``LowPrecisionDecentralizedState``.

    Raises:
      ValueError: at build time for axis names the mesh lacks, a bad ``block_size`` or
        ``communication_interval``; when called, for a batch that does not split over the
        devices or integer parameters.
      NotImplementedError: for ``implementation="pallas"`` where no supported GPU is.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> from jax_bytegrad import low_precision_decentralized_step
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> train = low_precision_decentralized_step(
      ...     lambda w, b: jnp.mean((b * w) ** 2), optax.sgd(0.1), mesh, block_size=128)
      >>> state, loss = train.step(train.init(jnp.ones(4)), jnp.ones((8, 4)))
      >>> state.weight.shape
      (1, 4)

    References:
      Tang et al., "Communication Compression for Decentralized Training", NeurIPS 2018.
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    where = "low_precision_decentralized_step"
    axes = (node_axis, local_axis)
    n, local = _check_step_args(
        where, mesh, axes, hierarchical, has_aux, communication_interval, message_bytes
    )
    check_block_size(block_size, where)
    ring_axis, peers = (node_axis, n) if hierarchical else (axes, n * local)
    impl = resolve_implementation(implementation)
    exchange = _ring_exchanger(ring_axis, peers, axes, block_size, impl, message_bytes)
    grad_fn = _loss_aux_and_grad(loss_fn, has_aux)

    def per_device(state, batch, *, choice):
        params, opt_state, w, left, right = jax.tree.map(lambda a: a[0], tuple(state[:5]))
        loss, aux, grads = grad_fn(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        flat = flatten_float32(optax.apply_updates(params, updates))
        # With hierarchical=True each device of a node runs the ring on its 1/L of the mean.
        own = scatter_flat(flat, local_axis, local) / np.float32(local) if hierarchical else flat
        if choice:
            own, w, left, right = exchange(own, w, left, right)
        else:
            own, w, left, right = _missing_varying((own, w, left, right), axes)
        if hierarchical:
            flat = gather_flat(own, local_axis, flat.size, invariant=False)
        else:
            flat = own
        new = LowPrecisionDecentralizedState(
            *jax.tree.map(
                lambda a: a[None], (unflatten_like(flat, params), opt_state, w, left, right)
            ),
            step=None,
        )
        return _step_outputs(new, loss, aux, has_aux)

    def init(params) -> LowPrecisionDecentralizedState:
        _check_float_params(params, where)
        return _ring_init(params, optimizer, mesh, axes, parts=local if hierarchical else 1)

    step = _host_selected_step(
        per_device,
        mesh,
        axes,
        LowPrecisionDecentralizedState(*([P(axes)] * 5), None),
        lambda count: count % communication_interval == 0,
        has_aux=has_aux,
        donate=donate,
        where=where,
    )
    return DecentralizedTrainStep(init=init, step=step)
