"""Cache-aware routing over a real stack: two engines publish their prefix caches, and prompts
sharing a long prefix land on the engine that holds it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.prefix_hash import decode_summary, iter_block_hashes, summary_key
from infra.stack import Stack

pytestmark = pytest.mark.stack


def test_prompts_sharing_a_long_prefix_land_on_one_engine(tiny_model: Any, tmp_path: Path) -> None:
    stack = Stack(tiny_model(), tmp_path, engines=2, executor_args=("--num-blocks", "128")).start()
    try:
        engines = stack.engines()
        assert len(engines) == 2
        block = next(iter(engines.values())).block_size
        vocab, model = next(iter(engines.values())).vocab_size, next(iter(engines.values())).model_name
        pairs = 4  # by chance, all four seconds would follow their firsts 1 time in 2**4
        with httpx.Client(base_url=stack.urls[0], timeout=60) as http:
            for p in range(pairs):
                prefix = [(7 + 31 * p + 13 * i) % (vocab - 10) + 5 for i in range(4 * block)]
                body = {"model": model, "prompt": prefix + [1], "max_tokens": 2, "temperature": 0}
                assert http.post("/v1/completions", json=body).status_code == 200
                # The engine's summary says so (the gateway would follow its own routing until then).
                deepest = summary_key(list(iter_block_hashes(prefix, block))[-1])
                deadline = time.monotonic() + 10
                while not any(deepest in decode_summary(e.cached_prefixes) for e in stack.engines().values()):
                    assert time.monotonic() < deadline, "no engine published the prefix"
                    time.sleep(0.1)
                body["prompt"] = prefix + [2, 3]
                assert http.post("/v1/completions", json=body).status_code == 200
        hits = sum(e.prefix_cache_hits for e in stack.engines().values())
        assert hits == pairs * 4 * block, stack.logs()  # every second prompt hit its first's whole prefix
    finally:
        stack.stop()
