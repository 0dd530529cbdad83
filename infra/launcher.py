"""`conveyor up`: start Redis, the engines (scheduler + executor pairs) and a gateway as processes.

Redis: ``--redis-url`` if given; else a ``redis-server`` started on a free port if one is
installed; else the embedded Redis-protocol server (`infra.embedded_redis`, development only).
With no ``--model``, a tiny random checkpoint is made once in ``~/.cache/conveyor/models`` and
served. Ctrl-C (or SIGTERM) stops everything this command started.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import cast

from common.redact import redact_url
from common.redis_url import PASSWORD_ENV, PASSWORD_FILE_ENV, URL_HELP
from common.service_cli import redis_url_arg
from infra.cpu_placement import ENV_CPUS, allowed_cpus, plan_placement, tensor_parallel_size


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.0f}s")


def start_redis(workdir: Path, log=None) -> tuple[str, subprocess.Popen[bytes]]:  # type: ignore[no-untyped-def]
    """A private Redis on a free port: redis-server if installed, else the embedded server."""
    port = free_port()
    server = shutil.which("redis-server")
    if server:
        cmd = [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--protected-mode",
            "no",
        ]
    else:
        print("conveyor: redis-server not found; using the embedded development server", file=sys.stderr)
        cmd = [sys.executable, "-m", "infra.embedded_redis", "--port", str(port)]
    # Own session: a terminal's Ctrl-C must not kill Redis before the services have shut down.
    proc = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for_port("127.0.0.1", port, 15, proc)
    return f"redis://127.0.0.1:{port}/0", proc


def proc_argv(proc: subprocess.Popen[bytes]) -> list[str]:
    """The command line ``proc`` was started with (every process here is started from a list of str)."""
    return cast(list[str], proc.args)


def wait_healthy(url: str, timeout_s: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, proc_argv(proc)[:4]))} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")


def stop_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = 5.0) -> None:
    """SIGTERM in reverse start order, then SIGKILL whatever is left."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in reversed(procs):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="conveyor up", description="Start Redis, executor, scheduler and gateway.")
    p.add_argument("--model", default=os.environ.get("CONVEYOR_MODEL"), help="default: a tiny random checkpoint")
    p.add_argument("--host", default=os.environ.get("CONVEYOR_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("CONVEYOR_PORT", "8000")))
    p.add_argument(
        "--redis-url",
        type=redis_url_arg,
        default=os.environ.get("CONVEYOR_REDIS_URL"),
        help=f"default: a private Redis. {URL_HELP}",
    )
    p.add_argument("--namespace", default=os.environ.get("CONVEYOR_NAMESPACE", f"conveyor-{uuid.uuid4().hex[:6]}"))
    p.add_argument(
        "--engines",
        type=int,
        default=int(os.environ.get("CONVEYOR_ENGINES", "1")),
        help="engine replicas (scheduler + executor pairs) serving the model",
    )
    p.add_argument("--executor-arg", action="append", default=[], help="extra flag for the executor (repeatable)")
    p.add_argument(
        "--cpu-placement",
        choices=("auto", "off"),
        default=os.environ.get("CONVEYOR_CPU_PLACEMENT", "off"),
        help="auto: each executor on CPUs of its own, the gateway, schedulers and Redis on the rest, where the host "
        "has enough CPUs (infra.cpu_placement); off (default): the OS places every process",
    )
    args = p.parse_args(argv)

    procs: list[subprocess.Popen[bytes]] = []
    redis_procs: list[subprocess.Popen[bytes]] = []

    def on_signal(*_: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops everything, like Ctrl-C

    signal.signal(signal.SIGTERM, on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-up-"))
    try:
        redis_url = args.redis_url
        if not redis_url:
            redis_url, redis_proc = start_redis(workdir)
            redis_procs.append(redis_proc)
        if args.model:
            model = str(Path(args.model).resolve())
        else:
            from executor.make_model import cached_model  # torch only when a model must be made

            model = str(cached_model("llama", "tiny"))
        env = {**os.environ, "CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": args.namespace, "CONVEYOR_MODEL": model}
        if not args.redis_url:  # the private Redis has no password: one from the environment is not for it
            env = {k: v for k, v in env.items() if k not in (PASSWORD_ENV, PASSWORD_FILE_ENV)}
        cli = [sys.executable, "-m", "infra.cli"]
        placement = None
        if args.cpu_placement == "auto":
            placement = plan_placement(allowed_cpus(), args.engines, tensor_parallel_size(args.executor_arg))
        if placement is not None:
            for proc in redis_procs:  # the private Redis belongs to the control plane
                os.sched_setaffinity(proc.pid, placement.control)
            control, executors = placement.env(None)[ENV_CPUS], placement.describe()
            print(f"conveyor: CPUs {control} for the control plane, {executors} for executors", file=sys.stderr)
        control_env = {**env, **placement.env(None)} if placement is not None else env
        for engine in range(args.engines):
            pair = ["--scheduler-id", str(engine)]
            executor_env = {**env, **placement.env(engine)} if placement is not None else env
            procs.append(subprocess.Popen([*cli, "executor", *pair, *args.executor_arg], env=executor_env))
            procs.append(subprocess.Popen([*cli, "scheduler", *pair], env=control_env))
        procs.append(subprocess.Popen([*cli, "gateway", "--host", args.host, "--port", str(args.port)], env=control_env))
        health_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        wait_healthy(f"http://{health_host}:{args.port}/health", 600, procs)
        print(
            f"conveyor: serving {model} at http://{health_host}:{args.port}/v1 (Redis {redact_url(redis_url)}; Ctrl-C stops)",
            file=sys.stderr,
        )
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        failed = [proc for proc in procs if proc.poll() is not None]
        print(f"conveyor: a process exited ({proc_argv(failed[0])[3:4]}, code {failed[0].returncode}); stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        # A second Ctrl-C (or the terminal's SIGINT to the whole group) must not cut the clean-up short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(procs)
        stop_all(redis_procs)  # last: the services clean up their keys on the way out
        shutil.rmtree(workdir, ignore_errors=True)
