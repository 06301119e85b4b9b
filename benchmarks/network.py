"""Benchmark: gradient all-reduce time between hosts on shaped links.

Builds K hosts as network namespaces on one bridge (`_netns`), limits every link to a rate with
`tc` (and optionally adds latency), runs one JAX process per host with one CPU device each (mesh
(K, 1): the "node" axis is the hosts, Gloo over TCP between them) and times each registered
operation on a gradient of ``--num-params`` parameters (25.2M by default, about ResNet-50).

Usage (root; without root it says so and exits 0)::

    python benchmarks/network.py --hosts 2 --rates 1gbit,10gbit --plot network.png
    python benchmarks/network.py --cleanup   # remove what a crashed run left behind

A timed operation is registered by name with `register`: a builder ``(mesh, num_params) ->
(jitted_fn, args)`` that runs in every worker process; ``--ops`` picks them by name.

References:
  - Bagua (Gan et al., 2021), Fig. 6: throughput on 1-25 Gbit/s links. https://arxiv.org/abs/2107.01499
  - Ring all-reduce: each host sends 2 (K-1)/K of the buffer (Patarasuk & Yuan, 2009).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_NUM_PARAMS = 25_200_000
DEFAULT_OPS = ("psum_f32", "psum_bf16")
BASELINE_OP = "psum_f32"

# The registry of timed operations ---------------------------------------------------------------

Builder = Callable[..., tuple[Callable, tuple]]
OPS: dict[str, Builder] = {}
# Bytes one host's gradient occupies on the wire, per op (for the ring bound column); optional.
WIRE_BYTES_PER_PARAM: dict[str, float] = {}


def register(name: str, *, wire_bytes_per_param: float | None = None):
    """Registers a timed operation under `name`.

    The builder runs in every worker after `jax_bytegrad.initialize()`, gets the global mesh
    (axes ``("node", "local")``, Auto) and the parameter count, and returns ``(fn, args)``; the
    worker times ``jax.block_until_ready(fn(*args))``. Each device should hold its own,
    unreduced gradient (see `local_gradient`).

    Args:
      name: The name ``--ops`` selects it by.
      wire_bytes_per_param: Bytes per parameter the op's all-reduce moves (4 for float32), for
        the ring-bound column of the table; None leaves that column empty.

    Examples:
      >>> @register("psum_f16", wire_bytes_per_param=2)  # doctest: +SKIP
      ... def _psum_f16(mesh, num_params):
      ...     return _psum_builder(mesh, local_gradient(mesh, num_params, jnp.float16))
    """

    def deco(builder: Builder) -> Builder:
        if name in OPS:
            raise ValueError(f"network: op {name!r} is already registered")
        OPS[name] = builder
        if wire_bytes_per_param is not None:
            WIRE_BYTES_PER_PARAM[name] = wire_bytes_per_param
        return builder

    return deco


def local_gradient(mesh, num_params: int, dtype):
    """A (devices, num_params) global array whose row on each device is that device's gradient.

    The rows differ per device ((1 + global device index) times a sawtooth in [0.5, 1.5), so
    every quantization block has a real range), sharded over both mesh axes, built from each
    process's own data with `jax.make_array_from_process_local_data`.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n_dev = mesh.devices.size
    n_local = mesh.devices.shape[1]
    sharding = NamedSharding(mesh, P(("node", "local"), None))
    first = jax.process_index() * n_local
    rows = np.arange(first + 1, first + n_local + 1, dtype=np.float32)[:, None]
    wave = 0.5 + (np.arange(num_params, dtype=np.int64) % 997).astype(np.float32) / 997
    data = (rows * wave[None]).astype(dtype)
    return jax.make_array_from_process_local_data(sharding, data, (n_dev, num_params))


def _psum_builder(mesh, grads):
    import jax
    from jax.sharding import PartitionSpec as P

    spec = P(("node", "local"), None)
    fn = jax.jit(
        jax.shard_map(
            lambda g: jax.lax.psum(g, ("node", "local")), mesh=mesh, in_specs=spec, out_specs=spec
        )
    )
    return fn, (grads,)


@register("psum_f32", wire_bytes_per_param=4)
def _psum_f32(mesh, num_params):
    return _psum_builder(mesh, local_gradient(mesh, num_params, np.float32))


@register("psum_bf16", wire_bytes_per_param=2)
def _psum_bf16(mesh, num_params):
    import jax.numpy as jnp

    return _psum_builder(mesh, local_gradient(mesh, num_params, jnp.bfloat16))


# ByteGrad sends 1-byte codes plus a (scale, zero) float32 header per block of 1024.
_CODE_BYTES_PER_PARAM = 1 + 8 / 1024
AXES = ("node", "local")


def _per_device_builder(mesh, body, grads, *extra):
    """jit(shard_map(body)) on each device's own gradient row; `extra` args are replicated."""
    import jax
    from jax.sharding import PartitionSpec as P

    in_specs = (P(AXES, None), *(P() for _ in extra))
    fn = jax.jit(
        jax.shard_map(
            lambda g, *rest: body(g[0], *rest), mesh=mesh, in_specs=in_specs, out_specs=P()
        )
    )
    return fn, (grads, *extra)


# --bucket-mb and --message-kb, set in each worker; None: the library's defaults.
_SIZES: dict[str, float | None] = {"bucket_mb": None, "message_kb": None}


def _sizes() -> dict:
    """The bucket and message sizes of this run, as keyword arguments of the library.

    Each flag gives the library's default when unset, and None (one bucket, one message per
    peer) when 0.
    """
    from jax_bytegrad.collectives import DEFAULT_BUCKET_BYTES, DEFAULT_MESSAGE_BYTES

    def size(value, default, unit):
        return default if value is None else None if value == 0 else int(value * unit)

    return {
        "bucket_bytes": size(_SIZES["bucket_mb"], DEFAULT_BUCKET_BYTES, 2**20),
        "message_bytes": size(_SIZES["message_kb"], DEFAULT_MESSAGE_BYTES, 2**10),
    }


@register("bytegrad_sync", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _bytegrad_sync(mesh, num_params):
    from jax_bytegrad.collectives import compressed_mean

    sizes = _sizes()
    return _per_device_builder(
        mesh,
        lambda g: compressed_mean(g, **sizes),
        local_gradient(mesh, num_params, np.float32),
    )


@register("bytegrad4_sync", wire_bytes_per_param=0.5 + 8 / 512)
def _bytegrad4_sync(mesh, num_params):
    """`bytegrad_sync` with 4-bit codes (two per byte, 512-value blocks by default)."""
    from jax_bytegrad.collectives import compressed_mean

    sizes = _sizes()
    return _per_device_builder(
        mesh,
        lambda g: compressed_mean(g, bits=4, **sizes),
        local_gradient(mesh, num_params, np.float32),
    )


@register("bytegrad_wire", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _bytegrad_wire(mesh, num_params):
    """ByteGrad's two exchanges alone (codes and headers, no quantization): its link floor."""
    import jax

    from jax_bytegrad.collectives import message_slices
    from jax_bytegrad.parallel import replicate

    n = mesh.shape["node"] * mesh.shape["local"]
    blocks = -(-num_params // (1024 * n)) * n
    own = blocks // n
    codes = np.full((n, own, 1024), 7, np.uint8)
    header = np.ones((n, own, 2), np.float32)
    pieces = message_slices(own, 1024, _sizes()["message_bytes"])

    def body(g, codes, header):
        del g
        codes = jax.lax.pcast(codes, AXES, to="varying")
        header = jax.lax.pcast(header, AXES, to="varying")
        out = []
        for rows in pieces:  # the same messages as compressed_mean's, one piece at a time
            for part in (codes[:, rows], header[:, rows]):
                part = jax.lax.all_to_all(part, AXES, 0, 0, tiled=True)
                # Stands in for the average: this device's piece of the mean, its real size.
                out.append(jax.lax.all_gather(part[0], AXES, axis=0, to="invarying"))
        return out

    grads = local_gradient(mesh, 8, np.float32)
    return _per_device_builder(mesh, body, grads, *replicate((codes, header), mesh))


@register("permute_wire", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _permute_wire(mesh, num_params):
    """ByteGrad's two exchanges as K-1 ppermute shifts each (same bytes as `bytegrad_wire`)."""
    import functools

    import jax

    from jax_bytegrad.parallel import replicate

    n = mesh.shape["node"] * mesh.shape["local"]
    blocks = -(-num_params // (1024 * n)) * n
    own = blocks // n
    codes = np.full((blocks, 1024), 7, np.uint8)
    header = np.ones((blocks, 2), np.float32)

    def shifts(chunk_of, me):
        # Round s sends this device's piece for device me + s and receives the piece of me - s.
        out = [chunk_of(me)]
        for s in range(1, n):
            perm = [(i, (i + s) % n) for i in range(n)]
            out.append(jax.lax.ppermute(chunk_of((me + s) % n), AXES, perm))
        return out

    def body(g, codes, header):
        del g
        me = jax.lax.axis_index(AXES)
        codes = jax.lax.pcast(codes, AXES, to="varying")
        header = jax.lax.pcast(header, AXES, to="varying")
        take = lambda a: lambda j: jax.lax.dynamic_slice_in_dim(a, j * own, own)
        received = shifts(take(codes), me), shifts(take(header), me)
        # Stands in for the average: uses every received chunk, and has the size it would.
        mine = [functools.reduce(jax.numpy.maximum, parts) for parts in received]
        gathered = [jax.numpy.concatenate(shifts(lambda j, a=a: a, me)) for a in mine]
        # A scalar that depends on every received byte keeps the exchanges alive; its psum
        # makes the output replicated (4 bytes).
        touched = sum(jax.numpy.sum(a.astype(jax.numpy.float32)) for a in gathered)
        return jax.lax.psum(touched, AXES)

    grads = local_gradient(mesh, 8, np.float32)
    return _per_device_builder(mesh, body, grads, *replicate((codes, header), mesh))


def _overlap_probe(mesh, num_params, *, wire: bool, compute: bool):
    """An all_to_all of ByteGrad's codes and/or an independent pass over the gradient."""
    import jax
    import jax.numpy as jnp

    from jax_bytegrad.parallel import replicate

    n = mesh.shape["node"] * mesh.shape["local"]
    codes = np.full((n, -(-num_params // (8 * n)) * 8), 7, np.uint8)

    def body(g, codes):
        # Eight independent pieces of each: XLA:CPU runs a program of 8 thunks or fewer in
        # sequence, whatever its dependencies.
        out = []
        if wire:
            codes = jax.lax.pcast(codes, AXES, to="varying")
            for part in jnp.split(codes, 8, axis=1):
                received = jax.lax.all_to_all(part, AXES, 0, 0, tiled=True)
                out.append(received.sum(dtype=jnp.int32))
        if compute:  # about the CPU work of quantizing the gradient: three passes over it
            for part in jnp.split(g[: g.size // 8 * 8], 8):
                out.append(jnp.sum(jnp.sin(part) * jnp.cos(part) + jnp.sqrt(jnp.abs(part))))
        return jax.lax.psum(sum(x.astype(jnp.float32) for x in out), AXES)

    grads = local_gradient(mesh, num_params, np.float32)
    return _per_device_builder(mesh, body, grads, replicate(codes, mesh))


register("probe_wire")(lambda mesh, n: _overlap_probe(mesh, n, wire=True, compute=False))
register("probe_compute")(lambda mesh, n: _overlap_probe(mesh, n, wire=False, compute=True))
register("probe_both")(lambda mesh, n: _overlap_probe(mesh, n, wire=True, compute=True))


@register("qadam_compressed", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _qadam_compressed(mesh, num_params):
    """One `scale_by_qadam` update past warm-up: local momentum, 8-bit compressed mean, Adam."""
    from jax_bytegrad.parallel import replicate
    from jax_bytegrad.qadam_optimizer import ScaleByQAdamState, scale_by_qadam

    warmup = 4
    tx = scale_by_qadam(warmup_steps=warmup, **_sizes())
    zeros = np.zeros(num_params, np.float32)
    # count = warmup_steps: the step taken is warmup_steps + 1, the compressed phase.
    state = ScaleByQAdamState(
        count=np.asarray(warmup, np.int32), mu=zeros, nu=np.full(num_params, 1e-4, np.float32)
    )
    state = replicate(state, mesh)

    return _per_device_builder(mesh, tx.update, local_gradient(mesh, num_params, np.float32), state)


# Full train steps of a ~25M-parameter float32 MLP (num_params sets its width) ------------------

_MLP_IN, _MLP_OUT, _BATCH_PER_DEVICE = 1024, 1024, 16


def _mlp_width(num_params: int) -> int:
    """Hidden width h of in -> h -> h -> out with about `num_params` parameters."""
    b = _MLP_IN + _MLP_OUT + 3
    return max(8, int((-b + (b * b + 4 * num_params) ** 0.5) / 2))


def _mlp_init(num_params: int) -> dict[str, np.ndarray]:
    h = _mlp_width(num_params)
    rng = np.random.default_rng(0)
    dims = [(_MLP_IN, h), (h, h), (h, _MLP_OUT)]
    params = {}
    for i, (a, b) in enumerate(dims):
        params[f"w{i}"] = (rng.standard_normal((a, b), np.float32) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    return params


def _mlp_loss(params, batch):
    import jax
    import jax.numpy as jnp

    x, y = batch
    for i in range(3):
        x = x @ params[f"w{i}"] + params[f"b{i}"][None]
        if i < 2:
            x = jax.nn.relu(x)
    return jnp.mean((x - y) ** 2)


def _train_builder(mesh, num_params, tx, *, qadam_warmup: int | None = None):
    import jax

    from jax_bytegrad.parallel import data_parallel_step, replicate, shard_batch

    params = _mlp_init(num_params)
    state = tx.init(params)
    if qadam_warmup is not None:  # past warm-up, so every timed step is a compressed one
        state = (state[0]._replace(count=np.asarray(qadam_warmup, np.int32)), *state[1:])
    rows = _BATCH_PER_DEVICE * mesh.devices.shape[1]
    rng = np.random.default_rng(1 + jax.process_index())
    batch = (
        rng.standard_normal((rows, _MLP_IN), np.float32),
        rng.standard_normal((rows, _MLP_OUT), np.float32),
    )
    step = data_parallel_step(_mlp_loss, tx, mesh, donate=False)
    return step, (replicate(params, mesh), replicate(state, mesh), shard_batch(batch, mesh))


@register("train_local")
def _train_local(mesh, num_params):
    """The same train step with no sync at all (forward, backward, Adam): with `bytegrad_sync`,
    the parts that `train_bytegrad` overlaps when it takes less than their sum."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    from jax_bytegrad.parallel import compiler_options, replicate, shard_batch

    tx = optax.adam(1e-4)
    params = _mlp_init(num_params)
    rows = _BATCH_PER_DEVICE * mesh.devices.shape[1]
    rng = np.random.default_rng(1 + jax.process_index())
    batch = (
        rng.standard_normal((rows, _MLP_IN), np.float32),
        rng.standard_normal((rows, _MLP_OUT), np.float32),
    )

    def body(params, state, batch):
        grads = jax.grad(_mlp_loss)(jax.lax.pcast(params, AXES, to="varying"), batch)
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda x: x[None], optax.apply_updates(params, updates))

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXES)), out_specs=P(AXES)),
        compiler_options=compiler_options(mesh),  # as data_parallel_step compiles
    )
    args = (*replicate((params, tx.init(params)), mesh), shard_batch(batch, mesh))
    return fn, args


@register("train_allreduce", wire_bytes_per_param=4)
def _train_allreduce(mesh, num_params):
    import optax

    from jax_bytegrad.transforms import gradient_allreduce

    return _train_builder(mesh, num_params, optax.chain(gradient_allreduce(), optax.adam(1e-4)))


@register("train_bytegrad", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _train_bytegrad(mesh, num_params):
    import optax

    from jax_bytegrad.transforms import bytegrad

    tx = optax.chain(bytegrad(**_sizes()), optax.adam(1e-4))
    return _train_builder(mesh, num_params, tx)


@register("train_qadam", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _train_qadam(mesh, num_params):
    from jax_bytegrad.qadam_optimizer import qadam

    warmup = 4
    tx = qadam(1e-4, warmup_steps=warmup, **_sizes())
    return _train_builder(mesh, num_params, tx, qadam_warmup=warmup)


# Decentralized training (weights, not gradients, cross the network) ------------------------------


def _decentralized_builder(mesh, num_params, build):
    """Times successive steps of a decentralized step builder on the MLP; state carried along."""
    import jax
    import optax

    from jax_bytegrad.parallel import shard_batch

    train = build(_mlp_loss, optax.sgd(1e-4), mesh)
    rows = _BATCH_PER_DEVICE * mesh.devices.shape[1]
    rng = np.random.default_rng(1 + jax.process_index())
    batch = shard_batch(
        (
            rng.standard_normal((rows, _MLP_IN), np.float32),
            rng.standard_normal((rows, _MLP_OUT), np.float32),
        ),
        mesh,
    )
    cell = [train.init(_mlp_init(num_params))]

    def fn():
        cell[0], loss = train.step(cell[0], batch)
        return loss

    # One program per gossip round: compile them all before timing.
    for _ in range(mesh.devices.size):
        jax.block_until_ready(fn())
    return fn, ()


@register("train_decentralized")
def _train_decentralized(mesh, num_params):
    import functools

    from jax_bytegrad.decentralized import decentralized_step

    build = functools.partial(decentralized_step, peer_selection_mode="shift_one")
    return _decentralized_builder(mesh, num_params, build)


@register("train_lowprec_decentralized")
def _train_lowprec_decentralized(mesh, num_params):
    from jax_bytegrad.decentralized import low_precision_decentralized_step

    return _decentralized_builder(mesh, num_params, low_precision_decentralized_step)


# Worker: one per host ---------------------------------------------------------------------------


def _worker(args) -> int:
    from jax_bytegrad.distributed import initialize

    info = initialize()
    _SIZES.update(bucket_mb=args.bucket_mb, message_kb=args.message_kb)
    import jax
    from jax.experimental import multihost_utils

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(jax.process_count(), jax.local_device_count()),
        ("node", "local"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    built = {}
    for name in args.ops:
        op, _, message_kb = name.partition(":")
        if message_kb:  # "op:KB" runs op with messages of KB KiB, in the same run as the others
            _SIZES["message_kb"] = float(message_kb)
        built[name] = OPS[op](mesh, args.num_params)
        _SIZES["message_kb"] = args.message_kb
        fn, fn_args = built[name]
        for _ in range(args.warmup):
            jax.block_until_ready(fn(*fn_args))
    # Ops take turns step by step, so a burst of load from elsewhere on this shared machine
    # lands on all of them alike instead of on whichever op was running at the time.
    times = {name: [] for name in args.ops}
    tx = {name: 0 for name in args.ops}
    for step in range(args.steps):
        for name in args.ops:
            fn, fn_args = built[name]
            # Start together, so one host's late start is not counted as link time.
            multihost_utils.sync_global_devices(f"{name}-{step}")
            tx0 = _tx_bytes()
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times[name].append(time.perf_counter() - t0)
            tx1 = _tx_bytes()
            tx[name] += (tx1 - tx0) if tx0 is not None and tx1 is not None else float("nan")
    results = {}
    for name in args.ops:
        # A step ends when the slowest host has its result.
        all_times = multihost_utils.process_allgather(np.asarray(times[name]))
        per_step = np.asarray(all_times).max(axis=0)
        # Bytes this host put on its link per timed step.
        sent = np.asarray(multihost_utils.process_allgather(np.asarray([tx[name] / args.steps])))
        results[name] = {"steps_s": per_step.tolist(), "tx_bytes_per_host": float(sent.mean())}
        if info.process_id == 0:
            print(f"{name}: median {1e3 * statistics.median(per_step):.1f} ms", flush=True)
    if info.process_id == 0:
        Path(args.out).write_text(json.dumps(results))
    jax.distributed.shutdown()
    return 0


def _tx_bytes(dev: str = "eth0") -> int | None:
    """Bytes sent so far on this host's link (`ip netns exec` mounts the namespace's /sys)."""
    try:
        return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


# Driver -----------------------------------------------------------------------------------------


def _parse_rate(text: str) -> float:
    """'1gbit', '10Gbit', '500mbit' or a plain number of Mbit/s -> Mbit/s; 'none' -> 0."""
    if text.strip().lower() in ("none", "0", "unshaped"):
        return 0.0  # no tbf: the veth at full speed, which shows the CPU-bound floor
    m = re.fullmatch(r"\s*([0-9.]+)\s*(g|m)?(bit)?(/s)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"rate {text!r}: use e.g. 1gbit, 500mbit or 1000")
    return float(m.group(1)) * (1000 if m.group(2) == "g" else 1)


def _rate_label(mbit: float) -> str:
    if not mbit:
        return "unshaped"
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def _ring_bound_ms(op: str, hosts: int, num_params: int, mbit: float) -> float | None:
    op = op.partition(":")[0]
    if op not in WIRE_BYTES_PER_PARAM or hosts < 2 or not mbit:
        return None
    sent = 2 * (hosts - 1) / hosts * num_params * WIRE_BYTES_PER_PARAM[op]
    return 1e3 * sent * 8 / (mbit * 1e6)


def _table(rows: list[dict]) -> str:
    head = "| hosts | link | operation | median ms | vs float32 | MB sent/host | ring bound ms |"
    lines = [head, "|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        bound = "" if r["bound_ms"] is None else f"{r['bound_ms']:.0f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['hosts']} | {_rate_label(r['mbit'])}"
            f"{' + ' + format(r['delay_ms'], 'g') + ' ms' if r['delay_ms'] else ''} | "
            f"{r['op']} | {r['median_ms']:.1f} | {ratio} | {r['tx_mb']:.1f} | {bound} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict], path: str) -> None:
    """One panel per host count, one line per op (same colour in every panel), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["mbit"]]  # unshaped runs have no place on a rate axis
    hosts = sorted({r["hosts"] for r in rows})
    ops = list(dict.fromkeys(r["op"] for r in rows))
    colors = {op: f"C{i}" for i, op in enumerate(ops)}
    fig, axes = plt.subplots(
        1, len(hosts), figsize=(4.5 * len(hosts), 4.5), sharey=True, squeeze=False
    )
    for ax, k in zip(axes[0], hosts, strict=True):
        for op in ops:
            pts = sorted(
                (r["mbit"] / 1000, r["median_ms"]) for r in rows if (r["hosts"], r["op"]) == (k, op)
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", color=colors[op], label=op)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_title(f"{k} hosts")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("median time per step (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(ops)), fontsize="small")
    fig.suptitle("Gradient sync and train steps between namespace hosts")
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(ops) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=120)


def _run_config(cluster, args, mbit: float) -> dict[str, list[float]]:
    from jax_bytegrad import _checks
    from jax_bytegrad.launch import launch

    cluster.shape(mbit, args.delay)
    with tempfile.TemporaryDirectory(prefix="bgn-") as tmp:
        out = Path(tmp) / "result.json"
        worker = [
            sys.executable, str(Path(__file__).resolve()), "--worker",
            "--ops", ",".join(args.ops), "--num-params", str(args.num_params),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
        ]  # fmt: skip
        for flag, value in (("--bucket-mb", args.bucket_mb), ("--message-kb", args.message_kb)):
            if value is not None:
                worker += [flag, str(value)]
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        )
        code = launch(
            lambda rank: cluster.command(rank, worker),
            nproc=len(cluster.hosts),
            coordinator_host=cluster.hosts[0].address,
            port=_checks.free_port(),
            timeout=args.timeout,
            env=env,
            hugepages=args.hugepages,
        )
        if code != 0:
            raise SystemExit(code)
        return json.loads(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", default="2", help="comma-separated host counts (default 2)")
    parser.add_argument(
        "--rates", default="1gbit,10gbit", help="comma-separated link rates (default 1gbit,10gbit)"
    )
    parser.add_argument("--delay", type=float, default=None, help="one-way latency in ms (netem)")
    parser.add_argument(
        "--ops",
        default=",".join(DEFAULT_OPS),
        help="comma-separated op names; op:KB sets its message size",
    )
    parser.add_argument("--num-params", type=int, default=DEFAULT_NUM_PARAMS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    parser.add_argument("--plot", default=None, help="write a PNG of time vs link rate here")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="ByteGrad / QAdam bucket size in MiB (default: the library's; 0: one bucket)",
    )
    parser.add_argument(
        "--message-kb",
        type=float,
        default=None,
        help="bytes per message between nodes, in KiB (default: the library's; 0: one per peer)",
    )
    parser.add_argument(
        "--no-hugepages",
        dest="hugepages",
        action="store_false",
        help="workers on 4 KiB pages (default, as the launcher: glibc.malloc.hugetlb=1)",
    )
    parser.add_argument("--cleanup", action="store_true", help="remove leftovers and exit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in args.ops if o.partition(":")[0] not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {unknown}; registered: {sorted(OPS)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")

    if args.worker:
        return _worker(args)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _netns

    if not _netns.have_root():
        print(
            "network benchmark: needs root (and ip, tc, unshare) to build namespace hosts; skipped"
        )
        return 0
    if args.cleanup:
        removed = _netns.cleanup()
        print(f"removed {removed}" if removed else "nothing to clean up")
        return 0
    hosts = [int(h) for h in args.hosts.split(",") if h]
    rates = [_parse_rate(r) for r in args.rates.split(",") if r]
    if any(h < 2 for h in hosts):
        parser.error("--hosts: every host count must be at least 2")

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that tear down

    signal.signal(signal.SIGTERM, on_term)
    rows = []
    try:
        for k in hosts:
            with _netns.Cluster(k) as cluster:
                for mbit in rates:
                    print(f"== {k} hosts, {_rate_label(mbit)}", flush=True)
                    result = _run_config(cluster, args, mbit)
                    base = result.get(BASELINE_OP)
                    base = statistics.median(base["steps_s"]) if base else None
                    for op in args.ops:
                        med = statistics.median(result[op]["steps_s"])
                        rows.append(
                            {
                                "hosts": k, "mbit": mbit, "delay_ms": args.delay, "op": op,
                                "median_ms": 1e3 * med, "steps_s": result[op]["steps_s"],
                                "tx_mb": result[op]["tx_bytes_per_host"] / 1e6,
                                "bound_ms": _ring_bound_ms(op, k, args.num_params, mbit),
                                "ratio": None if base is None else med / base,
                            }
                        )  # fmt: skip
    except KeyboardInterrupt:
        print("interrupted; namespaces removed", file=sys.stderr)
        return 130
    finally:
        _netns.cleanup()  # also what an interrupted Cluster.__exit__ may have missed

    print(f"\n{args.num_params / 1e6:g}M parameters, {args.steps} timed steps after {args.warmup}")
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        _plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
