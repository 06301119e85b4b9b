"""Argument checks, constants and small helpers shared by the library's modules (private).

Every public factory validates its arguments when it is built, as optax does, and raises a
``ValueError`` that names where the call came from (``where``), the bad value and what to
pass instead. The checks that more than one module needs live here, once.
"""

import math
import numbers
import socket

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

# The dtypes the codec quantizes and the collectives average; other leaves pass through.
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_int(value) -> bool:
    """A Python or NumPy integer, and not a bool (``True`` is an ``int`` to Python)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def varying_axes(x) -> frozenset:
    """The mesh axes along which ``x`` varies inside ``shard_map`` (its ``vma``)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def integer(
    value,
    name: str,
    where: str,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    or_none: bool = False,
    why: str = "",
) -> int | None:
    """Returns ``value`` as an int; raises unless it is an int in range (or None, with
    ``or_none``). ``why`` follows the rule in the message, to say what the number means."""
    if or_none and value is None:
        return None
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        rule = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
        rule += " or None" if or_none else ""
        raise ValueError(f"{where}: {name} must be {rule}{why}, got {value!r}")
    return int(value)


def real(
    value,
    name: str,
    where: str,
    *,
    minimum: float,
    below: float | None = None,
    why: str = "",
) -> float:
    """Returns ``value`` as a float; raises unless it is a finite real >= ``minimum`` (and
    < ``below``). NaN, inf and bools are refused."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and value >= minimum and (below is None or value < below)
    if not ok:
        rule = f"a float >= {minimum:g}"
        if below is not None:
            rule = f"a float in [{minimum:g}, {below:g})"
        raise ValueError(f"{where}: {name} must be {rule}{why}, got {value!r}")
    return float(value)


def one_of(value, options, name: str, where: str) -> None:
    """Raises unless ``value`` is one of ``options`` (of the same kind: 8.0 is not 8)."""
    same_kind = isinstance(value, str) if isinstance(options[0], str) else is_int(value)
    if not same_kind or value not in options:
        allowed = ", ".join(repr(option) for option in options)
        raise ValueError(f"{where}: {name} must be one of {allowed}, got {value!r}")


def boolean(value, name: str, where: str) -> None:
    """Raises unless ``value`` is ``True`` or ``False`` (a truthy 1 or "yes" is a mistake)."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be True or False, got {value!r}")


def transformation(value, name: str, where: str, example: str = "optax.adam(1e-3)") -> None:
    """Raises unless ``value`` is an optax transformation (``example``: one to suggest)."""
    if not isinstance(value, optax.GradientTransformation):
        raise ValueError(
            f"{where}: {name} must be an optax.GradientTransformation such as {example}, "
            f"got {value!r}"
        )


def distinct_axes(node_axis, local_axis, where: str) -> None:
    """Raises if the node and local axes are one axis, which would sum everything twice."""
    if node_axis == local_axis:
        raise ValueError(f"{where}: node_axis and local_axis must differ, both are {node_axis!r}")


def axis_names(node_axis, local_axis, where: str) -> None:
    """Raises unless both axis names are non-empty strings that differ (no mesh needed)."""
    for name, value in (("node_axis", node_axis), ("local_axis", local_axis)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: {name} must be a mesh axis name, got {value!r}")
    distinct_axes(node_axis, local_axis, where)


def mesh_axes(mesh, node_axis: str, local_axis: str, where: str) -> tuple[int, int]:
    """Validates the mesh and its two axis names; returns (nodes, devices per node)."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"{where}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for name, param in ((node_axis, "node_axis"), (local_axis, "local_axis")):
        if name not in mesh.axis_names:
            raise ValueError(
                f"{where}: axis {name!r} is not in the mesh axes {tuple(mesh.axis_names)}; "
                f"pass {param}=..."
            )
    distinct_axes(node_axis, local_axis, where)
    return int(mesh.shape[node_axis]), int(mesh.shape[local_axis])


def batch_splits(
    batch, devices: int, where: str = "data_parallel_step", *, owner: str = "the mesh"
) -> None:
    """Raises unless every batch leaf's leading dimension splits over ``devices``."""
    for path, leaf in jax.tree.leaves_with_path(batch):
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] % devices:
            raise ValueError(
                f"{where}: batch leaf {jax.tree_util.keystr(path)} has shape "
                f"{jnp.shape(leaf)}; its leading dimension must be a multiple of the "
                f"{devices} devices of {owner}; drop or pad the last rows"
            )


def not_deleted(tree, where: str) -> None:
    """Raises, naming donation, if a leaf of ``tree`` is an array a donating step consumed."""
    # Every step calls this: look for a deleted leaf first, and for its path only then.
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree)):
        return
    for path, leaf in jax.tree.leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(
                f"{where}: input {jax.tree_util.keystr(path)} was deleted: the step donates "
                "its params and state buffers (donate=True), so arrays passed to it once "
                "(or placed on the mesh from them, which may share their buffer) cannot be "
                "passed again. Pass the state the step returned, hand it a copy "
                "(jax.tree.map(jnp.copy, params)), or build the step with donate=False"
            )


def float_params(params, where: str) -> None:
    """Raises unless every parameter leaf is floating point: the gradient of an integer is
    undefined, and the syncs average floats."""
    for path, leaf in jax.tree.leaves_with_path(params):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{where}: parameter {jax.tree_util.keystr(path)} has dtype {dtype}; only "
                "floating-point parameters can be trained and averaged; cast it "
                "(x.astype(jnp.float32)), or carry integer state (counters, step numbers) "
                "as model_state=... of the train step"
            )


def _state_types(tree) -> list[str]:
    """The names of the optax states in an optimizer state, in order (its fingerprint)."""
    names = []

    def visit(node):
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            names.append(type(node).__name__)
        return node

    jax.tree.map(visit, tree, is_leaf=lambda x: isinstance(x, tuple) and hasattr(x, "_fields"))
    return names


def _made_by(state, devices: int) -> str:
    """A guess, from its contents, at which algorithm made a train state."""
    types = _state_types(state.opt_state)
    if "weight" in (state.extra or {}):
        return "a 'low_precision_decentralized' step"
    if "ScaleByQAdamState" in types:
        return "a 'qadam' step"
    if "ByteGradState" in types:
        return "a 'bytegrad' step"
    leaves = jax.tree.leaves(state.params)
    if leaves and all(jnp.ndim(x) >= 1 and jnp.shape(x)[0] == devices for x in leaves):
        return "a 'decentralized' step"  # one copy of the model per device
    if types[:1] == ["EmptyState"]:
        return "a 'gradient_allreduce' step"
    return "another algorithm's step"


def _describe(opt_state) -> str:
    return ", ".join(_state_types(opt_state)) or "no optax state"


def _opt_state_problem(opt_state, expected) -> str | None:
    """How ``opt_state`` differs from the abstract ``expected`` one; None if it does not."""
    if jax.tree.structure(opt_state) != jax.tree.structure(expected):
        return (
            f"its optimizer state holds {_describe(opt_state)}; this step's holds "
            f"{_describe(expected)}"
        )
    pairs = zip(jax.tree.leaves_with_path(opt_state), jax.tree.leaves(expected), strict=True)
    for (path, got), want in pairs:
        if np.shape(got) != tuple(want.shape):
            return (
                f"its optimizer state leaf {jax.tree_util.keystr(path)} has shape "
                f"{np.shape(got)}, this step's {tuple(want.shape)}"
            )
    return None


def same_state(state, expected, extra_keys, model, *, where: str, devices: int) -> None:
    """Raises a ``ValueError`` naming both algorithms when ``state`` was made by another step.

    ``expected`` is the abstract optimizer state this step would make for ``state.params``
    (None: not compared; a string: what is wrong with the params themselves);
    ``extra_keys`` the names ``state.extra`` holds; ``model`` the step's ``ModelState``.
    """
    problem = expected if isinstance(expected, str) else None
    if problem is None and expected is not None:
        problem = _opt_state_problem(state.opt_state, expected)
    extra = sorted(k for k in state.extra or {} if k not in ("model_state", "rng"))
    if problem is None and extra != sorted(extra_keys):
        problem = f"its extra state holds {extra}, this step's {sorted(extra_keys)}"
    for name, has, value in (
        ("model_state", model.has_state, state.model_state),
        ("rng", model.has_rng, state.rng),
    ):
        if problem is None and has != (value is not None):
            built = "model_state=..." if name == "model_state" else "rng_seed=..."
            problem = (
                f"its {name} is {'missing' if has else 'set'}, and this step was built "
                f"{'with' if has else 'without'} {built}"
            )
    if problem is None:
        return
    raise ValueError(
        f"{where}: this state was made by {_made_by(state, devices)}, not by this {where!r} "
        f"step: {problem}. Pass the state this step's init returned (state = "
        "step.init(params)); to carry a model over to another algorithm, start from it: "
        "new_step.init(old_step.params(old_state))"
    )


def _spec_axes(spec) -> set[str]:
    """The mesh axes a ``PartitionSpec`` splits over."""
    names = set()
    for entry in spec:
        names.update(entry if isinstance(entry, tuple) else () if entry is None else (entry,))
    return names


def unsynced(updates, update_specs, opt_state, specs, axes) -> list[str]:
    """Paths of updates, or state, that differ between devices where they should not: a leaf
    may vary over the axes its spec splits it over, and no other."""
    leaves = jax.tree.leaves_with_path((updates, opt_state))
    if update_specs is None:  # replicated: no update may vary
        update_specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), updates)
    allowed = [_spec_axes(spec) for spec in jax.tree.leaves((update_specs, specs))]
    return [
        jax.tree_util.keystr(path)
        for (path, leaf), ok in zip(leaves, allowed, strict=True)
        if (varying_axes(leaf) & set(axes)) - ok
    ]
