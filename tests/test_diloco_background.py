"""DiLoCo's exchange in the background (``Strategy("diloco", background=True)``): the same
landing as the exchange inside the steps, bit-identical replicas, resume mid-flight, the phases
and their bytes, bad input, and two processes over Gloo whose exchange runs on the step's
dispatch thread beside the inner steps."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import requires_gloo
from helpers import (
    assert_replicas_bit_identical,
    assert_trees_all_equal,
    load_script,
    needs_gpu_plugin,
)
from test_diloco import LOCAL, NODES, batches, loss_fn, node_params, params0, run, strategy

import jax_bytegrad
from jax_bytegrad.checkpoint import Checkpointer
from jax_bytegrad.sharding import gpu_mesh

REPO = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "_mp_scripts" / "diloco_worker.py"
worker = load_script(WORKER)


def nodes_after(step, data):
    """Each node's params after every step of ``data`` from ``params0``."""
    state, out = step.init(params0()), []
    for batch in data:
        state, _ = step(state, batch)
        out.append([node_params(state, n) for n in range(NODES)])
    return out, state


@pytest.mark.parametrize(
    "settings",
    [
        dict(delay=1, bits=8),
        dict(delay=3, fragments=2, bits=32, shard="params"),
        dict(delay=2, bits=32, shard="optimizer"),
    ],
    ids=["tau1_8bit", "tau3_f2_params", "tau2_optimizer"],
)
def test_the_background_lands_what_the_exchange_inside_the_steps_lands(settings):
    # The same outer step on the same pseudo-gradients, landing in the same step: the nodes'
    # params agree step by step to float32 rounding (the landing adds in another order). At
    # tau > 1 the steps' exchange goes in chunks, so only a float32 exchange sends the same
    # values; at tau = 1 both send the whole fragment, the same 8-bit codes.
    data = batches(11)
    got = {}
    for background in (False, True):
        s = strategy(inner_steps=4, background=background, **settings)
        with s.train_step(loss_fn, optax.adam(1e-2)) as step:
            got[background] = nodes_after(step, data)[0]
    for t, (inside, beside) in enumerate(zip(got[False], got[True], strict=True)):
        for n in range(NODES):
            for a, b in zip(jax.tree.leaves(beside[n]), jax.tree.leaves(inside[n]), strict=True):
                np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=f"step {t} node {n}")
    start = jax.tree.leaves(params0())
    moved = jax.tree.leaves(got[True][-1][0])
    assert all(not np.array_equal(a, b) for a, b in zip(moved, start, strict=True))


def test_an_exchange_in_the_background_starts_after_its_h_steps_and_lands_tau_later():
    s = strategy(inner_steps=4, fragments=2, delay=3, background=True, bits=4,
                 error_feedback=True)  # fmt: skip
    data = batches(9)
    with s.train_step(loss_fn, optax.adam(1e-2)) as step:
        assert step.phases == ("inner", "outer_0", "outer_1", "outer_0.land", "outer_1.land")
        names = [step._phase(i)[0] for i in range(9)]
        assert names == ["inner", "outer_0", "inner", "outer_1", "outer_0.land", "outer_0",
                         "outer_1.land", "outer_1", "outer_0.land"]  # fmt: skip
        traffic = step.bytes_between_nodes(step.state_shapes(params0()), data[0])
        state = run(step, data[:2])  # fragment 0's exchange has started, not landed
        glob = jax.device_get(step.params(state))
        assert_replicas_bit_identical(state.extra["global_params"], NODES * LOCAL)
        landing = state.extra["exchange_landing"][0]
        assert any(np.any(np.asarray(x) != 0) for x in landing)
        # The new global fragment minus each node's when the exchange started: each node's own.
        assert not np.array_equal(np.asarray(landing[0])[0], np.asarray(landing[0])[1])
        state = run(step, data[2:9], state)
        for n in range(NODES):  # the state keeps each node's params apart between exchanges
            assert not np.array_equal(node_params(state, n)["w1"], glob["w1"])
    # Only the steps that start an exchange send anything between nodes: each its fragment.
    assert traffic["inner"] == 0 and traffic["outer_0.land"] == traffic["outer_1.land"] == 0
    assert traffic["outer_0"] > 0 and traffic["outer_1"] > 0
    want = (traffic["outer_0"] + traffic["outer_1"]) / 4
    assert traffic["per_inner_step"] == pytest.approx(want)


def test_a_run_resumes_bit_exact_with_exchanges_in_flight(tmp_path):
    # After 6 steps both exchanges are in flight: fragment 1's started after step 4 and lands
    # in step 7, fragment 0's started after step 6 and lands in step 9 (counted from 1). The
    # checkpoint holds what each lands, with 4-bit residuals, the state split within the node.
    s = strategy(inner_steps=4, fragments=2, delay=3, background=True, bits=4,
                 error_feedback=True, shard="params")  # fmt: skip
    data = batches(10)
    with s.train_step(loss_fn, optax.adam(1e-2)) as step, Checkpointer(tmp_path, every=1) as ckpt:
        state = run(step, data[:6])
        assert step._phase(6)[0] == "outer_1.land" and step._phase(8)[0] == "outer_0.land"
        ckpt.save(6, state, force=True)
        ckpt.wait()
        straight = run(step, data[6:], state)
        target = step.state_shapes(params0())
        resumed = run(step, data[6:], ckpt.restore(6, lambda: target, target))
    assert_trees_all_equal(jax.device_get(resumed), jax.device_get(straight))
    start = params0()
    glob = jax.device_get(straight.extra["global_params"])
    assert all(not np.array_equal(glob[k], start[k]) for k in start)


def test_the_loss_is_the_mean_over_the_processs_devices_and_the_thread_stops_at_close():
    # One process holds every device here: its mean is the mean over all of them.
    data = batches(5)
    losses = {}
    for background in (False, True):
        s = strategy(inner_steps=2, delay=1, background=background)
        with s.train_step(loss_fn, optax.adam(1e-2)) as step:
            state = step.init(params0())
            losses[background] = []
            for batch in data:
                state, metrics = step(state, batch)
                losses[background].append(float(metrics["loss"]))
        if background:
            assert not step._dispatcher.alive
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(inner_steps=4, delay=0, background=True), "background=True runs each exchange"),
        (dict(inner_steps=4, background="yes"), "background must be True or False"),
    ],
    ids=["tau0", "not_bool"],
)
def test_bad_background_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        strategy(**kwargs)


@needs_gpu_plugin(covered_by="test_bad_background_settings_are_refused checks the others")
def test_the_background_is_refused_on_gpus():
    # Untested there, and not needed: XLA:GPU overlaps the exchange inside a step's program.
    mesh = gpu_mesh(2, 4, "h100")
    with pytest.raises(ValueError, match="background=True is for CPU hosts"):
        jax_bytegrad.Strategy("diloco", mesh=mesh, inner_steps=4, background=True)
    jax_bytegrad.Strategy("diloco", mesh=mesh, inner_steps=4, delay=2)  # the default's way


@pytest.mark.slow
@requires_gloo
def test_two_processes_of_one_device_match_one_process(tmp_path):
    """2 processes x 1 device over Gloo: the exchanges run on the dispatch thread beside the
    inner steps of the caller's, and a checkpoint saved mid-flight waits for them before its
    barrier; both processes end with the same global params, and each node's params are one
    process's 2 x 1 mesh's."""
    steps = 10
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    env.pop("NPROC", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jax_bytegrad.launch", "--nproc", "2", "--devices-per-proc", "1",
         "--timeout", "290", str(WORKER), str(tmp_path), str(steps)],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=300, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert (tmp_path / "ckpt" / "6").is_dir()  # saved with two exchanges in flight
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in (0, 1)]
    for key in worker.init_params():
        np.testing.assert_array_equal(ranks[1][f"global/{key}"], ranks[0][f"global/{key}"])
    single = worker.train(jax_bytegrad.make_mesh(2, 1), steps)
    assert not np.array_equal(single["global/w1"], worker.init_params()["w1"])  # it trained
    for r in (0, 1):
        for key, value in ranks[r].items():
            np.testing.assert_allclose(value, single[key], rtol=0, atol=2e-6, err_msg=key)
