"""Bytes between TPU slices for every algorithm: the library's count beside the HLO's sends.

Compiles each algorithm's train step for a deviceless multi-slice TPU topology (libtpu:
``pip install 'jax[tpu]'`` on Python 3.12), on ``make_mesh(devices=...)``'s mesh, one node
per slice, and prints per phase: the bytes each chip sends between slices per step as the
library counts them (``bytes_between_nodes``), and the Megascale ``send``s XLA wrote in the
compiled program, read straight off its text (``hlo_sends``, independent of the library's
reader), with their dtypes. The MLP is ``gpu_schedule.py``'s (no biases), 64 rows per chip.

The two figures differ where a send's buffer holds a piece that stays in its slice: an
all-to-all or reduce-scatter over two slices sends its whole input to the Megascale runtime,
of which half crosses; the library counts that half.

``async`` needs each process to be one node (its processes train on their own); a v5e:2x4
slice has two hosts, so it runs on two one-host v5e:2x2 slices, and on two-host slices
its build refuses the mesh.

Usage:
  JAX_PLATFORMS=cpu python benchmarks/tpu_bytes.py            # 2 slices of v5e:2x4, dim 512
  JAX_PLATFORMS=cpu python benchmarks/tpu_bytes.py --dim 256 --cases bytegrad,bytegrad_4bit_ef
"""

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
from jax.experimental import topologies

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_schedule  # noqa: E402

import jax_bytegrad as jbg  # noqa: E402

# (topology name, chips per host): two hosts per slice, the issue's; one host per slice.
TWO_HOSTS = ("v5e:2x4", (2, 2, 1))
ONE_HOST = ("v5e:2x2", (2, 2, 1))


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table: an algorithm, its settings, and the slices it runs on."""

    algorithm: str
    settings: dict = dataclasses.field(default_factory=dict)
    topology: tuple = TWO_HOSTS


# The registry: every algorithm, and bytegrad's sharded placements.
CASES = {
    "gradient_allreduce": Case("gradient_allreduce", {"hierarchical": True}),
    "bytegrad": Case("bytegrad"),
    "bytegrad_4bit_ef": Case("bytegrad", {"bits": 4, "error_feedback": True}),
    "bytegrad_shard_params": Case("bytegrad", {"shard": "params"}),
    "bytegrad_shard_full": Case("bytegrad", {"shard": "full"}),
    "qadam": Case("qadam", {"learning_rate": 1e-3, "warmup_steps": 2}),
    "diloco": Case("diloco", {"inner_steps": 4}),
    "decentralized": Case("decentralized"),
    "low_precision_decentralized": Case("low_precision_decentralized"),
    "async": Case("async", {"sync_interval_ms": 0}, ONE_HOST),
}
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "u8": 1, "s8": 1}
_SEND_RE = re.compile(
    r"^\s*%\S+ = \((\w+)\[([\d,]*)\]\S*, u32\[\].*\bsend\(.*_xla_megascale_target"
)


def topology_devices(topology: tuple = TWO_HOSTS, slices: int = 2) -> list:
    """The devices of ``slices`` deviceless slices of ``topology`` (name, chips per host)."""
    name, per_host = topology
    return topologies.get_topology_desc(
        platform="tpu", topology_name=name, chips_per_host_bounds=per_host, num_slices=slices
    ).devices


def hlo_sends(text: str) -> list[tuple[str, int]]:
    """``(dtype, bytes)`` of every Megascale ``send`` in compiled HLO text, as written."""
    sends = []
    for line in text.splitlines():
        match = _SEND_RE.match(line)
        if match is not None:
            elements = int(np.prod([int(v) for v in match[2].split(",") if v]))
            sends.append((match[1], elements * _BYTES[match[1]]))
    return sends


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase's bytes per chip and step between slices.

    Attributes:
      library: ``bytes_between_nodes``' figure.
      sends: ``hlo_sends`` of the phase's compiled program.
    """

    library: float
    sends: tuple[tuple[str, int], ...]

    @property
    def hlo_bytes(self) -> int:
        return sum(size for _, size in self.sends)

    def dtype_bytes(self) -> dict[str, int]:
        """The sends' bytes by dtype, largest first."""
        out: dict[str, int] = {}
        for dtype, size in self.sends:
            out[dtype] = out.get(dtype, 0) + size
        return dict(sorted(out.items(), key=lambda item: -item[1]))


def between_slices(case: Case, dim: int = 512, layers: int = 2) -> dict[str, Phase]:
    """Compiles ``case``'s step (once per phase) and returns each phase's bytes."""
    mesh = jbg.make_mesh(devices=topology_devices(case.topology))
    params, loss_fn, batch = gpu_schedule.mlp(layers, dim)
    batch = batch(mesh.devices.size)
    optimizer = None if case.algorithm == "qadam" else optax.sgd(0.1)
    strategy = jbg.Strategy(case.algorithm, mesh=mesh, **case.settings)
    with strategy.train_step(loss_fn, optimizer) as step:
        state = step.state_shapes(params)
        library = step.bytes_between_nodes(state, batch)
        if case.algorithm == "async":  # its background round runs on a mesh of its own
            compiled = {"averaging": step.lower_averaging(state).compile()}
        else:  # the executables bytes_between_nodes compiled
            compiled = step._compiled_phases(state, batch)
    return {
        phase: Phase(library[phase], tuple(hlo_sends(program.as_text())))
        for phase, program in compiled.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    print(f"JAX {jax.__version__}; 2 deviceless slices of {TWO_HOSTS[0]} (async: of "
          f"{ONE_HOST[0]}); MLP 2 x {args.dim} x {args.dim} float32, 64 rows per chip")  # fmt: skip
    print(f"{'case':28s} {'phase':10s} {'library B':>10s} {'HLO sends B':>12s} {'ratio':>6s} "
          f"{'sends by dtype':34s} {'compile s':>9s}")  # fmt: skip
    for name in args.cases.split(","):
        start = time.perf_counter()
        phases = between_slices(CASES[name], args.dim)
        seconds = time.perf_counter() - start
        for phase, got in phases.items():
            ratio = got.library / got.hlo_bytes if got.hlo_bytes else float("nan")
            dtypes = ", ".join(f"{d} {b:,}" for d, b in got.dtype_bytes().items()) or "-"
            print(f"{name:28s} {phase:10s} {got.library:10,.0f} {got.hlo_bytes:12,d} "
                  f"{ratio:6.2f} {dtypes:34s} {seconds:9.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
