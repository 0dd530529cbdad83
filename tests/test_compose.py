"""`docker compose up`, for real: the repository's compose file on a Docker engine.

Starts ``dockerd`` when none answers (installing docker.io and Compose v2 through
``infra/airgap.sh engine``; root only) and skips, saying why, only when no engine can run. Without
a registry the base images are Debian-built stand-ins and torch comes from a local index
(``infra/airgap.sh``). Then, with no variables set (the published port aside, when 8000 is
taken): ``up``, a chat completion through the openai client, scaling to two gateways and two
engines with requests completed through each, and ``down -v``. Times of the image build and of
``up`` to the first completion are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
AIRGAP = REPO / "infra" / "airgap.sh"
INDEX_PORT = 8765

pytestmark = [pytest.mark.stack, pytest.mark.slow]


def _run(*cmd: str, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def _answers(*cmd: str, timeout: float = 60) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _engine_or_skip() -> bool:
    """A Docker engine with Compose v2 answers (started here if need be: True then), or skip."""
    if os.environ.get("CONVEYOR_COMPOSE_TEST") == "0":
        pytest.skip("CONVEYOR_COMPOSE_TEST=0")
    if _answers("docker", "info") and _answers("docker", "compose", "version"):
        return False
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("no Docker engine answers, and starting one needs root and apt (docker.io)")
    try:
        _run("bash", str(AIRGAP), "engine", timeout=900)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"no Docker engine can run on this machine: {str(exc)[-1500:]}")
    return True


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Compose:
    """`docker compose` on this repository under a project name of its own."""

    def __init__(self, env: dict[str, str], port: int) -> None:
        self.env, self.port = env, port
        self.base_url = f"http://127.0.0.1:{port}"

    def __call__(self, *args: str, timeout: float = 600) -> str:
        return _run("docker", "compose", *args, env=self.env, timeout=timeout)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def compose() -> Iterator[Compose]:
    started_engine = _engine_or_skip()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "COMPOSE_", "MODEL_DIR", "TORCH_INDEX"))}
    env["COMPOSE_PROJECT_NAME"] = f"conveyor-test-{uuid.uuid4().hex[:8]}"
    port = 8000 if _free(8000) else _free_port()
    if port != 8000:
        env["CONVEYOR_PORT"] = str(port)
    c = Compose(env, port)
    built = airgapped = False
    try:
        # A registry that answers serves the base images; else local stand-ins and a torch index.
        airgapped = not _answers("docker", "pull", "-q", "nginx:stable", timeout=120)
        if airgapped:
            _run("bash", str(AIRGAP), "images", timeout=1800)
            env["TORCH_INDEX"] = _run("bash", str(AIRGAP), "index", str(INDEX_PORT), timeout=600).strip().splitlines()[-1]
            env["COMPOSE_FILE"] = "docker-compose.yml:infra/compose.airgap.yml"
        t0 = time.monotonic()
        c("build", "gateway", timeout=1800)  # every Conveyor service shares this one image
        built = True
        size = _run("docker", "image", "inspect", "-f", "{{.Size}}", "conveyor:latest").strip()
        print(f"\ncompose: image build {time.monotonic() - t0:.0f}s, conveyor:latest {int(size) / 1e6:.0f} MB")
        yield c
    finally:
        try:
            if built:
                print(c("logs", "--no-color", "--tail", "30", timeout=120)[-20000:])
                c("down", "-v", "--remove-orphans", "--timeout", "5", timeout=300)
        finally:
            # What this run started: the index (cheap to start again), and dockerd if none answered.
            what = ["index"] * airgapped + ["dockerd"] * started_engine
            if what:
                _run("bash", str(AIRGAP), "stop", *what, check=False)


def _complete(client: openai.OpenAI, text: str) -> tuple[str, str]:
    """One chat completion: its text and the gateway (replica address) that served it."""
    raw = client.chat.completions.with_raw_response.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": text}],
        max_tokens=4,
        temperature=0,
    )
    reply = raw.parse()
    assert reply.choices[0].message.content and reply.usage is not None and reply.usage.completion_tokens == 4
    return reply.choices[0].message.content, raw.headers.get("x-conveyor-gateway", "")


def _engines_that_stepped(base_url: str) -> set[str]:
    """Engines with steps run, from the deployment metrics any gateway exports."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = re.findall(r'^conveyor:engine_step_seconds_count\{[^}]*engine="([^"]+)"[^}]*\} ([0-9.e+]+)$', text, re.M)
    return {engine for engine, count in found if float(count) > 0}


def _until(what: str, check, timeout_s: float):  # type: ignore[no-untyped-def]
    """``check()``'s first truthy result, retrying (errors included) for up to ``timeout_s``."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (openai.APIError, httpx.HTTPError, IndexError) as exc:
            last = exc
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s (last error: {last!r})")


def test_up_serves_the_default_model_then_scales(compose: Compose) -> None:
    t0 = time.monotonic()
    compose("up", "-d", "--no-build", timeout=900)
    client = compose.client()
    text, _ = _until("a first chat completion", lambda: _complete(client, "Hello!"), 300)
    print(f"compose: up to first completion {time.monotonic() - t0:.0f}s")
    assert isinstance(text, str)

    t1 = time.monotonic()
    compose("up", "-d", "--no-build", "--scale", "gateway=2", "--scale", "scheduler=2", "--scale", "executor=2", timeout=900)
    gateways: set[str] = set()

    def through_each() -> bool:
        for i in range(4):
            gateways.add(_complete(client, f"request {i} of {len(gateways)}")[1])
        return len(gateways) >= 2 and len(_engines_that_stepped(compose.base_url)) >= 2

    _until("requests through two gateways and two engines", through_each, 300)
    print(f"compose: scaled to 2 gateways and 2 engines, served by each, in {time.monotonic() - t1:.0f}s")
