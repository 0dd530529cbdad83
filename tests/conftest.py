"""Shared fixtures (small random checkpoints written once per test session) and the test tiers.

Every test module declares its tier (``pytestmark``: ``unit``, ``model``, ``stack``, ``slow``; a
heavier test in it adds its own). With ``-m`` naming tiers only, a module none of whose tests can
be selected is not imported at all: `make test-fast` does not pay for importing the model and
stack modules it would deselect anyway.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

TIERS = ("unit", "model", "stack", "slow")
_MODULE_MARK = re.compile(r"^pytestmark = (.+)$", re.M)
_TEST_TIER_MARK = re.compile(r"^@pytest\.mark\.(?:unit|model|stack|slow)\b", re.M)
_EXPRESSION_WORD = re.compile(r"[A-Za-z_]\w*")


def _selects(markexpr: str, tiers: set[str]) -> bool | None:
    """Whether ``-m markexpr`` selects a test of exactly ``tiers``; None unless the expression
    names tiers only (anything else is left to pytest)."""
    words = set(_EXPRESSION_WORD.findall(markexpr))
    if not words - {"and", "or", "not"} <= set(TIERS) or set(markexpr) - set(" ()_" + "".join(words)):
        return None
    try:
        return bool(
            eval(markexpr, {"__builtins__": {}}, {tier: tier in tiers for tier in TIERS})
        )  # the expression holds tier names and operators only
    except SyntaxError:
        return None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Skip importing a test module whose tier ``-m`` excludes (when none of its tests adds a tier)."""
    markexpr = config.getoption("markexpr")
    if not markexpr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    text = collection_path.read_text()
    module = _MODULE_MARK.search(text)
    if module is None or _TEST_TIER_MARK.search(text):
        return None
    selected = _selects(markexpr, set(re.findall(r"pytest\.mark\.(\w+)", module.group(1))))
    return True if selected is False else None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_model(arch, size="tiny", seed=0, shards=1, sliding_window=None) -> Path``
    of a checkpoint dir.

    Each distinct argument tuple is written once per session and then reused.
    """
    from executor.make_model import make_model  # here: the unit tier needs no checkpoint

    cache: dict[tuple[str, str, int, int, int | None], Path] = {}

    def get(arch: str = "llama", size: str = "tiny", seed: int = 0, shards: int = 1, sliding_window: int | None = None) -> Path:
        key = (arch, size, seed, shards, sliding_window)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{size}-s{seed}-x{shards}-w{sliding_window}")
            cache[key] = make_model(arch, size, seed, out, shards=shards, sliding_window=sliding_window)
        return cache[key]

    return get
