"""shard="params" on models as people write them, on 2 x 4 CPU devices: a Llama-style decoder with
per-layer remat, as a scanned stack and as a list of layers, and NNX's stacked blocks with
Dropout. Each trains as with shard=None, and each layer is gathered where the model uses it."""

import inspect
import re
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_all_close, load_script

import jax_bytegrad
from jax_bytegrad.checkpoint import Checkpointer

LLAMA = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "_llama.py")
SHAPE = LLAMA.Shape(layers=3, dim=32, ffn=64, heads=4, vocab=256)
SEQ = 16


def token_batches(steps: int, rows: int = 16) -> list[np.ndarray]:
    """Windows of real text (the bytes of a standard-library module), ``(rows, SEQ + 1)``."""
    with open(inspect.getsourcefile(textwrap), "rb") as f:
        text = np.frombuffer(f.read(), np.uint8).astype(np.int32)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(text) - SEQ - 1, size=(steps, rows))
    return [np.stack([text[s : s + SEQ + 1] for s in row]) for row in starts]


# The sharded step sums each node's rows in another order than the replicated one: float32
# rounding, 3e-8 after a step. A large step size (SGD at 0.5, or Adam, whose steps on near-zero
# gradients turn on that rounding) makes the two runs part exponentially (1e-2 after 12 steps,
# measured), so the params' parity is checked at a step size where they stay within 2e-6, the
# losses' under AdamW.
OPTIMIZERS = {"gradient_allreduce": optax.sgd(0.1, momentum=0.9), "bytegrad": optax.adamw(3e-3)}


def train(algorithm: str, shard, *, scan: bool, steps: int, mark=False, mesh_shape=(2, 4),
          **settings):  # fmt: skip
    """The Llama decoder trained on ``mesh_shape`` (nodes, devices per node) for ``steps``
    steps (``mark``: ``LLAMA.loss_fn``'s, ``settings``: the Strategy's); returns its params,
    losses and last state."""
    params = jax.device_get(LLAMA.init(SHAPE, jax.random.key(0), scan=scan))
    mesh = jax_bytegrad.make_mesh(*mesh_shape)
    strategy = jax_bytegrad.Strategy(algorithm, mesh=mesh, shard=shard, **settings)
    loss = LLAMA.loss_fn(SHAPE, scan=scan, mark=mark)
    with strategy.train_step(loss, OPTIMIZERS[algorithm]) as step:
        state = step.init(params)
        losses = []
        for batch in token_batches(steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return jax.device_get(step.params(state)), losses, state


@pytest.mark.slow
# Each form once, each algorithm once: the sync is the same code for a list and a scan.
@pytest.mark.parametrize(
    ("algorithm", "scan"),
    [("gradient_allreduce", False), ("bytegrad", True)],
    ids=["list", "scanned"],
)
def test_a_llama_decoder_trains_with_params_sharded_as_replicated(algorithm, scan):
    want_params, want, _ = train(algorithm, None, scan=scan, steps=12)
    got_params, got, state = train(algorithm, "params", scan=scan, steps=12)
    assert want[-1] < 0.95 * want[0], "the model did not learn"
    if algorithm == "gradient_allreduce":
        assert_trees_all_close(got_params, want_params, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=0.01)
    # Each device rests with a quarter of every layer: a stacked leaf split along a layer's
    # own dimension, not the one the scan runs over.
    wq = state.params["layers"]["wq"] if scan else state.params["layers"][0]["wq"]
    block = wq.addressable_shards[0].data.shape
    assert block == ((SHAPE.layers, SHAPE.dim // 4, SHAPE.dim) if scan else (8, SHAPE.dim))


def _all_gathers(hlo: str) -> dict[str, list[str]]:
    """The result shapes of the all-gathers in each computation of an HLO module."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
        found = re.search(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", line)
        if found:
            out.setdefault(name, []).append(found.group(1))
    return out


def test_a_scanned_stack_is_gathered_one_layer_at_a_time_inside_the_loop():
    params = LLAMA.param_shapes(SHAPE, scan=True)
    strategy = jax_bytegrad.Strategy(
        "gradient_allreduce", mesh=jax_bytegrad.make_mesh(2, 4), shard="params"
    )
    with strategy.train_step(LLAMA.loss_fn(SHAPE, scan=True), optax.adam(1e-3)) as step:
        batch = jax.ShapeDtypeStruct((16, SEQ + 1), jnp.int32)
        hlo = step.lower(step.state_shapes(params), batch).compile().as_text()
    gathers = _all_gathers(hlo)
    stacked = f"f32[{SHAPE.layers},{SHAPE.dim},{SHAPE.dim}]"
    shapes = [s for found in gathers.values() for s in found]
    assert stacked not in shapes, "the whole stack was gathered"
    # One layer's matrices are gathered, in the loops' bodies (forward, and the backward's
    # recomputation under the remat).
    bodies = set(re.findall(r"while\(.*body=%?([\w.\-]+)", hlo))
    layer = f"f32[{SHAPE.dim},{SHAPE.dim}]"
    in_bodies = [name for name, found in gathers.items() if layer in found and name in bodies]
    assert len(in_bodies) >= 2, (bodies, gathers)


def test_a_stack_split_along_its_layers_is_named_in_a_warning():
    # 8 layers of 2 x 2: the layer dimension is the only one 4 devices divide.
    params = {"stack": np.ones((8, 2, 2), np.float32) * 0.1}

    def loss_fn(params, x):
        return jnp.mean(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["stack"])[0])

    strategy = jax_bytegrad.Strategy(
        "gradient_allreduce", mesh=jax_bytegrad.make_mesh(2, 4), shard="params"
    )
    with strategy.train_step(loss_fn, optax.sgd(0.1)) as step:
        state = step.init(params)
        with pytest.warns(UserWarning, match=r"params\['stack'\].*gathered whole"):
            step(state, np.ones((8, 2), np.float32))


def _stacked_blocks_model(nnx, layers: int = 4, dim: int = 16):
    """NNX's stacked-blocks pattern: blocks built under nnx.vmap with split RNG streams, run
    by nnx.scan under nnx.remat, each with Dropout."""

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(dim, dim, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.drop(jax.nn.relu(self.linear(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)
            self.head = nnx.Linear(dim, 1, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def run(x, block):
                return block(x)

            return self.head(run(x, self.blocks))[:, 0]

    return Model(nnx.Rngs(0, dropout=1))


def _regression_batches(steps: int, rows: int = 32, dim: int = 16):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(rows, dim)).astype(np.float32)
        out.append((x, np.tanh(x[:, :4].sum(1)).astype(np.float32)))
    return out


def _nnx_run(nnx, shard, steps: int):
    model = _stacked_blocks_model(nnx)
    strategy = jax_bytegrad.Strategy(
        "gradient_allreduce", mesh=jax_bytegrad.make_mesh(2, 4), shard=shard
    )

    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    step = jax_bytegrad.nnx.train_step(strategy, model, optax.adam(1e-2), loss_fn)
    return step, [float(step(b)["loss"]) for b in _regression_batches(steps)]


# "params", where stacked blocks failed; the reseed that fixed it is the same for every shard=.
@pytest.mark.parametrize("shard", ["params"])
def test_nnx_stacked_blocks_with_dropout_train_sharded_as_replicated(shard):
    nnx = pytest.importorskip("flax.nnx")
    base, want = _nnx_run(nnx, None, 6)
    step, got = _nnx_run(nnx, shard, 6)
    with base, step:
        assert want[-1] < want[0]
        # Each device's rows get the same dropout keys either way: the same training.
        np.testing.assert_allclose(got, want, rtol=1e-5)
        params = [nnx.to_pure_dict(nnx.state(s.model, nnx.Param)) for s in (step, base)]
        assert_trees_all_close(*params, atol=1e-5)
        kernel = step.state.params["blocks"]["linear"]["kernel"]
        if shard == "params":  # (layers, 16, 16): split along a layer's own dimension
            assert kernel.addressable_shards[0].data.shape == (4, 4, 16)


def test_an_nnx_run_with_params_sharded_restores_exactly(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    batches = _regression_batches(6)
    step, _ = _nnx_run(nnx, "params", 0)
    with step, Checkpointer(tmp_path, every=1) as ckpt:
        for b in batches[:3]:
            step(b)
        ckpt.save(3, step.state)
        ckpt.wait()
        for b in batches[3:]:
            step(b)
        want = jax.device_get(step.train_step.params(step.state))
    again, _ = _nnx_run(nnx, "params", 0)
    with again, Checkpointer(tmp_path, every=1) as ckpt:
        start, restored = ckpt.restore_or_init(lambda: again.state, again.state_shapes())
        again.state = restored
        assert start == 3
        assert (
            restored.params["head"]["kernel"].sharding
            == step.state.params["head"]["kernel"].sharding
        )
        for b in batches[start:]:
            again(b)
        got = jax.device_get(again.train_step.params(again.state))
    assert_trees_all_close(got, want)


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "list"])
def test_each_remat_layer_releases_its_gradients_together(scan):
    """shard="params" rewrites a list's top-level checkpoints so that a layer's input
    cotangents (its weights' and the one for the layer below) come out of one barrier: XLA
    cannot run the data gradient through every layer and leave the weight gradients for after
    the last (a 30B-shaped list held 58 GiB per device at its peak that way). Same values; a
    scan's body is left as it is."""
    from jax_bytegrad._src.steps.remat_order import tie_remat_backward

    params = LLAMA.init(SHAPE, jax.random.key(0), scan=scan)
    tokens = jnp.asarray(token_batches(1, rows=4)[0])
    loss = LLAMA.loss_fn(SHAPE, scan=scan)
    tied = tie_remat_backward(loss)
    want = jax.jit(jax.value_and_grad(loss))(params, tokens)
    got = jax.jit(jax.value_and_grad(tied))(params, tokens)
    assert_trees_all_close(got, want, atol=1e-6)

    def barriers(fn):
        return jax.jit(jax.grad(fn)).lower(params, tokens).as_text().count("optimization_barrier")

    # jax.checkpoint holds each recomputation's inputs behind a barrier; the rewrite holds
    # them with the cotangent, and adds one that releases the layer's gradients.
    added = barriers(tied) - barriers(loss)
    assert added == (0 if scan else SHAPE.layers), added
