"""The JAX platform a mesh's devices are, or the mesh being traced: what the sync's buckets
and integer widths, and the codec's automatic implementation (``codecs.selection.select``),
depend on.

It sits below both, so that the codecs ask the same question as the sync without importing it.
"""

import jax


def platform_of(mesh=None) -> str:
    """The JAX platform (``"cpu"``, ``"gpu"``, ...) of ``mesh``'s devices: a ``Mesh``, or an
    abstract mesh; None for the mesh being traced (``jax.sharding.get_abstract_mesh()``
    inside ``shard_map`` knows it, deviceless meshes included, on JAX 0.10.2 and 0.12); the
    default backend's where an abstract mesh names no device (outside any ``shard_map``)."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0].platform
    device = getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()
