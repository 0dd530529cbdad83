"""Real Redis deployments for tests, on free ports under a test's tmp dir: a TLS server with a
throwaway CA (made with ``openssl``), a master + replica watched by three sentinels, and a Redis
Cluster of three masters with a replica each; and a namespace of its own on the test Redis
(`private_namespace`)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from common.protocol import Names
from common.transport import SyncTransport
from infra.launcher import free_port, stop_all, wait_for_port
from infra.stack import find_redis

SERVICE = "mymaster"


@contextmanager
def private_namespace(tmp_path: Path, tag: str) -> Iterator[tuple[redis.Redis, Names, SyncTransport]]:
    """A client and a `SyncTransport` on the test Redis (`infra.stack.find_redis`) under a fresh
    namespace, whose keys are deleted after."""
    url, proc = find_redis(tmp_path)
    names = Names(f"test-{tag}-{uuid.uuid4().hex[:8]}")
    r = redis.Redis.from_url(url)
    transport = SyncTransport(url, names, owner="test")
    try:
        yield r, names, transport
    finally:
        transport.close()
        for key in r.scan_iter(match=f"{names.namespace}:*"):
            r.delete(key)
        if proc is not None:
            proc.terminate()


def redis_server() -> str:
    """The ``redis-server`` binary, or skip the test saying why."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    return server


def _start(argv: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_for_port("127.0.0.1", port, 15, proc)
    return proc


def _server_args(workdir: Path, port: int, password: str | None) -> list[str]:
    args = [redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(workdir)]
    if password:
        args += ["--requirepass", password, "--masterauth", password]
    return args


def make_certs(workdir: Path) -> dict[str, Path]:
    """A throwaway CA and a server and a client certificate it signed (for 127.0.0.1), as files."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificates for a TLS Redis")
    out = {name: workdir / f"{name}.pem" for name in ("ca", "ca_key", "server", "server_key", "client", "client_key")}

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=workdir)

    days = ["-days", "1"]
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", *days, "-subj", "/CN=conveyor-test-ca",
        "-keyout", str(out["ca_key"]), "-out", str(out["ca"]))  # fmt: skip
    san = workdir / "san.cnf"
    san.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        csr = str(workdir / f"{who}.csr")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", str(out[f"{who}_key"]), "-out", csr)
        signer = ["-CA", str(out["ca"]), "-CAkey", str(out["ca_key"]), "-CAcreateserial"]
        run("x509", "-req", "-in", csr, *signer, *days, "-extfile", str(san), "-out", str(out[who]))
    return out


def start_tls_redis(workdir: Path, password: str) -> tuple[subprocess.Popen[bytes], int, dict[str, Path]]:
    """A redis-server on TLS only (plain port off), clients must show a certificate of the CA.
    Skips when this redis-server was built without TLS."""
    certs = make_certs(workdir)
    port = free_port()
    argv = _server_args(workdir, 0, password)  # --port 0: no plain-text port at all
    argv += ["--tls-port", str(port), "--tls-cert-file", str(certs["server"]), "--tls-key-file", str(certs["server_key"])]
    argv += ["--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "yes"]
    log = workdir / "redis-tls.log"
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port("127.0.0.1", port, 15, proc)
    except Exception:
        proc.kill()
        text = log.read_text(errors="replace")
        if "tls" in text.lower() and ("not supported" in text.lower() or "bad directive" in text.lower()):
            pytest.skip(f"redis-server was built without TLS: {text.strip()[-200:]}")
        raise
    return proc, port, certs


@dataclass
class SentinelCluster:
    """One master, one replica and three sentinels (quorum 2) on localhost, with a password."""

    workdir: Path
    password: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def start(self) -> SentinelCluster:
        for name in ("master", "replica", "sentinel0", "sentinel1", "sentinel2"):
            self.ports[name] = free_port()
        master = self.ports["master"]
        self.procs["master"] = _start(_server_args(self.workdir, master, self.password), master, self.workdir / "master.log")
        replica = [*_server_args(self.workdir, self.ports["replica"], self.password), "--replicaof", "127.0.0.1", str(master)]
        replica += ["--dbfilename", "replica.rdb"]
        self.procs["replica"] = _start(replica, self.ports["replica"], self.workdir / "replica.log")
        self._wait_replicated()
        for i in range(3):
            name = f"sentinel{i}"
            conf = self.workdir / f"{name}.conf"
            conf.write_text(
                f"port {self.ports[name]}\nbind 127.0.0.1\ndir {self.workdir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {master} 2\n"
                f"sentinel auth-pass {SERVICE} {self.password}\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 3000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            # `redis-server --sentinel` is redis-sentinel; the conf file must be writable (sentinels record state).
            argv = [redis_server(), str(conf), "--sentinel"]
            self.procs[name] = _start(argv, self.ports[name], self.workdir / f"{name}.log")
        self._wait_sentinels_see_replica()
        return self

    @property
    def url(self) -> str:
        """The sentinel form of the URL, without the password (the services read it from the environment)."""
        hosts = ",".join(f"127.0.0.1:{self.ports[f'sentinel{i}']}" for i in range(3))
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.ports[name], password=None if name.startswith("sentinel") else self.password)

    def _wait_replicated(self, timeout_s: float = 15) -> None:
        deadline = time.monotonic() + timeout_s
        while self.client("replica").info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never synced with the master"
            time.sleep(0.1)

    def _wait_sentinels_see_replica(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        for i in range(3):
            sentinel = self.client(f"sentinel{i}")
            while not sentinel.sentinel_slaves(SERVICE) or int(sentinel.sentinel_master(SERVICE)["num-other-sentinels"]) < 2:
                assert time.monotonic() < deadline, f"sentinel{i} never saw the replica and the other sentinels"
                time.sleep(0.2)

    def master_port(self) -> int:
        """The port of the master the sentinels name now."""
        return int(self.client("sentinel0").sentinel_get_master_addr_by_name(SERVICE)[1])

    def kill_master(self) -> None:
        """SIGKILL the master (no shutdown: whatever was not yet replicated is lost)."""
        self.procs["master"].kill()
        self.procs["master"].wait()

    def logs(self, lines: int = 20) -> str:
        out = []
        for name in self.procs:
            tail = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        stop_all(list(self.procs.values()))


CLUSTER_PORTS = range(7100, 7200)  # a node's bus listens 10000 above its port: ephemeral ports would not fit


def free_cluster_port(taken: set[int]) -> int:
    """A port of `CLUSTER_PORTS` that is free, its cluster bus port (10000 above) too."""
    for port in random.sample(CLUSTER_PORTS, len(CLUSTER_PORTS)):
        if port in taken:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port pair in {CLUSTER_PORTS}")


@dataclass
class ClusterServers:
    """A Redis Cluster on localhost: three masters with one replica each (``redis-cli --cluster
    create``), a short ``cluster-node-timeout`` so that a dead master's replica takes over in seconds."""

    workdir: Path
    node_timeout_ms: int = 1000
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, num_nodes: int = 6) -> ClusterServers:
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.skip("redis-cli is not installed")
        for _ in range(num_nodes):
            port = free_cluster_port(set(self.procs))
            argv = _server_args(self.workdir, port, None)
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            argv += ["--cluster-node-timeout", str(self.node_timeout_ms), "--dbfilename", f"dump-{port}.rdb"]
            self.procs[port] = _start(argv, port, self.workdir / f"node-{port}.log")
        nodes = [f"127.0.0.1:{port}" for port in self.procs]
        create = [cli, "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    @property
    def url(self) -> str:
        """The cluster form of the URL, naming two of the nodes (either finds the rest)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in list(self.procs)[:2])

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port)

    def live_ports(self) -> list[int]:
        return [port for port, proc in self.procs.items() if proc.poll() is None]

    def wait_ok(self, timeout_s: float = 30) -> None:
        """Until every live node says ``cluster_state:ok`` and agrees on three masters."""
        deadline = time.monotonic() + timeout_s
        while True:
            infos = [self.client(port).cluster("info") for port in self.live_ports()]
            if all(info["cluster_state"] == "ok" and int(info["cluster_size"]) == 3 for info in infos):
                if len({self.masters_seen_by(port) for port in self.live_ports()}) == 1:
                    return
            assert time.monotonic() < deadline, f"the cluster never became ok: {infos}"
            time.sleep(0.1)

    def serving(self) -> bool:
        """Whether every live node says ``cluster_state:ok`` (each slot has a master that answers)."""
        return all(self.client(port).cluster("info")["cluster_state"] == "ok" for port in self.live_ports())

    def masters_seen_by(self, port: int) -> frozenset[int]:
        """The ports of the masters (not failed) that node ``port`` knows."""
        nodes = self.client(port).cluster("nodes")
        return frozenset(
            int(addr.split("@")[0].rpartition(":")[2])
            for addr, node in nodes.items()
            if "master" in node["flags"] and "fail" not in node["flags"] and node["slots"]
        )

    def master_of(self, key: str) -> int:
        """The port of the master that holds ``key``'s slot now."""
        port = self.live_ports()[0]
        slot = int(self.client(port).cluster("keyslot", key))
        for row in self.client(port).execute_command("CLUSTER", "SLOTS"):
            if int(row[0]) <= slot <= int(row[1]):
                return int(row[2][1])
        raise AssertionError(f"no master holds slot {slot}")

    def kill(self, port: int) -> None:
        """SIGKILL one node (no shutdown: whatever was not yet replicated is lost)."""
        self.procs[port].kill()
        self.procs[port].wait()

    def logs(self, lines: int = 15) -> str:
        out = []
        for port in self.procs:
            tail = (self.workdir / f"node-{port}.log").read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- node {port} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        stop_all(list(self.procs.values()))
