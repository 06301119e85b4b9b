"""The ("node", "local") mesh, and placing params, batches and optimizer state on it.

Nodes map to TPU slices, or else to JAX processes, by default, so the "node" axis is the slow
one (Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022).
"""

import warnings

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.axes import LOCAL_AXIS, NODE_AXIS
from jax_bytegrad._src.sync.config import Residuals

AXES = (NODE_AXIS, LOCAL_AXIS)


def _groups(devices) -> tuple[str, list[list]]:
    """The devices split into the groups that are nodes by default: TPU slices where the
    devices name more than one slice (or are the TPUs of one slice), processes otherwise;
    groups in slice (process) order, each in its physical order."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    tpu = all(getattr(d, "platform", "") == "tpu" for d in devices)
    if None not in slices and (len(slices) > 1 or tpu):
        by_slice = {s: [d for d in devices if d.slice_index == s] for s in sorted(slices)}
        return "slice", [_physical_order(group) for group in by_slice.values()]
    processes = sorted({d.process_index for d in devices})
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return "process", [[d for d in ordered if d.process_index == p] for p in processes]


def _physical_order(group: list) -> list:
    """One slice's devices in the order ``mesh_utils`` lays them on its links (a ring of the
    chips), or by coordinates where it cannot (a subset of a slice): every slice the same."""
    from jax.experimental import mesh_utils

    try:
        return list(mesh_utils.create_device_mesh((len(group),), group).flat)
    except Exception:  # noqa: BLE001 - a subset mesh_utils does not lay out: by coordinates
        return sorted(group, key=lambda d: (tuple(getattr(d, "coords", ())), d.id))


def make_mesh(
    num_nodes: int | None = None,
    devices_per_node: int | None = None,
    *,
    devices=None,
) -> Mesh:
    """Builds a 2-D ``Mesh`` with axes ("node", "local").

    The nodes are what the slow links join: on TPUs, each slice is a node by default (its
    chips talk over ICI, slices over DCN), however many hosts it spans; elsewhere, with
    several JAX processes, each process is a node and its local devices form that node's
    row, so "node" collectives are the ones that cross hosts. A group (slice or process) may
    also hold several nodes (``devices_per_node`` dividing its devices), and a node may
    span several processes. With a single process the devices are split as asked; by
    default they form one node.

    Args:
      num_nodes: rows of the mesh; defaults to the slices (processes), or what the device
        count and ``devices_per_node`` imply.
      devices_per_node: columns of the mesh; defaults to the devices per slice (process).
      devices: the devices to lay out, e.g. a subset of ``jax.devices()`` or the devices of
        a deviceless topology (``jax.experimental.topologies.get_topology_desc``); by
        default ``jax.devices()``. A slice's devices are ordered as ``mesh_utils`` lays them
        on its links.

    Returns:
      A ``jax.sharding.Mesh`` of shape (num_nodes, devices_per_node), with Auto axis types
      so that ``jax.jit`` places inputs as ``shard_map`` expects.

    Raises:
      ValueError: for non-positive sizes, more devices than exist, slices (processes) of
        different sizes, or (with several) a mesh that would leave devices out or cut a
        node across two of them.

    Warns:
      RuntimeWarning: when the nodes asked for lie inside TPU slices
        (``warn_if_mesh_crosses_slices``).

    Examples:
      >>> import jax_bytegrad
      >>> jax_bytegrad.make_mesh(1, 1).axis_names
      ('node', 'local')
    """
    checks.integer(num_nodes, "num_nodes", "make_mesh", or_none=True)
    checks.integer(devices_per_node, "devices_per_node", "make_mesh", or_none=True)
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: devices=... is empty; pass the devices to lay out")
    unit, groups = _groups(devices)
    units = {"slice": "slices", "process": "processes"}[unit]
    sizes = sorted({len(group) for group in groups})
    if len(sizes) > 1:
        raise ValueError(
            f"make_mesh: the {units} hold different numbers of devices ({sizes}); pass "
            "devices=... with as many devices of each"
        )
    per_group = sizes[0]
    if devices_per_node is None:
        if num_nodes is None:
            devices_per_node = per_group
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
    if len(groups) > 1 and (
        wanted != len(devices) or (per_group % devices_per_node and devices_per_node % per_group)
    ):
        raise ValueError(
            f"make_mesh: with {len(groups)} {units} of {per_group} devices each, a mesh of "
            f"{num_nodes} x {devices_per_node} would leave devices out or cut a node across "
            f"two {units}; use devices_per_node dividing the devices per {unit}, or a multiple "
            "of them"
        )
    ordered = [d for group in groups for d in group]
    grid = np.array(ordered[:wanted], dtype=object).reshape(num_nodes, devices_per_node)
    mesh = Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    warn_if_mesh_crosses_slices(mesh, where="make_mesh")
    return mesh


def _slice_of(device) -> int:
    """A device's TPU slice, or -1 for a device of no slice."""
    index = getattr(device, "slice_index", None)
    return -1 if index is None else int(index)


def slice_crossings(
    mesh: Mesh, *, node_axis: str = NODE_AXIS, local_axis: str = LOCAL_AXIS
) -> list[str]:
    """Where a mesh of TPUs puts its axes against the slices: the "node" axis should join
    slices (DCN) and the "local" axis the chips of one slice (ICI).

    Args:
      mesh: a mesh whose devices may carry ``slice_index`` (TPUs); others have nothing to say.
      node_axis: the mesh axis between nodes.
      local_axis: the mesh axis within a node.

    Returns:
      One sentence per misplaced axis, naming it and the links it crosses; empty where the
      mesh follows the slices (or its devices name no slice).
    """
    devices = np.asarray(mesh.devices)
    slices = np.vectorize(_slice_of, otypes=[np.int64])(devices)
    tpu = all(getattr(d, "platform", "") == "tpu" for d in devices.flat)
    if (slices < 0).any() or (len(np.unique(slices)) < 2 and not tpu):
        return []
    out = []
    names = list(mesh.axis_names)
    if node_axis in names and mesh.shape[node_axis] > 1:
        along = np.moveaxis(slices, names.index(node_axis), -1).reshape(-1, mesh.shape[node_axis])
        shared = [row for row in along if len(set(row.tolist())) < len(row)]
        if shared:
            out.append(
                f"axis {node_axis!r} joins devices of one TPU slice (slice {int(shared[0][0])}): "
                "its compressed traffic crosses the slice's ICI links, which are fast enough "
                "for full precision, instead of DCN between slices"
            )
    if local_axis in names and mesh.shape[local_axis] > 1:
        along = np.moveaxis(slices, names.index(local_axis), -1)
        along = along.reshape(-1, mesh.shape[local_axis])
        mixed = [row for row in along if len(set(row.tolist())) > 1]
        if mixed:
            out.append(
                f"axis {local_axis!r} spans TPU slices {sorted(set(mixed[0].tolist()))}: its "
                "full-precision traffic crosses DCN between slices, uncompressed"
            )
    return out


def warn_if_mesh_crosses_slices(
    mesh: Mesh, *, node_axis: str = NODE_AXIS, local_axis: str = LOCAL_AXIS, where: str = "mesh"
) -> None:
    """Warns (``RuntimeWarning``) when a mesh of TPUs puts ``node_axis`` inside slices or
    ``local_axis`` across them (``slice_crossings``); a step built on a mesh of the user's own
    calls it."""
    found = slice_crossings(mesh, node_axis=node_axis, local_axis=local_axis)
    if found:
        warnings.warn(
            f"{where}: " + "; ".join(found) + ". Build the mesh with jax_bytegrad.make_mesh() "
            "(one node per slice), or lay each slice's devices along the local axis",
            RuntimeWarning,
            stacklevel=3,
        )


def replicate(tree, mesh: Mesh):
    """Places a pytree (same value on every process) replicated on every device of ``mesh``."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


def _local_batch_shards(mesh: Mesh, axes: tuple[str, str]) -> int:
    """How many slices of the batch this process's devices hold: its distinct positions along
    ``axes`` (a mesh with another axis, say "model", holds each slice on several devices)."""
    grid = np.moveaxis(np.asarray(mesh.devices), [mesh.axis_names.index(a) for a in axes], [0, 1])
    mine = {
        index[:2]
        for index, device in np.ndenumerate(grid)
        if device.process_index == jax.process_index()
    }
    return len(mine)


def shard_batch(
    tree, mesh: Mesh, *, node_axis: str = NODE_AXIS, local_axis: str = LOCAL_AXIS, where: str = ""
):
    """Splits this process's part of a batch over its devices along the leading axis.

    With one process this is the whole batch; with several, each process passes its own
    rows and the global batch is their concatenation in process order. Arrays already
    sharded this way pass as they are.

    Raises:
      ValueError: for a leaf whose leading dimension does not split over this process's
        devices of the mesh.
    """
    sharding = NamedSharding(mesh, P((node_axis, local_axis)))
    leaves = jax.tree.leaves(tree)
    if leaves and all(
        isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim) for x in leaves
    ):
        return tree
    slices = _local_batch_shards(mesh, (node_axis, local_axis))
    checks.batch_splits(tree, slices, where or "shard_batch", owner="this process in the mesh")
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


def _per_device(node) -> bool:
    """Whether an optimizer state's node holds each device's own values."""
    return isinstance(node, (Residuals, optax.MultiStepsState))


def state_specs(opt_state, *, node_axis: str = NODE_AXIS, local_axis: str = LOCAL_AXIS):
    """``shard_map`` specs for an optimizer state: each device's own values per device, the
    rest replicated.

    Each device's own: error feedback's ``Residuals``, and the gradients an
    ``optax.MultiStepsState`` accumulates (``acc_grads``: in a ``shard_map`` of your own,
    ``optax.MultiSteps(optax.chain(bytegrad(), ...), k)`` accumulates each device's gradient;
    ``shard_state`` gives every device its own row).

    Args:
      opt_state: an optax state (or its ``jax.eval_shape``), e.g. from ``tx.init``.
      node_axis: the mesh axis between nodes.
      local_axis: the mesh axis within a node.

    Returns:
      A pytree like ``opt_state`` of ``PartitionSpec``: ``P((node_axis, local_axis))`` for
      every per-device leaf (along its first dimension), ``P()`` elsewhere.

    Examples:
      >>> import jax.numpy as jnp, jax_bytegrad
      >>> from jax_bytegrad.sharding import state_specs
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> tx = jax_bytegrad.bytegrad(error_feedback=True, mesh=mesh)
      >>> state_specs(tx.init({"w": jnp.ones(3)})).residuals
      Residuals(((P(('node', 'local'),), P(('node', 'local'),)),))
    """
    per_device = P((node_axis, local_axis))

    def specs(node):
        if isinstance(node, Residuals):
            return jax.tree.map(lambda _: per_device, node)
        if isinstance(node, optax.MultiStepsState):
            inner = state_specs(node.inner_opt_state, node_axis=node_axis, local_axis=local_axis)
            return node._replace(
                mini_step=P(),
                gradient_step=P(),
                inner_opt_state=inner,
                acc_grads=jax.tree.map(lambda _: per_device, node.acc_grads),
                skip_state=jax.tree.map(lambda _: P(), node.skip_state),
            )
        return P()

    return jax.tree.map(specs, opt_state, is_leaf=_per_device)


class StateSpecs:
    """A step's ``state_specs``, from the first optimizer state it is called with, then kept:
    a step's state keeps its structure from step to step.

    Attributes:
      specs: the specs, None until the first call.
    """

    def __init__(self, axes: tuple[str, str]):
        self._axes = axes
        self.specs = None

    def __call__(self, opt_state):
        if self.specs is None:
            self.specs = state_specs(opt_state, node_axis=self._axes[0], local_axis=self._axes[1])
        return self.specs


def shard_state(opt_state, mesh: Mesh, *, node_axis: str = NODE_AXIS, local_axis: str = LOCAL_AXIS):
    """Places an optimizer state (same value on every process) on ``mesh`` per ``state_specs``.

    Replicated leaves are copied to every device; each device gets its own slice of the
    error-feedback residuals, and its own row of an ``optax.MultiStepsState``'s accumulated
    gradients (every row a copy of ``opt_state``'s: zeros after ``init``).

    Args:
      opt_state: an optax state, e.g. from ``tx.init``.
      mesh: the ("node", "local") mesh of the step.
      node_axis: the mesh axis between nodes.
      local_axis: the mesh axis within a node.

    Returns:
      The state as global arrays sharded as ``state_specs`` says.
    """
    devices = mesh.shape[node_axis] * mesh.shape[local_axis]

    def rows(node):
        """An ``optax.MultiStepsState`` whose accumulated gradients are every device's own,
        from the one value ``tx.init`` gives: each device's row is a copy of it."""
        if not isinstance(node, optax.MultiStepsState):
            return node
        for path, x in jax.tree.leaves_with_path(node.acc_grads):
            if np.ndim(x) == 0:
                raise ValueError(
                    f"shard_state: optax.MultiSteps accumulates a scalar gradient "
                    f"({jax.tree_util.keystr(path)}), which has no axis to hold one row per "
                    "device; make the parameter shape (1,), or accumulate with "
                    "data_parallel_step(loss_fn, optax.MultiSteps(...), mesh)"
                )
        acc = jax.tree.map(lambda x: np.concatenate([np.asarray(x)] * devices), node.acc_grads)
        return node._replace(acc_grads=acc)

    opt_state = jax.tree.map(rows, opt_state, is_leaf=_per_device)
    specs = state_specs(opt_state, node_axis=node_axis, local_axis=local_axis)

    def place(x, spec):
        sharding = NamedSharding(mesh, spec)
        if spec == P():
            return jax.make_array_from_process_local_data(sharding, x)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(place, opt_state, specs)
