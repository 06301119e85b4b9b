"""The public surface: each name has one home, every namespace's ``__all__`` is what it holds, and
docs/index.md lists what each namespace holds."""

import collections
import importlib
import re
import types
from pathlib import Path

import pytest

import jax_bytegrad

NAMESPACES = [
    "jax_bytegrad",
    "jax_bytegrad.sharding",
    "jax_bytegrad.distributed",
    "jax_bytegrad.launch",
    "jax_bytegrad.checkpoint",
    "jax_bytegrad.data",
    "jax_bytegrad.profiling",
    "jax_bytegrad.experimental",
    "jax_bytegrad.nnx",
]
INDEX = Path(__file__).resolve().parent.parent / "docs" / "index.md"


def _names(namespace: str) -> set[str]:
    """The names ``namespace`` exports, less the namespaces the top level also exports."""
    module = importlib.import_module(namespace)
    return {n for n in module.__all__ if not isinstance(getattr(module, n), types.ModuleType)}


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_all_lists_exactly_the_public_attributes(namespace):
    module = importlib.import_module(namespace)
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == _names(namespace)


def test_each_name_has_one_home():
    homes = collections.defaultdict(list)
    for namespace in NAMESPACES:
        for name in _names(namespace):
            homes[name].append(namespace)
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}
    # Not vacuous: the names moved off the top level are found in their namespace.
    for name, namespace in [
        ("replicate", "sharding"),
        ("shard_batch", "sharding"),
        ("Checkpointer", "checkpoint"),
        ("communication_stats", "profiling"),
        ("CommunicationStats", "profiling"),
        ("DistributedInfo", "distributed"),
    ]:
        assert homes[name] == [f"jax_bytegrad.{namespace}"], name
    assert homes["make_mesh"] == homes["initialize"] == ["jax_bytegrad"]


@pytest.mark.parametrize(
    ("name", "now"),
    [
        ("shard_batch", "jax_bytegrad.sharding.shard_batch"),
        ("replicate", "jax_bytegrad.sharding.replicate"),
        ("Checkpointer", "jax_bytegrad.checkpoint.Checkpointer"),
        ("communication_stats", "jax_bytegrad.profiling.communication_stats"),
        ("valid_kwargs", "jax_bytegrad.Strategy.valid_kwargs"),
        ("step_key", "step.device_key"),
    ],
)
def test_a_name_moved_off_the_top_level_says_where_it_lives_now(name, now):
    with pytest.raises(AttributeError, match=rf"{name}'.*it is now {re.escape(now)}"):
        getattr(jax_bytegrad, name)
    # Every home it names exists.
    if now.startswith("jax_bytegrad."):
        module, _, attr = now.rpartition(".")
        if module == "jax_bytegrad.Strategy":
            assert hasattr(jax_bytegrad.Strategy, attr)
        else:
            assert hasattr(importlib.import_module(module), attr)


def test_an_unknown_name_is_still_a_plain_attribute_error():
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_name'$"):
        jax_bytegrad.no_such_name  # noqa: B018


def _documented() -> dict[str, set[str]]:
    """docs/index.md's "What lives where" table: {namespace: the names in its last column}."""
    section = INDEX.read_text().split("## What lives where", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`jax_bytegrad[\w.]*`", cells[0]):
            rows[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", cells[2]))
    return rows


def test_the_index_lists_each_namespaces_names():
    assert _documented() == {namespace: _names(namespace) for namespace in NAMESPACES}


def test_the_default_block_sizes_are_read_only():
    # Private since every default reads it: SyncConfig(bits=...).block_size is the public form.
    from jax_bytegrad._src.codecs.widths import DEFAULT_BLOCK_SIZES

    with pytest.raises(TypeError):
        DEFAULT_BLOCK_SIZES[8] = 2048
    assert jax_bytegrad.SyncConfig(bits=8).block_size == DEFAULT_BLOCK_SIZES[8] == 1024
    assert jax_bytegrad.SyncConfig(bits=4).block_size == DEFAULT_BLOCK_SIZES[4] == 512
    assert jax_bytegrad.SyncConfig(bits=2).block_size == DEFAULT_BLOCK_SIZES[2] == 512
