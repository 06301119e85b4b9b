"""The training of train.py, unchanged on one process or on N: one node per process.

    # One process: one node of this machine's devices.
    python examples/multihost.py --algorithm bytegrad

    # Two processes on one machine, 4 CPU devices each: a 2 x 4 mesh whose "node" hop
    # crosses processes (Gloo over TCP). Without --algorithm: all six, async included.
    python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 examples/multihost.py
    python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 \\
        examples/multihost.py --algorithm bytegrad

    # The state split within each node (each process): each of its 4 devices keeps 1/4 of
    # the optimizer state (optimizer), or of the parameters too (params). Without
    # --algorithm: gradient_allreduce, bytegrad and qadam, the algorithms that can.
    python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 \\
        examples/multihost.py --algorithm bytegrad --shard params

    # A SLURM cluster, one task per host (GPU or CPU): JAX reads the layout from SLURM.
    srun python examples/multihost.py --algorithm bytegrad

``jax_bytegrad.initialize()`` runs first, before anything touches a device. ``make_mesh()``
then makes each process a node, every process draws the same global batch and hands the
``Strategy``'s step only its own rows, the parameters start identical everywhere, and only
process 0 prints.
"""

import os
import sys

import jax

import jax_bytegrad

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402


def main(argv=None) -> None:
    jax_bytegrad.initialize()
    train.run(train.parse_args(argv, processes=jax.process_count()))


if __name__ == "__main__":
    main()
