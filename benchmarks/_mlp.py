"""The float32 MLP the network and autotune benchmarks train: in -> h -> h -> out, its width h
set by the parameter count, and the random batches each host feeds it."""

import numpy as np

MLP_IN, MLP_OUT = 1024, 1024


def mlp_width(num_params: int) -> int:
    """Hidden width h of in -> h -> h -> out with about `num_params` parameters."""
    b = MLP_IN + MLP_OUT + 3
    return max(8, int((-b + (b * b + 4 * num_params) ** 0.5) / 2))


def mlp_init(num_params: int) -> dict[str, np.ndarray]:
    """The MLP's parameters, the same on every host: scaled normal weights, zero biases."""
    h = mlp_width(num_params)
    rng = np.random.default_rng(0)
    dims = [(MLP_IN, h), (h, h), (h, MLP_OUT)]
    params = {}
    for i, (a, b) in enumerate(dims):
        params[f"w{i}"] = (rng.standard_normal((a, b), np.float32) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    return params


def mlp_loss(params, batch):
    """Mean squared error of the MLP (ReLU between layers) on one device's rows."""
    import jax
    import jax.numpy as jnp

    x, y = batch
    for i in range(3):
        x = x @ params[f"w{i}"] + params[f"b{i}"][None]
        if i < 2:
            x = jax.nn.relu(x)
    return jnp.mean((x - y) ** 2)


def mlp_batch(rng: np.random.Generator, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """One host's batch of `rows` standard normal inputs and targets, drawn from `rng`."""
    return (
        rng.standard_normal((rows, MLP_IN), np.float32),
        rng.standard_normal((rows, MLP_OUT), np.float32),
    )
