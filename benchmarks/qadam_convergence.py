"""QAdam against Adam on a small byte-level transformer language model.

Trains the same model from the same initialisation and batches twice on a 2 x 4 mesh of
("node", "local") devices: once with ``optax.adam`` after ``gradient_allreduce`` (float32
all-reduce every step), once with ``jax_bytegrad.qadam`` (float32 warm-up, then frozen
second moment and 8-bit momentum between nodes). The text is the Python standard
library's own source, which every machine has. Prints both loss curves as a table, the
final held-out losses, and saves a PNG.

    python benchmarks/qadam_convergence.py --steps 1000 --warmup-frac 0.2 --png qadam.png

``tests/test_qadam.py`` runs a short version of ``train``. With one process and no
``XLA_FLAGS``, this script asks XLA for 8 host devices before JAX starts.
"""

import argparse
import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_bytegrad  # noqa: E402
from jax_bytegrad import qadam  # noqa: E402
from jax_bytegrad.sharding import shard_batch  # noqa: E402

AXES = ("node", "local")
# A fixed, version-stable choice of standard-library modules (about 420 kB of text).
SOURCES = ("os.py", "functools.py", "inspect.py", "argparse.py", "typing.py")
VOCAB = 256  # bytes


def load_text() -> np.ndarray:
    """The bytes of ``SOURCES`` from this interpreter's standard library, as uint8."""
    root = os.path.dirname(os.__file__)
    chunks = []
    for name in SOURCES:
        with open(os.path.join(root, name), "rb") as f:
            chunks.append(f.read())
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


def init_params(key, *, d_model=64, layers=2, context=64):
    """A pre-norm decoder-only transformer with tied embeddings."""

    def dense(key, fan_in, fan_out):
        return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / np.float32(np.sqrt(fan_in))

    keys = jax.random.split(key, 2 + 4 * layers)
    params = {
        "embed": jax.random.normal(keys[0], (VOCAB, d_model), jnp.float32) * 0.02,
        "pos": jax.random.normal(keys[1], (context, d_model), jnp.float32) * 0.02,
        "ln_f": jnp.ones(d_model, jnp.float32),
        "layers": [],
    }
    for i in range(layers):
        k = keys[2 + 4 * i : 6 + 4 * i]
        params["layers"].append(
            {
                "ln1": jnp.ones(d_model, jnp.float32),
                "qkv": dense(k[0], d_model, 3 * d_model),
                "proj": dense(k[1], d_model, d_model) / np.float32(np.sqrt(2 * layers)),
                "ln2": jnp.ones(d_model, jnp.float32),
                "up": dense(k[2], d_model, 4 * d_model),
                "down": dense(k[3], 4 * d_model, d_model) / np.float32(np.sqrt(2 * layers)),
            }
        )
    return params


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale[None, None]


def loss_fn(params, batch, *, heads=4):
    """Mean next-byte cross-entropy of ``batch`` (int32, shape (B, context + 1))."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    b, t = inputs.shape
    d = params["embed"].shape[1]
    x = params["embed"][inputs] + params["pos"][:t][None]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for layer in params["layers"]:
        h = _rms_norm(x, layer["ln1"])
        q, k, v = jnp.split(h @ layer["qkv"], 3, axis=-1)
        q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(d // heads))
        logits = jnp.where(causal[None, None], logits, np.float32(-1e9))
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
        x = x + attn.reshape(b, t, d) @ layer["proj"]
        h = _rms_norm(x, layer["ln2"])
        x = x + jax.nn.gelu(h @ layer["up"]) @ layer["down"]
    logits = _rms_norm(x, params["ln_f"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def batches(data: np.ndarray, steps: int, batch_size: int, context: int, seed: int):
    """``steps`` batches of random windows of ``data``, the same for every optimizer."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, data.size - context - 1, size=batch_size)
        yield np.stack([data[s : s + context + 1] for s in starts]).astype(np.int32)


def train(
    optimizer: str,
    *,
    steps: int,
    warmup_frac: float = 0.2,
    learning_rate: float = 3e-3,
    batch_size: int = 32,
    context: int = 64,
    d_model: int = 64,
    layers: int = 2,
    eval_batches: int = 4,
    seed: int = 0,
    mesh=None,
):
    """Trains with ``"adam"`` or ``"qadam"``; returns (train losses, held-out loss).

    Both optimizers use the same warm-up + cosine learning-rate schedule. The held-out
    loss is the mean over ``eval_batches`` fixed batches from the last 10% of the text.
    """
    mesh = jax_bytegrad.make_mesh(2, 4) if mesh is None else mesh
    data = load_text()
    split = int(data.size * 0.9)
    train_data, val_data = data[:split], data[split:]
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, max(1, steps // 20), steps, learning_rate * 0.1
    )
    if optimizer == "adam":
        tx = optax.chain(jax_bytegrad.gradient_allreduce(), optax.adam(schedule))
    elif optimizer == "qadam":
        tx = qadam(schedule, warmup_steps=max(1, round(warmup_frac * steps)))
    else:
        raise ValueError(f"train: optimizer must be 'adam' or 'qadam', got {optimizer!r}")
    params = init_params(jax.random.key(seed), d_model=d_model, layers=layers, context=context)
    # optax.adam's bias correction needs standard promotion (tests run with strict).
    with jax.numpy_dtype_promotion("standard"):
        step = jax_bytegrad.data_parallel_step(loss_fn, tx, mesh)
        state = step.init(params)
        evaluate = jax.jit(
            jax.shard_map(
                lambda p, b: jax.lax.pmean(loss_fn(p, b), AXES),
                mesh=mesh,
                in_specs=(P(), P(AXES)),
                out_specs=P(),
            )
        )
        losses = []
        for batch in batches(train_data, steps, batch_size, context, seed + 1):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        val = [
            evaluate(state.params, shard_batch(b, mesh))
            for b in batches(val_data, eval_batches, 64, context, seed + 2)
        ]
    return np.asarray(losses), float(np.mean(jax.device_get(val)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup-frac", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--every", type=int, default=50, help="print every N steps")
    parser.add_argument("--png", default=None, help="save the loss curves here")
    args = parser.parse_args()

    results, seconds = {}, {}
    for name in ("adam", "qadam"):
        start = time.perf_counter()
        results[name] = train(
            name,
            steps=args.steps,
            warmup_frac=args.warmup_frac,
            learning_rate=args.lr,
            batch_size=args.batch_size,
        )
        seconds[name] = time.perf_counter() - start

    def smooth(x, i):
        return float(np.mean(x[max(0, i - args.every + 1) : i + 1]))

    warmup = max(1, round(args.warmup_frac * args.steps))
    print(f"train loss (mean of the last {args.every} steps); QAdam warm-up = {warmup} steps")
    print(f"| {'step':>5} | {'adam':>7} | {'qadam':>7} |")
    print("|-------|---------|---------|")
    for i in range(args.every - 1, args.steps, args.every):
        adam, q = smooth(results["adam"][0], i), smooth(results["qadam"][0], i)
        print(f"| {i + 1:>5} | {adam:7.4f} | {q:7.4f} |")
    adam_val, qadam_val = results["adam"][1], results["qadam"][1]
    print(
        f"held-out loss: adam {adam_val:.4f}, qadam {qadam_val:.4f} "
        f"({100 * (qadam_val / adam_val - 1):+.2f}%)"
    )
    print(f"wall time: adam {seconds['adam']:.1f} s, qadam {seconds['qadam']:.1f} s")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name in ("adam", "qadam"):
            curve = [smooth(results[name][0], i) for i in range(args.steps)]
            ax.plot(np.arange(1, args.steps + 1), curve, label=name)
        ax.axvline(warmup, color="gray", linestyle=":", label="QAdam warm-up ends")
        ax.set_xlabel("step")
        ax.set_ylabel(f"train loss (mean of last {args.every})")
        ax.set_title("Byte-level LM on stdlib source, 2 nodes x 4 devices")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"saved {args.png}")


if __name__ == "__main__":
    main()
