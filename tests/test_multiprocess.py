"""Multi-process training on one machine: 2 processes x 4 CPU devices over Gloo on loopback.

Each test starts ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4`` on a worker in
``tests/_mp_scripts`` and compares its output with the same computation in this process (8 CPU
devices from conftest). That a failing worker makes the launcher stop the others and exit
non-zero is tested in tests/test_launch.py (``test_a_failing_rank_makes_the_launcher_stop_the_
other``), on the same 2 x 4 layout.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import requires_gloo
from helpers import load_script

import jax_bytegrad

SCRIPTS = Path(__file__).parent / "_mp_scripts"
REPO = Path(__file__).parent.parent
WORKER = SCRIPTS / "train_worker.py"


pytestmark = [pytest.mark.slow, requires_gloo]


worker = load_script(WORKER)


def _env() -> dict[str, str]:
    """The workers' environment: this one's, less the device count, which comes from
    --devices-per-proc (conftest's other XLA flags stay)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "host_platform_device_count" not in f)
    return env


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """Runs the worker on 2 processes x 4 devices once; returns its output directory."""
    out_dir = tmp_path_factory.mktemp("mp_train")
    proc = subprocess.run(
        [sys.executable, "-m", "jax_bytegrad.launch", "--nproc", "2", "--devices-per-proc", "4",
         "--timeout", "440", str(WORKER), str(out_dir)],
        cwd=REPO,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=450,
        text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    for rank in (0, 1):
        assert f"[rank {rank}] OK" in proc.stdout, proc.stdout
    return out_dir


# Per-device gradients, float32 sums over the 2 nodes (a + b commutes) and the code exchange are
# bit-for-bit the same in both runs. A float32 sum over the 4 devices of a node is not: Gloo's ring
# reduce-scatter adds chunk c of the buffer in the order ((g[c+2] + g[c+3]) + g[c+1]) + g[c]
# (indices mod 4), XLA's in-process CPU collective in device order ((g0 + g1) + g2) + g3, so
# the sums differ by an ulp here and there (measured on JAX 0.10.2). Flat ByteGrad
# (hierarchical=False) has no float32 sum between devices, only codes exchanged and averaged
# in a fixed order, and must match bit for bit; the others must agree to float32 rounding.
# A lost or doubled gradient would move these parameters by ~1e-3, far past that tolerance.
ROUNDING_ATOL = 2e-6  # ~16 ulp at |x| = 1; measured: 3e-8 (bytegrad), 5e-7 (qadam)
# 20 steps of QAdam: those ulps compound, magnified where Adam divides by a small frozen
# second moment. Measured 2.6e-6 (qadam4_ef), where the parameters moved by up to 2.6.
DRIFT_ATOL = 2e-5
# A value that one run rounds to one side of a code boundary and the other to the next code
# moves by one code step, then by lr * step / sqrt(v) in the parameter: an ulp of difference
# anywhere can do it. Measured in one process: one initial weight moved by 1 ulp left QAdam's
# parameters (5 steps, lr 1e-2) within 3e-8 but for one value of 5674, 2.0e-4 off. So at most
# 0.1% of the values may differ by up to FLIP_ATOL; a lost or doubled gradient moves many.
FLIP_ATOL = 1e-3
FLIP_SHARE = 1e-3
EXPECTED = {
    "bytegrad_flat": "bit-identical",
    "qadam": "rounding",
    "bytegrad_128": "rounding",
    "bytegrad_128_split": "rounding",
    "bytegrad4_ef_flat": "bit-identical",
    "bytegrad4_ef": "rounding",  # measured: 6e-8
    "qadam4_ef": "drift",
}


@pytest.mark.parametrize("name", sorted(worker.ALGORITHMS))
def test_two_processes_match_one_process(two_process_run, name):
    # Both processes hold bit-identical replicas ...
    ranks = [dict(np.load(two_process_run / f"{name}_rank{r}.npz")) for r in (0, 1)]
    assert sorted(ranks[0]) == sorted(worker.init_params())
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[1][key], ranks[0][key], err_msg=f"{name} {key}")

    # ... and the parameters of one process with 8 devices on the same 2 x 4 mesh.
    assert jax.device_count() >= 8
    single = worker.train(name, jax_bytegrad.make_mesh(2, 4))
    initial = worker.init_params()
    assert not np.array_equal(single["w1"], initial["w1"])  # it trained
    for key, value in single.items():
        if EXPECTED[name] == "bit-identical":
            np.testing.assert_array_equal(ranks[0][key], value, err_msg=f"{name} {key}")
        else:
            atol = DRIFT_ATOL if EXPECTED[name] == "drift" else ROUNDING_ATOL
            off = np.abs(ranks[0][key] - value) > atol
            assert off.sum() <= FLIP_SHARE * off.size, (name, key, int(off.sum()), off.size)
            np.testing.assert_allclose(
                ranks[0][key], value, rtol=0, atol=FLIP_ATOL, err_msg=f"{name} {key}"
            )


def test_message_split_changes_no_bit_over_gloo(two_process_run):
    """One message per peer, or one block per message: the same parameters on every rank."""
    for rank in (0, 1):
        whole = np.load(two_process_run / f"bytegrad_128_rank{rank}.npz")
        split = np.load(two_process_run / f"bytegrad_128_split_rank{rank}.npz")
        assert sorted(whole) == sorted(split)
        for key in whole:
            np.testing.assert_array_equal(split[key], whole[key], err_msg=f"rank {rank} {key}")


def test_collectives_inside_lax_cond_do_not_deadlock_under_load():
    """QAdam's one-program form (both phases' collectives in a lax.cond, the branch flipping
    every step or two) on 2 processes x 4 devices, while two busy loops load both cores.

    The step builders pick a phase's program on the host instead (one program per phase);
    this is the form a user's own jit of ``optax.chain(qadam(...))`` compiles to. The worker
    starts the busy loops (one per process) once its first step has compiled the program.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "jax_bytegrad.launch", "--nproc", "2",
         "--devices-per-proc", "4", "--timeout", "500", str(SCRIPTS / "cond_worker.py")],
        cwd=REPO, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=560, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in (0, 1):
        assert f"[rank {rank}] cond OK after 40 steps" in proc.stdout, proc.stdout[-4000:]
