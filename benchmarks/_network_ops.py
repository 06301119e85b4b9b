"""The timed operations of ``benchmarks/network.py``: a table of ops over a few builders.

Each row of ``_TABLE`` names an op, its builder and the builder's settings, and the bytes per
parameter its all-reduce moves (for the ring-bound column; None leaves it empty). A builder
``(mesh, num_params, **settings) -> (fn, args)`` runs in every worker process after
``jax_bytegrad.initialize()``, gets the global mesh (axes ``("node", "local")``, Auto) and the
parameter count; the worker times ``jax.block_until_ready(fn(*args))``. Each device holds its
own, unreduced gradient (``local_gradient``). ``--ops`` picks ops by name. Sizes and wire
formats come from the library's constants.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _mlp import mlp_batch, mlp_init, mlp_loss
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MESSAGE_BYTES,
    Residuals,
    ScaleByQAdamState,
    SyncConfig,
    compressed_mean,
    scale_by_qadam,
)
from jax_bytegrad._src.sync.patterns import ring_all_gather
from jax_bytegrad.experimental import (
    PipelinedMean,
    message_slices,
    residual_sizes,
    ring_all_to_all,
    split_ppermute,
)
from jax_bytegrad.profiling import HEADER_WIDTH
from jax_bytegrad.sharding import AXES, replicate, shard_batch

DEFAULT_BLOCK_SIZE = SyncConfig(bits=8).block_size

DEFAULT_OPS = ("psum_f32", "psum_bf16")
BASELINE_OP = "psum_f32"

Builder = Callable[..., tuple[Callable, tuple]]

# --bucket-mb and --message-kb, set in each worker; None: the library's defaults.
SIZES: dict[str, float | None] = {"bucket_mb": None, "message_kb": None}
# --donate, set in each worker: train steps donate their state and carry it along, and the
# float32 psums and the integer and ring wires' syncs (`_wire_sync`) their gradient buffer.
BUFFERS: dict[str, bool] = {"donate": False}

# 8-bit codes cross as 1 byte each plus two float32 per block: the scatter-gather wire's
# (scale, zero) header, or the integer wire's (max, -min) bounds.
_HEADER_BYTES = HEADER_WIDTH * 4
_CODES_8 = 1 + _HEADER_BYTES / DEFAULT_BLOCK_SIZE
_CODES_4 = 0.5 + _HEADER_BYTES / SyncConfig(bits=4).block_size
_BATCH_PER_DEVICE = 16


def _sizes() -> dict:
    """The bucket and message sizes of this run, as keyword arguments of the library.

    Each flag gives the library's default when unset, and None (one bucket, one message per
    peer) when 0.
    """

    def size(value, default, unit):
        return default if value is None else None if value == 0 else int(value * unit)

    return {
        "bucket_bytes": size(SIZES["bucket_mb"], DEFAULT_BUCKET_BYTES, 2**20),
        "message_bytes": size(SIZES["message_kb"], DEFAULT_MESSAGE_BYTES, 2**10),
    }


def _wire_sizes(wire: str) -> dict:
    """`_sizes`, but one message per bucket for the integer wire: its psum runs at line rate
    in one message and loses rate when split (the psum_u8:KB patterns), unless `op:KB` says
    otherwise."""
    sizes = _sizes()
    if wire == "allreduce" and SIZES["message_kb"] is None:
        sizes["message_bytes"] = None
    return sizes


def local_gradient(mesh, num_params: int, dtype):
    """A (devices, num_params) global array whose row on each device is that device's gradient.

    The rows differ per device ((1 + global device index) times a sawtooth in [0.5, 1.5), so
    every quantization block has a real range), sharded over both mesh axes, built from each
    process's own data with `jax.make_array_from_process_local_data`.
    """
    n_local = mesh.devices.shape[1]
    first = jax.process_index() * n_local
    rows = np.arange(first + 1, first + n_local + 1, dtype=np.float32)[:, None]
    wave = 0.5 + (np.arange(num_params, dtype=np.int64) % 997).astype(np.float32) / 997
    data = (rows * wave[None]).astype(dtype)
    sharding = NamedSharding(mesh, P(AXES, None))
    return jax.make_array_from_process_local_data(sharding, data, (mesh.devices.size, num_params))


def _per_device_builder(mesh, body, grads, *extra, keep: bool = False, donate: bool = False):
    """jit(shard_map(body)) on each device's own gradient row; `extra` args are replicated.

    The result is replicated, or with `keep` stays on each device (out_specs over both axes),
    so that nothing but the body's collectives runs. `donate` donates the gradient.
    """

    def per_device(g, *rest):
        out = body(g[0], *rest)
        return jax.tree.map(lambda y: y[None], out) if keep else out

    in_specs = (P(AXES, None), *(P() for _ in extra))
    out_specs = P(AXES) if keep else P()
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(mapped, donate_argnums=(0,) if donate else ()), (grads, *extra)


def _timed(fn, state, *args, carry: bool | None = None):
    """``(fn, args)`` that times ``fn(state, *args) -> (state, out)``: on the same state every
    call, or with `carry` (default: --donate) on the state the call before returned (the
    worker then waits for the state and the output)."""
    if not (BUFFERS["donate"] if carry is None else carry):
        return fn, (state, *args)
    cell = [state]

    def carried():
        cell[0], out = fn(cell[0], *args)
        return cell[0], out

    return carried, ()


# Builders: syncs of each host's own gradient ------------------------------------------------


def _psum(mesh, num_params, *, dtype):
    """The float32 (or bfloat16) all-reduce of the gradient: the baseline. With --donate, the
    sum comes back in the gradient's buffer, as the syncs' means do, and is summed again."""
    grads = local_gradient(mesh, num_params, jnp.dtype(dtype))
    donate = BUFFERS["donate"]
    fn, _ = _per_device_builder(
        mesh, lambda g: jax.lax.psum(g, AXES), grads, keep=True, donate=donate
    )
    return _timed(lambda g: (fn(g), None), grads)


def _compressed_sync(mesh, num_params, *, bits: int):
    """`compressed_mean` of each host's gradient with the library's default wire."""
    sizes = _sizes()
    kwargs = {} if bits == 8 else {"bits": bits}
    return _per_device_builder(
        mesh,
        lambda g: compressed_mean(g, sync=SyncConfig(**kwargs, **sizes)),
        local_gradient(mesh, num_params, np.float32),
    )


def _codes_wire(mesh, num_params, *, permute: bool):
    """ByteGrad's two exchanges alone (codes and headers, no quantization): its link floor.
    With `permute`, each exchange is K-1 ppermute shifts (the same bytes)."""
    n = mesh.devices.size
    own = -(-num_params // (DEFAULT_BLOCK_SIZE * n))  # blocks per device
    codes = np.full((n, own, DEFAULT_BLOCK_SIZE), 7, np.uint8)
    header = np.ones((n, own, HEADER_WIDTH), np.float32)
    pieces = message_slices(own, DEFAULT_BLOCK_SIZE, _sizes()["message_bytes"])

    def exchanges(codes, header):
        out = []
        for rows in pieces:  # the same messages as compressed_mean's, one piece at a time
            for part in (codes[:, rows], header[:, rows]):
                part = jax.lax.all_to_all(part, AXES, 0, 0, tiled=True)
                # Stands in for the average: this device's piece of the mean, its real size.
                out.append(jax.lax.all_gather(part[0], AXES, axis=0, to="invarying"))
        return out

    def shifts(chunk_of, me):
        # Round s sends this device's piece for device me + s and receives the piece of me - s.
        out = [chunk_of(me)]
        for s in range(1, n):
            perm = [(i, (i + s) % n) for i in range(n)]
            out.append(jax.lax.ppermute(chunk_of((me + s) % n), AXES, perm))
        return out

    def permutes(codes, header):
        me = jax.lax.axis_index(AXES)

        def take(a):
            return lambda j: jax.lax.dynamic_index_in_dim(a, j, keepdims=False)

        received = shifts(take(codes), me), shifts(take(header), me)
        # Stands in for the average: uses every received chunk, and has the size it would.
        mine = [functools.reduce(jnp.maximum, parts) for parts in received]
        gathered = [jnp.concatenate(shifts(lambda j, a=a: a, me)) for a in mine]
        # A scalar that depends on every received byte keeps the exchanges alive; its psum
        # makes the output replicated (4 bytes).
        touched = sum(jnp.sum(a.astype(jnp.float32)) for a in gathered)
        return jax.lax.psum(touched, AXES)

    def body(g, codes, header):
        del g
        codes, header = (jax.lax.pcast(a, AXES, to="varying") for a in (codes, header))
        return (permutes if permute else exchanges)(codes, header)

    grads = local_gradient(mesh, 8, np.float32)
    return _per_device_builder(mesh, body, grads, *replicate((codes, header), mesh))


def _overlap_probe(mesh, num_params, *, wire: bool, compute: bool):
    """An all_to_all of ByteGrad's codes and/or an independent pass over the gradient."""
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


def _qadam_compressed(mesh, num_params, *, wire: str = "auto"):
    """One `scale_by_qadam` update past warm-up, as the Strategy compiles it (the compressed
    phase's own program): local momentum, 8-bit compressed mean, Adam."""
    warmup = 4
    on_wire = {} if wire == "auto" else {"wire": wire}
    sync = SyncConfig(**on_wire, **_wire_sizes(wire))
    tx = scale_by_qadam(warmup_steps=warmup, phase="compressed", sync=sync)
    zeros = np.zeros(num_params, np.float32)
    # count = warmup_steps: the step taken is warmup_steps + 1, the compressed phase.
    state = ScaleByQAdamState(
        count=np.asarray(warmup, np.int32), mu=zeros, nu=np.full(num_params, 1e-4, np.float32)
    )
    state = replicate(state, mesh)

    return _per_device_builder(mesh, tx.update, local_gradient(mesh, num_params, np.float32), state)


def _zero_residuals(mesh, num_params, config):
    """Error feedback's ``Residuals`` for a ``num_params`` gradient, zero, sharded over the
    devices as ``compressed_mean`` takes and returns them: (send, mean) per bucket."""
    n, local = mesh.shape["node"], mesh.shape["local"]
    sharding = NamedSharding(mesh, P(AXES))
    shape = jax.ShapeDtypeStruct((num_params,), np.float32)
    return Residuals(
        tuple(
            jax.make_array_from_process_local_data(
                sharding, np.zeros((local * size,), np.float32), (n * local * size,)
            )
            for size in pair
        )
        for pair in residual_sizes(shape, config, (n, local))
    )


def _wire_sync(mesh, num_params, *, wire: str, bits: int = 8, rounding: str = "nearest",
               feedback: bool = False):  # fmt: skip
    """`compressed_mean(wire=...)` of each host's own gradient, as `bytegrad_sync` times it.

    With --donate, the gradient's buffer is donated and the mean comes back in it, as a train
    step reuses its buffers, instead of a fresh 100 MB output every call; the next call
    averages that mean (the codec's work does not depend on the values).
    """
    kwargs = dict(wire=wire, bits=bits, rounding=rounding, **_wire_sizes(wire))
    grads = local_gradient(mesh, num_params, np.float32)
    key = replicate(np.asarray(jax.random.key_data(jax.random.key(0))), mesh)
    residuals = ()
    if feedback:
        config = SyncConfig(bits=bits, wire=wire, bucket_bytes=kwargs["bucket_bytes"])
        residuals = _zero_residuals(mesh, num_params, config)

    def body(state, key_data):
        g, residuals = state
        key = None
        if rounding == "stochastic":
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), 0)
        out = compressed_mean(
            g[0], key=key, residuals=residuals if feedback else None, sync=SyncConfig(**kwargs)
        )
        mean, residuals = out if feedback else (out, residuals)
        return mean[None], residuals

    specs = (P(AXES, None), jax.tree.map(lambda _: P(AXES), residuals))
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=specs),
        donate_argnums=(0,) if BUFFERS["donate"] else (),
    )
    return _timed(lambda state, key: (fn(state, key), None), (grads, residuals), key)


# Builders: one collective pattern alone on per-device buffers, no compute -------------------
# Each host holds its own buffer (varying); the result stays on the devices (out_specs over both
# axes), so nothing but the collectives runs. `op:KB` cuts each collective into messages of KB
# KiB (0: one message). Names give the dtype; sizes are in bytes of the 25.2M-parameter case:
# N bytes = one uint8 code per parameter.


def _pattern_builder(mesh, body, size: int, dtype):
    """`body` alone on each device's own buffer of `size` elements of `dtype`."""
    return _per_device_builder(mesh, body, local_gradient(mesh, size, dtype), keep=True)


def _pieces(x, message_bytes):
    """`x` (flat) cut into consecutive messages of about `message_bytes` (None: one)."""
    return [x[p] for p in message_slices(x.size, x.dtype.itemsize, message_bytes)]


def _psum_pattern(mesh, num_params, *, dtype, reduce: str = "psum", bounds: bool = False):
    """A psum (or pmax) of N bytes per host in `dtype`; with `bounds`, of two float32 values
    per block instead: the integer wire's agreement on block ranges."""
    op = {"psum": jax.lax.psum, "pmax": jax.lax.pmax}[reduce]
    message_bytes = _sizes()["message_bytes"]
    size = 2 * -(-num_params // DEFAULT_BLOCK_SIZE) if bounds else num_params // dtype.itemsize

    def body(x):
        return jnp.concatenate([op(p, AXES) for p in _pieces(x, message_bytes)])

    return _pattern_builder(mesh, body, size, dtype)


def _shift_u8(mesh, num_params):
    """One ppermute shift by +1 of N bytes: at 2 hosts a swap, at 3+ a ring (one-way per link)."""
    n = mesh.devices.size
    perm = [(i, (i + 1) % n) for i in range(n)]
    message_bytes = _sizes()["message_bytes"]
    return _pattern_builder(
        mesh, lambda x: split_ppermute(x, AXES, perm, message_bytes), num_params, np.uint8
    )


def _exchange_pattern(mesh, num_params, exchange: str):
    """The scatter-gather wire's two exchanges of uint8 codes, N bytes per host in all."""
    n = mesh.devices.size
    chunk = -(-num_params // n)
    message_bytes = _sizes()["message_bytes"]

    def body(x):
        if exchange == "all_to_all":
            rows = x.reshape(n, chunk)
            return [
                jax.lax.all_to_all(rows[:, p], AXES, 0, 0, tiled=True)
                for p in message_slices(chunk, 1, message_bytes)
            ]
        if exchange == "ring_all_to_all":
            return ring_all_to_all(x.reshape(n, chunk), AXES, message_bytes=message_bytes)
        mine = x[:chunk]
        if exchange == "all_gather":
            return [jax.lax.all_gather(p, AXES, axis=0) for p in _pieces(mine, message_bytes)]
        return ring_all_gather(mine, AXES, n, message_bytes=message_bytes)

    return _pattern_builder(mesh, body, n * chunk, np.uint8)


# Builders: full train steps of a ~25M-parameter float32 MLP (num_params sets its width) ------
# Each host feeds its own batch (`_host_batch`). Without --donate nothing is donated and every
# timed call starts from the same state; the decentralized steps always carry their state.


def _host_batch(mesh):
    """This host's batch of the MLP, placed on the mesh: its own rows on each process."""
    rows = _BATCH_PER_DEVICE * mesh.devices.shape[1]
    batch = mlp_batch(np.random.default_rng(1 + jax.process_index()), rows)
    return shard_batch(batch, mesh)


def _train_step(mesh, num_params, step, *, carry: bool | None = None, state=None):
    """Times `step` on the MLP, from its initial state (or `state`) and this host's batch."""
    state = step.init(mlp_init(num_params)) if state is None else state
    return _timed(step, state, _host_batch(mesh), carry=carry)


def _train(mesh, num_params, *, algorithm: str, shard: str | None = None, **settings):
    """`data_parallel_step` of the MLP: Adam after `algorithm`'s sync (QAdam: its compressed
    phase alone, past warm-up, so that every timed step is a compressed one), its state split
    within each host with `shard` ("optimizer", "params"; None: every device holds it all)."""
    warmup = 4
    if algorithm == "qadam":
        tx = jax_bytegrad.qadam(1e-4, warmup_steps=warmup, phase="compressed", **_sizes())
    elif algorithm == "gradient_allreduce":
        tx = optax.chain(jax_bytegrad.gradient_allreduce(), optax.adam(1e-4))
    else:
        sync = jax_bytegrad.bytegrad(**settings, **_wire_sizes(settings.get("wire", "auto")))
        tx = optax.chain(sync, optax.adam(1e-4))
    step = jax_bytegrad.data_parallel_step(
        mlp_loss, tx, mesh, donate=BUFFERS["donate"], shard=shard
    )
    state = step.init(mlp_init(num_params))
    if algorithm == "qadam":  # past warm-up: the count a compressed step sees
        qadam_state = state.opt_state[0]._replace(
            count=replicate(np.asarray(warmup, np.int32), mesh)
        )
        state = state._replace(opt_state=(qadam_state, *state.opt_state[1:]))
    return _train_step(mesh, num_params, step, state=state)


def _train_local(mesh, num_params):
    """The same train step with no sync at all (forward, backward, Adam): with `bytegrad_sync`,
    the parts that `train_bytegrad` overlaps when it takes less than their sum."""
    tx = optax.adam(1e-4)
    params = mlp_init(num_params)

    def body(params, state, batch):
        grads = jax.grad(mlp_loss)(jax.lax.pcast(params, AXES, to="varying"), batch)
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda x: x[None], optax.apply_updates(params, updates))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXES)), out_specs=P(AXES)))
    args = (*replicate((params, tx.init(params)), mesh), _host_batch(mesh))
    return fn, args


def _train_decentralized(mesh, num_params, *, low_precision: bool):
    """Decentralized SGD (shift_one peers) or its low-precision variant, weights on the wire."""
    if low_precision:
        build = jax_bytegrad.low_precision_decentralized_step
    else:
        build = functools.partial(jax_bytegrad.decentralized_step, peer_selection_mode="shift_one")
    fn, args = _train_step(mesh, num_params, build(mlp_loss, optax.sgd(1e-4), mesh), carry=True)
    # One program per gossip round: compile them all before timing.
    for _ in range(mesh.devices.size):
        jax.block_until_ready(fn(*args))
    return fn, args


# Builders: the pipelined step, the sync's codec beside its wire -----------------------------
# `op@MB` sets the bucket size, which is also the size of the pieces the pipeline sends.


def _train_diloco(mesh, num_params, **settings):
    """``Strategy("diloco")`` on the MLP, one inner step per call, the state carried from call
    to call: the timed steps cross an outer exchange once every ``inner_steps`` calls, so the
    mean step (``steps_s`` in --json), not the median, is the cost per inner step. One period
    and the delay run first, so that every program is compiled before any timed step. Its
    state is donated only with --donate, as the other train steps' (XLA:CPU copies a donated
    Adam state before updating it in place: RESULTS.md, "DiLoCo", "Time between namespace
    hosts"). The worker waits for what the next inner step reads, as a training loop does: the
    node's params, its inner state and the metrics; an exchange in the background is waited for
    in the step it lands in, which reads what it hands back."""
    settings = {"donate": BUFFERS["donate"], **settings}
    strategy = jax_bytegrad.Strategy("diloco", mesh=mesh, **settings)
    step = strategy.train_step(mlp_loss, optax.adam(1e-4))
    state, batch = step.init(mlp_init(num_params)), _host_batch(mesh)
    for _ in range(settings["inner_steps"] + settings.get("delay", 1) + 1):
        state, _ = step(state, batch)
    cell = [state]

    def inner_step():
        cell[0], metrics = step(cell[0], batch)
        return cell[0].params, cell[0].opt_state, metrics

    # The worker waits for the exchanges in flight before its own collectives at the end.
    inner_step.drain = lambda: jax.block_until_ready(cell[0])
    return inner_step, ()


def runs_alone(name: str) -> bool:
    """Whether op ``name`` keeps an exchange in flight on a thread of its own between calls
    (DiLoCo in the background), where any other collective between the hosts (another op's,
    the worker's barrier) would meet it on the same Gloo pairs: it must run alone, with no
    barrier between steps, and end with its exchanges (``drain``)."""
    return bool(_TABLE[name][1].get("background"))


def _pipelined_sync(mesh, num_params, *, wire: str, rounding: str = "nearest",
                    feedback: bool = False):  # fmt: skip
    """The sync of `_wire_sync`, pipelined: each bucket piece's exchange on the wire while the
    next piece is encoded and the one before decoded, in programs of their own."""
    config = SyncConfig(wire=wire, rounding=rounding, error_feedback=feedback, **_wire_sizes(wire))
    grads = local_gradient(mesh, num_params, np.float32)
    key = None
    if rounding == "stochastic":
        key = replicate(jax.random.fold_in(jax.random.key(0), 0), mesh)
    residuals = _zero_residuals(mesh, num_params, config) if feedback else None
    mean = PipelinedMean(mesh, config)
    return (lambda: mean(grads, key, residuals)), ()


def _train_pipelined(mesh, num_params, *, wire: str, **settings):
    """`train_ar8` / `train_bytegrad` as `pipelined_step` builds them (Adam after the sync)."""
    config = SyncConfig(wire=wire, **_wire_sizes(wire), **settings)
    step = jax_bytegrad.pipelined_step(
        mlp_loss, optax.adam(1e-4), mesh, sync=config, donate=BUFFERS["donate"]
    )
    return _train_step(mesh, num_params, step)


# The table: name -> (builder, settings, bytes per parameter on the wire or None) -------------
# The float32 psum sends 4 bytes per parameter; 8-bit codes 1 plus each block's header; 4-bit
# codes half that. The all_to_all sends (K-1)/K of N bytes per host, the all_gather N/K to
# every other host.

_U8, _I8, _U16, _I32, _F32 = (np.dtype(t) for t in ("uint8", "int8", "uint16", "int32", "float32"))

_TABLE: dict[str, tuple[Builder, dict, float | None]] = {
    "psum_f32": (_psum, dict(dtype="float32"), 4),
    "psum_bf16": (_psum, dict(dtype="bfloat16"), 2),
    "bytegrad_sync": (_compressed_sync, dict(bits=8), _CODES_8),
    "bytegrad4_sync": (_compressed_sync, dict(bits=4), _CODES_4),
    "bytegrad_wire": (_codes_wire, dict(permute=False), _CODES_8),
    "permute_wire": (_codes_wire, dict(permute=True), _CODES_8),
    "probe_wire": (_overlap_probe, dict(wire=True, compute=False), None),
    "probe_compute": (_overlap_probe, dict(wire=False, compute=True), None),
    "probe_both": (_overlap_probe, dict(wire=True, compute=True), None),
    "qadam_compressed": (_qadam_compressed, {}, _CODES_8),
    "qadam_ar8_compressed": (_qadam_compressed, dict(wire="allreduce"), _CODES_8),
    "ar8_sync": (_wire_sync, dict(wire="allreduce"), _CODES_8),
    "ar8_sync_sr": (_wire_sync, dict(wire="allreduce", rounding="stochastic"), _CODES_8),
    "ar8_sync_ef": (_wire_sync, dict(wire="allreduce", feedback=True), _CODES_8),
    "ar4_sync": (_wire_sync, dict(wire="allreduce", bits=4), _CODES_4),
    "ring_sync": (_wire_sync, dict(wire="ring"), _CODES_8),
    "train_ar8": (_train, dict(algorithm="bytegrad", wire="allreduce"), _CODES_8),
    "train_ar4": (_train, dict(algorithm="bytegrad", wire="allreduce", bits=4), _CODES_4),
    # The same 25.2 MB per host (N bytes) in each dtype: XLA:CPU and Gloo's integer all-reduce.
    "psum_u8": (_psum_pattern, dict(dtype=_U8), 1),
    "psum_i8": (_psum_pattern, dict(dtype=_I8), 1),
    "psum_u16": (_psum_pattern, dict(dtype=_U16), 1),
    "psum_i32": (_psum_pattern, dict(dtype=_I32), 1),
    "psum_f32_n": (_psum_pattern, dict(dtype=_F32), 1),
    "pmax_ranges": (
        _psum_pattern,
        dict(dtype=_F32, reduce="pmax", bounds=True),
        8 / DEFAULT_BLOCK_SIZE,
    ),
    "shift_u8": (_shift_u8, {}, None),
    "a2a_u8": (_exchange_pattern, dict(exchange="all_to_all"), 0.5),
    "a2a_ring_u8": (_exchange_pattern, dict(exchange="ring_all_to_all"), 0.5),
    "ag_u8": (_exchange_pattern, dict(exchange="all_gather"), 0.5),
    "ag_ring_u8": (_exchange_pattern, dict(exchange="ring_all_gather"), 0.5),
    "train_local": (_train_local, {}, None),
    "train_allreduce": (_train, dict(algorithm="gradient_allreduce"), 4),
    "train_bytegrad": (_train, dict(algorithm="bytegrad"), _CODES_8),
    # The same step with its state split over each host's devices (run them on 2+ devices per
    # host: --devices-per-host): the same bytes between hosts.
    "train_bytegrad_shard_optimizer": (
        _train,
        dict(algorithm="bytegrad", shard="optimizer"),
        _CODES_8,
    ),
    "train_bytegrad_shard_params": (_train, dict(algorithm="bytegrad", shard="params"), _CODES_8),
    "train_qadam": (_train, dict(algorithm="qadam"), _CODES_8),
    "train_decentralized": (_train_decentralized, dict(low_precision=False), None),
    "train_lowprec_decentralized": (_train_decentralized, dict(low_precision=True), None),
    # DiLoCo: one inner step per call, the outer exchange every 50 (delay 1: inside a step).
    "train_diloco50": (_train_diloco, dict(inner_steps=50), None),
    "train_diloco50_4ef": (_train_diloco, dict(inner_steps=50, bits=4, error_feedback=True), None),
    # The same on the integer wire (one psum per bucket; 4-bit codes on it: 2 nodes at most).
    "train_diloco50_4ef_ar": (
        _train_diloco,
        dict(inner_steps=50, bits=4, error_feedback=True, wire="allreduce"),
        None,
    ),
    # The exchange in the background: a program of its own on a thread of its own, beside the
    # next 40 inner steps, landing in the last of them. Each runs alone (`runs_alone`).
    "train_diloco50_bg": (_train_diloco, dict(inner_steps=50, delay=40, background=True), None),
    "train_diloco50_4ef_bg": (
        _train_diloco,
        dict(inner_steps=50, delay=40, background=True, bits=4, error_feedback=True),
        None,
    ),
    "train_diloco50_4ef_ar_bg": (
        _train_diloco,
        dict(
            inner_steps=50, delay=40, background=True, bits=4, error_feedback=True, wire="allreduce"
        ),
        None,
    ),
    "pipelined_sync_ar8": (_pipelined_sync, dict(wire="allreduce"), _CODES_8),
    "pipelined_sync_ar8_sr": (
        _pipelined_sync,
        dict(wire="allreduce", rounding="stochastic"),
        _CODES_8,
    ),
    "pipelined_sync_ar8_ef": (_pipelined_sync, dict(wire="allreduce", feedback=True), _CODES_8),
    "pipelined_sync_sg": (_pipelined_sync, dict(wire="scatter_gather"), _CODES_8),
    "train_pipelined_ar8": (_train_pipelined, dict(wire="allreduce"), _CODES_8),
    "train_pipelined_ar8_ef": (
        _train_pipelined,
        dict(wire="allreduce", error_feedback=True),
        _CODES_8,
    ),
    "train_pipelined_sg": (_train_pipelined, dict(wire="scatter_gather"), _CODES_8),
}

OPS: dict[str, Builder] = {
    name: functools.partial(builder, **settings) for name, (builder, settings, _) in _TABLE.items()
}
# Bytes one host's gradient occupies on the wire, per op (for the ring bound column).
WIRE_BYTES_PER_PARAM: dict[str, float] = {
    name: wire for name, (_, _, wire) in _TABLE.items() if wire is not None
}
