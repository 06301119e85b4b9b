"""Will it fit on TPUs: a Llama-style decoder's step on two deviceless TPU slices.

The model is ``_llama.py``'s (each layer under ``jax.checkpoint``, a scanned stack), float32
AdamW, sequence 2048, one row per chip; the mesh is ``make_mesh`` on a deviceless multi-slice
topology (libtpu: ``pip install 'jax[tpu]'`` on Python 3.12), one node per slice. Prints the
step's memory per chip against the TPU kind's (``memory_stats``), whether it fits, and the
bytes each chip sends between slices per step (``bytes_between_nodes``).

Usage:
  JAX_PLATFORMS=cpu python benchmarks/tpu_memory.py                       # 7b, v5p:2x2x2 x 2
  JAX_PLATFORMS=cpu python benchmarks/tpu_memory.py --models 7b,13b --shards none,params
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from jax.experimental import topologies

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _llama  # noqa: E402

import jax_bytegrad as jbg  # noqa: E402

SEQ, MIB = 2048, 2**20
SHARDS = {"none": None, "optimizer": "optimizer", "params": "params"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5p:2x2x2")
    parser.add_argument("--slices", type=int, default=2)
    parser.add_argument("--models", default="7b")
    parser.add_argument("--shards", default="params")
    args = parser.parse_args()
    devices = topologies.get_topology_desc(
        platform="tpu", topology_name=args.topology, num_slices=args.slices
    ).devices
    mesh = jbg.make_mesh(devices=devices)
    print(f"JAX {jax.__version__}; {args.slices} x {args.topology} ({devices[0].device_kind}), "
          f"mesh {dict(mesh.shape)}, deviceless")  # fmt: skip
    print(f"{'model':6s} {'shard':8s} {'peak GiB':>9s} {'of':>6s} {'fits':>5s} "
          f"{'MiB between slices':>19s} {'compile s':>9s}")  # fmt: skip
    for model in args.models.split(","):
        shape = _llama.SHAPES[model]
        batch = jax.ShapeDtypeStruct((mesh.devices.size, SEQ + 1), jnp.int32)
        for shard in args.shards.split(","):
            strategy = jbg.Strategy("bytegrad", mesh=mesh, shard=SHARDS[shard])
            loss = _llama.loss_fn(shape, scan=True)
            with strategy.train_step(loss, optax.adamw(1e-4)) as step:
                state = step.state_shapes(_llama.param_shapes(shape, scan=True), batch)
                start = time.perf_counter()
                memory = step.memory_stats(state, batch)["step"]
                seconds = time.perf_counter() - start
                sent = step.bytes_between_nodes(state, batch)["step"]
            print(
                f"{model:6s} {shard:8s} {memory.peak_bytes / 2**30:9.2f} "
                f"{memory.device_bytes / 2**30:6.2f} {str(memory.fits()):>5s} "
                f"{sent / MIB:19.2f} {seconds:9.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
