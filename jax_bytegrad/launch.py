"""``python -m jax_bytegrad.launch``: start, watch and restart the processes of a run."""

import sys

from jax_bytegrad._src.runtime.hugepages import with_hugepages as with_hugepages
from jax_bytegrad._src.runtime.launcher import launch as launch
from jax_bytegrad._src.runtime.launcher import main as main

__all__ = ["launch", "main", "with_hugepages"]

if __name__ == "__main__":
    sys.exit(main())
