"""Shared fixtures: small random checkpoints written once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from executor.make_model import make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_model(arch, size="tiny", seed=0, shards=1, sliding_window=None) -> Path``
    of a checkpoint dir.

    Each distinct argument tuple is written once per session and then reused.
    """
    cache: dict[tuple[str, str, int, int, int | None], Path] = {}

    def get(arch: str = "llama", size: str = "tiny", seed: int = 0, shards: int = 1, sliding_window: int | None = None) -> Path:
        key = (arch, size, seed, shards, sliding_window)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{size}-s{seed}-x{shards}-w{sliding_window}")
            cache[key] = make_model(arch, size, seed, out, shards=shards, sliding_window=sliding_window)
        return cache[key]

    return get
