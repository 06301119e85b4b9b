"""TPU slices as nodes: make_mesh groups by slice, and communication_stats counts the Megascale
transfers XLA writes between slices.

The tests that compile for a deviceless 2-slice v5e topology need libtpu (``pip install
'jax[tpu]'`` on Python 3.12), which CI does not install: they skip without it. The same logic
runs everywhere on HLO text copied from such a compiled program, and on fake devices that carry
``slice_index``, ``process_index``, ``id`` and ``coords``.
"""

import dataclasses
import importlib.util
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import load_script

import jax_bytegrad as jbg
from jax_bytegrad._src.inspection import hlo
from jax_bytegrad._src.inspection.megascale import DeviceIds
from jax_bytegrad._src.inspection.stats import stats_from_hlo
from jax_bytegrad._src.mesh import slice_crossings, warn_if_mesh_crosses_slices

AXES = ("node", "local")
_ATTRS = '_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="psum_invariant.21_0",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:7}",_xla_megascale_transfer_type="ALL_REDUCE"'  # noqa: E501
# Lines of gradient_allreduce's step compiled for 2 slices of v5e:2x4 (backend configs cut):
# the all-reduce within the slice, one float32 shard and the scalar loss sent across slices.
_SLICE_HLO = f"""HloModule jit_step, is_scheduled=true, num_partitions=8

ENTRY %main (p0: f32[65536], p1: f32[1,1,128]) -> f32[8,8,128] {{
  %param = f32[65536]{{0:T(1024)}} parameter(0)
  %loss = f32[1,1,128]{{2,1,0:T(1,128)}} parameter(1)
  %all-reduce.3 = f32[65536]{{0:T(1024)S(1)}} all-reduce(%param), channel_id=2, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, use_global_device_ids=true, to_apply=%region_0.1.clone
  %shard = f32[8,8,128]{{2,1,0:T(8,128)}} bitcast(%all-reduce.3)
  %after-all = token[] after-all()
  %after-all.2 = token[] after-all()
  %send = (f32[8,8,128]{{2,1,0:T(8,128)}}, u32[]{{:S(2)}}, token[]) send(%shard, %after-all), channel_id=2, is_host_transfer=true, frontend_attributes={{{_ATTRS}}}, backend_config={{"flag_configs":[],"aggregated_send_recv_config":{{"status":"AGGREGATE_STATUS_ISSUE"}}}}
  %send.2 = (f32[1,1,128]{{2,1,0:T(1,128)}}, u32[]{{:S(2)}}, token[]) send(%loss, %after-all.2), channel_id=6, is_host_transfer=true, frontend_attributes={{{_ATTRS}}}
  %recv = (f32[8,8,128]{{2,1,0:T(8,128)}}, u32[]{{:S(2)}}, token[]) recv(%after-all), channel_id=1, is_host_transfer=true, frontend_attributes={{{_ATTRS}}}
  %recv.2 = (f32[1,1,128]{{2,1,0:T(1,128)}}, u32[]{{:S(2)}}, token[]) recv(%after-all.2), channel_id=5, is_host_transfer=true, frontend_attributes={{{_ATTRS}}}
  %send-done = token[] send-done(%send), channel_id=2, is_host_transfer=true, frontend_attributes={{_xla_host_transfer_handler_name="xla_megascale_runtime"}}
  %send-done.2 = token[] send-done(%send.2), channel_id=6, is_host_transfer=true, frontend_attributes={{_xla_host_transfer_handler_name="xla_megascale_runtime"}}
  %recv-done = (f32[8,8,128]{{2,1,0:T(8,128)}}, token[]) recv-done(%recv), channel_id=1, is_host_transfer=true, frontend_attributes={{_xla_host_transfer_handler_name="xla_megascale_runtime"}}
  %recv-done.2 = (f32[1,1,128]{{2,1,0:T(1,128)}}, token[]) recv-done(%recv.2), channel_id=5, is_host_transfer=true, frontend_attributes={{_xla_host_transfer_handler_name="xla_megascale_runtime"}}
  ROOT %out = f32[8,8,128]{{2,1,0:T(8,128)}} get-tuple-element(%recv-done), index=0
}}
"""  # noqa: E501
_SHARD_BYTES = 8 * 8 * 128 * 4  # each device's 1/8 of the float32 sum crosses slices
_LOSS_BYTES = 128 * 4


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What make_mesh and DeviceIds read of a device."""

    id: int
    process_index: int
    slice_index: int | None = None
    coords: tuple[int, ...] = ()
    platform: str = "tpu"


def _two_slices(order=(0, 1)) -> list[FakeDevice]:
    """2 slices of v5e:2x4 as the deviceless topology numbers them: ids 100000 (slice + 1) + k,
    two hosts of 4 chips per slice, listed slice by slice in ``order``."""
    return [
        FakeDevice(100000 * (s + 1) + k, 2 * s + k // 4, s, (k % 2, k // 2, 0))
        for s in order
        for k in range(8)
    ]


def _stats(hlo_text, devices, shape):
    ids = DeviceIds.of_devices(devices, range(len(devices)))
    return stats_from_hlo(hlo_text, AXES, shape, ids=ids)


def _rows(stats):
    return {(r.kind, r.axes, r.dtype): r for r in stats.rows}


# The parser, on HLO text (no libtpu needed) ------------------------------------------------


def test_a_megascale_send_is_traffic_on_the_node_axis():
    stats = _stats(_SLICE_HLO, _two_slices(), (2, 8))
    rows = _rows(stats)
    assert set(rows) == {("all-reduce", "node", "f32"), ("all-reduce", "local", "f32")}
    node = rows["all-reduce", "node", "f32"]
    # Two sends counted, their recvs not; a 2-member all-reduce sends its payload once.
    assert node.count == 2 and node.payload_bytes == _SHARD_BYTES + _LOSS_BYTES
    assert node.bytes_sent == node.link_bytes[0] == _SHARD_BYTES + _LOSS_BYTES
    assert stats.bytes_on("node") == _SHARD_BYTES + _LOSS_BYTES
    assert stats.bytes_on("local") == 2 * 7 / 8 * 65536 * 4
    assert stats.overlap_on("node").bytes_sent == stats.bytes_on("node")
    assert "all-reduce  node" in str(stats)


def test_the_send_is_read_as_written_with_its_tile_padding_apart():
    text = _SLICE_HLO.replace("f32[8,8,128]{2,1,0:T(8,128)}", "u8[3,100]{1,0:T(8,128)(4,1)}")
    sends = [c for c in hlo.parse_collectives(text) if c.target is not None]
    assert [(c.payload_bytes, c.padded_bytes, c.dtypes) for c in sends] == [
        (300, 8 * 128, ("u8",)),
        (_LOSS_BYTES, _LOSS_BYTES, ("f32",)),
    ]
    stats = _stats(text, _two_slices(), (2, 8))
    assert _rows(stats)["all-reduce", "node", "u8"].padding_bytes == 8 * 128 - 300
    assert stats.bytes_on("node") == 300 + _LOSS_BYTES
    assert "Tile padding" in str(stats)


def test_a_multislice_programs_ids_count_one_slice():
    # The slices laid along "local": program ids 0..7 are slice 0's devices, at positions
    # 0, 2, ..., 14 of this (8, 2) mesh, so the in-slice all-reduce runs over "node", and the
    # transfer between slices over "local". Read against the whole mesh, ids 0..7 would be
    # the first 4 rows: "node+local".
    devices = list(np.array(_two_slices(), dtype=object).reshape(2, 8).T.flat)
    rows = _rows(_stats(_SLICE_HLO, devices, (8, 2)))
    assert set(rows) == {("all-reduce", "node", "f32"), ("all-reduce", "local", "f32")}
    assert rows["all-reduce", "local", "f32"].payload_bytes == _SHARD_BYTES + _LOSS_BYTES
    # Slice 1 first in the assignment: the program's ids are its devices.
    ids = DeviceIds.of_devices(_two_slices(order=(1, 0)), range(16))
    assert ids.program == tuple(range(8)) and ids.slices[1] == tuple(range(8, 16))


@pytest.mark.parametrize(
    ("target", "kind", "axes", "sent"),
    [
        # The explicit form, by global device id: each device and its peer in the other slice.
        ("{{100000,200000},{100001,200001}}", "all-to-all", "node", 4000 / 2),
        # A permute's pairs, no transfer type.
        ("{{100000->200000},{200000->100000}}", "collective-permute", "node", 4000.0),
    ],
    ids=["groups", "pairs"],
)
def test_the_other_target_forms(target, kind, axes, sent):
    kind_attr = ',_xla_megascale_transfer_type="ALL_TO_ALL"' if kind == "all-to-all" else ""
    text = (
        "  %send = (f32[2,500,1]{1,2,0:T(1,128)}, u32[]{:S(2)}, token[]) send(%x, %t), "
        f"channel_id=2, is_host_transfer=true, frontend_attributes={{_xla_megascale_target="
        f"{target}{kind_attr}}}\n"
    )
    (row,) = _stats(text, _two_slices(), (2, 8)).rows
    assert (row.kind, row.axes, row.payload_bytes, row.bytes_sent) == (kind, axes, 4000, sent)
    assert row.padding_bytes == 4096 - 4000  # 500 rounded up to 512 lanes


def test_an_unknown_transfer_type_is_an_error_not_zero_bytes():
    text = _SLICE_HLO.replace('type="ALL_REDUCE"', 'type="BROADCAST"')
    with pytest.raises(ValueError, match="transfer type 'BROADCAST'"):
        hlo.parse_collectives(text)


def test_a_send_to_a_slice_the_mesh_lacks_is_an_error():
    one_slice = [d for d in _two_slices() for _ in [0]][:8]
    with pytest.raises(ValueError, match="sends to TPU slices"):
        _stats(_SLICE_HLO, one_slice, (1, 8))


# make_mesh on fake devices --------------------------------------------------------------


def test_make_mesh_makes_each_slice_a_node_across_its_processes():
    mesh = jbg.make_mesh(devices=_two_slices(order=(1, 0)))
    assert mesh.axis_names == AXES and dict(mesh.shape) == {"node": 2, "local": 8}
    assert [{d.slice_index for d in row} for row in mesh.devices] == [{0}, {1}]
    # Each node spans the slice's two processes; inside, the order follows the chips' layout.
    assert {d.process_index for d in mesh.devices[0]} == {0, 1}
    assert [d.coords for d in mesh.devices[0]] == [d.coords for d in mesh.devices[1]]
    assert [d.coords for d in mesh.devices[0]] == sorted(d.coords for d in mesh.devices[0])


def test_make_mesh_without_slices_keeps_a_node_per_process():
    devices = [FakeDevice(i, i // 4, platform="cpu") for i in range(12)]
    mesh = jbg.make_mesh(devices=devices)
    assert [[d.id for d in row] for row in mesh.devices] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]
    # A node may span processes, whole ones.
    assert {d.process_index for d in jbg.make_mesh(3, 4, devices=devices).devices[0]} == {0}
    assert {d.process_index for d in jbg.make_mesh(1, 12, devices=devices).devices[0]} == {0, 1, 2}
    with pytest.raises(ValueError, match="cut a node across two processes"):
        jbg.make_mesh(2, 6, devices=devices)


def test_make_mesh_lays_out_a_subset_and_refuses_uneven_slices():
    devices = _two_slices()
    mesh = jbg.make_mesh(devices=[d for d in devices if d.id % 100000 < 4])
    assert dict(mesh.shape) == {"node": 2, "local": 4}
    with pytest.raises(ValueError, match="different numbers of devices"):
        jbg.make_mesh(devices=devices[:12])


@pytest.mark.parametrize(
    ("shape", "match"),
    [((4, 4), "axis 'node' joins devices of one TPU slice"), ((1, 16), "axis 'local' spans")],
    ids=["node-inside-slices", "local-across-slices"],
)
def test_a_mesh_against_the_slices_warns_naming_the_axis(shape, match):
    with pytest.warns(RuntimeWarning, match=match):
        jbg.make_mesh(*shape, devices=_two_slices())


def test_a_users_mesh_is_checked_by_the_same_function():
    grid = np.array(_two_slices(), dtype=object)
    good = jax.sharding.Mesh(grid.reshape(2, 8), AXES)
    assert slice_crossings(good) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_mesh_crosses_slices(good)
    transposed = jax.sharding.Mesh(grid.reshape(2, 8).T, AXES)
    found = slice_crossings(transposed)
    assert len(found) == 2 and "'node' joins" in found[0] and "'local' spans" in found[1]
    with pytest.warns(RuntimeWarning, match="Strategy: axis 'node'"):
        warn_if_mesh_crosses_slices(transposed, where="Strategy")
    # Devices without slices (CPU) have nothing to say.
    cpu = [FakeDevice(i, 0, platform="cpu") for i in range(4)]
    assert slice_crossings(jax.sharding.Mesh(np.array(cpu, dtype=object).reshape(4, 1), AXES)) == []


# Compiled for a deviceless 2-slice v5e topology (libtpu) ------------------------------------


def _topology_error() -> str | None:
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (pip install 'jax[tpu]' on Python 3.12)"
    try:
        _topology_devices()
    except Exception as error:  # noqa: BLE001 - the reason goes into the skip
        return f"libtpu cannot describe a deviceless v5e topology here: {error}"
    return None


def _topology_devices(slices: int = 2):
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5e:2x4",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=slices,
    ).devices


needs_libtpu = pytest.mark.skipif(
    _topology_error() is not None,
    reason=f"{_topology_error()}; test_a_megascale_send_* and test_make_mesh_* check the same "
    "logic on HLO text and fake devices",
)
_MLP = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_schedule.py").mlp
_SEND_RE = re.compile(
    r"^\s*%\S+ = \((\w+)\[([\d,]*)\]\S*, u32\[\].*\bsend\(.*_xla_megascale_target"
)


def _hlo_send_bytes(text: str) -> int:
    """The bytes of every Megascale send, read straight off the text."""
    total = 0
    for line in text.splitlines():
        match = _SEND_RE.match(line)
        if match is not None:
            elements = int(np.prod([int(v) for v in match[2].split(",") if v]))
            total += elements * {"f32": 4, "s32": 4, "u8": 1, "s8": 1}[match[1]]
    return total


@needs_libtpu
def test_make_mesh_on_the_topology_puts_each_slice_in_a_row():
    mesh = jbg.make_mesh(devices=_topology_devices())
    assert dict(mesh.shape) == {"node": 2, "local": 8}
    assert [{d.slice_index for d in row} for row in mesh.devices] == [{0}, {1}]
    assert {d.process_index for d in mesh.devices[0]} == {0, 1}
    assert slice_crossings(mesh) == []


@needs_libtpu
@pytest.mark.parametrize(
    ("name", "settings"),
    [("gradient_allreduce", {"hierarchical": True}), ("bytegrad", {})],
)
def test_a_two_slice_step_sends_its_megascale_bytes_between_nodes(name, settings):
    mesh = jbg.make_mesh(devices=_topology_devices())
    params, loss_fn, _ = _MLP(2, 256)
    batch = (jax.ShapeDtypeStruct((64, 256), jnp.float32),) * 2
    with jbg.Strategy(name, mesh=mesh, **settings).train_step(loss_fn, optax.sgd(0.1)) as step:
        state = step.state_shapes(params)
        text = step.lower(state, batch).compile().as_text()
        stats = step.communication_stats(state, batch)["step"]
    sent = _hlo_send_bytes(text)
    assert sent > 0 and stats.bytes_on("node") == sent
    assert {r.axes for r in stats.rows if r.link_bytes[0]} == {"node"}
    node = stats.overlap_on("node")
    assert len(node.exchanges) == text.count("_xla_megascale_target") // 2  # sends, not recvs


@needs_libtpu
def test_bytegrad_sends_under_a_third_of_gradient_allreduces_bytes_between_slices():
    mesh = jbg.make_mesh(devices=_topology_devices())
    params, loss_fn, _ = _MLP(2, 256)
    batch = (jax.ShapeDtypeStruct((64, 256), jnp.float32),) * 2

    def node_bytes(name, **settings):
        strategy = jbg.Strategy(name, mesh=mesh, **settings)
        with strategy.train_step(loss_fn, optax.sgd(0.1)) as step:
            return step.communication_stats(step.state_shapes(params), batch)["step"].bytes_on(
                "node"
            )

    full, compressed = node_bytes("gradient_allreduce", hierarchical=True), node_bytes("bytegrad")
    # XLA splits the float32 all-reduce itself: each device sends its 1/8 across slices.
    assert full >= 2 * 256 * 256 * 4 / 8
    assert compressed < full / 3


@needs_libtpu
def test_four_slices_grouped_by_a_sub_axis_name_their_devices():
    devices = sorted(_topology_devices(4), key=lambda d: (d.slice_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object).reshape(2, 2, 8), ("a", "b", "local"))
    x = jax.ShapeDtypeStruct((1000,), jnp.float32)
    for axis in ("a", "b"):
        fn = jax.jit(
            jax.shard_map(
                lambda v, axis=axis: jax.lax.psum(v, axis), mesh=mesh, in_specs=jax.P(),
                out_specs=jax.P(), check_vma=False,
            )
        )  # fmt: skip
        (row,) = jbg.profiling.communication_stats(fn, x).rows
        # The explicit form names each pair of slices: the one axis they differ on.
        assert (row.kind, row.axes, row.bytes_sent) == ("all-reduce", axis, 8 * 128 * 4)


def test_a_strategy_on_a_users_mesh_against_the_slices_warns():
    grid = np.array(_two_slices(), dtype=object)
    transposed = jax.sharding.Mesh(grid.reshape(2, 8).T, AXES)
    with pytest.warns(RuntimeWarning, match=r"Strategy\('gradient_allreduce'\): axis 'node'"):
        jbg.Strategy("gradient_allreduce", mesh=transposed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jbg.Strategy("gradient_allreduce", mesh=jax.sharding.Mesh(grid.reshape(2, 8), AXES))


class _Kind:
    """A device that is not here: its kind, and no allocator to ask."""

    def __init__(self, kind):
        self.device_kind = kind

    def memory_stats(self):
        return None


@pytest.mark.parametrize(
    ("kind", "gib"),
    [("TPU v5", 95), ("TPU v5 lite", 16), ("TPU v4", 32), ("TPU v6 lite", 32), ("cpu", None)],
)
def test_memory_stats_know_the_tpu_kinds(kind, gib):
    from jax_bytegrad._src.inspection import memory

    got = memory._device_bytes(_Kind(kind))
    assert got == (None if gib is None else gib * 2**30)
