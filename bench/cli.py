"""`conveyor bench <name> ...`: dispatch to the benchmark modules."""

from __future__ import annotations

import importlib

BENCHES = {
    "offline": "bench.offline",
    "serve": "bench.serve",
    "prefix-overhead": "bench.prefix_overhead",
    "engine-redis": "bench.engine_redis",
    "cpu-threads": "bench.cpu_threads",
    "moe-layer": "bench.moe_layer",
    "window-kv": "bench.window_kv",
    "broker": "bench.broker",
    "decode-rows": "bench.decode_rows",
}


def main(argv: list[str]) -> int:
    """Run ``conveyor bench NAME [options]``, NAME one of `BENCHES`."""
    if not argv or argv[0] not in BENCHES:
        print(f"usage: conveyor bench {{{','.join(BENCHES)}}} [options]")
        return 2
    return int(importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0)
