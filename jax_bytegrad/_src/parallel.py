"""The ("node", "local") mesh and a data-parallel train step around any optax optimizer.

Follows Bagua's data-parallel model (Gan et al., VLDB 2022): parameters and optimizer state
are replicated, each device computes the gradient of its slice of the batch, and the
optimizer's first transformation (``bytegrad``, ``gradient_allreduce``, ``qadam``) averages
what must be averaged. Nodes map to JAX processes, so the "node" axis is the slow one.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks as _checks

AXES = ("node", "local")


def make_mesh(num_nodes: int | None = None, devices_per_node: int | None = None) -> Mesh:
    """Builds a 2-D ``Mesh`` with axes ("node", "local").

    With several JAX processes, each process is a node by default and its local devices
    form that node's row, so "node" collectives are the ones that cross hosts. A process
    may also hold several nodes (``devices_per_node`` dividing its device count). With a
    single process, the devices are split as asked; by default they form one node.

    Args:
      num_nodes: rows of the mesh; defaults to the process count (or what the device count
        and ``devices_per_node`` imply).
      devices_per_node: columns of the mesh; defaults to the devices per process.

    Returns:
      A ``jax.sharding.Mesh`` of shape (num_nodes, devices_per_node), with Auto axis types
      so that ``jax.jit`` places inputs as ``shard_map`` expects.

    Raises:
      ValueError: for non-positive sizes, more devices than exist, or (with several
        processes) a node that would span two processes.

    Examples:
      >>> import jax_bytegrad
      >>> jax_bytegrad.make_mesh(1, 1).axis_names
      ('node', 'local')
    """
    _checks.positive_int(num_nodes, "num_nodes", "make_mesh", or_none=True)
    _checks.positive_int(devices_per_node, "devices_per_node", "make_mesh", or_none=True)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    processes = jax.process_count()
    per_process = len(devices) // processes
    if devices_per_node is None:
        if num_nodes is None:
            devices_per_node = per_process
        elif len(devices) % num_nodes:
            raise ValueError(
                f"make_mesh: {len(devices)} devices do not split into {num_nodes} nodes; "
                "pass devices_per_node=..."
            )
        else:
            devices_per_node = len(devices) // num_nodes
    if num_nodes is None:
        num_nodes = max(1, len(devices) // devices_per_node)
    wanted = num_nodes * devices_per_node
    if wanted > len(devices):
        raise ValueError(
            f"make_mesh: {num_nodes} nodes x {devices_per_node} devices needs {wanted} devices, "
            f"but only {len(devices)} exist. On CPU, ask for more before JAX first uses a "
            f'device: jax.config.update("jax_num_cpu_devices", {wanted}) at the top of the '
            f"script, or XLA_FLAGS=--xla_force_host_platform_device_count={wanted}"
        )
    if processes > 1 and (wanted != len(devices) or per_process % devices_per_node):
        raise ValueError(
            f"make_mesh: with {processes} processes of {per_process} devices each, a mesh of "
            f"{num_nodes} x {devices_per_node} would leave devices out or split a node "
            "across processes; use devices_per_node dividing the devices per process"
        )
    grid = np.array(devices[:wanted], dtype=object).reshape(num_nodes, devices_per_node)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def replicate(tree, mesh: Mesh):
    """Places a pytree (same value on every process) replicated on every device of ``mesh``."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


def shard_batch(tree, mesh: Mesh, *, node_axis: str = "node", local_axis: str = "local"):
    """Splits this process's part of a batch over its devices along the leading axis.

    With one process this is the whole batch; with several, each process passes its own
    rows and the global batch is their concatenation in process order.

    Raises:
      ValueError: for a leaf whose leading dimension does not split over this process's
        devices of the mesh.
    """
    mine = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    _checks.batch_splits(tree, mine, "shard_batch", owner="this process in the mesh")
    sharding = NamedSharding(mesh, P((node_axis, local_axis)))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


@functools.cache
def _has_compile_option(name: str, value) -> bool:
    """Whether this jaxlib's XLA:CPU accepts compile option ``name``; asked once per process.

    XLA drops options between releases and rejects unknown ones ("No such compile option"),
    so an option is passed only where a tiny program compiles with it.
    """
    try:
        x = jax.device_put(np.float32(0), jax.local_devices(backend="cpu")[0])
        jax.jit(lambda x: x + 1).lower(x).compile({name: value})
    except Exception:  # noqa: BLE001 - any refusal means "do not pass it"
        return False
    return True


def compiler_options(mesh: Mesh) -> dict | None:
    """XLA options for the train steps this library compiles over ``mesh``.

    On CPU, XLA's fusion emitters compiled the bucket decode, fused into a parameter whose
    rows do not line up with the 1024-value quantization blocks, to a slow element-wise
    loop; with the classic emitters a ByteGrad step of a 25M-parameter MLP took 763 ms
    instead of 5544 ms (benchmarks/RESULTS.md, "Network"). JAX releases whose XLA no longer
    has the option get none. Other platforms need nothing.
    """
    if next(iter(mesh.devices.flat)).platform != "cpu":
        return None
    option = ("xla_cpu_use_fusion_emitters", False)
    return dict([option]) if _has_compile_option(*option) else None


def data_parallel_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    has_aux: bool = False,
    donate: bool = True,
    node_axis: str = "node",
    local_axis: str = "local",
) -> Callable:
    """Builds a jitted data-parallel train step over a ("node", "local") mesh.

    Parameters and optimizer state are replicated; the batch is split over both mesh axes
    along its leading dimension. Each device differentiates ``loss_fn`` on its own slice
    and hands the per-device gradient to ``optimizer``, whose first transformation must
    average it (``bytegrad()``, ``gradient_allreduce()``, or ``qadam()``). The parameters
    are marked as varying per device before differentiation: otherwise ``jax.grad`` of a
    replicated parameter inside ``shard_map`` returns it already summed, through a hidden
    float32 all-reduce that would make compression pointless.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
        computed on one device's slice of the batch.
      optimizer: an optax transformation that synchronizes the gradient first.
      mesh: from ``make_mesh``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; float aux leaves are averaged.
      donate: donate the params and optimizer-state buffers to the step: pass it the state
        it returned, not arrays it already consumed (or False to keep the inputs).
      node_axis: the mesh axis between nodes.
      local_axis: the mesh axis within a node.

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, loss[, aux])``, jitted, with
      ``loss`` the mean over all devices. ``step.lower(...)`` works, for
      ``communication_stats``.

    Raises:
      ValueError: for axis names the mesh lacks; when called, for a batch whose leading
        dimension does not split over the devices, params or state a donating call already
        consumed, or an optimizer that leaves the updates different on different devices.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> tx = optax.chain(jax_bytegrad.bytegrad(), optax.sgd(0.1))
      >>> step = jax_bytegrad.data_parallel_step(
      ...     lambda w, b: jnp.mean((b * w) ** 2), tx, mesh, donate=False)
      >>> w = jnp.ones(4)
      >>> w, state, loss = step(w, tx.init(w), jnp.ones((8, 4)))
      >>> float(loss)
      1.0

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    axes = (node_axis, local_axis)
    nodes, per_node = _checks.mesh_axes(mesh, node_axis, local_axis, "data_parallel_step")
    devices = nodes * per_node
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def state_specs(opt_state):
        # Error feedback's residuals are each device's own; everything else is replicated.
        # (transforms imports this module, hence the late import.)
        from jax_bytegrad._src.transforms import state_specs

        return state_specs(opt_state, node_axis=node_axis, local_axis=local_axis)

    def per_device(params, opt_state, batch):
        out, grads = grad_fn(jax.lax.pcast(params, axes, to="varying"), batch)
        loss, aux = out if has_aux else (out, None)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        replicated = jax.tree.leaves(
            jax.tree.map(lambda spec: spec == P(), state_specs(opt_state)),
        )
        unsynced = [
            jax.tree_util.keystr(path)
            for (path, leaf), shared in zip(
                jax.tree_util.tree_leaves_with_path((updates, opt_state)),
                [True] * len(jax.tree.leaves(updates)) + replicated,
                strict=True,
            )
            if shared and _checks.varying_axes(leaf) & set(axes)
        ]
        if unsynced:
            raise ValueError(
                "data_parallel_step: the optimizer leaves updates or state that differ "
                f"between devices ({', '.join(unsynced[:3])}); put jax_bytegrad.bytegrad() "
                "or gradient_allreduce() first in the optax chain, or use jax_bytegrad.qadam()"
            )
        params = optax.apply_updates(params, updates)
        loss = jax.lax.pmean(loss, axes)
        if has_aux:
            return params, opt_state, loss, jax.lax.pmean(aux, axes)
        return params, opt_state, loss

    def step(params, opt_state, batch):
        _checks.batch_splits(batch, devices)
        state = state_specs(opt_state)
        out_specs = (P(), state, P(), P()) if has_aux else (P(), state, P())
        sharded = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), state, P(axes)), out_specs=out_specs
        )
        return sharded(params, opt_state, batch)

    def shardings(opt_state):
        state = jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(opt_state))
        return (NamedSharding(mesh, P()), state, NamedSharding(mesh, P(axes)))

    return _PlacedStep(step, mesh, shardings, devices, donate)


class StepsInFlight:
    """Keeps at most one train step in flight on XLA:CPU with several devices.

    XLA:CPU runs every simulated device's share of a program on one shared thread pool.
    Dispatching steps without waiting queues many programs' collectives on it; on a host
    with fewer cores than devices a rendezvous can then miss a participant for 40 s, and
    XLA aborts the process ("Termination timeout for all reduce"). 200 unblocked ByteGrad
    steps of a 0.8M-parameter MLP on a 2 x 4 mesh did so on 2 cores; waiting for the
    previous step before dispatching the next ran them in 12 s. The wait costs nothing
    there (the cores are busy anyway) and is skipped on other platforms, where queuing
    steps keeps the accelerator fed.
    """

    def __init__(self, mesh: Mesh):
        devices = list(mesh.devices.flat)
        self.enabled = len(devices) > 1 and devices[0].platform == "cpu"
        self._last = None

    def wait(self) -> None:
        """Blocks until the step dispatched last has finished."""
        last, self._last = self._last, None
        if last is not None and not last.is_deleted():
            last.block_until_ready()

    def track(self, out) -> None:
        """Remembers a step's output; every output of one program is ready together."""
        if self.enabled:
            leaves = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
            self._last = leaves[-1] if leaves else None


class _PlacedStep:
    """The jitted step; at top level it places its arguments on the mesh first.

    Placing them makes the first call (host arrays) and the later ones (this step's own
    committed outputs) hit the same compiled program; jit alone compiles once for
    uncommitted and once for committed arguments. The optimizer state's placement depends
    on its structure (``shardings(opt_state)``), so there is one jitted step per structure.
    Inside a caller's jit the step is inlined, and the caller's program chooses the
    compiler options (XLA accepts them on a top-level jit only). ``lower`` works as in
    jit, for ``communication_stats``.
    """

    def __init__(self, step, mesh, shardings, devices, donate):
        self._step = step
        self._mesh = mesh
        self._donate = donate
        self._jitted = {}
        self.shardings = shardings
        self.devices = devices
        self.in_flight = StepsInFlight(mesh)

    def _jit(self, opt_state, nested: bool = False):
        shardings = self.shardings(opt_state)
        key = (nested, jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings)))
        if key not in self._jitted:
            options = {} if nested else {"compiler_options": compiler_options(self._mesh)}
            self._jitted[key] = jax.jit(
                self._step,
                in_shardings=shardings,  # the outputs keep the shard_map's out_specs
                donate_argnums=(0, 1) if self._donate else (),
                **options,
            )
        return self._jitted[key], shardings

    def _cache_size(self) -> int:
        """Programs compiled so far, over every state structure (for no-recompile tests)."""
        return sum(jitted._cache_size() for jitted in self._jitted.values())

    def lower(self, params, opt_state, batch):
        return self._jit(opt_state)[0].lower(params, opt_state, batch)

    def __call__(self, params, opt_state, batch):
        _checks.batch_splits(batch, self.devices)
        args = (params, opt_state, batch)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            return self._jit(opt_state, nested=True)[0](*args)
        _checks.not_deleted((params, opt_state), "data_parallel_step")
        jitted, shardings = self._jit(opt_state)
        self.in_flight.wait()
        out = jitted(*jax.device_put(args, shardings))
        self.in_flight.track(out)
        return out
