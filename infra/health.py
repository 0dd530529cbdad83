"""`conveyor health --role {gateway,scheduler,executor}`: is this host's service of that role live?

For container health checks (docker compose, Kubernetes probes): exit 0 if it is, 1 with the
reason on stderr if not. Each role is asked where it proves its own liveness:
- gateway: ``GET /health`` on its port answers 200 (ready: tokenizer loaded, engines reachable);
- scheduler: its `EngineStatus` key in Redis exists (`EngineBeat` refreshes it, TTL-bound);
- executor: its heartbeat key in Redis exists (beats once the model and KV cache are up).
The scheduler's and executor's ids are made up at start (auto pairing, random executor ids), so
by default they are read from the file each service records (`common.service_cli.process_id_path`);
``--id`` names one instead. A probe costs about 0.3 s of CPU (mostly imports), so compose runs
them every 5 s rather than every second or two.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from common.service_cli import process_id_path, service_parser

ROLES = ("gateway", "scheduler", "executor")


def build_parser() -> argparse.ArgumentParser:
    from gateway.http.server import build_parser as gateway_parser  # the gateway's own --port default

    p = service_parser("conveyor health", "Exit 0 if this host's service of --role is live.", "unused")
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--id", default=None, help="scheduler or executor id (default: the one the service recorded)")
    p.add_argument("--port", type=int, default=gateway_parser().get_default("port"), help="gateway port")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for the check's request")
    return p


def check(args: argparse.Namespace) -> str | None:
    """None if the service is live, else why not."""
    if args.role == "gateway":
        url = f"http://127.0.0.1:{args.port}/health"
        try:
            with urllib.request.urlopen(url, timeout=args.timeout) as response:
                return None if response.status == 200 else f"{url} answered {response.status}"
        except urllib.error.HTTPError as exc:
            return f"{url} answered {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        except OSError as exc:
            return f"{url}: {exc}"
    process_id = args.id
    if process_id is None:
        path = process_id_path(args.role)
        try:
            process_id = path.read_text().strip()
        except OSError:
            return f"no {args.role} has started here yet ({path} is missing)"
    # Imported only for the roles that need them (a probe's cost is mostly its imports).
    import redis

    from common.protocol import Names
    from common.redis_url import sync_client

    names = Names(args.namespace)
    key = names.engine(process_id) if args.role == "scheduler" else names.heartbeat("executor", process_id)
    try:
        # Any URL form the services take (TLS, Sentinel), the password from the environment too.
        client = sync_client(args.redis_url, socket_timeout=args.timeout, socket_connect_timeout=args.timeout)
        if not client.exists(key):
            return f"{args.role} {process_id} is not beating ({key} is missing or expired)"
    except redis.RedisError as exc:
        return f"redis: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check(args)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0
