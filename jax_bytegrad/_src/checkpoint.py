"""Checkpoints of a training state through orbax, for runs that restart (Bagua's elastic training).

Bagua's elastic training is TorchElastic underneath: the launcher restarts every worker after a
failure and the script reloads its own last checkpoint. Here the launcher is ``python -m
jax_bytegrad.launch --max-restarts N`` and the checkpoints are orbax's: a `Checkpointer` saves
any pytree of arrays (params, optimizer state, algorithm state, step, data position) every K
steps, in the background, keeps the last few, and `Checkpointer.restore_or_init` resumes from
the newest one that reads back, or initializes.

What makes it safe to kill a process at any moment:

- orbax writes a step into a temporary directory (``<step>.orbax-checkpoint-tmp-*``) and renames
  it to ``<step>`` only when every process has finished writing (its atomic finalize on POSIX
  file systems), so a checkpoint half-written when a process dies is never listed, never
  restored, and removed when the next `Checkpointer` opens the directory;
- a checkpoint that was finalized but later lost or truncated files fails to read (tensorstore
  checks the byte ranges it reads): `Checkpointer.restore_or_init` warns, falls back to the
  previous one, and deletes the unreadable newer ones so that the resumed run can save those
  steps again. orbax keeps no checksums of local files, so a bit flipped inside a data file is
  not detected.

A different number of processes on restart: replicated state (everything of
``gradient_allreduce``, ``bytegrad`` and ``qadam``) restores exactly onto any mesh, given that
mesh's replicated sharding (`replicated_shardings`). Per-device state has no meaning for
another device count; the rule is `average_replicas`: per-device copies (decentralized SGD's
params and optimizer state) are replaced by their mean, the consensus model, on every new
device; the low-precision variant's ring copies are rebuilt from that mean; error-feedback
residuals are zeroed, which drops at most one step's quantization error per device (see
docs/elastic.md).

References:
  - Orbax checkpointing: https://orbax.readthedocs.io/en/latest/guides/checkpoint/api_refactor.html
  - Bagua elastic training: https://tutorials-8ro.pages.dev/elastic-training/basic-usage.html
  - TorchElastic: https://pytorch.org/docs/stable/distributed.elastic.html
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checkpoint_mismatch as mismatch
from jax_bytegrad._src import checks
from jax_bytegrad._src.algorithms.decentralized.step import consensus_params

# Private helpers ----------------------------------------------------------------------------------


def _ocp():
    # Imported on first use: orbax is a dependency of this package, but importing it takes as
    # long as importing the rest of jax_bytegrad, and most processes never checkpoint.
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - a dependency, missing only if removed
        raise ImportError(
            f"jax_bytegrad.checkpoint needs orbax-checkpoint, a dependency of jax_bytegrad that "
            f"cannot be imported here ({e}); reinstall jax_bytegrad (pip install -e .) or "
            "pip install orbax-checkpoint"
        ) from e
    return ocp


def _on(x, mesh: Mesh) -> Sharding:
    """Where leaf ``x`` goes on ``mesh``: where it is already, for an array placed on that
    mesh (a train step's ``init`` splits what it keeps split); else replicated."""
    if isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) == mesh:
        return x.sharding
    return NamedSharding(mesh, P())


def _target_shardings(abstract, shardings):
    """A sharding per leaf of `abstract`, from one Mesh (replicated on it, but for the arrays
    of `abstract` already placed on it), one Sharding or a matching pytree of shardings, or of
    arrays or `jax.ShapeDtypeStruct`s that carry theirs (a train step's `state_shapes`); there
    a leaf that carries none (the host step count) goes replicated on the others' mesh."""
    if isinstance(shardings, Mesh):
        return jax.tree.map(lambda x: _on(x, shardings), abstract)
    if isinstance(shardings, Sharding):
        return jax.tree.map(lambda _: shardings, abstract)
    try:
        tree = jax.tree.map(lambda _, s: getattr(s, "sharding", s), abstract, shardings)
    except ValueError as e:
        raise ValueError(
            f"restore_or_init: shardings do not match the structure of init_fn()'s state ({e}); "
            "pass one Mesh or Sharding for all leaves, a pytree of shardings like the state, or "
            "the train step's state_shapes(params)"
        ) from None
    meshes = [s.mesh for s in jax.tree.leaves(tree) if isinstance(s, NamedSharding)]
    if not meshes:
        return tree
    return jax.tree.map(
        lambda s: s if isinstance(s, Sharding) else NamedSharding(meshes[0], P()), tree
    )


def _empty(x) -> bool:
    """Whether ``x`` is an array (or its shape) of no values."""
    shape = getattr(x, "shape", None)
    return shape is not None and 0 in tuple(shape)


def _without_empty(tree):
    """``tree`` with each array of no values as None: orbax refuses to save one ("Cannot save
    arrays with zero size"), and error feedback keeps such residuals where the integer wire
    codes once (the empty ``mean``)."""
    return jax.tree.map(lambda x: None if _empty(x) else x, tree)


def _refilled(restored, target):
    """``restored`` (restored onto ``_without_empty(target)``) with ``target``'s arrays of no
    values put back, placed where ``target`` says."""
    leaves, treedef = jax.tree.flatten(target)
    got = iter(jax.tree.leaves(restored))

    def empty(t):
        return jax.make_array_from_callback(
            t.shape, t.sharding, lambda i: np.zeros(t.shape, t.dtype)[i]
        )

    return jax.tree.unflatten(treedef, [empty(t) if _empty(t) else next(got) for t in leaves])


def _async_options(ocp):
    """Orbax's async options: the step's directories made in ``save`` itself.

    Made in orbax's threads (its default since 0.12), a save still under way when Python 3.12
    exits could leave threads waiting for directories that no thread would make (none can
    start at exit), and the interpreter waited for those threads up to orbax's timeout (1200
    s): 3 of 8 scripts that never closed their Checkpointer, run side by side. Older orbax
    makes them in ``save`` already and has no such option (None: its defaults).
    """
    fields = {f.name for f in dataclasses.fields(ocp.AsyncOptions)}
    if "create_directories_asynchronously" not in fields:
        return None
    return ocp.AsyncOptions(create_directories_asynchronously=False)


# The orbax managers of the Checkpointers not yet closed, by id.
_UNCLOSED: set[int] = set()


class _CutShortByExit(logging.Filter):
    """Drops orbax's error logs of a save that the interpreter's exit cut short, while a
    Checkpointer is unclosed: three tracebacks that end in "RuntimeError: cannot schedule new
    futures after interpreter shutdown" (or "after shutdown"), which `_close_unclosed` replaces
    with one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if _UNCLOSED and record.exc_info else None
        for _ in range(10):  # down the chain of causes, which may loop
            if error is None:
                return True
            # The global pool's refusal ("after interpreter shutdown"), one pool's once its
            # workers saw it ("after shutdown"), or Python 3.12's ("can't create new thread
            # at interpreter shutdown").
            if isinstance(error, RuntimeError) and any(
                cause in str(error) for cause in ("interpreter shutdown", "futures after shutdown")
            ):
                return False
            error = error.__cause__ or error.__context__
        return True


_CUT_SHORT_BY_EXIT = _CutShortByExit()


def _close_unclosed(manager, directory: Path) -> None:
    """Closes the orbax manager of a `Checkpointer` its script never closed: when the
    Checkpointer is garbage-collected, or at exit if it never is.

    Dropped before the script ends, its save under way finishes here. Still alive at exit, it
    cannot: Python runs ``atexit`` (and so ``weakref.finalize``) only after it has shut the
    thread pools that orbax's save needs, so the save under way has failed by then (a step
    never finished is never restored); this says so in one line, with what to do.
    """
    try:
        manager.wait_until_finished()
        manager.close()
    except Exception as error:  # noqa: BLE001 - at exit, a line to act on, not a traceback
        warnings.warn(
            f"Checkpointer: the save under way in {directory} could not finish as the "
            f"interpreter exited ({type(error).__name__}: {error}); close the Checkpointer (or "
            "use it in a with block) before the script ends. An unfinished step is never "
            "restored",
            RuntimeWarning,
            stacklevel=1,
        )
    finally:
        _UNCLOSED.discard(id(manager))


def _place(state, shardings):
    """Puts each leaf (this process's value of it) onto its target sharding."""

    def place(x, sharding):
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(place, state, shardings)


# Public API ---------------------------------------------------------------------------------------


class Checkpointer:
    """Saves a training state every `every` steps and restores the newest readable one.

    The state is any pytree of `jax.Array` (NamedTuples, dicts, optax states, typed PRNG keys
    included), the same on every process: call every method on every process, in the same
    order. Saves run in the background (orbax's async checkpointing): `save` returns once the
    arrays are copied off the devices (so the next step may donate them), and the next `save`,
    `wait` or `close` waits for the previous one to finish.

    Args:
      directory: Where the checkpoints go, one subdirectory per step; created if missing. All
        processes must see the same directory (a shared file system on a cluster).
      every: Save when ``step % every == 0`` (and whenever ``save(..., force=True)``).
      keep: How many of the newest checkpoints to keep; older ones are deleted. Keep at least
        2 so that an unreadable newest one has a previous one to fall back to.
      async_save: Write in a background thread; False blocks in `save` until written.

    Raises:
      ValueError: `every` or `keep` is not a whole number >= 1.

    Examples:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> import jax_bytegrad
      >>> from jax_bytegrad.checkpoint import Checkpointer
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> with Checkpointer(tempfile.mkdtemp(), every=2) as ckpt:
      ...     step, state = ckpt.restore_or_init(lambda: {"w": jnp.zeros(3)}, mesh)
      ...     while step < 5:
      ...         state = {"w": state["w"] + 1.0}  # a train step
      ...         step += 1
      ...         _ = ckpt.save(step, state)
      ...     ckpt.wait()
      ...     print(ckpt.steps)
      [2, 4]
    """

    def __init__(
        self, directory: str | Path, *, every: int, keep: int = 3, async_save: bool = True
    ):
        checks.integer(every, "every", "Checkpointer")
        checks.integer(keep, "keep", "Checkpointer")
        ocp = _ocp()
        self.directory = Path(directory).absolute()
        self.every = every
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=True,
                cleanup_tmp_directories=True,  # what a killed process left half-written
                async_options=_async_options(ocp),
            ),
            # Named up front so that a fresh manager reads a step's metadata (restore checks
            # the shapes in it) before its first save or restore, which would name it.
            item_handlers=ocp.StandardCheckpointHandler(),
        )
        # A Checkpointer dropped without close() is closed when it is collected, while the
        # thread pools its save needs still run. One alive at exit is closed by atexit (the
        # finalizer's), which runs after Python has shut those pools: too late for its save
        # to finish, early enough to say so in one line, orbax's tracebacks of it dropped
        # (_close_unclosed, _CutShortByExit). Only threading's private exit hooks run before
        # the pools shut, and a private hook may change in any Python release.
        # weakref.finalize holds no reference to the Checkpointer itself.
        self._finalizer = weakref.finalize(self, _close_unclosed, self._manager, self.directory)
        _UNCLOSED.add(id(self._manager))
        logging.getLogger("absl").addFilter(_CUT_SHORT_BY_EXIT)  # once: a filter set

    @property
    def steps(self) -> list[int]:
        """The steps with a finalized checkpoint, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, *, force: bool = False) -> bool:
        """Saves `state` as the state after `step` steps, if `step` is a multiple of `every`.

        Args:
          step: Steps done, which is also the data position of a deterministic sampler.
          state: The pytree of arrays to save, e.g. ``{"params": p, "opt_state": s}``.
          force: Save whatever the step (say, at the end of training).

        Returns:
          Whether a save was started.
        """
        if not force and step % self.every:
            return False
        if step in self._manager.all_steps():
            return False  # already saved at this step (a forced save after a periodic one)
        ocp = _ocp()
        # Every value computed first: orbax's save starts with a barrier that is a collective
        # between processes (multihost_utils.sync_global_devices), which must not meet a
        # collective still running on another thread (DiLoCo's exchange in the background:
        # Gloo cannot tell the two apart). The save copies every array to the host anyway.
        jax.block_until_ready(state)
        saved = ocp.args.StandardSave(_without_empty(state))
        return bool(self._manager.save(step, args=saved, force=True))

    def restore(self, step: int, init_fn: Callable[[], Any], shardings, *, relayout=False):
        """Restores the checkpoint of `step` onto `shardings`, shaped like ``init_fn()``.

        Args:
          step: A step in `steps`.
          init_fn: Returns a state of the saved structure, shapes and dtypes; only traced
            (`jax.eval_shape`), not run.
          shardings: Where the leaves go: a `Mesh` (replicated on it), one `Sharding`, a
            pytree of shardings like the state, or a state whose leaves carry theirs (a train
            step's ``state_shapes(params)``, whose split leaves stay split). It need not be the
            mesh, nor the ``shard=`` setting, that saved it.
          relayout: For a checkpoint whose structure differs from ``init_fn()``'s only in
            where its leaves sit (an optimizer chain of an earlier release, with an element
            that holds no arrays added or removed): map its leaves onto the state in order,
            after checking that their count, shapes and dtypes agree.

        Returns:
          The restored state.

        Raises:
          ValueError: The checkpoint's structure differs (naming the leaves one has and the
            other lacks; advising ``relayout=True`` only where the same leaves sit at other
            places), a leaf has another shape (naming it, with the saved and the expected
            shape), or with ``relayout``, its leaves differ.
        """
        abstract = jax.eval_shape(init_fn)
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract,
            _target_shardings(abstract, shardings),
        )
        # Arrays of no values are not saved (``save``): made again here.
        bare = _without_empty(target)
        if relayout:
            restored = self._relayout(step, bare)
        else:
            restored = self._restore(step, bare, abstract)
        return _refilled(restored, target)

    def _restore(self, step: int, target, abstract):
        """``restore`` onto ``target`` (shapes placed as they will be), with ``init_fn()``'s
        ``abstract`` state for the errors' hints."""
        ocp = _ocp()
        # Checked here, not left to orbax: its error for a leaf of another shape names neither
        # the leaf nor a remedy that Checkpointer offers (it advises strict=False, padding or
        # truncating the array), and comes with a long traceback through its coroutines.
        saved = self._manager.item_metadata(step)
        other = mismatch.other_shapes(getattr(saved, "tree", saved), target)
        if other:
            listed = "; ".join(other[:3]) + (
                f"; and {len(other) - 3} more" if len(other) > 3 else ""
            )
            raise ValueError(
                f"Checkpointer: the checkpoint of step {step} in {self.directory} holds leaves "
                f"of other shapes than the state to restore: {listed}. Restore with init_fn of "
                "the model and optimizer that saved it, or start the changed model in another "
                f"directory{mismatch.residuals_hint(abstract)}"
            )
        try:
            return self._manager.restore(step, args=ocp.args.StandardRestore(target))
        except ValueError as e:
            if "structure" not in str(e).lower():
                raise
            saved = self._manager.item_metadata(step)
            differs = mismatch.differing_leaves(getattr(saved, "tree", saved), target)
            raise ValueError(
                f"Checkpointer: the checkpoint of step {step} has another structure than the "
                f"state to restore: {differs}{mismatch.residuals_hint(abstract)}"
            ) from None

    def _relayout(self, step: int, target):
        """``restore(..., relayout=True)``: the saved leaves, in order, in ``target``'s
        structure."""
        ocp = _ocp()
        saved = self._manager.item_metadata(step)
        saved = getattr(saved, "tree", saved)
        have = sorted(jax.tree.flatten_with_path(saved)[0], key=lambda kv: mismatch.path_key(kv[0]))
        want, treedef = jax.tree.flatten_with_path(target)
        ranks = sorted(range(len(want)), key=lambda i: mismatch.path_key(want[i][0]))
        if len(have) != len(want):
            raise ValueError(
                f"Checkpointer: the checkpoint of step {step} holds {len(have)} arrays, the "
                f"state {len(want)}: it is not the same state in another layout"
            )
        shardings = {}
        for (path, meta), i in zip(have, ranks, strict=True):
            leaf = want[i][1]
            if tuple(meta.shape) != tuple(leaf.shape) or str(meta.dtype) != str(leaf.dtype):
                raise ValueError(
                    f"Checkpointer: the saved {jax.tree_util.keystr(path)} is "
                    f"{meta.dtype}{list(meta.shape)}, the state's "
                    f"{jax.tree_util.keystr(want[i][0])} {leaf.dtype}{list(leaf.shape)}: it is "
                    "not the same state in another layout"
                )
            shardings[jax.tree_util.keystr(path)] = leaf
        saved_target = jax.tree_util.tree_map_with_path(
            lambda path, _: shardings[jax.tree_util.keystr(path)], saved
        )
        restored = self._manager.restore(step, args=ocp.args.StandardRestore(saved_target))
        got = jax.tree.flatten_with_path(restored)[0]
        got = sorted(got, key=lambda kv: mismatch.path_key(kv[0]))
        leaves = [None] * len(want)
        for (_, value), i in zip(got, ranks, strict=True):
            leaves[i] = value
        return jax.tree.unflatten(treedef, leaves)

    def restore_or_init(self, init_fn: Callable[[], Any], shardings) -> tuple[int, Any]:
        """Resumes from the newest readable checkpoint, or starts from ``init_fn()``.

        A checkpoint that fails to read (files truncated or missing) is skipped with a warning
        and deleted, and the previous one is tried.

        Args:
          init_fn: Returns the initial state: a pytree of this process's values (numpy or
            JAX arrays, the same on every process for replicated leaves). With a checkpoint it
            is only traced, to learn the structure.
          shardings: Where the leaves go (see `restore`); typically the run's mesh, or
            `replicated_shardings` of it. A state split on the mesh (``shard=``, DiLoCo's
            nodes) restores onto the train step's ``state_shapes(params)``, which carry its
            shardings; a fresh ``init_fn()``'s arrays that are on the mesh stay as placed.

        Returns:
          ``(step, state)``: the steps already done (0 when initialized) and the state.

        Raises:
          RuntimeError: There are checkpoints, but none could be read.
          ValueError: `shardings` does not match the state's structure, or a checkpoint's
            leaf has another shape than the state's (as in `restore`).
        """
        steps = self.steps
        failed = []
        for step in reversed(steps):
            try:
                state = self.restore(step, init_fn, shardings)
            except ValueError as e:
                # Another model, not an unreadable checkpoint: none is skipped or deleted.
                if "of other shapes than the state" in str(
                    e
                ) or "do not match the structure" in str(e):
                    raise
                failed.append((step, e))
                continue
            except Exception as e:  # noqa: BLE001 - tensorstore raises plain Exception
                failed.append((step, e))
                continue
            for bad, e in failed:
                warnings.warn(
                    f"Checkpointer: the checkpoint of step {bad} in {self.directory} could not "
                    f"be read ({type(e).__name__}: {str(e).splitlines()[0][:200]}); it is "
                    f"deleted and the run resumes from step {step}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._manager.delete(bad)
            return step, state
        if failed:
            raise RuntimeError(
                f"Checkpointer: none of the checkpoints {steps} in {self.directory} could be "
                f"read (newest: {type(failed[0][1]).__name__}: "
                f"{str(failed[0][1]).splitlines()[0][:1000]}); move the directory away to start "
                "from scratch"
            )
        state = init_fn()
        return 0, _place(state, _target_shardings(state, shardings))

    def wait(self) -> None:
        """Blocks until the save in progress, if any, is written and finalized."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in progress and releases orbax's resources. Calling it again does
        nothing. Never called, it runs when the Checkpointer is garbage-collected; one still
        alive at exit cannot finish its last save (Python has shut the thread pools orbax needs
        by then), which a RuntimeWarning says."""
        if self._finalizer.detach() is None:
            return  # closed already
        try:
            self._manager.wait_until_finished()
            self._manager.close()
        finally:
            _UNCLOSED.discard(id(self._manager))

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def replicated_shardings(tree, mesh: Mesh):
    """The replicated sharding on `mesh` for every leaf of `tree` (a state or its shapes)."""
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def average_replicas(per_device, num_devices: int):
    """The rule for per-device state on a different device count: every device gets the mean.

    Per-device state (leaves whose leading axis has one entry per device, like decentralized
    SGD's params and optimizer state) cannot be mapped onto another number of devices one to
    one. Their mean (`jax_bytegrad.consensus_params`) is the consensus model that decentralized
    SGD converges to, so each of the `num_devices` new devices starts from it. Restore such
    leaves with a replicated sharding (their saved shape, every old device's row), average
    them here, and place the result as the new run's per-device state.

    The low-precision variant's ring copies (``weight``, ``left_peer_weight``,
    ``right_peer_weight``) are not averaged but rebuilt: after averaging, every device and both
    of its neighbours hold the same parameters, which is what the step's ``init`` sets the
    copies to, so call ``init`` on the averaged parameters. Error-feedback residuals are zeroed:
    a residual is the part of one device's own gradient that its last quantization dropped,
    and means nothing on another device; zeroing loses at most that one step's quantization
    error per device, the same as a step without error feedback.

    Args:
      per_device: A pytree of arrays (on the host or on devices) with a leading axis of one
        entry per old device.
      num_devices: The new device count.

    Returns:
      A pytree of arrays with a leading axis of `num_devices`, every row the mean, in the
      leaves' own dtypes.

    Raises:
      ValueError: `num_devices` < 1, or a leaf has no leading axis.

    Examples:
      >>> import numpy as np
      >>> from jax_bytegrad.checkpoint import average_replicas
      >>> average_replicas({"w": np.array([[1.0], [3.0]], np.float32)}, 4)["w"].ravel().tolist()
      [2.0, 2.0, 2.0, 2.0]
    """
    checks.integer(num_devices, "num_devices", "average_replicas")
    for leaf in jax.tree.leaves(per_device):
        if np.ndim(leaf) == 0:
            raise ValueError(
                "average_replicas: a scalar leaf has no per-device axis; pass per-device leaves "
                "of shape (devices, ...) only, and restore replicated state as it is"
            )
    mean = consensus_params(jax.tree.map(np.asarray, per_device))
    return jax.tree.map(
        lambda m: np.broadcast_to(np.asarray(m), (num_devices, *np.shape(m))).copy(), mean
    )
