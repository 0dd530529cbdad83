"""A Redis-protocol server for development when no ``redis-server`` is installed.

Runs fakeredis's TCP server (an in-memory Redis implemented in Python) in this process:
``python -m infra.embedded_redis --port 6390``. Fine for trying the stack on a laptop; slower
than Redis and single-process, so use a real Redis for benchmarks and deployments.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.embedded_redis")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=6390)
    args = p.parse_args(argv)
    from fakeredis import TcpFakeServer

    server = TcpFakeServer((args.host, args.port), server_type="redis")
    server.daemon_threads = True  # blocked client threads must not keep the process alive
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("conveyor.redis").info("embedded Redis-protocol server on %s:%d", args.host, args.port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
