"""A Llama-style decoder written as users write one, for the memory and schedule benchmarks.

RMSNorm, rotary position embeddings, multi-head causal attention, a SwiGLU feed-forward block
and an untied output head, with ``jax.checkpoint`` around each layer as transformers do. The
layers are either a list of per-layer dicts (``scan=False``) or one stacked dict run by
``jax.lax.scan`` (``scan=True``, as MaxText's and Levanter's ``scan_layers``).

``SHAPES`` holds the 7B, 13B and 30B shapes (Llama's widths, depths and feed-forward sizes), and
the 30B widths at 67 and 74 layers (36.3B and 40.0B parameters) and at 12 (a quick probe).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_bytegrad.sharding import exchange_in_loop


class Shape(NamedTuple):
    """A decoder's size."""

    layers: int
    dim: int
    ffn: int
    heads: int
    vocab: int = 32000
    kv_heads: int | None = None  # grouped-query attention's key/value heads; None: ``heads``

    @property
    def kv_dim(self) -> int:
        return self.dim // self.heads * (self.kv_heads or self.heads)

    def parameters(self) -> int:
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim
        per_layer = attention + 3 * self.dim * self.ffn + 2 * self.dim
        return self.layers * per_layer + 2 * self.vocab * self.dim + self.dim


SHAPES = {
    "tiny": Shape(layers=2, dim=32, ffn=64, heads=4, vocab=64),
    "7b": Shape(layers=32, dim=4096, ffn=11008, heads=32),
    "13b": Shape(layers=40, dim=5120, ffn=13824, heads=40),
    "30b": Shape(layers=60, dim=6656, ffn=17920, heads=52),
    # The 30B widths, deeper: where a device's memory runs out.
    "36b": Shape(layers=67, dim=6656, ffn=17920, heads=52),
    "40b": Shape(layers=74, dim=6656, ffn=17920, heads=52),
    # The 30B widths at 12 layers: a list's excess over its floor, in a fifth of the compile.
    "30b12": Shape(layers=12, dim=6656, ffn=17920, heads=52),
    # Llama-2-70B: 80 layers of 8192, 8 key/value heads, feed-forward 28672 (69.0B).
    "70b": Shape(layers=80, dim=8192, ffn=28672, heads=64, kv_heads=8),
    # Its widths, deeper: 141 layers (120.6B), 160 (136.8B).
    "120b": Shape(layers=141, dim=8192, ffn=28672, heads=64, kv_heads=8),
    # Its widths at 8 layers: the per-step memory that does not grow with depth.
    "70b8": Shape(layers=8, dim=8192, ffn=28672, heads=64, kv_heads=8),
    "137b": Shape(layers=160, dim=8192, ffn=28672, heads=64, kv_heads=8),
}


def _layer_shapes(shape: Shape, dtype) -> dict:
    d, f, kv = shape.dim, shape.ffn, shape.kv_dim
    s = jax.ShapeDtypeStruct
    return {
        "attn_norm": s((d,), dtype),
        "wq": s((d, d), dtype),
        "wk": s((d, kv), dtype),
        "wv": s((d, kv), dtype),
        "wo": s((d, d), dtype),
        "mlp_norm": s((d,), dtype),
        "w_gate": s((d, f), dtype),
        "w_up": s((d, f), dtype),
        "w_down": s((f, d), dtype),
    }


def param_shapes(shape: Shape, *, scan: bool, dtype=jnp.float32) -> dict:
    """The params as ``jax.ShapeDtypeStruct`` leaves: a list of layers, or one stacked dict."""
    layer = _layer_shapes(shape, dtype)
    if scan:
        stack = lambda v: jax.ShapeDtypeStruct((shape.layers, *v.shape), dtype)  # noqa: E731
        layers = {k: stack(v) for k, v in layer.items()}
    else:
        layers = [dict(layer) for _ in range(shape.layers)]
    return {
        "embed": jax.ShapeDtypeStruct((shape.vocab, shape.dim), dtype),
        "layers": layers,
        "final_norm": jax.ShapeDtypeStruct((shape.dim,), dtype),
        "head": jax.ShapeDtypeStruct((shape.dim, shape.vocab), dtype),
    }


def init(shape: Shape, key, *, scan: bool, dtype=jnp.float32) -> dict:
    """Random params of ``param_shapes``: norms at one, matrices scaled by fan-in."""
    shapes = param_shapes(shape, scan=scan, dtype=dtype)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))

    def one(k, s):
        if s.shape[-1:] == (shape.dim,) and len(s.shape) <= 2 and s.shape[0] != shape.vocab:
            return jnp.ones(s.shape, s.dtype)  # a norm's scale (stacked or not)
        return jax.random.normal(k, s.shape, s.dtype) / jnp.sqrt(s.shape[-2]).astype(s.dtype)

    return jax.tree.unflatten(treedef, [one(k, s) for k, s in zip(keys, leaves, strict=True)])


def _rms_norm(x, scale):
    scale = scale.reshape((1,) * (x.ndim - 1) + scale.shape)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _rope(x):
    """Rotary position embeddings over the sequence axis of ``x`` (batch, seq, heads, hd)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def block(x, p, heads: int):
    """One decoder layer: attention then SwiGLU, each after an RMSNorm, with residuals; with
    fewer key/value heads than query heads (``wk`` narrower than ``wq``), each serves a group
    of query heads."""
    b, t, d = x.shape
    hd = d // heads
    groups = heads // (p["wk"].shape[-1] // hd)
    h = _rms_norm(x, p["attn_norm"])
    q = _rope((h @ p["wq"]).reshape(b, t, heads, hd))
    k = jnp.repeat(_rope((h @ p["wk"]).reshape(b, t, -1, hd)), groups, axis=2)
    v = jnp.repeat((h @ p["wv"]).reshape(b, t, -1, hd), groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(x.dtype)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
    x = x + attn @ p["wo"]
    h = _rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def loss_fn(shape: Shape, *, scan: bool, mark: bool | str = False):
    """``loss(params, tokens) -> mean next-token cross-entropy``; tokens (batch, seq + 1).

    ``mark``: each layer marks its params with ``exchange_in_loop``: True (or ``"outside"``)
    in the scan body before its ``jax.checkpoint`` (a ``shard="params"`` step then exchanges
    it inside the backward loop; scanned stacks only), ``"inside"`` within its checkpoint (a
    ``shard="full"`` step then gathers the layer there, and again in the backward pass)."""
    if mark == "inside":
        layer = jax.checkpoint(lambda x, p: block(x, exchange_in_loop(p), shape.heads))
    else:
        layer = jax.checkpoint(lambda x, p: block(x, p, shape.heads))
    if mark and mark != "inside":
        if not scan:
            raise ValueError("mark=True needs scan=True")
        unmarked = layer
        layer = lambda x, p: unmarked(x, exchange_in_loop(p))  # noqa: E731

    def loss(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = params["embed"][inputs]
        if scan:
            x, _ = jax.lax.scan(lambda x, p: (layer(x, p), None), x, params["layers"])
        else:
            for p in params["layers"]:
                x = layer(x, p)
        logits = _rms_norm(x, params["final_norm"]) @ params["head"]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss
