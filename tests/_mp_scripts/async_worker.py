"""Worker for tests/test_async_averaging.py: asynchronous model averaging on several processes.

Run it under ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 2``. It checks, in order:
1. the exact round math: with snapshots s_p and local updates u_p made meanwhile, a round
   gives x_p = s_p + u_p + mean(s) - s_p;
2. the background thread averages while the main thread trains (rounds > 0), abort() stops
   every process's thread after the same round, resume() restarts it, and abort() again
   returns promptly;
3. convergence on sklearn's digits: async after a warm-up is within 2 points of a
   synchronous gradient all-reduce run, after one final exact average.
"""

import sys
import time

from jax_bytegrad import initialize

initialize()  # must precede any JAX computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _gather import process_rows  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jax_bytegrad  # noqa: E402
from jax_bytegrad.experimental import async_model_average  # noqa: E402

rank, nproc = jax.process_index(), jax.process_count()
mesh = jax_bytegrad.make_mesh()
assert mesh.shape["node"] == nproc, mesh.shape


def say(*args):
    print(*args, flush=True)


# 1. Exact round math ----------------------------------------------------------------------
avg = async_model_average(
    lambda w, b: jnp.mean((b @ w) ** 2), optax.sgd(0.0), mesh, sync_interval_ms=0
)
snap = {"w": jnp.full((3,), 1.0 + rank), "b": jnp.asarray([10.0 * rank])}
local_update = {"w": jnp.full((3,), 0.5 * rank), "b": jnp.asarray([-1.0])}
params = avg.init(snap).params
avg._averager.publish(params)
avg._averager.round(False)
got = avg.pull(jax.tree.map(lambda s, u: s + u, params, local_update))
mean_s = {
    "w": np.full(3, np.mean([1.0 + p for p in range(nproc)])),
    "b": np.asarray([np.mean([10.0 * p for p in range(nproc)])]),
}
for k in ("w", "b"):
    want = np.asarray(snap[k]) + np.asarray(local_update[k]) + mean_s[k] - np.asarray(snap[k])
    np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-6)
say("round math OK")

# 2 and 3: digits --------------------------------------------------------------------------
x, y = load_digits(return_X_y=True)
order = np.random.default_rng(0).permutation(len(y))
x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
(xtr, ytr), (xte, yte) = (x[:1440], y[:1440]), (x[1440:], y[1440:])
rng = np.random.default_rng(0)
init = {
    "w1": rng.standard_normal((64, 64)).astype(np.float32) / 8.0,
    "b1": np.zeros(64, np.float32),
    "w2": rng.standard_normal((64, 10)).astype(np.float32) / 8.0,
    "b2": np.zeros(10, np.float32),
}


def logits(p, xb):
    return jax.nn.relu(xb @ p["w1"] + p["b1"][None]) @ p["w2"] + p["b2"][None]


def xent(p, batch):
    xb, yb = batch
    return optax.softmax_cross_entropy_with_integer_labels(logits(p, xb), yb).mean()


def accuracy(p):
    p = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), p)
    return float(np.mean(np.argmax(np.asarray(logits(p, xte)), -1) == yte))


def my_batches_of(process, steps, per_process=64, seed=0):
    # Each process draws its own rows: a different shard of the global batch.
    r = np.random.default_rng(seed + 1000 * process)
    for _ in range(steps):
        idx = r.choice(len(ytr), per_process, replace=False)
        yield xtr[idx], ytr[idx]


STEPS = 250
opt = optax.sgd(0.2, momentum=0.9)
# The gradient all-reduce baseline, computed in-process: the mean gradient over every
# process's rows is what a synchronous all-reduce step applies. (A cross-process
# data_parallel_step did not finish on CPU/Gloo here; see docs/async.md.)
everyone = [my_batches_of(r, STEPS) for r in range(nproc)]
p, s = jax.tree.map(jnp.asarray, init), opt.init(jax.tree.map(jnp.asarray, init))
sgd_step = jax.jit(
    lambda p, s, b: (
        lambda g: (optax.apply_updates(p, opt.update(g, s, p)[0]), opt.update(g, s, p)[1])
    )(jax.grad(xent)(p, b))
)
for parts in zip(*everyone, strict=True):
    batch = (np.concatenate([b[0] for b in parts]), np.concatenate([b[1] for b in parts]))
    p, s = sgd_step(p, s, batch)
p = jax.tree.map(lambda a: jax.device_put(a, jax.local_devices()[0]), p)
baseline = accuracy(p)
say(f"baseline {baseline:.4f}")

avg = async_model_average(xent, opt, mesh, sync_interval_ms=20, warmup_steps=0)
state = avg.init(init)
say("async init")
start = time.perf_counter()
for i, batch in enumerate(my_batches_of(rank, STEPS)):
    if i == STEPS // 2:
        avg.abort()
        stats = avg.round_stats
        assert not stats.running and stats.rounds > 0, stats
        say(f"aborted after {stats.rounds} rounds at step {i}")
        avg.resume()
        assert avg.round_stats.running
    if rank == 1 and i % 10 == 0:
        time.sleep(0.05)  # a straggler: the other process does not wait for it
    state, metrics = avg.step(state, batch)
    if i % 25 == 0:
        say(f"step {i} rounds {avg.round_stats.rounds}")
t0 = time.perf_counter()
avg.close()  # collective: stops every process's averaging after the same round
abort_s = time.perf_counter() - t0
stats = avg.round_stats
assert not stats.running, stats
p = avg.params(state)  # one exact average over the processes
acc = accuracy(p)
# After the exact average every process holds the same model, up to x + (m - x) rounding.
flat = np.concatenate(
    [np.ravel(np.asarray(a.addressable_shards[0].data)) for a in jax.tree.leaves(p)]
)
both = process_rows(flat, mesh)
np.testing.assert_allclose(both[0], both[-1], rtol=1e-5, atol=1e-7)
say(
    f"rank {rank}: gradient_allreduce={baseline:.4f} async={acc:.4f} rounds={stats.rounds} "
    f"abort_s={abort_s:.3f} train_s={time.perf_counter() - start:.1f}"
)
assert acc >= baseline - 0.02, (acc, baseline)
avg.close()  # idempotent
jax.distributed.shutdown()
say("OK")
sys.exit(0)
