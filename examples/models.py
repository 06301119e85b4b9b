"""Flax NNX models for the examples: a small CNN for 8x8 digits and a character transformer."""

import jax
import jax.numpy as jnp
from flax import nnx


class CNN(nnx.Module):
    """Two 3x3 convolutions, a 2x2 average pool and two dense layers, for 8x8x1 images."""

    def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.dense1 = nnx.Linear(4 * 4 * 64, 256, rngs=rngs)
        self.dense2 = nnx.Linear(256, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        b, h, w, c = x.shape
        # 2x2 average pool, written out: flax's avg_pool divides by an int, which strict
        # dtype promotion (as in the tests) rejects.
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))
        x = x.reshape(b, -1)
        x = nnx.relu(self.dense1(x))
        return self.dense2(x)


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=num_heads, in_features=dim, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))


class CharTransformer(nnx.Module):
    """A decoder-only transformer over bytes (vocabulary 256) with learned positions."""

    def __init__(
        self,
        vocab_size: int = 256,
        *,
        seq_len: int,
        dim: int = 128,
        depth: int = 2,
        num_heads: int = 4,
        rngs: nnx.Rngs,
    ):
        self.embed = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, dim)))
        self.blocks = nnx.List([Block(dim, num_heads, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.pos[...][None, :length]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def create(name: str, *, num_classes: int, seq_len: int, seed: int) -> nnx.Module:
    """Builds ``"cnn"`` or ``"transformer"`` with parameters drawn from ``seed``."""
    rngs = nnx.Rngs(seed)
    if name == "cnn":
        return CNN(num_classes, rngs=rngs)
    if name == "transformer":
        return CharTransformer(num_classes, seq_len=seq_len, rngs=rngs)
    raise ValueError(f"models: unknown model {name!r}; use 'cnn' or 'transformer'")


def count_params(params) -> int:
    """Number of scalar parameters in a pytree."""
    return sum(int(jnp.size(x)) for x in jax.tree.leaves(params))
