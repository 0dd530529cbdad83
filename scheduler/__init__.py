"""Scheduler: request queues, the paged KV block table and the engine loop.

``LLM`` is imported lazily so the service can import this package without loading torch first.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from scheduler import llm

        return getattr(llm, name)
    raise AttributeError(name)
