"""The wires between nodes: the integer all-reduce wire and the rings (``_src/sync/wire.py``).

Per-device inputs are rows of a (devices, size) array, row d on the device at flat mesh
position d. ``BLOCK`` is small so that a few thousand values make several blocks per device.
"""

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gloo
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad import SyncConfig, compressed_mean, full_precision_mean
from jax_bytegrad._src.codecs import Codec, integer
from jax_bytegrad._src.sync import wire as wire_lib
from jax_bytegrad._src.sync.config import plan_sync
from jax_bytegrad._src.sync.patterns import ring_all_gather
from jax_bytegrad.experimental import residual_sizes, ring_all_to_all
from jax_bytegrad.profiling import communication_stats

pytestmark = pytest.mark.usefixtures("strict_dtypes")

AXES = ("node", "local")
BLOCK = 256
SIZE = 8 * BLOCK * 3  # three blocks per device shard on every mesh below
# (nodes, devices per node, hierarchical): every way the integer sum's group is formed.
MESHES = [(2, 4, True), (4, 2, True), (8, 1, True), (1, 8, False), (2, 4, False)]
MESH_IDS = ["2x4", "4x2", "8x1", "1x8-flat", "2x4-flat"]


def _mesh(nodes, local):
    return jax_bytegrad.make_mesh(nodes, local)


def _put(mesh, x):
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(AXES)))


def _mean(mesh, x, *, key=None, **kwargs):
    """compressed_mean of each device's row of ``x``; returns every device's copy, (8, size)."""
    key_data = None if key is None else jax.random.key_data(key)
    out = _mean_program(mesh, _settings(**kwargs))(_put(mesh, x), key_data)
    return np.stack([np.asarray(s.data) for s in out.addressable_shards])


def _settings(**kwargs):
    """``_mean``'s SyncConfig settings, as a key of ``_mean_program``."""
    kwargs = {"block_size": BLOCK, "bucket_bytes": None, "message_bytes": None, **kwargs}
    return tuple(sorted(kwargs.items()))


@functools.cache
def _mean_program(mesh, settings):
    """One jitted program per mesh and settings: a test drawing many keys compiles once."""

    def body(g, key_data):
        key = None if key_data is None else jax.random.wrap_key_data(key_data)
        return compressed_mean(g[0], key=key, sync=SyncConfig(**dict(settings)))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), P()), out_specs=P()))


def _group(nodes, local, hierarchical):
    return nodes if hierarchical else nodes * local


def _summands(x, nodes, local, hierarchical):
    """What the integer sum adds, in float64: node sums (hierarchical) or device rows."""
    x = np.asarray(x, np.float64)
    return x.reshape(nodes, local, -1).sum(1) if hierarchical else x


def _bound(x, nodes, local, hierarchical, levels, *, block=BLOCK):
    """Per element: the documented error bound of the mean, weight * g * scale / 2."""
    summands = _summands(x, nodes, local, hierarchical)
    g = summands.shape[0]
    blocks = summands.reshape(g, -1, block)
    scale = (blocks.max((0, 2)) - blocks.min((0, 2))) / levels
    return np.repeat(g * scale / 2 / (nodes * local), block)


def _data(seed, devices=8, size=SIZE):
    rng = np.random.default_rng(seed)
    scales = rng.uniform(0.01, 10.0, (1, size // BLOCK, 1))
    x = rng.standard_normal((devices, size // BLOCK, BLOCK)) * scales
    return x.reshape(devices, size).astype(np.float32)


# --- the integer all-reduce wire -----------------------------------------------------------


@pytest.mark.parametrize("nodes,local,hierarchical", MESHES, ids=MESH_IDS)
def test_mean_is_within_the_quantization_bound(nodes, local, hierarchical):
    x = _data(nodes)
    got = _mean(_mesh(nodes, local), x, wire="allreduce", hierarchical=hierarchical)
    levels = integer.allreduce_width(8, _group(nodes, local, hierarchical)).levels
    bound = _bound(x, nodes, local, hierarchical, levels)
    want = x.astype(np.float64).mean(0)
    error = np.abs(got[0] - want)
    # Float32 slack: the node sums and the decode round; far below the quantization step.
    assert np.all(error <= bound * (1 + 1e-4) + 1e-6 * np.abs(x).max()), error.max()
    assert error.max() > 0  # it was quantized, not sent in float32


def test_one_node_hierarchical_is_the_float32_mean():
    x = _data(1)
    got = _mean(_mesh(1, 8), x, wire="allreduce")
    np.testing.assert_allclose(got[0], x.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("nodes,local,hierarchical", MESHES, ids=MESH_IDS)
def test_replicas_are_bit_identical(nodes, local, hierarchical, rounding):
    key = jax.random.key(3) if rounding == "stochastic" else None
    got = _mean(
        _mesh(nodes, local),
        _data(7),
        key=key,
        wire="allreduce",
        hierarchical=hierarchical,
        rounding=rounding,
    )
    for copy in got[1:]:
        np.testing.assert_array_equal(copy.view(np.uint32), got[0].view(np.uint32))


def test_stochastic_rounding_is_unbiased_with_its_own_draws_per_device():
    # Every device holds a block spanning [-1, 1] and otherwise a value 0.3 of a stochastic
    # grid step above 0: nearest rounding always drops it, stochastic keeps it on average.
    nodes, local = 8, 1
    levels = integer.allreduce_width(8, nodes).levels
    step = 2.0 / (levels - 1)
    value = np.float32(0.3 * step)
    x = np.full((8, SIZE), value, np.float32)
    x[:, ::BLOCK] = -1.0
    x[:, 1::BLOCK] = 1.0
    mesh = _mesh(nodes, local)
    keys = 64
    draws = np.stack(
        [
            _mean(mesh, x, key=jax.random.key(k), wire="allreduce", rounding="stochastic")[0]
            for k in range(keys)
        ]
    )
    inner = np.ones(SIZE, bool)
    inner[::BLOCK] = inner[1::BLOCK] = False
    # One draw: each device rounds up with probability 0.3, independently of the others.
    sigma = step * np.sqrt(0.3 * 0.7 / (nodes * keys))
    np.testing.assert_array_less(np.abs(draws.mean(0)[inner] - value), 6 * sigma)
    # Devices draw their own uniforms: the mean of one draw takes values between 0 and step.
    assert len(np.unique(draws[0][inner])) > 2
    nearest = _mean(mesh, x, wire="allreduce")[0]
    assert np.all(np.abs(nearest[inner] - value) > 6 * sigma)  # the test can tell bias


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("nodes,local,hierarchical", MESHES, ids=MESH_IDS)
def test_zero_stays_exactly_zero(nodes, local, hierarchical, rounding):
    x = _data(11)
    x[:, 5::7] = 0.0  # zero on every device, inside blocks that span both signs
    x[:, BLOCK : 2 * BLOCK] = 0.0  # a block that is zero everywhere
    key = jax.random.key(5) if rounding == "stochastic" else None
    got = _mean(
        _mesh(nodes, local),
        x,
        key=key,
        wire="allreduce",
        hierarchical=hierarchical,
        rounding=rounding,
    )[0]
    assert np.all(got[5::7] == 0.0)
    assert np.all(got[BLOCK : 2 * BLOCK] == 0.0)
    assert np.count_nonzero(got) > SIZE // 2


@pytest.mark.parametrize("nodes,local,hierarchical", MESHES, ids=MESH_IDS)
def test_a_block_with_nan_or_inf_on_one_device_is_nan_on_every_replica(nodes, local, hierarchical):
    x = _data(13)
    x[3, 1 * BLOCK + 17] = np.nan
    x[6, 4 * BLOCK + 2] = np.inf
    x[1, 7 * BLOCK + 9] = -np.inf
    got = _mean(_mesh(nodes, local), x, wire="allreduce", hierarchical=hierarchical)
    blocks = got.reshape(8, -1, BLOCK)
    poisoned = [1, 4, 7]
    assert np.all(np.isnan(blocks[:, poisoned]))
    clean = np.delete(blocks, poisoned, axis=1)
    assert np.all(np.isfinite(clean))


def _worst_case():
    """Every device at the block maximum 3 but for one 0 per block: with nearest rounding
    every device sends the largest code, L, for all but one value."""
    x = np.full((8, SIZE), 3.0, np.float32)
    x[:, ::BLOCK] = 0.0
    return x


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(
    "nodes,local,hierarchical,bits,max_group",
    [
        (8, 1, True, 8, None),  # uint8, 8 nodes: 8 x 31 = 248
        (2, 4, False, 8, None),  # uint8, 8 devices flat
        (8, 1, True, 8, 4),  # uint16 forced at 8 nodes: 8 x 8191 = 65528
        (2, 4, True, 4, None),  # nibbles, 2 nodes: 2 x 7 = 14 in each half of a byte
    ],
    ids=["u8-8", "u8-8flat", "u16-8", "nibble-2"],
)
def test_sum_cannot_overflow_with_every_device_at_the_block_max(
    nodes, local, hierarchical, bits, max_group, rounding, monkeypatch
):
    if max_group is not None:
        monkeypatch.setitem(integer.MAX_GROUP, 8, max_group)
    group = _group(nodes, local, hierarchical)
    width = integer.allreduce_width(bits, group)
    assert group * width.levels <= 2 ** (8 if bits == 4 else width.bits) - 1
    assert width.bits == (16 if max_group else bits)
    x = _worst_case()
    key = jax.random.key(1) if rounding == "stochastic" else None
    got = _mean(
        _mesh(nodes, local),
        x,
        key=key,
        wire="allreduce",
        hierarchical=hierarchical,
        bits=bits,
        rounding=rounding,
        block_size=BLOCK if bits == 8 else 2 * BLOCK,
    )[0]
    top = np.ones(SIZE, bool)
    top[::BLOCK] = False
    # The codes sum without wrapping: the mean is the maximum (nearest: exactly on the grid;
    # stochastic: within its step), and the zeros stay zero. A wrapped sum would land far off.
    step = 3.0 / (width.levels - (rounding == "stochastic"))
    np.testing.assert_allclose(got[top], 3.0, rtol=0, atol=1e-6 if rounding == "nearest" else step)
    assert np.all(got[~top] == 0.0)


def test_widths_leave_room_for_every_group_size():
    for group in range(1, 4097):
        width = integer.allreduce_width(8, group)
        assert width.bits == (8 if group <= 8 else 16)
        assert group * width.levels <= 2**width.bits - 1 and width.levels >= 2
    assert integer.allreduce_width(8, 2).levels == 127
    assert integer.allreduce_width(4, 2) == integer.Width(4, 7)
    with pytest.raises(ValueError, match="4-bit codes sum over at most 2 devices.*got 3"):
        integer.allreduce_width(4, 3)
    with pytest.raises(ValueError, match="fewer than 2 levels"):
        integer.allreduce_width(8, 40000)


@pytest.mark.parametrize("nodes,local,hierarchical", MESHES, ids=MESH_IDS)
def test_error_feedback_loses_nothing_over_the_group(nodes, local, hierarchical):
    """Decoded sum + every device's new residual == sum of (input + old residual)."""
    mesh = _mesh(nodes, local)
    x = _data(17)
    config = SyncConfig(
        hierarchical=hierarchical, block_size=BLOCK, bucket_bytes=None, wire="allreduce"
    )
    sizes = residual_sizes(jax.ShapeDtypeStruct((SIZE,), jnp.float32), config, (nodes, local))
    ((send, mean),) = sizes
    assert (send, mean) == ((SIZE // local if hierarchical else SIZE), 0)
    old = np.random.default_rng(1).standard_normal((8, send)).astype(np.float32) * 0.01

    def body(g, r):
        out, ((new, empty),) = compressed_mean(
            g[0],
            residuals=((r[0], jnp.zeros(0, jnp.float32)),),
            sync=SyncConfig(
                wire="allreduce", hierarchical=hierarchical, block_size=BLOCK, bucket_bytes=None
            ),
        )
        return out, new[None], empty

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=(P(), P(AXES), P(AXES)))
    )
    out, new, empty = fn(_put(mesh, x), _put(mesh, old))
    out, new = np.asarray(out, np.float64), np.asarray(new, np.float64)
    assert empty.size == 0
    summands = _summands(x, nodes, local, hierarchical)  # (g, size)
    g = summands.shape[0]
    if hierarchical:  # device (i, j) holds shard j of node i's sum
        old_full = old.astype(np.float64).reshape(nodes, local * send)
        new_full = new.reshape(nodes, local * send)
    else:
        old_full, new_full = old.astype(np.float64), new
    total = (summands + old_full).sum(0)
    decoded_sum = out * (nodes * local)
    np.testing.assert_allclose(decoded_sum + new_full.sum(0), total, rtol=0, atol=1e-4)
    # Each residual is at most half a grid step: nearest rounding, nothing clipped.
    levels = integer.allreduce_width(8, g).levels
    blocks = (summands + old_full).reshape(g, -1, BLOCK)
    half_step = (blocks.max((0, 2)) - blocks.min((0, 2))) / levels / 2
    assert np.all(np.abs(new_full).reshape(g, -1, BLOCK) <= half_step[None, :, None] * 1.0001)


@pytest.mark.parametrize(
    "nodes,local,hierarchical",
    [(2, 4, True), (4, 2, True), (8, 1, True), (2, 4, False)],
    ids=["2x4", "4x2", "8x1", "2x4-flat"],
)
def test_bytes_between_nodes_are_at_most_027x_float32(nodes, local, hierarchical):
    mesh = _mesh(nodes, local)
    x = _put(mesh, jnp.ones((8, 2**18), jnp.float32))

    def jitted(f):
        return jax.jit(jax.shard_map(lambda g: f(g[0]), mesh=mesh, in_specs=P(AXES), out_specs=P()))

    wire = communication_stats(
        jitted(
            lambda g: compressed_mean(
                g, sync=SyncConfig(wire="allreduce", hierarchical=hierarchical)
            )
        ),
        x,
    )
    fp32 = communication_stats(
        jitted(lambda g: full_precision_mean(g, sync=SyncConfig(hierarchical=hierarchical))), x
    )
    assert wire.bytes_on("node") <= 0.27 * fp32.bytes_on("node")
    node_rows = [r for r in wire.rows if "node" in r.axes.split("+")]
    # Between nodes: one all-reduce of uint8 codes, one (max) of float32 block bounds and one
    # (max) of int32 decode factors.
    assert {(r.kind, r.dtype) for r in node_rows} == {
        ("all-reduce", "u8"),
        ("all-reduce", "f32"),
        ("all-reduce", "s32"),
    }
    codes = sum(r.bytes_sent for r in node_rows if r.dtype == "u8")
    assert codes >= 0.98 * wire.bytes_on("node")


@pytest.mark.parametrize("message_bytes", [None, BLOCK, 3 * BLOCK + 1], ids=str)
def test_the_integer_sum_is_one_psum_per_bucket_whatever_the_message_size(message_bytes):
    """An all-reduce cut into messages only runs slower through Gloo (RESULTS.md), so
    ``message_bytes`` sizes the pairwise exchanges only; the bucket is the psum."""
    mesh = _mesh(2, 4)
    fn = jax.jit(
        jax.shard_map(
            lambda g: compressed_mean(
                g[0],
                sync=SyncConfig(wire="allreduce", block_size=BLOCK, message_bytes=message_bytes),
            ),
            mesh=mesh,
            in_specs=P(AXES),
            out_specs=P(),
        )
    )
    stats = communication_stats(fn, _put(mesh, _data(19)))
    codes = [r for r in stats.rows if r.dtype == "u8" and "node" in r.axes.split("+")]
    assert [(r.kind, r.count) for r in codes] == [("all-reduce", 1)], stats


def test_four_bits_over_two_nodes_packs_nibbles_within_the_bound():
    x = _data(23)
    got = _mean(_mesh(2, 4), x, wire="allreduce", bits=4, block_size=BLOCK)
    bound = _bound(x, 2, 4, True, integer.allreduce_width(4, 2).levels)
    error = np.abs(got[0] - x.astype(np.float64).mean(0))
    assert np.all(error <= bound * (1 + 1e-4) + 1e-6 * np.abs(x).max())
    mesh = _mesh(2, 4)
    fn = jax.jit(
        jax.shard_map(
            lambda g: compressed_mean(g[0], sync=SyncConfig(wire="allreduce", bits=4)),
            mesh=mesh,
            in_specs=P(AXES),
            out_specs=P(),
        )
    )
    stats = communication_stats(fn, _put(mesh, jnp.ones((8, 2**18), jnp.float32)))
    fp32 = 2 * (2 - 1) / 2 * 4 * 2**18 / 4  # hierarchical float32 bytes between nodes
    assert stats.bytes_on("node") <= 0.14 * fp32


def test_four_bit_bytes_hold_adjacent_values_and_their_byte_sum_unpacks_to_the_code_sum():
    width, codec = integer.allreduce_width(4, 2), Codec(bits=4)
    rng = np.random.default_rng(5)
    a, b = (rng.integers(0, width.levels + 1, (3, 2 * BLOCK)).astype(np.float32) for _ in "ab")
    # Bounds [max, -min] = [levels, 0]: a grid of scale 1 and zero point 0, each value its code.
    bounds = jnp.tile(jnp.asarray([[width.levels, 0.0]], jnp.float32), (3, 1))
    encode = functools.partial(
        integer.integer_encode, codec, bounds=bounds, block_size=2 * BLOCK, width=width,
        seed=None, feedback=False,
    )  # fmt: skip
    packed = np.asarray(encode(jnp.asarray(a).reshape(-1))[0])
    assert packed.shape == (3, BLOCK) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, a[:, 0::2] + 16 * a[:, 1::2])
    total = jnp.asarray(packed) + encode(jnp.asarray(b).reshape(-1))[0]
    factors = integer.decode_factors(codec, bounds, width=width, group_size=2, weight=1.0)
    decoded = integer.integer_decode(codec, total, factors, width=width)
    np.testing.assert_array_equal(np.asarray(decoded).reshape(3, -1), a + b)


def test_four_bits_over_more_than_two_nodes_is_refused():
    with pytest.raises(ValueError, match="4-bit codes sum over at most 2 devices.*got 4"):
        _mean(_mesh(4, 2), _data(1), wire="allreduce", bits=4, block_size=2 * BLOCK)


def test_bad_wire_and_mismatched_residuals_are_refused():
    with pytest.raises(ValueError, match="wire must be one of .* got 'tcp'"):
        _mean(_mesh(2, 4), _data(1), wire="tcp")
    with pytest.raises(ValueError, match="wire must be one of"):
        SyncConfig(wire="tcp")
    mesh = _mesh(2, 4)
    sizes = residual_sizes(
        jax.ShapeDtypeStruct((SIZE,), jnp.float32),
        SyncConfig(block_size=BLOCK, bucket_bytes=None, wire="scatter_gather"),
        (2, 4),
    )
    scatter_gather = [(jnp.zeros(send), jnp.zeros(mean)) for send, mean in sizes]
    fn = jax.jit(
        jax.shard_map(
            lambda g: compressed_mean(
                g[0], residuals=scatter_gather,
                sync=SyncConfig(wire="allreduce", block_size=BLOCK, bucket_bytes=None),
            ),
            mesh=mesh,
            in_specs=P(AXES),
            out_specs=P(),
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match="residuals of per-device sizes"):
        fn(_put(mesh, _data(1)))


# --- ring patterns ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,axis", [((8, 1), "node"), ((4, 2), "node"), ((2, 4), AXES)], ids=["8", "4x2", "2x4"]
)
def test_ring_patterns_equal_all_to_all_and_all_gather(shape, axis):
    mesh = _mesh(*shape)
    n = shape[0] if axis == "node" else 8
    x = np.random.default_rng(0).integers(0, 255, (8, n, 5, 3)).astype(np.uint8)

    def body(x):
        x = x[0]
        return (
            ring_all_to_all(x, axis)[None],
            jax.lax.all_to_all(x, axis, 0, 0, tiled=True)[None],
            ring_all_to_all(x, axis, message_bytes=4)[None],
            ring_all_gather(x[0], axis, n, message_bytes=7)[None],
            jax.lax.all_gather(x[0], axis, axis=0)[None],
        )

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))
    ring, direct, ring_split, gathered_ring, gathered = (np.asarray(y) for y in fn(_put(mesh, x)))
    np.testing.assert_array_equal(ring, direct)
    np.testing.assert_array_equal(ring_split, direct)
    np.testing.assert_array_equal(gathered_ring, gathered)
    assert not np.array_equal(direct, x)  # the exchange moved data


# The ring changes only how codes travel, whatever the rounding: stochastic rounding on every
# mesh (its draws must land on the same values as the scatter-gather wire's), nearest on one.
RING_CASES = [(*mesh, "stochastic") for mesh in MESHES] + [(2, 4, True, "nearest")]


@pytest.mark.parametrize(
    "nodes,local,hierarchical,rounding",
    RING_CASES,
    ids=[f"{i}-stochastic" for i in MESH_IDS] + ["2x4-nearest"],
)
def test_ring_wire_gives_the_scatter_gather_result_bit_for_bit(
    nodes, local, hierarchical, rounding
):
    mesh = _mesh(nodes, local)
    x = _data(29)
    key = jax.random.key(4) if rounding == "stochastic" else None
    common = dict(key=key, hierarchical=hierarchical, rounding=rounding, message_bytes=BLOCK)
    ring = _mean(mesh, x, wire="ring", **common)
    direct = _mean(mesh, x, wire="scatter_gather", **common)
    np.testing.assert_array_equal(ring.view(np.uint32), direct.view(np.uint32))
    if _group(nodes, local, hierarchical) > 1:
        # The ring program just run (cached, not compiled again): shifts, no all_to_all.
        settings = _settings(wire="ring", hierarchical=hierarchical, rounding=rounding,
                             message_bytes=BLOCK)  # fmt: skip
        key_data = None if key is None else jax.random.key_data(key)
        stats = communication_stats(_mean_program(mesh, settings), _put(mesh, x), key_data)
        kinds = {r.kind for r in stats.rows}
        assert "all-to-all" not in kinds and "collective-permute" in kinds


# --- over Gloo, 2 processes x 4 devices ------------------------------------------------------

SCRIPTS = Path(__file__).parent / "_mp_scripts"


def _load_worker():
    spec = importlib.util.spec_from_file_location("wire_worker", SCRIPTS / "wire_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    """Runs the wire worker on 2 processes x 4 devices once; returns its output directory."""
    out_dir = tmp_path_factory.mktemp("mp_wire")
    repo = Path(__file__).parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)  # the device count comes from --devices-per-proc
    proc = subprocess.run(
        [sys.executable, "-m", "jax_bytegrad.launch", "--nproc", "2", "--devices-per-proc", "4",
         "--timeout", "440", str(SCRIPTS / "wire_worker.py"), str(out_dir)],
        cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=450, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    for rank in (0, 1):
        assert f"[rank {rank}] OK" in proc.stdout, proc.stdout
    return out_dir


@pytest.mark.slow
@requires_gloo
def test_integer_psum_over_gloo_keeps_replicas_bit_identical_across_processes(gloo_run):
    worker = _load_worker()
    mesh = _mesh(2, 4)
    rows = _put(mesh, worker.gradient())
    for name, case in worker.CASES.items():
        ranks = [np.load(gloo_run / f"{name}_rank{r}.npz") for r in (0, 1)]
        means = np.concatenate([r["mean"] for r in ranks])  # the 8 devices' copies
        for copy in means[1:]:
            np.testing.assert_array_equal(copy.view(np.uint32), means[0].view(np.uint32))
        assert np.all(np.isnan(means[0][3 * worker.BLOCK : 4 * worker.BLOCK]))
        single = worker.run_case(name, mesh, rows)
        if not case["hierarchical"]:
            # Integers only between devices: the same bits as on one process.
            np.testing.assert_array_equal(
                means[0].view(np.uint32), single["mean"][0].view(np.uint32), err_msg=name
            )
            kept = np.concatenate([r["kept"] for r in ranks])
            np.testing.assert_array_equal(kept, np.concatenate(single["kept"]), err_msg=name)
        else:
            # Gloo adds a node's 4 float32 values in another order than XLA in one process
            # (tests/test_multiprocess.py): a node sum, and so a block's bounds and grid, may
            # differ by an ulp, and a code by one step: 1/8 of a grid step of the mean here
            # (126 levels: the stochastic grid's, the coarser). A lost or doubled node's
            # contribution would be off by its whole value.
            finite = np.isfinite(means[0])
            x = worker.gradient()
            bound = _bound(np.nan_to_num(x), 2, 4, True, 126, block=worker.BLOCK)
            np.testing.assert_allclose(
                means[0][finite], single["mean"][0][finite], rtol=0, atol=bound[finite].max()
            )


def test_a_lone_leaf_is_encoded_where_it_lies_without_a_padded_copy():
    # 5000 values are not whole blocks: the bucket pads them to 5120 (2 devices x 256 per
    # granule), but only its last block is copied; the rest is read in place.
    mesh = _mesh(2, 1)

    def body(g):
        return compressed_mean(g[0], sync=SyncConfig(wire="allreduce", block_size=BLOCK))[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))
    text = fn.lower(_put(mesh, np.ones((2, 5000), np.float32))).compile().as_text()
    entry = text[text.index("ENTRY") :]
    assert "f32[5000]" not in entry and "f32[5120]" not in entry, entry
    assert "f32[256]" in entry  # the padded last block


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
def test_a_bucket_in_parts_gives_the_whole_buckets_bits(feedback):
    # Stochastic rounding draws by the value's index in the bucket, and the bounds are per
    # block, so cutting the bucket at a block changes no code, no residual, no bit.
    mesh = _mesh(2, 1)
    rng = np.random.default_rng(3)
    x = _put(mesh, rng.standard_normal((2, 8 * BLOCK), np.float32))
    res = _put(mesh, rng.standard_normal((2, 8 * BLOCK), np.float32) * 0.01)
    key = jax.random.key(5)
    sync = SyncConfig(wire="allreduce", block_size=BLOCK, rounding="stochastic")
    leaves = [jax.ShapeDtypeStruct((8 * BLOCK,), jnp.float32)]
    (plan,) = plan_sync(sync, leaves, (2, 1), "cpu", weight=0.5).buckets
    assert (plan.group.axis, plan.group.size, plan.codec) == (AXES, 2, Codec(stochastic=True))

    cuts = (None, BLOCK, 3 * BLOCK, 7 * BLOCK)

    def body(g, r, key_data):
        g, r = g[0], r[0] if feedback else None
        key = jax.random.wrap_key_data(key_data)
        device = jax.random.fold_in(key, jax.lax.axis_index(AXES))
        residual = None if r is None else (r, jnp.zeros(0, jnp.float32))
        out = []
        for cut in cuts:  # every cut in one program: one compile
            parts = g if cut is None else (g[:cut], g[cut:])
            mean, kept = wire_lib.sum_shard(parts, plan, key=device, residual=residual)
            out.append((mean[None], (mean * 0 if kept is None else kept[0])[None]))
        return out

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), P(AXES), P()), out_specs=P(AXES))
    )
    whole, *parts = jax.tree.map(np.asarray, fn(x, res, jax.random.key_data(key)))
    for cut, run in zip(cuts[1:], parts, strict=True):
        for got, want in zip(run, whole, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"cut at {cut}")
