"""QAdam's second moment after warm-up: the candidate rules, measured against Adam.

One process, one device, plain JAX: an MLP on scikit-learn's digits, wine and breast_cancer,
trained with Adam and with QAdam-like optimizers that differ only in what they do with ``v``
after a float32 warm-up of ``W`` steps. The momentum is rounded to 8 bits per 1024-value block
(min/max grid, round to nearest) after warm-up, as the compressed mean leaves it, so every
candidate sees the compression's error. Rules (t > W):

    adam          v = b2 v + (1 - b2) g^2, correction 1 - b2^t (float32 every step; no rounding)
    frozen        v and its correction as at step W (Bagua)
    momentum      v = b2 v + (1 - b2) m_hat^2, correction 1 - b2^t; m_hat = m / (1 - b1^t)
    gradient      v = b2 v + (1 - b2) g_est^2, correction 1 - b2^t, where g_est =
                  (m - b1 m_prev) / (1 - b1) from the rounded m and the stored (rounded) m_prev:
                  the mean gradient up to the rounding error / (1 - b1)
    momentum_max  v_hat = max(v_hat, momentum's v_hat): never below the warm-up's
    floor         frozen v, but v_hat >= m_hat^2 (every |step| <= lr)
    refresh01     frozen v, refreshed with the float32 g^2 on 0/1 Adam's schedule (gap 1 for
                  16 refreshes, then 2 for 16, 4, ...): each refresh is a float32 step
    compress_u    frozen v; the rounded quantity is m / (sqrt(v_hat) + eps), not m

    python benchmarks/qadam_second_moment.py --task issue --seeds 3
    python benchmarks/qadam_second_moment.py --task sklearn --steps 150 1000 --seeds 3
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from sklearn import datasets
from sklearn.model_selection import train_test_split

RULES = (
    "adam", "frozen", "momentum", "gradient", "momentum_max", "floor", "refresh01", "compress_u"
)  # fmt: skip
BLOCK = 1024


def _round8(x):
    """8-bit min/max rounding per block of 1024 values, as the compressed mean leaves ``m``."""
    flat = x.reshape(-1)
    pad = -flat.size % BLOCK
    blocks = jnp.pad(flat, (0, pad)).reshape(-1, BLOCK)
    lo, hi = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
    scale = jnp.maximum(hi - lo, 1e-30) / 255.0
    out = jnp.round((blocks - lo) / scale) * scale + lo
    return out.reshape(-1)[: flat.size].reshape(x.shape)


def _schedule01(warmup: int, steps: int) -> np.ndarray:
    """0/1 Adam's variance-update steps after warm-up: the gap doubles every 16 updates."""
    refresh = np.zeros(steps + 1, bool)
    t, gap, n = warmup, 1, 0
    while t + gap <= steps:
        t += gap
        refresh[t] = True
        n += 1
        if n % 16 == 0:
            gap *= 2
    return refresh


def _mlp_init(key, sizes):
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        w = jax.random.normal(jax.random.fold_in(key, i), (a, b)) * np.sqrt(2.0 / a)
        params.append({"w": w.astype(jnp.float32), "b": jnp.zeros(b, jnp.float32)})
    return params


def _logits(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def _loss(params, x, y):
    logp = jax.nn.log_softmax(_logits(params, x))
    return -jnp.take_along_axis(logp, y[:, None], 1).mean()


def _leaf_update(rule, t, warmup, refresh, g, m, v, vhat, hp):
    """One parameter's Adam-like step; returns (step, m, v, vhat)."""
    b1, b2, eps = hp
    m_new = b1 * m + (1 - b1) * g
    c1 = 1 - b1**t
    warm = (t <= warmup) | (rule == "adam") | ((rule == "refresh01") & refresh[0])
    v_adam = b2 * v + (1 - b2) * g * g
    m_q = m_new if rule in ("adam", "compress_u") else _round8(m_new)
    m_used = jnp.where(warm, m_new, m_q)
    m_hat = m_used / c1
    if rule == "compress_u":
        u = m_new / c1 / (jnp.sqrt(vhat) + eps)
        u_q = _round8(u)
        m_used = jnp.where(warm, m_new, u_q * (jnp.sqrt(vhat) + eps) * c1)
        m_hat = m_used / c1
    if rule in ("momentum", "momentum_max", "gradient"):
        if rule == "gradient":
            # The library's rule: both momenta are the ones every replica holds (m rounded).
            g_est = (m_used - b1 * m) / (1 - b1)
            v_c = b2 * v + (1 - b2) * g_est * g_est
        else:
            v_c = b2 * v + (1 - b2) * m_hat * m_hat
        v_new = jnp.where(t <= warmup, v_adam, v_c)
        vhat_new = v_new / (1 - b2**t)
        if rule == "momentum_max":
            vhat_new = jnp.where(t <= warmup, vhat_new, jnp.maximum(vhat, vhat_new))
    elif rule == "adam":
        v_new, vhat_new = v_adam, v_adam / (1 - b2**t)
    else:  # frozen, floor, refresh01, compress_u: v moves on warm-up (and refresh) steps only
        v_new = jnp.where(warm, v_adam, v)
        vhat_new = jnp.where(warm, v_adam / (1 - b2 ** refresh[1]), vhat)
    denom_v = vhat_new
    if rule == "floor":
        denom_v = jnp.where(t <= warmup, vhat_new, jnp.maximum(vhat_new, m_hat * m_hat))
    step = m_hat / (jnp.sqrt(denom_v) + eps)
    return step, m_used, v_new, vhat_new


@functools.partial(jax.jit, static_argnames=("rule", "steps", "warmup", "batch", "sizes"))
def train(key, x, y, *, rule, steps, warmup, batch, sizes, lr, wd, eps, refresh_mask, v_count):
    params = _mlp_init(key, sizes)
    zeros = jax.tree.map(jnp.zeros_like, params)
    grad = jax.grad(_loss)

    def body(carry, t):
        params, m, v, vhat = carry
        idx = jax.random.randint(jax.random.fold_in(key, t), (batch,), 0, x.shape[0])
        loss = _loss(params, x[idx], y[idx])
        g = grad(params, x[idx], y[idx])
        tf = t.astype(jnp.float32)
        refresh = (refresh_mask[t], v_count[t])
        out = jax.tree.map(
            lambda g, m, v, vh: _leaf_update(
                rule, tf, warmup, refresh, g, m, v, vh, (0.9, 0.999, eps)
            ),
            g, m, v, vhat,
        )  # fmt: skip
        pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=lambda o: isinstance(o, tuple))  # noqa: E731
        params = jax.tree.map(lambda p, s: p - lr * (s + wd * p), params, pick(0))
        return (params, pick(1), pick(2), pick(3)), loss

    carry, losses = jax.lax.scan(body, (params, zeros, zeros, zeros), jnp.arange(1, steps + 1))
    return carry[0], losses


def _data(name, standardize):
    loader = {"digits": datasets.load_digits, "wine": datasets.load_wine,
              "breast_cancer": datasets.load_breast_cancer}[name]  # fmt: skip
    x, y = loader(return_X_y=True)
    x = x.astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    if standardize:
        mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
        xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    else:
        xtr, xte = xtr / 16.0, xte / 16.0
    return xtr, ytr.astype(np.int32), xte, yte.astype(np.int32), int(y.max()) + 1


def run(rule, seed, *, data, steps, warmup, batch, hidden, lr, wd, eps):
    xtr, ytr, xte, yte, classes = data
    mask = _schedule01(warmup, steps) if rule == "refresh01" else np.zeros(steps + 1, bool)
    count = np.minimum(np.arange(steps + 1), warmup) + np.concatenate([[0], np.cumsum(mask[1:])])
    sizes = (xtr.shape[1], *hidden, classes)
    params, losses = train(
        jax.random.key(seed), jnp.asarray(xtr), jnp.asarray(ytr), rule=rule, steps=steps,
        warmup=warmup, batch=batch, sizes=sizes, lr=lr, wd=wd, eps=eps,
        refresh_mask=jnp.asarray(mask), v_count=jnp.asarray(count, jnp.float32),
    )  # fmt: skip
    losses = np.asarray(losses)
    acc = float((np.asarray(_logits(params, xte)).argmax(1) == yte).mean())
    final = float(losses[-10:].mean())
    diverged = not np.isfinite(final) or final > 2 * losses[0]
    return final, acc, diverged, float(np.nanmax(np.where(np.isfinite(losses), losses, np.inf)))


def _table(title, rows, rules):
    print(f"\n{title}")
    print("| rule | final train loss (median) | / Adam's | test accuracy (median) | diverged "
          "| max loss |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    base = np.median([r[0] for r in rows["adam"]])
    for rule in rules:
        finals = [r[0] for r in rows[rule]]
        med = float(np.median(finals)) if all(np.isfinite(finals)) else float("nan")
        acc = np.median([r[1] for r in rows[rule]])
        div = sum(r[2] for r in rows[rule])
        worst = max(r[3] for r in rows[rule])
        print(f"| {rule} | {med:.4f} | {med / base:.2f} | {acc:.1%} | {div}/{len(finals)} "
              f"| {worst:.3g} |", flush=True)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("issue", "sklearn"), default="issue")
    parser.add_argument("--steps", type=int, nargs="+", default=[100])
    parser.add_argument("--warmup-frac", type=float, nargs="+", default=[0.2])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--rules", nargs="+", default=list(RULES))
    args = parser.parse_args()
    if args.task == "issue":
        # The MLP: 64-256-256-10 on digits / 16, batch 128, lr 1e-3, weight decay 1e-4.
        cases = [("digits (64-256-256-10, /16)", _data("digits", False), (256, 256), 128, 1e-4)]
    else:
        cases = [(f"{n} (standardized, 64-64)", _data(n, True), (64, 64), 64, 0.0)
                 for n in ("breast_cancer", "wine", "digits")]  # fmt: skip
    for steps in args.steps:
        for frac in args.warmup_frac:
            warmup = max(1, round(frac * steps))
            for name, data, hidden, batch, wd in cases:
                rows = {
                    rule: [
                        run(
                            rule,
                            s,
                            data=data,
                            steps=steps,
                            warmup=warmup,
                            batch=batch,
                            hidden=hidden,
                            lr=1e-3,
                            wd=wd,
                            eps=args.eps,
                        )  # fmt: skip
                        for s in range(args.seeds)
                    ]
                    for rule in args.rules
                }
                _table(f"{name}: {steps} steps, warm-up {warmup}, eps {args.eps:g}, "
                       f"{args.seeds} seeds", rows, args.rules)  # fmt: skip


if __name__ == "__main__":
    main()
