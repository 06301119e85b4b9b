"""The timed operations of ``benchmarks/network.py``, registered by name.

A builder ``(mesh, num_params) -> (jitted_fn, args)`` runs in every worker process after
``jax_bytegrad.initialize()``; the worker times ``jax.block_until_ready(fn(*args))``.
``--ops`` picks builders by name. Sizes and wire formats come from the library's constants.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jax_bytegrad import DEFAULT_BLOCK_SIZES, DEFAULT_BUCKET_BYTES, DEFAULT_MESSAGE_BYTES
from jax_bytegrad._src.collective_ops import message_slices
from jax_bytegrad._src.quantization import HEADER_WIDTH
from jax_bytegrad.sharding import AXES

DEFAULT_BLOCK_SIZE = DEFAULT_BLOCK_SIZES[8]

DEFAULT_OPS = ("psum_f32", "psum_bf16")
BASELINE_OP = "psum_f32"

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
    donate = BUFFERS["donate"]
    fn = jax.jit(
        jax.shard_map(
            lambda g: jax.lax.psum(g, ("node", "local")), mesh=mesh, in_specs=spec, out_specs=spec
        ),
        donate_argnums=(0,) if donate else (),
    )
    if not donate:
        return fn, (grads,)
    # --donate: the sum comes back in the gradient's buffer, as the syncs' means do, and is
    # summed again by the next call.
    cell = [grads]

    def carried():
        cell[0] = fn(cell[0])
        return cell[0]

    return carried, ()


@register("psum_f32", wire_bytes_per_param=4)
def _psum_f32(mesh, num_params):
    return _psum_builder(mesh, local_gradient(mesh, num_params, np.float32))


@register("psum_bf16", wire_bytes_per_param=2)
def _psum_bf16(mesh, num_params):
    import jax.numpy as jnp

    return _psum_builder(mesh, local_gradient(mesh, num_params, jnp.bfloat16))


# 8-bit codes cross as 1 byte each plus two float32 per block: the scatter-gather wire's
# (scale, zero) header, or the integer wire's (max, -min) bounds.
_HEADER_BYTES = HEADER_WIDTH * 4
_CODE_BYTES_PER_PARAM = 1 + _HEADER_BYTES / DEFAULT_BLOCK_SIZE


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
SIZES: dict[str, float | None] = {"bucket_mb": None, "message_kb": None}
# --donate, set in each worker: train steps donate their state and carry it along, and the
# float32 psums and the integer and ring wires' syncs (`_wire_sync`) their gradient buffer.
BUFFERS: dict[str, bool] = {"donate": False}


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


@register("bytegrad_sync", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _bytegrad_sync(mesh, num_params):
    from jax_bytegrad import compressed_mean

    sizes = _sizes()
    return _per_device_builder(
        mesh,
        lambda g: compressed_mean(g, **sizes),
        local_gradient(mesh, num_params, np.float32),
    )


@register("bytegrad4_sync", wire_bytes_per_param=0.5 + _HEADER_BYTES / DEFAULT_BLOCK_SIZES[4])
def _bytegrad4_sync(mesh, num_params):
    """`bytegrad_sync` with 4-bit codes (two per byte, 512-value blocks by default)."""
    from jax_bytegrad import compressed_mean

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

    from jax_bytegrad import replicate

    n = mesh.shape["node"] * mesh.shape["local"]
    blocks = -(-num_params // (DEFAULT_BLOCK_SIZE * n)) * n
    own = blocks // n
    codes = np.full((n, own, DEFAULT_BLOCK_SIZE), 7, np.uint8)
    header = np.ones((n, own, HEADER_WIDTH), np.float32)
    pieces = message_slices(own, DEFAULT_BLOCK_SIZE, _sizes()["message_bytes"])

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

    from jax_bytegrad import replicate

    n = mesh.shape["node"] * mesh.shape["local"]
    blocks = -(-num_params // (DEFAULT_BLOCK_SIZE * n)) * n
    own = blocks // n
    codes = np.full((blocks, DEFAULT_BLOCK_SIZE), 7, np.uint8)
    header = np.ones((blocks, HEADER_WIDTH), np.float32)

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

    from jax_bytegrad import replicate

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


def _qadam_compressed(mesh, num_params, **sizes):
    """One `scale_by_qadam` update past warm-up, as the Strategy compiles it (the compressed
    phase's own program): local momentum, 8-bit compressed mean, Adam."""
    from jax_bytegrad import ScaleByQAdamState, replicate, scale_by_qadam

    warmup = 4
    tx = scale_by_qadam(warmup_steps=warmup, phase="compressed", **sizes)
    zeros = np.zeros(num_params, np.float32)
    # count = warmup_steps: the step taken is warmup_steps + 1, the compressed phase.
    state = ScaleByQAdamState(
        count=np.asarray(warmup, np.int32), mu=zeros, nu=np.full(num_params, 1e-4, np.float32)
    )
    state = replicate(state, mesh)

    return _per_device_builder(mesh, tx.update, local_gradient(mesh, num_params, np.float32), state)


register("qadam_compressed", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _qadam_compressed(mesh, n, **_sizes())
)
register("qadam_ar8_compressed", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _qadam_compressed(mesh, n, wire="allreduce", **_wire_sizes("allreduce"))
)


# The integer all-reduce wire and the ring wire (jax_bytegrad._src.wire) ----------------------
# The integer wire's psum runs at line rate in one message and loses rate when split (see the
# psum_u8:KB patterns), so its ops send one message per bucket unless `op:KB` says otherwise.


def _wire_sizes(wire: str) -> dict:
    sizes = _sizes()
    if wire == "allreduce" and SIZES["message_kb"] is None:
        sizes["message_bytes"] = None
    return sizes


def _zero_residuals(mesh, num_params, config):
    """Error feedback's ``Residuals`` for a ``num_params`` gradient, zero, sharded over the
    devices as ``compressed_mean`` takes and returns them: (send, mean) per bucket."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_bytegrad import Residuals
    from jax_bytegrad._src.collectives import residual_sizes

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
    """`compressed_mean(wire=...)` of each host's own gradient, as `bytegrad_sync` times it."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jax_bytegrad import SyncConfig, compressed_mean, replicate

    kwargs = dict(wire=wire, bits=bits, rounding=rounding, **_wire_sizes(wire))
    grads = local_gradient(mesh, num_params, np.float32)
    key = replicate(np.asarray(jax.random.key_data(jax.random.key(0))), mesh)
    residuals = ()
    if feedback:
        config = SyncConfig(bits=bits, wire=wire, bucket_bytes=kwargs["bucket_bytes"])
        residuals = _zero_residuals(mesh, num_params, config)

    def body(g, key_data, residuals):
        key = None
        if rounding == "stochastic":
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), 0)
        out = compressed_mean(g[0], key=key, residuals=residuals if feedback else None, **kwargs)
        return out if feedback else (out, residuals)

    res_specs = jax.tree.map(lambda _: P(AXES), residuals)
    in_specs = (P(AXES, None), P(), res_specs)
    if not BUFFERS["donate"]:
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), res_specs)))
        return fn, (grads, key, residuals)

    # --donate: the gradient's buffer is donated and the mean comes back in it, as a train
    # step reuses its buffers, instead of a fresh 100 MB output every call; the next call
    # averages that mean (the codec's work does not depend on the values).
    def carried_body(g, key_data, residuals):
        mean, residuals = body(g, key_data, residuals)
        return mean[None], residuals

    fn = jax.jit(
        jax.shard_map(carried_body, mesh=mesh, in_specs=in_specs, out_specs=in_specs[::2]),
        donate_argnums=(0, 2),
    )
    cell = [grads, residuals]

    def carried():
        cell[0], cell[1] = fn(cell[0], key, cell[1])
        return cell

    return carried, ()


register("ar8_sync", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _wire_sync(mesh, n, wire="allreduce")
)
register("ar8_sync_sr", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _wire_sync(mesh, n, wire="allreduce", rounding="stochastic")
)
register("ar8_sync_ef", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _wire_sync(mesh, n, wire="allreduce", feedback=True)
)
register("ar4_sync", wire_bytes_per_param=0.5 + _HEADER_BYTES / DEFAULT_BLOCK_SIZES[4])(
    lambda mesh, n: _wire_sync(mesh, n, wire="allreduce", bits=4)
)
register("ring_sync", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _wire_sync(mesh, n, wire="ring")
)


@register("train_ar8", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _train_ar8(mesh, num_params):
    """`train_bytegrad` with the integer all-reduce wire: the sync inside the train step."""
    import optax

    from jax_bytegrad import bytegrad

    tx = optax.chain(bytegrad(wire="allreduce", **_wire_sizes("allreduce")), optax.adam(1e-4))
    return _train_builder(mesh, num_params, tx)


@register("train_ar4", wire_bytes_per_param=0.5 + _HEADER_BYTES / DEFAULT_BLOCK_SIZES[4])
def _train_ar4(mesh, num_params):
    import optax

    from jax_bytegrad import bytegrad

    kwargs = dict(wire="allreduce", bits=4, **_wire_sizes("allreduce"))
    return _train_builder(mesh, num_params, optax.chain(bytegrad(**kwargs), optax.adam(1e-4)))


# Wire patterns: one collective pattern alone on per-device buffers, no compute ----------------
# Each host holds its own buffer (varying); the result stays on the devices (out_specs over both
# axes), so nothing but the collectives runs. `op:KB` cuts each collective into messages of KB
# KiB (0: one message). Names give the dtype; sizes are in bytes of the 25.2M-parameter case:
# N bytes = one uint8 code per parameter.


def _buffer(mesh, size: int, dtype):
    """A (devices, size) array sharded over both axes: each device's own buffer."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n_local = mesh.devices.shape[1]
    data = np.broadcast_to((np.arange(size) % 3).astype(dtype), (n_local, size))
    sharding = NamedSharding(mesh, P(AXES, None))
    return jax.make_array_from_process_local_data(sharding, data, (mesh.devices.size, size))


def _pattern_builder(mesh, body, size: int, dtype):
    """jit(shard_map(body)) on each device's own buffer of `size` elements of `dtype`."""
    import jax
    from jax.sharding import PartitionSpec as P

    fn = jax.jit(
        jax.shard_map(
            lambda x: jax.tree.map(lambda y: y[None], body(x[0])),
            mesh=mesh,
            in_specs=P(AXES, None),
            out_specs=P(AXES),
        )
    )
    return fn, (_buffer(mesh, size, dtype),)


def _pieces(x, message_bytes):
    """`x` (flat) cut into consecutive messages of about `message_bytes` (None: one)."""
    return [x[p] for p in message_slices(x.size, x.dtype.itemsize, message_bytes)]


def _psum_pattern(mesh, size, dtype, reduce="psum"):
    import jax
    import jax.numpy as jnp

    op = {"psum": jax.lax.psum, "pmax": jax.lax.pmax}[reduce]
    message_bytes = _sizes()["message_bytes"]

    def body(x):
        return jnp.concatenate([op(p, AXES) for p in _pieces(x, message_bytes)])

    return _pattern_builder(mesh, body, size, dtype)


# The same 25.2 MB per host (N bytes) in each dtype: XLA:CPU and Gloo's integer all-reduce.
for _name, _dtype, _itemsize in (
    ("psum_u8", np.uint8, 1),
    ("psum_i8", np.int8, 1),
    ("psum_u16", np.uint16, 2),
    ("psum_i32", np.int32, 4),
    ("psum_f32_n", np.float32, 4),
):
    register(_name, wire_bytes_per_param=1)(
        lambda mesh, n, _d=_dtype, _i=_itemsize: _psum_pattern(mesh, n // _i, _d)
    )
# Two float32 values per 1024-value block: the allreduce wire's agreement on block ranges.
register("pmax_ranges", wire_bytes_per_param=8 / DEFAULT_BLOCK_SIZE)(
    lambda mesh, n: _psum_pattern(mesh, 2 * -(-n // DEFAULT_BLOCK_SIZE), np.float32, "pmax")
)


@register("shift_u8")
def _shift_u8(mesh, num_params):
    """One ppermute shift by +1 of N bytes: at 2 hosts a swap, at 3+ a ring (one-way per link)."""
    from jax_bytegrad._src.collective_ops import split_ppermute

    n = mesh.devices.size
    perm = [(i, (i + 1) % n) for i in range(n)]
    message_bytes = _sizes()["message_bytes"]
    return _pattern_builder(
        mesh, lambda x: split_ppermute(x, AXES, perm, message_bytes), num_params, np.uint8
    )


def _exchange_pattern(mesh, num_params, exchange: str):
    """The scatter-gather wire's two exchanges of uint8 codes, N bytes per host in all."""
    import jax

    from jax_bytegrad._src import collective_ops

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
            return collective_ops.ring_all_to_all(
                x.reshape(n, chunk), AXES, message_bytes=message_bytes
            )
        mine = x[:chunk]
        if exchange == "all_gather":
            return [jax.lax.all_gather(p, AXES, axis=0) for p in _pieces(mine, message_bytes)]
        return collective_ops.ring_all_gather(mine, AXES, n, message_bytes=message_bytes)

    return _pattern_builder(mesh, body, n * chunk, np.uint8)


# all_to_all: each host sends (K-1)/K N bytes; all_gather: each host's N/K to every other.
register("a2a_u8", wire_bytes_per_param=0.5)(
    lambda mesh, n: _exchange_pattern(mesh, n, "all_to_all")
)
register("a2a_ring_u8", wire_bytes_per_param=0.5)(
    lambda mesh, n: _exchange_pattern(mesh, n, "ring_all_to_all")
)
register("ag_u8", wire_bytes_per_param=0.5)(
    lambda mesh, n: _exchange_pattern(mesh, n, "all_gather")
)
register("ag_ring_u8", wire_bytes_per_param=0.5)(
    lambda mesh, n: _exchange_pattern(mesh, n, "ring_all_gather")
)


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

    from jax_bytegrad import data_parallel_step, replicate, shard_batch

    # One phase per transformation (QAdam: the compressed one alone, so every timed step is
    # a compressed one). Without --donate nothing is donated: every timed call starts from
    # the same state.
    step = data_parallel_step(_mlp_loss, tx, mesh, donate=BUFFERS["donate"])
    state = step.init(_mlp_init(num_params))
    if qadam_warmup is not None:  # past warm-up: the count a compressed step sees
        qadam_state = state.opt_state[0]
        count = replicate(np.asarray(qadam_warmup, np.int32), mesh)
        state = state._replace(opt_state=(qadam_state._replace(count=count), *state.opt_state[1:]))
    rows = _BATCH_PER_DEVICE * mesh.devices.shape[1]
    rng = np.random.default_rng(1 + jax.process_index())
    batch = (
        rng.standard_normal((rows, _MLP_IN), np.float32),
        rng.standard_normal((rows, _MLP_OUT), np.float32),
    )
    return _timed_step(step, state, shard_batch(batch, mesh))


def _timed_step(step, state, batch):
    """``(fn, args)`` that times ``step``: on the same state every call, or, with --donate,
    on the state the call before returned (the worker waits for the state and metrics)."""
    if not BUFFERS["donate"]:
        return step, (state, batch)
    cell = [state]

    def carried():
        cell[0], metrics = step(cell[0], batch)
        return cell[0], metrics

    return carried, ()


@register("train_local")
def _train_local(mesh, num_params):
    """The same train step with no sync at all (forward, backward, Adam): with `bytegrad_sync`,
    the parts that `train_bytegrad` overlaps when it takes less than their sum."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    from jax_bytegrad import replicate, shard_batch

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

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXES)), out_specs=P(AXES)))
    args = (*replicate((params, tx.init(params)), mesh), shard_batch(batch, mesh))
    return fn, args


@register("train_allreduce", wire_bytes_per_param=4)
def _train_allreduce(mesh, num_params):
    import optax

    from jax_bytegrad import gradient_allreduce

    return _train_builder(mesh, num_params, optax.chain(gradient_allreduce(), optax.adam(1e-4)))


@register("train_bytegrad", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _train_bytegrad(mesh, num_params):
    import optax

    from jax_bytegrad import bytegrad

    tx = optax.chain(bytegrad(**_sizes()), optax.adam(1e-4))
    return _train_builder(mesh, num_params, tx)


@register("train_qadam", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)
def _train_qadam(mesh, num_params):
    from jax_bytegrad import qadam

    warmup = 4
    tx = qadam(1e-4, warmup_steps=warmup, phase="compressed", **_sizes())
    return _train_builder(mesh, num_params, tx, qadam_warmup=warmup)


# Decentralized training (weights, not gradients, cross the network) ------------------------------


def _decentralized_builder(mesh, num_params, build):
    """Times successive steps of a decentralized step builder on the MLP; state carried along."""
    import jax
    import optax

    from jax_bytegrad import shard_batch

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
        cell[0], metrics = train(cell[0], batch)
        return metrics["loss"]

    # One program per gossip round: compile them all before timing.
    for _ in range(mesh.devices.size):
        jax.block_until_ready(fn())
    return fn, ()


@register("train_decentralized")
def _train_decentralized(mesh, num_params):
    import functools

    from jax_bytegrad import decentralized_step

    build = functools.partial(decentralized_step, peer_selection_mode="shift_one")
    return _decentralized_builder(mesh, num_params, build)


@register("train_lowprec_decentralized")
def _train_lowprec_decentralized(mesh, num_params):
    from jax_bytegrad import low_precision_decentralized_step

    return _decentralized_builder(mesh, num_params, low_precision_decentralized_step)


# The pipelined step (jax_bytegrad._src.steps.pipelined): the sync's codec beside its wire ------
# `op@MB` sets the bucket size, which is also the size of the pieces the pipeline sends.


def _pipelined_sync(mesh, num_params, *, wire: str, rounding: str = "nearest",
                    feedback: bool = False):  # fmt: skip
    """The sync of `_wire_sync`, pipelined: each bucket piece's exchange on the wire while the
    next piece is encoded and the one before decoded, in programs of their own."""
    import jax

    from jax_bytegrad import SyncConfig, replicate
    from jax_bytegrad._src.steps.pipelined import _PipelinedMean

    config = SyncConfig(wire=wire, rounding=rounding, error_feedback=feedback, **_wire_sizes(wire))
    grads = local_gradient(mesh, num_params, np.float32)
    key = None
    if rounding == "stochastic":
        key = replicate(jax.random.fold_in(jax.random.key(0), 0), mesh)
    residuals = _zero_residuals(mesh, num_params, config) if feedback else None
    mean = _PipelinedMean(mesh, config)
    return (lambda: mean(grads, key, residuals)), ()


register("pipelined_sync_ar8", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _pipelined_sync(mesh, n, wire="allreduce")
)
register("pipelined_sync_ar8_sr", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _pipelined_sync(mesh, n, wire="allreduce", rounding="stochastic")
)
register("pipelined_sync_ar8_ef", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _pipelined_sync(mesh, n, wire="allreduce", feedback=True)
)
register("pipelined_sync_sg", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _pipelined_sync(mesh, n, wire="scatter_gather")
)


def _train_pipelined(mesh, num_params, *, wire: str, **settings):
    """`train_ar8` / `train_bytegrad` as `pipelined_step` builds them (Adam after the sync)."""
    import jax
    import optax

    from jax_bytegrad import SyncConfig, pipelined_step, shard_batch

    config = SyncConfig(wire=wire, **_wire_sizes(wire), **settings)
    step = pipelined_step(_mlp_loss, optax.adam(1e-4), mesh, sync=config, donate=BUFFERS["donate"])
    state = step.init(_mlp_init(num_params))
    rows = _BATCH_PER_DEVICE * mesh.devices.shape[1]
    rng = np.random.default_rng(1 + jax.process_index())
    batch = (
        rng.standard_normal((rows, _MLP_IN), np.float32),
        rng.standard_normal((rows, _MLP_OUT), np.float32),
    )
    return _timed_step(step, state, shard_batch(batch, mesh))


register("train_pipelined_ar8", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _train_pipelined(mesh, n, wire="allreduce")
)
register("train_pipelined_ar8_ef", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _train_pipelined(mesh, n, wire="allreduce", error_feedback=True)
)
register("train_pipelined_sg", wire_bytes_per_param=_CODE_BYTES_PER_PARAM)(
    lambda mesh, n: _train_pipelined(mesh, n, wire="scatter_gather")
)
