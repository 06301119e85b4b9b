"""What a checkpoint that does not fit the state to restore differs in, said by name: the leaves
one has and the other lacks, the leaves of other shapes, and what error feedback's residuals
need. orbax's own errors give neither the leaf nor the shapes (``Checkpointer.restore``)."""

import jax

from jax_bytegrad._src.sync.config import Residuals


def residuals_hint(abstract) -> str:
    """What to check when a state with error feedback's residuals does not restore: they are
    sized per bucket, and the default buckets differ between GPU meshes and others."""
    found = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, Residuals))
    if not any(isinstance(x, Residuals) and len(x) for x in found):
        return ""
    return (
        ". The state keeps error feedback's residuals, one pair per bucket: build the "
        "optimizer with the bucket_bytes the checkpoint was saved with (one saved with the "
        "default off a GPU mesh restores on a GPU mesh with bucket_bytes=32 * 2**20; "
        "docs/gpu.md, 'The bucket grain')"
    )


def path_key(path) -> tuple:
    """A key path as a sort key that a tuple saved as a list, or a NamedTuple saved as a dict,
    share: names in alphabetical order, sequence positions in numeric order."""
    out = []
    for key in path:
        name = getattr(key, "name", getattr(key, "key", None))
        if name is None:
            out.append((0, getattr(key, "idx", 0), ""))
        elif isinstance(name, str) and name.isdigit():
            out.append((0, int(name), ""))
        else:
            out.append((1, 0, str(name)))
    return tuple(out)


def differing_leaves(saved, target) -> str:
    """How the saved leaves (orbax's metadata tree) and the state's differ, for a structure
    error: the leaves one has and the other lacks, by name; ``relayout=True`` is advised only
    where it can help, every leaf's shape and dtype agreeing in order."""
    have = dict(sorted(jax.tree.flatten_with_path(saved)[0], key=lambda kv: path_key(kv[0])))
    want = dict(sorted(jax.tree.flatten_with_path(target)[0], key=lambda kv: path_key(kv[0])))

    def described(leaves) -> list[str]:
        return [f"{jax.tree_util.keystr(p)} ({x.dtype}{list(x.shape)})" for p, x in leaves.items()]

    def kinds(leaves) -> list[tuple]:
        return [(str(x.dtype), tuple(x.shape)) for x in leaves.values()]

    if kinds(have) == kinds(want):
        return (
            "the same leaves, in order, at other places. If only where the leaves sit changed "
            "(a state saved by an earlier release), pass relayout=True"
        )
    names = {path_key(p): p for p in have} | {path_key(p): p for p in want}
    saved_keys, state_keys = {path_key(p) for p in have}, {path_key(p) for p in want}
    only_saved = [names[k] for k in sorted(saved_keys - state_keys)]
    only_state = [names[k] for k in sorted(state_keys - saved_keys)]
    parts = []
    if only_saved:
        leaves = described({p: have[p] for p in only_saved[:3]})
        parts.append(f"the checkpoint holds {', '.join(leaves)}, which the state lacks")
    if only_state:
        leaves = described({p: want[p] for p in only_state[:3]})
        parts.append(f"the state has {', '.join(leaves)}, which the checkpoint lacks")
    if not parts:
        parts.append("the same leaf names with other shapes or dtypes")
    return (
        f"{'; '.join(parts)} ({len(have)} saved arrays, {len(want)} in the state). "
        "relayout=True cannot help: restore with init_fn of the model and optimizer that saved "
        "it"
    )


def stored_shape(leaf) -> tuple:
    """The shape orbax stores for a leaf of the target: a typed PRNG key's as its key data."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.eval_shape(jax.random.key_data, leaf).shape
    return tuple(leaf.shape)


def other_shapes(saved, target) -> list[str]:
    """The leaves that the saved tree (orbax's metadata) and `target` both have, by name, but
    with other shapes: ``"['w'] is [8, 4] in the checkpoint, [8, 5] in the state"``. Empty when
    the names differ too, which orbax's own structure check names (see `differing_leaves`)."""
    have = {path_key(p): x for p, x in jax.tree.flatten_with_path(saved)[0]}
    want = {path_key(p): (p, x) for p, x in jax.tree.flatten_with_path(target)[0]}
    if have.keys() != want.keys():
        return []
    out = []
    for key in sorted(want):
        path, leaf = want[key]
        shape = getattr(have[key], "shape", None)
        if shape is None or tuple(shape) in (tuple(leaf.shape), stored_shape(leaf)):
            continue
        out.append(
            f"{jax.tree_util.keystr(path)} is {list(shape)} in the checkpoint, "
            f"{list(leaf.shape)} in the state"
        )
    return out
