"""State split within each node, compiled for GPUs that are not here (``sharding.gpu_mesh``):
each device needs less memory with ``shard="optimizer"``, and holds less state again with
``"params"``, while the same bytes cross between nodes as with the replicated step.

``benchmarks/memory.py`` measures the same on a 6.44B-parameter model (benchmarks/RESULTS.md,
"Sharded state within a node"); here a few small layers compile in seconds. Compiling for
GPUs needs JAX's CUDA plugin (the ``cuda12`` extra, Python 3.12); without it these tests
skip, and tests/test_sharding.py checks the same bytes and state on the CPU mesh.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import load_script, needs_gpu_plugin

import jax_bytegrad as jbg
from jax_bytegrad.sharding import gpu_mesh

ALGORITHMS = {
    # Hierarchical, as the sharded steps' sync between nodes is: the same bytes to compare.
    "gradient_allreduce": {"hierarchical": True},
    "bytegrad": {},
    "bytegrad_4bit_ef": {"bits": 4, "error_feedback": True},
    "qadam": {"learning_rate": 1e-3, "warmup_steps": 2},
}
LAYERS, DIM, PER_DEVICE = 4, 512, 8  # 4 MiB of float32 params


needs_plugin = needs_gpu_plugin()


# The benchmark's MLP (benchmarks/gpu_schedule.py), small.
GPU_SCHEDULE = load_script(
    Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_schedule.py"
)


def _figures(name: str, shard):
    """``memory_stats`` and the bytes between nodes of each phase, compiled for 2 x 4 H100s."""
    algorithm = name.split("_4bit")[0]
    strategy = jbg.Strategy(algorithm, mesh=gpu_mesh(2, 4), shard=shard, **ALGORITHMS[name])
    optimizer = None if algorithm == "qadam" else optax.adam(1e-3)
    params, loss_fn, batch_of = GPU_SCHEDULE.mlp(LAYERS, DIM, PER_DEVICE)
    batch = batch_of(8)
    with strategy.train_step(loss_fn, optimizer) as step:
        state = step.state_shapes(params)
        memory = step.memory_stats(state, batch)
        sent = {p: s.bytes_on("node") for p, s in step.communication_stats(state, batch).items()}
    return memory, sent


@needs_plugin
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_sharded_steps_need_less_memory_and_send_the_same_bytes_between_nodes(name):
    figures = {shard: _figures(name, shard) for shard in (None, "optimizer", "params")}
    memory = {shard: m for shard, (m, _) in figures.items()}
    sent = {shard: s for shard, (_, s) in figures.items()}
    params_bytes = LAYERS * DIM * DIM * 4
    assert set(memory[None]) == set(memory["params"]) == set(sent[None])
    for phase in memory[None]:
        state = {shard: memory[shard][phase].argument_bytes for shard in memory}
        # Params and two moments (Adam's, QAdam's): 3 P whole; P + 2 P / 4 with "optimizer";
        # 3 P / 4 with "params". Residuals of error feedback and the batch are the same in all.
        assert state["params"] < state["optimizer"] < state[None], (phase, state)
        assert state[None] - state["optimizer"] >= 2 * params_bytes * 3 / 4, (phase, state)
        assert state[None] - state["params"] >= 3 * params_bytes * 3 / 4, (phase, state)
        peak = {shard: memory[shard][phase].peak_bytes for shard in memory}
        assert max(peak["optimizer"], peak["params"]) < peak[None], (phase, peak)
        assert sent[None][phase] > 0
        for shard in ("optimizer", "params"):
            assert sent[shard][phase] == pytest.approx(sent[None][phase], rel=0.01), (shard, phase)


LLAMA = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "_llama.py")


def _scanned(shard, settings):
    """``memory_stats`` and the exchanges between nodes (``overlap_on``) of a scanned Llama
    decoder's bytegrad step, each layer marked with ``exchange_in_loop`` (inside its
    checkpoint for ``"full"``), compiled for 2 x 4 H100s; and the decoder's shape."""
    shape = LLAMA.Shape(layers=8, dim=256, ffn=512, heads=4, vocab=256)
    strategy = jbg.Strategy("bytegrad", mesh=gpu_mesh(2, 4), shard=shard, **settings)
    batch = jax.ShapeDtypeStruct((8, 33), jnp.int32)
    loss = LLAMA.loss_fn(shape, scan=True, mark="inside" if shard == "full" else True)
    with strategy.train_step(loss, optax.adamw(1e-4)) as step:
        state = step.state_shapes(LLAMA.param_shapes(shape, scan=True), batch)
        memory = step.memory_stats(state, batch)["step"]
        overlap = step.communication_stats(state, batch)["step"].overlap_on("node")
        return memory, overlap, shape


@needs_plugin
@pytest.mark.parametrize("shard", ["full", "params"])
def test_error_feedback_in_the_loop_holds_its_residuals_once(shard):
    # Each marked layer's backward reads its residuals and overwrites them in place (a
    # jax.Ref): they sit in the step's arguments, and its temporaries are the step's without
    # feedback. Passed in beside the params instead, the new residuals came back as a
    # cotangent, a second stack written while the first was read (temp + the residuals).
    plain, _, shape = _scanned(shard, {"bits": 4})
    fed, _, _ = _scanned(shard, {"bits": 4, "error_feedback": True})
    residuals = fed.argument_bytes - plain.argument_bytes
    # At least 1/L of the model in float32 per device (L = 4 devices per node).
    assert residuals >= 0.9 * shape.parameters() * 4 / 4, (residuals, shape.parameters())
    assert fed.temp_bytes - plain.temp_bytes < 0.1 * residuals, (fed, plain)


@needs_plugin
def test_full_gathers_the_next_layer_beside_this_ones_gemms():
    # XLA's collective pipeliner, which the "full" step turns on: the forward loop issues the
    # next layer's 8-bit weight gather across nodes in this layer's iteration (one iteration
    # fewer), beside its gemms. Without it each gather ran alone, before its layer.
    _, overlap, shape = _scanned("full", {})
    gathers = [e for e in overlap.exchanges if e.kind == "all-gather" and e.runs]
    assert any(e.runs == shape.layers - 1 and e.gemms_beside > 0 for e in gathers), gathers
