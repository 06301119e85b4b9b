"""Deviceless GPU meshes: compile a GPU cluster's train step on a machine without a GPU.

XLA:GPU compiles ahead of time for GPUs it cannot see when it is given a target description,
a ``GpuTargetConfigProto`` in text form. JAX's CUDA plugin then hands out abstract devices
(``jax.experimental.topologies.get_topology_desc``); a ``Mesh`` of them compiles a step into
the executable that the cluster would run, whose optimized HLO is the schedule XLA:GPU
follows. ``communication_stats`` reads its traffic and overlap from there.

The shipped targets hold the public specifications of each GPU (NVIDIA's data sheets): compute
capability, streaming multiprocessors, shared memory, L2, memory bandwidth and size.
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jax_bytegrad._src import checks
from jax_bytegrad._src.mesh import AXES


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA:GPU needs to know of a GPU to compile for it (one device).

    Attributes:
      name: the device kind the abstract devices report.
      compute_capability: (major, minor).
      cores: streaming multiprocessors.
      fpus_per_core: float32 lanes per multiprocessor.
      shared_memory_per_core: bytes of shared memory per multiprocessor.
      shared_memory_per_block_optin: the most shared memory one block may opt into.
      l2_cache_bytes: L2 cache size.
      memory_bandwidth: bytes per second of device memory.
      memory_bytes: device memory.
      clock_ghz: boost clock.
    """

    name: str
    compute_capability: tuple[int, int]
    cores: int
    fpus_per_core: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    l2_cache_bytes: int
    memory_bandwidth: int
    memory_bytes: int
    clock_ghz: float

    def target_config(self) -> str:
        """The ``GpuTargetConfigProto`` text XLA:GPU compiles against."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.cores}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 patch: 0 }}
device_description_str: "{self.name}"
"""


# NVIDIA's data sheets: H100 SXM5 80 GB, H200 SXM 141 GB, A100 SXM4 80 GB.
GPUS = {
    "h100": GpuSpec(
        "NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 233472, 232448, 50 * 2**20,
        3_352_320_000_000, 85_045_477_376, 1.98,
    ),
    "h200": GpuSpec(
        "NVIDIA H200", (9, 0), 132, 128, 233472, 232448, 50 * 2**20,
        4_800_000_000_000, 150_754_820_096, 1.98,
    ),
    "a100": GpuSpec(
        "NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 167936, 166912, 40 * 2**20,
        2_039_000_000_000, 85_198_045_184, 1.41,
    ),
}  # fmt: skip


def gpu_mesh(
    num_nodes: int,
    devices_per_node: int,
    gpu: str = "h100",
    *,
    target_config: str | None = None,
) -> Mesh:
    """A ("node", "local") mesh of GPUs that need not exist, for ahead-of-time compilation.

    Each node is one host of ``devices_per_node`` GPUs, as ``make_mesh`` lays out a real
    cluster. Nothing can run on these devices; a step built on the mesh compiles
    (``step.lower(step.state_shapes(params), batch).compile()``), and
    ``communication_stats`` reads what the cluster would send and how much of it overlaps
    the compute.

    Args:
      num_nodes: hosts.
      devices_per_node: GPUs per host.
      gpu: a shipped target: ``"h100"``, ``"h200"`` or ``"a100"`` (the Mosaic GPU kernels
        need compute capability 9.0; on an A100 the codec is XLA's).
      target_config: your own ``GpuTargetConfigProto`` text instead of ``gpu``'s.

    Returns:
      A ``jax.sharding.Mesh`` of shape (num_nodes, devices_per_node).

    Raises:
      ValueError: for non-positive sizes or an unknown ``gpu``.
      RuntimeError: when JAX's CUDA plugin is not installed, naming the extra to install.

    Examples:
      >>> from jax_bytegrad.sharding import gpu_mesh
      >>> mesh = gpu_mesh(2, 4)  # doctest: +SKIP
      >>> mesh.shape  # doctest: +SKIP
      {'node': 2, 'local': 4}
    """
    where = "gpu_mesh"
    for value, name in ((num_nodes, "num_nodes"), (devices_per_node, "devices_per_node")):
        checks.integer(value, name, where)
        if value < 1:
            raise ValueError(f"{where}: {name} must be >= 1, got {value!r}")
    if target_config is None:
        if gpu not in GPUS:
            raise ValueError(
                f"{where}: gpu must be one of {sorted(GPUS)}, got {gpu!r}; or pass your own "
                "GpuTargetConfigProto text as target_config=..."
            )
        target_config = GPUS[gpu].target_config()
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda",
            topology=f"1x{num_nodes}x{devices_per_node}",
            target_config=target_config,
        )
    except Exception as error:  # noqa: BLE001 - reworded with what to do
        if "not implemented" in str(error) or "Unknown backend" in str(error):
            raise RuntimeError(
                f"{where}: compiling for GPUs needs JAX's CUDA plugin; install it from the "
                "repository's root with pip install -e '.[cuda12]' (or '.[cuda13]'; about "
                f"3.4 GB, docs/gpu.md). JAX said: {error}"
            ) from None
        raise
    devices = sorted(topology.devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(num_nodes, devices_per_node)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
