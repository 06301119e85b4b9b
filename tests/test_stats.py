"""Tests for communication_stats: exact byte counts, axis labels and HLO parsing."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import needs_gpu_plugin
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad._src.inspection.hlo import (
    called_computations,
    conditional_branches,
    parse_collectives,
    parse_replica_groups,
)
from jax_bytegrad._src.inspection.stats import merge, stats_from_hlo
from jax_bytegrad.profiling import (
    CommunicationStats,
    array_shapes,
    communication_stats,
    hlo_instructions,
)
from jax_bytegrad.sharding import gpu_mesh

MESH_SHAPES = [(2, 4), (4, 2), (1, 8), (8, 1)]
MESH_IDS = [f"{n}x{m}" for n, m in MESH_SHAPES]
ALL = ("node", "local")
SHARD = 16  # float32 elements per device: a 64-byte payload


def _mesh(nodes: int, per_node: int, devices=None) -> jax.sharding.Mesh:
    devices = np.array(jax.devices()) if devices is None else np.asarray(devices)
    return jax.sharding.Mesh(
        devices.reshape(nodes, per_node), ALL, axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


SPEC = P(ALL)


def _shard_map(fn, mesh, in_specs=SPEC, out_specs=SPEC):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _x(dtype=jnp.float32, per_device=SHARD):
    return jnp.arange(8 * per_device).astype(dtype)


def _sizes(mesh, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in axes]))


def _label(mesh, axes) -> str:
    axes = (axes,) if isinstance(axes, str) else axes
    return "+".join(a for a in mesh.axis_names if a in axes and mesh.shape[a] > 1)


def _only_row(stats: CommunicationStats):
    moving = [row for row in stats.rows if row.bytes_sent > 0]
    assert len(moving) == 1, str(stats)
    return moving[0]


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=MESH_IDS)
@pytest.mark.parametrize("axes", ["local", "node", ALL], ids=["local", "node", "both"])
def test_psum(shape, axes):
    mesh = _mesh(*shape)
    stats = communication_stats(_shard_map(lambda x: jax.lax.psum(x, axes), mesh), _x())
    g = _sizes(mesh, axes)
    if g == 1:
        assert stats.total_bytes == 0, str(stats)
        return
    row = _only_row(stats)
    assert (row.kind, row.axes, row.dtype, row.count) == (
        "all-reduce",
        _label(mesh, axes),
        "f32",
        1,
    )
    assert row.payload_bytes == 64
    assert row.bytes_sent == 2 * (g - 1) / g * 64
    assert stats.total_bytes == row.bytes_sent
    assert stats.bytes_by_axis() == {row.axes: row.bytes_sent}
    # A ring over the group in mesh order: of its g hops, those from one node to the next
    # cross between nodes (every hop of a ring over "node" alone, one per node over both axes).
    nodes = mesh.shape["node"] if "node" in row.axes else 1
    hops_between_nodes = nodes if nodes > 1 else 0
    assert stats.bytes_on("node") == hops_between_nodes / g * row.bytes_sent
    assert stats.bytes_on("local") == (g - hops_between_nodes) / g * row.bytes_sent
    assert row.link_bytes == (stats.bytes_on("node"), stats.bytes_on("local"))


def test_a_flat_all_reduce_leaves_each_node_once():
    """The model: a flat ring over 2 nodes of 4 devices crosses between nodes on 2 of its 8
    hops, so each node sends one device's ring share, 2 (nL - 1) / (nL) B, to the other: 1.75x
    what a hierarchical all-reduce sends per node, 2 (n - 1) / n B."""
    mesh = _mesh(2, 4)
    flat = communication_stats(_shard_map(lambda x: jax.lax.psum(x, ALL), mesh), _x())

    def hierarchical(x):
        part = jax.lax.psum_scatter(x, "local", tiled=True)
        return jax.lax.all_gather(jax.lax.psum(part, "node"), "local", tiled=True)

    hier = communication_stats(_shard_map(hierarchical, mesh), _x())
    per_node = {name: 4 * stats.bytes_on("node") for name, stats in [("flat", flat), ("h", hier)]}
    assert per_node == {"flat": 2 * 7 / 8 * 64, "h": 2 * 1 / 2 * 64}
    assert flat.total_bytes == 2 * 7 / 8 * 64  # what each device sends, over any link
    assert hier.bytes_on("local") == 2 * 3 / 4 * 64  # reduce-scatter and all-gather of 64 B


def test_pairwise_and_permuted_traffic_between_nodes():
    mesh = _mesh(2, 4)

    def fn(x):
        shift = [(i, (i + 1) % 8) for i in range(8)]  # over both axes: 3 -> 4 and 7 -> 0 cross
        return (
            jax.lax.all_to_all(x, ALL, 0, 0, tiled=True),
            jax.lax.ppermute(x, ALL, shift),
        )

    stats = communication_stats(_shard_map(fn, mesh, out_specs=(P(ALL),) * 2), _x())
    rows = {row.kind: row for row in stats.rows}
    # All-to-all: 64 / 8 bytes to each of 7 peers, 4 of them on the other node.
    assert rows["all-to-all"].link_bytes == (4 / 8 * 64, 3 / 8 * 64)
    assert rows["collective-permute"].link_bytes == (2 * 64 / 8, 6 * 64 / 8)
    assert rows["collective-permute"].bytes_sent == 64  # each device sends its 64 B once


def test_a_ring_follows_mesh_order_whatever_the_listed_order():
    # XLA may list a group's devices in any order: the ring is laid out node after node.
    hlo = (
        "  %r = f32[16]{0} all-reduce(f32[16]{0} %p), "
        "replica_groups={{0,4,1,5,2,6,3,7}}, to_apply=%add\n"
    )
    row = _only_row(stats_from_hlo(hlo, ALL, (2, 4)))
    assert row.link_bytes == (2 / 8 * 2 * 7 / 8 * 64, 6 / 8 * 2 * 7 / 8 * 64)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8)], ids=["2x4", "4x2", "1x8"])
def test_psum_scatter_local(shape):
    mesh = _mesh(*shape)
    fn = _shard_map(lambda x: jax.lax.psum_scatter(x, "local", tiled=True), mesh)
    row = _only_row(communication_stats(fn, _x()))
    per_node = mesh.shape["local"]
    assert (row.kind, row.axes, row.dtype, row.payload_bytes) == (
        "reduce-scatter",
        "local",
        "f32",
        64,
    )
    assert row.bytes_sent == (per_node - 1) / per_node * 64


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (8, 1)], ids=["2x4", "4x2", "8x1"])
@pytest.mark.parametrize("to", ["varying", "invarying"])
def test_all_gather_node(shape, to):
    mesh = _mesh(*shape)
    out_specs = P(ALL) if to == "varying" else P("local")
    fn = _shard_map(
        lambda x: jax.lax.all_gather(x, "node", tiled=True, to=to), mesh, out_specs=out_specs
    )
    stats = communication_stats(fn, _x())
    row = _only_row(stats)
    n = mesh.shape["node"]
    # Input 64 B; output n * 64 B; each device sends (n-1)/n of the output.
    assert (row.kind, row.axes, row.dtype, row.payload_bytes) == ("all-gather", "node", "f32", 64)
    assert row.bytes_sent == (n - 1) * 64
    assert stats.bytes_on("node") == row.bytes_sent
    assert stats.bytes_on("local") == 0


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (8, 1)], ids=["2x4", "4x2", "8x1"])
def test_all_to_all_uint8_node(shape):
    mesh = _mesh(*shape)
    fn = _shard_map(lambda y: jax.lax.all_to_all(y, "node", 0, 0, tiled=True), mesh)
    row = _only_row(communication_stats(fn, _x(jnp.uint8, per_device=64)))
    n = mesh.shape["node"]
    assert (row.kind, row.axes, row.dtype, row.payload_bytes) == ("all-to-all", "node", "u8", 64)
    assert row.bytes_sent == (n - 1) / n * 64


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8)], ids=["2x4", "4x2", "1x8"])
def test_ppermute_local_ring(shape):
    mesh = _mesh(*shape)
    per_node = mesh.shape["local"]
    ring = [(i, (i + 1) % per_node) for i in range(per_node)]
    fn = _shard_map(lambda x: jax.lax.ppermute(x, "local", ring), mesh)
    row = _only_row(communication_stats(fn, _x()))
    assert (row.kind, row.axes, row.dtype, row.count) == ("collective-permute", "local", "f32", 1)
    assert row.payload_bytes == row.bytes_sent == 64


def test_half_precision():
    mesh = _mesh(2, 4)
    gather = _shard_map(lambda x: jax.lax.all_gather(x, "node", tiled=True), mesh)
    row = _only_row(communication_stats(gather, _x(jnp.float16)))
    assert (row.dtype, row.payload_bytes, row.bytes_sent) == ("f16", 32, 32)

    # XLA:CPU computes bfloat16 in float32, collectives included; the stats report what runs.
    dtype, itemsize = ("f32", 4) if jax.default_backend() == "cpu" else ("bf16", 2)
    row = _only_row(communication_stats(gather, _x(jnp.bfloat16)))
    assert (row.dtype, row.payload_bytes, row.bytes_sent) == (
        dtype,
        SHARD * itemsize,
        SHARD * itemsize,
    )
    psum = _shard_map(lambda x: jax.lax.psum(x, "local"), mesh)
    row = _only_row(communication_stats(psum, _x(jnp.bfloat16)))
    assert (row.kind, row.axes, row.dtype) == ("all-reduce", "local", dtype)
    assert row.payload_bytes == SHARD * itemsize
    assert row.bytes_sent == 2 * 3 / 4 * SHARD * itemsize


def test_permuted_devices_map_to_mesh_axes():
    # HLO device ids are positions in mesh.devices.flat, not device ids.
    devices = np.array(jax.devices())[[5, 2, 7, 0, 3, 6, 1, 4]]
    mesh = _mesh(2, 4, devices)

    def fn(x):
        return (
            jax.lax.psum(x, "local"),
            jax.lax.psum(x * 2, "node"),
            jax.lax.ppermute(x, "node", [(0, 1), (1, 0)]),
        )

    jitted = _shard_map(fn, mesh, out_specs=(P(ALL),) * 3)
    x = jax.device_put(_x(), jax.sharding.NamedSharding(mesh, P(ALL)))
    stats = communication_stats(jitted, x)
    labels = {(row.kind, row.axes) for row in stats.rows}
    assert labels == {
        ("all-reduce", "local"),
        ("all-reduce", "node"),
        ("collective-permute", "node"),
    }
    assert stats.bytes_on("node") == 64 + 64 and stats.bytes_on("local") == 2 * 3 / 4 * 64

    # The same devices viewed as a (local, node) mesh: groups are matched by device, so the
    # labels follow the devices.
    swapped = jax.sharding.Mesh(mesh.devices.T, ("local", "node"))
    again = communication_stats(jitted, x, mesh=swapped)
    assert {(row.kind, row.axes) for row in again.rows} == labels
    assert again.bytes_on("node") == stats.bytes_on("node")

    # The computation really runs on mesh.devices.flat order (a runtime check of the mapping).
    local_sum, _, swapped_x = jitted(x)
    shards = np.asarray(x).reshape(2, 4, SHARD)
    np.testing.assert_array_equal(
        np.asarray(local_sum).reshape(2, 4, SHARD),
        np.broadcast_to(shards.sum(1, keepdims=True), shards.shape),
    )
    np.testing.assert_array_equal(np.asarray(swapped_x).reshape(2, 4, SHARD), shards[::-1])


def test_grad_of_replicated_param_hides_an_all_reduce():
    mesh = _mesh(2, 4)

    def loss(w, x):
        return jnp.sum((x * w) ** 2)

    hidden = _shard_map(lambda w, x: jax.grad(loss)(w, x), mesh, (P(), P(ALL)), P())
    w = jnp.ones((SHARD,), jnp.float32)
    row = _only_row(communication_stats(hidden, w, _x()))
    assert (row.kind, row.axes, row.dtype, row.payload_bytes) == (
        "all-reduce",
        "node+local",
        "f32",
        64,
    )
    assert row.bytes_sent == 2 * 7 / 8 * 64

    def local_grad(w, x):
        return jax.grad(loss)(jax.lax.pcast(w, ALL, to="varying"), x)

    explicit = _shard_map(local_grad, mesh, (P(), P(ALL)), P(ALL))
    stats = communication_stats(explicit, w, _x())
    assert stats.rows == () and stats.total_bytes == 0


def test_compressed_node_traffic_is_a_quarter_of_float32():
    mesh = _mesh(2, 4)
    n = mesh.shape["node"]
    full = _shard_map(lambda x: jax.lax.psum(x, "node"), mesh)

    def compressed(codes):
        chunk = jax.lax.all_to_all(codes.reshape(n, -1), "node", 0, 0, tiled=True)
        return jax.lax.all_gather(chunk[0], "node", tiled=True)

    compressed = _shard_map(compressed, mesh)
    f32 = communication_stats(full, _x(jnp.float32, per_device=64))
    u8 = communication_stats(compressed, _x(jnp.uint8, per_device=64))
    assert u8.bytes_on("node") / f32.bytes_on("node") == 0.25
    assert u8.bytes_on("local") == 0


def test_table():
    mesh = _mesh(2, 4)

    def fn(x, y):
        return (
            jax.lax.psum(x, ALL),
            jax.lax.all_to_all(y, "node", 0, 0, tiled=True),
            jax.lax.ppermute(x, "local", [(0, 1), (1, 2), (2, 3), (3, 0)]),
        )

    stats = communication_stats(
        _shard_map(fn, mesh, out_specs=(P(ALL),) * 3), _x(), _x(jnp.uint8, per_device=4096)
    )
    text = str(stats)
    # A printed dict of them (what steps return) shows the table, not the fields.
    assert repr({"step": stats}) == "{'step': " + text + "}"
    lines = text.splitlines()
    assert "node=2, local=4" in lines[0]
    # The overlap comes first, one line per axis that carries traffic; then the table.
    assert [line.split(":")[0] for line in lines[1:3]] == ["Overlap node", "Overlap local"]
    assert "gemms" in lines[1] and "run beside" in lines[1]
    lines = [lines[0], *lines[3:]]
    assert re.split(r"\s{2,}", lines[1]) == [
        "kind",
        "axes",
        "dtype",
        "count",
        "payload",
        "sent/device",
        "on node",
        "on local",
    ]
    expected_rows = [
        ["all-reduce", "node+local", "f32", "1", "64 B", "112 B", "28 B", "84 B"],
        ["all-to-all", "node", "u8", "1", "4.00 KiB", "2.00 KiB", "2.00 KiB", "0 B"],
        ["collective-permute", "local", "f32", "1", "64 B", "64 B", "0 B", "64 B"],
    ]
    assert [re.split(r"\s{2,}", line) for line in lines[3:6]] == expected_rows
    table = lines
    assert re.split(r"\s{2,}", table[-1]) == [
        "total",
        "3",
        "4.12 KiB",
        "2.17 KiB",
        "2.03 KiB",
        "148 B",
    ]
    # Columns line up: every row is as wide as the header.
    assert len({len(line) for line in table[1:]}) <= 2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[1,8]<=[2,4]T(1,0)", ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ("[4,2]<=[2,2,2]T(2,1,0)", ((0, 4), (2, 6), (1, 5), (3, 7))),
        ("{{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("{ {0, 1}, {2, 3} }", ((0, 1), (2, 3))),
        ("{}", None),
        # The mesh-axes form of newer XLA (JAX 0.12), with sub-axes and a device order.
        ("mesh['node'=2,'local'=4] {'node'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh['node'=2,'local'=4] {'local'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh['node'=2,'local'=4] {'node','local'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh['x'=4] {'x':(2)2}", ((0, 1), (2, 3))),
        ("mesh['x'=4] {'x':(1)2}", ((0, 2), (1, 3))),
        ("mesh['a'=2,'b'=2] <=[2,2]T(1,0) {'a'}", ((0, 1), (2, 3))),
    ],
)
def testparse_replica_groups(text, expected):
    assert parse_replica_groups(text) == expected


def test_parse_replica_groups_iota_matches_numpy():
    ids = np.arange(24).reshape(2, 3, 4).transpose(1, 2, 0).reshape(6, 4)
    assert parse_replica_groups("[6,4]<=[2,3,4]T(1,2,0)") == tuple(map(tuple, ids.tolist()))


def test_parse_replica_groups_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse replica groups"):
        parse_replica_groups("[2,4]<=oops")


_ASYNC_HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[16]{0})->f32[16]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

%all-to-all.wrapped (p0: u8[64], p1: u8[64]) -> (u8[64], u8[64]) {
  %p0 = u8[64]{0} parameter(0)
  %p1 = u8[64]{0} parameter(1)
  ROOT %all-to-all.1 = (u8[64]{0}, u8[64]{0}) all-to-all(%p0, %p1), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0)
}

ENTRY %main (param: f32[16], codes: u8[64], half: bf16[32]) -> f32[16] {
  %param = f32[16]{0} parameter(0)
  %codes = u8[64]{0} parameter(1)
  %half = bf16[32]{0} parameter(2)
  %all-reduce-start = (f32[16]{0}, bf16[32]{0}) all-reduce-start(f32[16]{0} %param, bf16[32]{0} %half), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":false}}
  %all-reduce-done = (f32[16]{0}, bf16[32]{0}) all-reduce-done((f32[16]{0}, bf16[32]{0}) %all-reduce-start)
  %all-gather-start = (f32[16]{0}, f32[128]{0}) all-gather-start(%param), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[128]{0} all-gather-done(%all-gather-start)
  %collective-permute-start = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%param), channel_id=3, source_target_pairs={{0,4},{4,0},{1,1}}
  %collective-permute-done = f32[16]{0} collective-permute-done(%collective-permute-start)
  %self-permute = f32[16]{0} collective-permute(%param), channel_id=5, source_target_pairs={{0,0},{1,1}}
  %single = s32[4,2]{1,0} all-reduce(s32[4,2]{1,0} %idx), channel_id=6, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
  %mask = pred[8]{0} all-reduce(pred[8]{0} %m), channel_id=7, replica_groups={}, to_apply=%add
  %a2a-start = ((u8[64]{0}, u8[64]{0}), (u8[64]{0}, u8[64]{0})) async-start(%codes, %codes), calls=%all-to-all.wrapped
  %a2a-done = (u8[64]{0}, u8[64]{0}) async-done(%a2a-start), calls=%all-to-all.wrapped
  ROOT %out = f32[16]{0} get-tuple-element(%all-reduce-done), index=0
}
"""  # noqa: E501


def test_parse_async_and_variadic_hlo():
    collectives = parse_collectives(_ASYNC_HLO)
    kinds = [c.kind for c in collectives]
    assert kinds == [
        "all-to-all",
        "all-reduce",
        "all-gather",
        "collective-permute",
        "collective-permute",
        "all-reduce",
        "all-reduce",
    ]
    stats = stats_from_hlo(_ASYNC_HLO, ALL, (2, 4))
    rows = {(r.kind, r.axes, r.dtype): (r.count, r.payload_bytes, r.bytes_sent) for r in stats.rows}
    assert rows == {
        # Variadic f32[16] + bf16[32] = 128 B over the 4 local devices.
        ("all-reduce", "local", "f32,bf16"): (1, 128, 2 * 3 / 4 * 128),
        ("all-reduce", "-", "s32"): (1, 32, 0.0),
        # replica_groups={}: all 8 devices.
        ("all-reduce", "node+local", "pred"): (1, 8, 2 * 7 / 8 * 8),
        ("all-gather", "node+local", "f32"): (1, 64, 7 * 64),
        # Two u8[64] operands; [4,2]<=[2,4]T(1,0) pairs device i with i+4: the node axis.
        ("all-to-all", "node", "u8"): (1, 128, 64.0),
        # The pair 1 -> 1 stays on its device; 0 -> 4 and 4 -> 0 cross nodes.
        ("collective-permute", "node", "f32"): (1, 64, 64.0),
        ("collective-permute", "-", "f32"): (1, 64, 0.0),
    }
    # The rings over all 8 devices (the pred all-reduce, the all-gather) cross between nodes on
    # 2 of their 8 hops; the permute's senders are devices 0 and 4, both across.
    assert stats.bytes_on("node") == 64 + 64 + 2 / 8 * (14 + 7 * 64)
    assert stats.bytes_on("local") == 2 * 3 / 4 * 128 + 6 / 8 * (14 + 7 * 64)


def test_stats_from_hlo_with_device_positions():
    # HLO device i sits at mesh position positions[i]: device 1 is at (node 1, local 0).
    hlo = "  %r = f32[4]{0} all-reduce(f32[4]{0} %p), replica_groups={{0,1}}, to_apply=%add\n"
    row = _only_row(stats_from_hlo(hlo, ALL, (2, 2), positions=[0, 2, 1, 3]))
    assert row.axes == "node"
    row = _only_row(stats_from_hlo(hlo, ALL, (2, 2)))
    assert row.axes == "local"


def test_branches_of_a_cond_are_reported_apart():
    """A cond whose branches send different traffic: rows mix them, branches keep them apart."""
    mesh = _mesh(2, 4)

    def body(x):
        total = jax.lax.psum(jnp.sum(x), ALL)  # outside the cond: every call sends it
        return jax.lax.cond(
            total > 0,
            # index 1, taken when True; pcast only marks the type, it moves nothing.
            lambda v: jax.lax.pcast(jax.lax.psum(v, "node"), "node", to="varying"),
            lambda v: jax.lax.all_gather(v.astype(jnp.uint8), "local", tiled=True)[:SHARD].astype(
                v.dtype
            ),
            x,
        )

    stats = communication_stats(_shard_map(body, mesh), _x())
    assert len(stats.branches) == 1
    false_branch, true_branch = stats.branches[0]
    assert [(r.kind, r.axes, r.dtype, r.payload_bytes) for r in false_branch.rows] == [
        ("all-gather", "local", "u8", SHARD)
    ]
    assert [(r.kind, r.axes, r.dtype, r.payload_bytes) for r in true_branch.rows] == [
        ("all-reduce", "node", "f32", 4 * SHARD)
    ]
    assert [(r.kind, r.axes, r.dtype, r.payload_bytes) for r in stats.unconditional.rows] == [
        ("all-reduce", "node+local", "f32", 4)
    ]
    # The program's rows hold all three, once each.
    assert sorted(r.count for r in stats.rows) == [1, 1, 1]
    assert stats.total_bytes == pytest.approx(
        stats.unconditional.total_bytes + false_branch.total_bytes + true_branch.total_bytes
    )
    assert false_branch.branches == () and false_branch.unconditional is None


def test_no_conditional_means_everything_is_unconditional():
    mesh = _mesh(2, 4)
    stats = communication_stats(_shard_map(lambda x: jax.lax.psum(x, ALL), mesh), _x())
    assert stats.branches == ()
    assert stats.unconditional.rows == stats.rows


_COND_HLO = """\
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

%yes.1 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %r = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

%no.2 (q: f32[4]) -> f32[4] {
  ROOT %q = f32[4]{0} parameter(0)
}

ENTRY %main (c: pred[], x: f32[4]) -> f32[4] {
  %c = pred[] parameter(0)
  %x = f32[4]{0} parameter(1)
  ROOT %cond = f32[4]{0} conditional(%c, %x, %x), true_computation=%yes.1, false_computation=%no.2
}
"""


def test_hlo_instructions_and_conditional_forms():
    instructions = hlo_instructions(_COND_HLO)
    assert [(i.computation, i.entry, i.name, i.opcode) for i in instructions][-2:] == [
        ("main", True, "x", "parameter"),
        ("main", True, "cond", "conditional"),
    ]
    assert instructions[0].computation == "add" and not instructions[0].entry
    # The pred form lists (false, true), like lax.cond's branch indices.
    assert conditional_branches(instructions) == [("no.2", "yes.1")]
    assert called_computations(instructions, "yes.1") == {"yes.1", "add"}
    assert called_computations(instructions, "main") == {"main", "yes.1", "no.2", "add"}
    stats = stats_from_hlo(_COND_HLO, ALL, (1, 2))
    no, yes = stats.branches[0]
    assert no.rows == () and stats.unconditional.rows == ()
    assert [(r.kind, r.axes, r.payload_bytes) for r in yes.rows] == [("all-reduce", "local", 16)]
    assert array_shapes("(f32[2,3]{1,0}, u8[<=8]{0}, pred[]) tuple()") == [
        ("f32", (2, 3)),
        ("u8", (8,)),
        ("pred", ()),
    ]


def test_errors():
    with pytest.raises(ValueError, match="pass mesh="):
        communication_stats(jax.jit(lambda x: x * 2), jnp.ones(4))
    with pytest.raises(TypeError, match="wrap it in jax.jit"):
        communication_stats(lambda x: x, jnp.ones(4))
    mesh = _mesh(2, 4)
    fn = _shard_map(lambda x: jax.lax.psum(x, "local"), mesh)
    with pytest.raises(ValueError, match="pass the mesh the function runs on"):
        communication_stats(fn, _x(), mesh=_mesh(1, 4, jax.devices()[:4]))
    stats = communication_stats(fn.lower(_x()).compile())
    with pytest.raises(ValueError, match="'nodes' is not in the mesh axes"):
        stats.bytes_on("nodes")
    with pytest.raises(ValueError, match="compiled function and arguments"):
        communication_stats(fn.lower(_x()), _x())


def test_no_collectives():
    mesh = _mesh(2, 4)
    stats = communication_stats(_shard_map(lambda x: x * 2, mesh), _x())
    assert stats.rows == () and stats.total_bytes == 0 and stats.bytes_by_axis() == {}
    assert "(no collectives)" in str(stats)


def test_merge_sums_rows_of_programs_and_sorts_them():
    one = stats_from_hlo(_COND_HLO, ALL, (1, 2)).branches[0][1]
    merged = merge([one, one, stats_from_hlo(_COND_HLO, ALL, (1, 2)).unconditional])
    (row,) = merged.rows
    assert (row.kind, row.axes, row.count) == ("all-reduce", "local", 2)
    assert row.payload_bytes == 32 and row.bytes_sent == 2 * one.rows[0].bytes_sent
    assert row.link_bytes == (0.0, 2 * one.rows[0].bytes_sent)
    assert merged.branches == () and merged.unconditional is None
    with pytest.raises(ValueError, match="over one mesh"):
        merge([one, stats_from_hlo(_COND_HLO, ALL, (2, 1))])
    with pytest.raises(ValueError, match="over one mesh"):
        merge([])


_SCHEDULED = (
    """HloModule m, is_scheduled=true

%gemm_body (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%a, %b), @DOT
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[4,4], q: f32[1024]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  %q = f32[1024]{0} parameter(1)
  %g1 = f32[4,4]{1,0} fusion(%p, %p), kind=kCustom, calls=%gemm_body
  %ar-start = (f32[1024]{0}, f32[1024]{0}) all-reduce-start(%q), channel_id=1, @NODE
  %g2 = f32[4,4]{1,0} fusion(%g1, %p), kind=kCustom, calls=%gemm_body
  %g3 = f32[4,4]{1,0} dot(%g2, %p), @DOT
  %ar-done = f32[1024]{0} all-reduce-done(%ar-start)
  %late = f32[1024]{0} all-reduce(%ar-done), channel_id=2, @NODE
  %local = f32[1024]{0} all-reduce(%q), channel_id=3, @LOCAL
  ROOT %out = f32[4,4]{1,0} add(%g3, %g3)
}
""".replace("@NODE", "replica_groups={{0,4},{1,5},{2,6},{3,7}}, @ATTRS")
    .replace("@LOCAL", "replica_groups={{0,1,2,3},{4,5,6,7}}, @ATTRS")
    .replace("@ATTRS", "use_global_device_ids=true, to_apply=%add")
    .replace("@DOT", "lhs_contracting_dims={1}, rhs_contracting_dims={0}")
)


def test_overlap_reads_the_schedule():
    stats = stats_from_hlo(_SCHEDULED, ALL, (2, 4))
    node = stats.overlap_on("node")
    # Two node all-reduces of 4 KiB (2 (g-1)/g B = 4096 B each): the async one starts after
    # the first gemm and is in flight over the other two; the second starts after the last.
    assert (node.bytes_sent, node.early_bytes) == (8192.0, 4096.0)
    assert (node.gemms, node.gemms_beside) == (3, 2)
    assert (node.flops, node.flops_beside) == (3 * 128.0, 2 * 128.0)  # 2 * 4 * 4 * 4 each
    assert [(e.name, e.runs, e.gemms_beside) for e in node.exchanges] == [
        ("ar-start", 1, 2),
        ("late", 1, 0),
    ]
    assert node.early_share == 0.5 and node.gemm_share == 2 / 3 and node.trip_counts_known
    local = stats.overlap_on("local")
    assert (local.bytes_sent, local.early_bytes, local.gemms_beside) == (6144.0, 0.0, 0)
    assert "node: 2 of 3 gemms (66.7% of 384 FLOP) run beside its 2 collectives" in str(stats)
    with pytest.raises(ValueError, match="no schedule for axis 'x'"):
        stats.overlap_on("x")
    assert merge([stats, stats]).overlap == ()


# A library gemm (cuBLAS, as XLA:GPU calls it) and a convolution between an all-reduce's start
# and done: 2 * 4 * 8 * 16 and 2 * (8 * 8 * 16 outputs) * (3 * 3 * 4 inputs each) FLOPs.
_LIBRARY_CALLS = """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: f32[4,16], b: f32[16,8], img: f32[1,8,8,4], k: f32[3,3,4,16], q: f32[1024]) -> f32[4,8] {
  %a = f32[4,16]{1,0} parameter(0)
  %b = f32[16,8]{1,0} parameter(1)
  %img = f32[1,8,8,4]{3,2,1,0} parameter(2)
  %k = f32[3,3,4,16]{3,2,1,0} parameter(3)
  %q = f32[1024]{0} parameter(4)
  %ar-start = (f32[1024]{0}, f32[1024]{0}) all-reduce-start(%q), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %cc = (f32[4,8]{1,0}, s8[256]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %conv = f32[1,8,8,16]{3,2,1,0} convolution(%img, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  %ar-done = f32[1024]{0} all-reduce-done(%ar-start)
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%cc), index=0
}
"""  # noqa: E501


def test_library_gemms_and_convolutions_count_with_their_flops():
    node = stats_from_hlo(_LIBRARY_CALLS, ALL, (2, 4)).overlap_on("node")
    flops = 2.0 * 4 * 8 * 16 + 2.0 * (8 * 8 * 16) * (3 * 3 * 4)
    assert (node.gemms, node.gemms_beside, node.flops, node.flops_beside) == (2, 2, flops, flops)
    (exchange,) = node.exchanges
    assert (exchange.gemms_beside, exchange.flops_beside) == (2, flops)


# A scanned stack as XLA prints it: a while loop whose body starts an all-reduce between
# nodes, runs one gemm beside it, and one more after its done; one gemm after the loop.
_LOOP = (
    """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4,4], f32[1024])) -> (s32[], f32[4,4], f32[1024]) {
  %p = (s32[], f32[4,4]{1,0}, f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[4,4]{1,0} get-tuple-element(%p), index=1
  %v = f32[1024]{0} get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %ar-start = (f32[1024]{0}, f32[1024]{0}) all-reduce-start(%v), channel_id=1, @NODE
  %d1 = f32[4,4]{1,0} dot(%w, %w), @DOT
  %ar-done = f32[1024]{0} all-reduce-done(%ar-start)
  %d2 = f32[4,4]{1,0} dot(%d1, %w), @DOT
  ROOT %t = (s32[], f32[4,4]{1,0}, f32[1024]{0}) tuple(%next, %d2, %ar-done)
}

%cond (c: (s32[], f32[4,4], f32[1024])) -> pred[] {
  %c = (s32[], f32[4,4]{1,0}, f32[1024]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (w: f32[4,4], v: f32[1024]) -> f32[4,4] {
  %w = f32[4,4]{1,0} parameter(0)
  %v = f32[1024]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,4]{1,0}, f32[1024]{0}) tuple(%zero, %w, %v)
  %loop = (s32[], f32[4,4]{1,0}, f32[1024]{0}) while(%init), condition=%cond, body=%body@LOOP
  %out = f32[4,4]{1,0} get-tuple-element(%loop), index=1
  ROOT %last = f32[4,4]{1,0} dot(%out, %w), @DOT
}
""".replace("@NODE", "replica_groups={{0,4},{1,5},{2,6},{3,7}}, @ATTRS")
    .replace("@ATTRS", "use_global_device_ids=true, to_apply=%add")
    .replace("@DOT", "lhs_contracting_dims={1}, rhs_contracting_dims={0}")
)
_TRIP_COUNTS = {
    "known_trip_count": ', backend_config={"known_trip_count":{"n":"5"}}',
    "induction_and_condition": ', backend_config={"known_init_step":{"init":"0","step":"1"}}',
    "unknown": "",
}


@pytest.mark.parametrize("how", list(_TRIP_COUNTS))
def test_a_loop_body_counts_once_per_iteration(how):
    stats = stats_from_hlo(_LOOP.replace("@LOOP", _TRIP_COUNTS[how]), ALL, (2, 4))
    node = stats.overlap_on("node")
    (exchange,) = node.exchanges
    assert (exchange.name, exchange.computation, exchange.bytes_sent) == ("ar-start", "body", 4096)
    assert (exchange.gemms_beside, exchange.flops_beside) == (1, 128.0)
    if how == "unknown":  # the body counts once, and the figures say so
        assert exchange.runs is None and not node.trip_counts_known
        assert (node.gemms, node.gemms_beside, node.bytes_sent) == (3, 1, 4096.0)
        assert "unknown trip count" in str(node)
        return
    assert exchange.runs == 5 and node.trip_counts_known
    # Two gemms in each of 5 iterations and one after the loop; one per iteration beside.
    assert (node.gemms, node.gemms_beside) == (11, 5)
    assert (node.flops, node.flops_beside) == (11 * 128.0, 5 * 128.0)
    assert node.bytes_sent == 5 * 4096.0
    # The loop starts before the last gemm, so every byte is "early": 5 of 11 gemms beside.
    assert node.early_share == 1.0 and node.gemm_share == 5 / 11


def test_a_compiled_scan_counts_its_gemms_per_iteration():
    """XLA:CPU's own loop (``lax.scan``): the gemms inside count once per iteration, and the
    collective inside the body once per iteration; XLA:CPU runs it synchronously."""
    mesh = _mesh(2, 4)

    def fn(x, ws):
        def body(x, w):
            y = x @ w
            return jnp.tanh(y), jax.lax.psum(y, "node")

        x, sums = jax.lax.scan(body, x, ws)
        return x @ ws[0], sums

    x = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    ws = jax.ShapeDtypeStruct((3, 4, 4), jnp.float32)
    f = jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False)
    )
    stats = communication_stats(f, x, ws)
    node = stats.overlap_on("node")
    assert node.trip_counts_known
    assert (node.gemms, node.flops) == (3 + 1, 4 * 2.0 * 4 * 4 * 4)
    (exchange,) = node.exchanges
    assert exchange.runs == 3 and exchange.computation != "main"
    assert node.bytes_sent == 3 * exchange.bytes_sent == 3 * 64.0  # 16 floats, 2 (g-1)/g B
    assert node.gemms_beside == 0  # XLA:CPU runs collectives synchronously
    # The traffic table counts the body's all-reduce as often too: 3 runs a step.
    (row,) = [row for row in stats.rows if row.axes == "node"]
    assert (row.count, row.payload_bytes, row.bytes_sent) == (3, 3 * 64, 3 * 64.0)
    assert stats.bytes_on("node") == node.bytes_sent


def test_overlap_on_cpu_counts_traffic_that_starts_before_the_last_product():
    mesh = _mesh(2, 4)

    def fn(x, w):
        early = jax.lax.psum(x, "node")  # needs nothing computed: may start at once
        y = (x.reshape(4, 4) @ w) @ w
        return early, jax.lax.psum(y, "node")  # needs the last product

    x = jax.ShapeDtypeStruct((8 * 16,), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    f = jax.jit(
        jax.shard_map(
            fn, mesh=mesh, in_specs=(P(ALL), P()), out_specs=(P(ALL), P(ALL)), check_vma=False
        )
    )
    node = communication_stats(f, x, w).overlap_on("node")
    assert node.gemms == 2
    assert node.bytes_sent == 2 * 64.0  # two psums of 16 floats over 2 nodes: 2 (g-1)/g B each
    assert node.early_bytes <= 64.0  # the second psum can never start before the last product
    assert node.gemms_beside == 0  # XLA:CPU runs collectives synchronously


def test_the_default_strategies_compare_at_their_real_ratio():
    """docs/performance.md's table: per device between nodes, the flat float32 all-reduce of
    Strategy("gradient_allreduce") sends 7/4 of the hierarchical one, which sends about 4x
    ByteGrad's 8-bit codes."""
    mesh = jax_bytegrad.make_mesh(2, 4)

    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    params = {"w1": jnp.zeros((256, 512)), "w2": jnp.zeros((512, 64))}
    batch = {"x": jax.ShapeDtypeStruct((64, 256), jnp.float32)}
    batch["y"] = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    node = {}
    for name, kwargs in [
        ("flat", {}),
        ("hierarchical", {"hierarchical": True}),
        ("bytegrad", {}),
        ("bytegrad flat", {"hierarchical": False}),
        ("bytegrad scatter_gather", {"wire": "scatter_gather"}),
        ("bytegrad scatter_gather flat", {"wire": "scatter_gather", "hierarchical": False}),
    ]:
        algorithm = "bytegrad" if name.startswith("bytegrad") else "gradient_allreduce"
        strategy = jax_bytegrad.Strategy(algorithm, mesh=mesh, **kwargs)
        with strategy.train_step(loss_fn, optax.adam(1e-3)) as step:
            stats = step.communication_stats(step.state_shapes(params), batch)["step"]
        node[name] = stats.bytes_on("node")
    gradient = 4 * 163_840
    # The loss's mean over all 8 devices adds 1.75 B where it is a collective of its own.
    assert node["flat"] == pytest.approx(2 * 7 / 8 * gradient / 4, abs=2)
    assert node["hierarchical"] == pytest.approx(2 * 1 / 2 * gradient / 4, abs=2)
    assert node["bytegrad"] / 1024 == pytest.approx(40.63, abs=0.005)
    assert node["flat"] / node["bytegrad"] == pytest.approx(6.89, abs=0.005)
    assert node["hierarchical"] / node["bytegrad"] == pytest.approx(3.94, abs=0.005)
    # docs/bytegrad.md: ByteGrad's own exchange over all 8 devices (hierarchical=False).
    assert node["bytegrad flat"] / node["bytegrad"] == pytest.approx(1.75, abs=0.005)
    flat_sg = node["bytegrad scatter_gather flat"] / node["bytegrad scatter_gather"]
    assert flat_sg == pytest.approx(2.87, abs=0.005)


@needs_gpu_plugin("test_overlap_reads_the_schedule and test_a_loop_body_* read the same forms")
def test_gemms_between_a_start_and_done_and_in_a_loop_on_h100s():
    """XLA:GPU, 2 x 4 deviceless H100s: an all-reduce between nodes that needs nothing computed
    runs async beside the three gemms that do not need it; inside a scanned loop, the body's
    gemms count once per iteration (XLA:GPU runs this body's all-reduce synchronously)."""
    mesh = gpu_mesh(2, 4)

    def flat(x, w):
        return jax.lax.psum(x, "node"), jnp.tanh(jnp.tanh(w @ w) @ w) @ w

    def scanned(x, ws):
        def body(x, w):
            return jnp.tanh(x @ w.T) @ w, jax.lax.psum(jnp.tanh(x @ w), "node")

        return jax.lax.scan(body, x, ws)

    def node(fn, *shapes):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P())))
        sharding = jax.sharding.NamedSharding(mesh, P())
        args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes]
        return communication_stats(f.lower(*args).compile()).overlap_on("node")

    beside = node(flat, (1024, 1024), (1024, 1024))
    (exchange,) = beside.exchanges
    assert exchange.name.startswith("all-reduce-start") and exchange.runs == 1
    assert (exchange.gemms_beside, beside.gemms_beside, beside.gemms) == (3, 3, 3)
    assert exchange.flops_beside == beside.flops == 3 * 2.0 * 1024**3
    looped = node(scanned, (256, 256), (4, 256, 256))
    (exchange,) = looped.exchanges
    assert exchange.runs == 4  # the loop's known_trip_count
    # Three products of 256^3 an iteration; XLA:GPU merges the two that share x into one gemm.
    assert looped.gemms == 4 * 2 and looped.flops == 4 * 3 * 2.0 * 256**3
    assert looped.bytes_sent == 4 * exchange.bytes_sent == 4 * 256 * 256 * 4.0  # 2 (g-1)/g B
