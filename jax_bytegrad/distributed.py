"""Multi-process runs beyond ``jax_bytegrad.initialize`` (which joins the cluster): what it
returns, the launcher's environment variables, restarts and progress reports."""

from jax_bytegrad._src.runtime.cluster import COORDINATOR_ENV as COORDINATOR_ENV
from jax_bytegrad._src.runtime.cluster import CPU_DEVICES_ENV as CPU_DEVICES_ENV
from jax_bytegrad._src.runtime.cluster import FAIL_FAST_ENV as FAIL_FAST_ENV
from jax_bytegrad._src.runtime.cluster import NUM_PROCESSES_ENV as NUM_PROCESSES_ENV
from jax_bytegrad._src.runtime.cluster import PROCESS_ID_ENV as PROCESS_ID_ENV
from jax_bytegrad._src.runtime.cluster import PROGRESS_FILE_ENV as PROGRESS_FILE_ENV
from jax_bytegrad._src.runtime.cluster import QUIET_ENV as QUIET_ENV
from jax_bytegrad._src.runtime.cluster import RESTART_ENV as RESTART_ENV
from jax_bytegrad._src.runtime.cluster import DistributedInfo as DistributedInfo
from jax_bytegrad._src.runtime.cluster import ensure_cpu_threads as ensure_cpu_threads
from jax_bytegrad._src.runtime.cluster import report_progress as report_progress
from jax_bytegrad._src.runtime.cluster import restart_count as restart_count

__all__ = [
    "COORDINATOR_ENV",
    "CPU_DEVICES_ENV",
    "FAIL_FAST_ENV",
    "NUM_PROCESSES_ENV",
    "PROCESS_ID_ENV",
    "PROGRESS_FILE_ENV",
    "QUIET_ENV",
    "RESTART_ENV",
    "DistributedInfo",
    "ensure_cpu_threads",
    "report_progress",
    "restart_count",
]
