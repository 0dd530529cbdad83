"""`InputWorkers`: the threads that parse request bodies and tokenize prompts off the event loop."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class InputWorkers:
    """Runs parsing and tokenization off the event loop, so it keeps answering other requests
    (and ``/health``) meanwhile; large inputs on a pool of their own."""

    def __init__(self, large_workers: int = 2) -> None:
        self.large = ThreadPoolExecutor(max_workers=large_workers, thread_name_prefix="conveyor-large-input")

    async def run(self, large: bool, fn: Callable[..., T], *args: Any) -> T:
        if large:
            return await asyncio.get_running_loop().run_in_executor(self.large, functools.partial(fn, *args))
        return await asyncio.to_thread(fn, *args)

    def close(self) -> None:
        self.large.shutdown(wait=False, cancel_futures=True)
