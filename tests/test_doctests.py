"""The docstring examples of every jax_bytegrad module run, as the README promises."""

import doctest
import importlib
import pkgutil

import jax
import pytest

import jax_bytegrad

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(jax_bytegrad.__path__, prefix="jax_bytegrad.")
)


@pytest.mark.parametrize("name", MODULES, ids=MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    # As a user runs them: JAX's default rank promotion, not the test suite's strict one.
    with jax.numpy_rank_promotion("allow"):
        result = doctest.testmod(
            module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
        )
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_public_modules_have_examples():
    # A module list that found nothing, or examples that were all skipped, would pass above.
    attempted = sum(
        doctest.testmod(importlib.import_module(name), verbose=False, report=False).attempted
        for name in (
            "jax_bytegrad._src.sync.collectives",
            "jax_bytegrad._src.transforms",
            "jax_bytegrad._src.strategy",
        )
    )
    assert attempted >= 10
