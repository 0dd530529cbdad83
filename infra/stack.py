"""Start a real service stack for tests and benchmarks: Redis, N engines, N gateways.

Redis comes from the ``redis_url`` given, else ``CONVEYOR_REDIS_URL``, else 127.0.0.1:6379 when
reachable, else a private ``redis-server`` on a free port (always, where installed, for a stack with
a CPU placement and no ``CONVEYOR_REDIS_URL``: its Redis then runs on the control CPUs). Every stack
gets its own namespace, so parallel runs sharing one Redis never see each other's streams. Process
logs go to files; `Stack.logs()` shows their tails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import cast

import redis

from common.protocol import EngineStatus, Names, decode
from common.redis_url import PASSWORD_ENV, PASSWORD_FILE_ENV, sync_client
from common.service_cli import AUTO
from infra.cpu_placement import Placement, allowed_cpus, plan_placement, tensor_parallel_size
from infra.launcher import free_port, proc_argv, start_redis, stop_all, wait_for_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]


def find_redis(workdir: Path) -> tuple[str, subprocess.Popen[bytes] | None]:
    """A reachable Redis URL, and the process if this call had to start one."""
    candidates = [os.environ["CONVEYOR_REDIS_URL"]] if os.environ.get("CONVEYOR_REDIS_URL") else []
    candidates.append("redis://127.0.0.1:6379/0")
    for url in candidates:
        try:
            sync_client(url, socket_connect_timeout=1).ping()
            return url, None
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            continue
    return start_redis(workdir)


class Stack:
    """Engines (executor ``executor<i>`` + scheduler ``scheduler<i>``) and gateways (``gateway<i>``)
    as separate processes under one fresh namespace."""

    def __init__(
        self,
        model: str | Path,
        workdir: Path,
        *,
        gateways: int = 1,
        engines: int = 1,
        executor_args: tuple[str, ...] = (),
        scheduler_args: tuple[str, ...] = (),
        gateway_args: tuple[str, ...] = (),
        heartbeat_ttl_ms: int = 1500,
        private_redis: bool = False,
        redis_url: str | None = None,
        auto_pairing: bool = False,
        cpu_placement: bool = False,
        module: str = "infra.cli",
        repo: Path = REPO,
    ) -> None:
        self.model = str(model)
        self.repo = repo  # whose code the processes run: this checkout, or another revision's (a benchmark's baseline)
        self.module = module  # run as every process: `infra.cli`, or a test's wrapper around it
        self.workdir = workdir
        self.namespace = f"test-{uuid.uuid4().hex[:10]}"
        self.names = Names(self.namespace)
        # Executors on CPUs of their own, the rest of the stack on the others (`infra.cpu_placement`);
        # off by default: tests run many stacks beside pytest itself.
        self.placement: Placement | None = (
            plan_placement(allowed_cpus(), engines, tensor_parallel_size(executor_args)) if cpu_placement else None
        )
        # A private redis-server when the test restarts it (never the shared one), or when the stack is
        # placed and no Redis is named: it then runs on the control CPUs as `conveyor up --cpu-placement
        # auto` puts it (the machine's would take turns on the executor's); ``redis_url``: one the test
        # runs itself (TLS, Sentinel), its password, if not in the URL, in the environment.
        placed_redis = self.placement is not None and not os.environ.get("CONVEYOR_REDIS_URL") and shutil.which("redis-server")
        if redis_url is not None:
            self.redis_url, self.redis_proc = redis_url, None
        elif private_redis or placed_redis:
            self.redis_url, self.redis_proc = start_redis(workdir)
        else:
            self.redis_url, self.redis_proc = find_redis(workdir)
        try:
            self._place_redis()
            self.redis = sync_client(self.redis_url)
        except BaseException:
            if self.redis_proc is not None:
                stop_all([self.redis_proc])
            raise
        self.num_gateways = gateways
        self.num_engines = engines
        self.executor_args, self.scheduler_args, self.gateway_args = executor_args, scheduler_args, gateway_args
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        # `--scheduler-id auto` for every engine process: paired by claim, not by index
        self.auto_pairing = auto_pairing
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: list[int] = []

    def _place_redis(self) -> None:
        if self.placement is None or self.redis_proc is None:
            return
        for tid in os.listdir(f"/proc/{self.redis_proc.pid}/task"):  # its background threads too
            os.sched_setaffinity(int(tid), self.placement.control)

    def _env(self) -> dict[str, str]:
        # A private Redis has no password: one in the environment is not for it (as `conveyor up`).
        inherited = {k: v for k, v in os.environ.items() if self.redis_proc is None or k not in (PASSWORD_ENV, PASSWORD_FILE_ENV)}
        return {
            **inherited,
            "CONVEYOR_REDIS_URL": self.redis_url,
            "CONVEYOR_NAMESPACE": self.namespace,
            "CONVEYOR_MODEL": self.model,
            "CONVEYOR_HEARTBEAT_TTL_MS": str(self.heartbeat_ttl_ms),
            "PYTHONPATH": str(self.repo),
            "TOKENIZERS_PARALLELISM": "false",
            "CONVEYOR_RUN_DIR": str(self.workdir),  # where `conveyor health` finds the ids
        }

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start (or restart) process ``name`` as ``conveyor <args>``, logging to ``<name>.log``."""
        log = open(self.workdir / f"{name}.log", "ab")
        env = self._env()
        if self.placement is not None:
            index = name.removeprefix("executor")
            env.update(self.placement.env((int(index) if index.isdigit() else 0) if name.startswith("executor") else None))
        proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *args], env=env, cwd=self.repo, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs[name] = proc
        return proc

    def start(self, timeout_s: float = 120) -> Stack:
        try:
            for i in range(self.num_engines):
                self.spawn_executor(i)
                self.spawn_scheduler(i)
            for i in range(self.num_gateways):
                self.ports.append(free_port())
                self.spawn_gateway(i)
            for url in self.urls:
                wait_healthy(f"{url}/health", timeout_s, list(self.procs.values()))
            deadline = time.monotonic() + timeout_s
            while len(self.engines()) < self.num_engines and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:
            print(self.logs(), file=sys.stderr)
            self.stop()
            raise
        return self

    def restart_redis(self, down_s: float = 1.0) -> None:
        """Kill this stack's private Redis and start an empty one on the same port."""
        assert self.redis_proc is not None, "restart_redis needs private_redis=True"
        cmd = list(proc_argv(self.redis_proc))
        self.redis_proc.kill()
        self.redis_proc.wait()
        time.sleep(down_s)
        self.redis_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        self._place_redis()
        port = int(cmd[cmd.index("--port") + 1])
        wait_for_port("127.0.0.1", port, 15, self.redis_proc)

    def spawn_executor(self, i: int) -> subprocess.Popen[bytes]:
        return self.spawn(f"executor{i}", "executor", "--scheduler-id", self._engine_id(i), *self.executor_args)

    def spawn_scheduler(self, i: int) -> subprocess.Popen[bytes]:
        return self.spawn(f"scheduler{i}", "scheduler", "--scheduler-id", self._engine_id(i), *self.scheduler_args)

    def _engine_id(self, i: int) -> str:
        return AUTO if self.auto_pairing else str(i)

    def spawn_gateway(self, i: int, *extra_args: str) -> subprocess.Popen[bytes]:
        """Start (or restart) gateway ``i``; ``extra_args``: flags of its own besides the stack's."""
        port = str(self.ports[i])
        return self.spawn(f"gateway{i}", "gateway", "--host", "127.0.0.1", "--port", port, *self.gateway_args, *extra_args)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def engines(self) -> dict[str, EngineStatus]:
        """The live engines with a bound executor, by scheduler id."""
        out = {}
        # A sync client without decode_responses: replies are bytes.
        for sid in cast(list[bytes], self.redis.zrange(self.names.engines, 0, -1)):
            value = cast("bytes | None", self.redis.get(self.names.engine(sid.decode())))
            status = decode(value, (EngineStatus,)) if value else None
            if status is not None and status.executor_id:
                out[status.scheduler_id] = status
        return out

    def stats(self, scheduler_id: str = "0") -> EngineStatus:
        value = cast("bytes | None", self.redis.get(self.names.engine(scheduler_id)))
        assert value is not None, f"engine {scheduler_id} is not registered"
        return decode(value, (EngineStatus,))

    def wait_stats(self, predicate, timeout_s: float, scheduler_id: str = "0") -> EngineStatus:  # type: ignore[no-untyped-def]
        """Poll an engine's status until ``predicate(status)`` holds; returns the last one."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats(scheduler_id)
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def logs(self, lines: int = 40) -> str:
        out = []
        for name in self.procs:
            path = self.workdir / f"{name}.log"
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        stop_all(list(self.procs.values()))
        try:
            keys = list(self.redis.scan_iter(match=f"{self.namespace}:*", count=1000))
            if keys:
                self.redis.delete(*keys)
        except redis.RedisError:
            pass
        if self.redis_proc is not None:
            stop_all([self.redis_proc])
