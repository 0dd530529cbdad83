"""Tenants: who a request belongs to, by the API key that made it.

A gateway accepts several API keys (``--api-key`` repeated, ``CONVEYOR_API_KEY`` comma-separated,
``--api-key-file``). Each key is a tenant, known only by its id: an HMAC-SHA256 of the key under
the deployment's tenant secret (``CONVEYOR_TENANT_SECRET``; without one, the namespace), so every
gateway replica computes the same id and neither Redis nor a log ever holds a key. Whatever a
request leaves behind belongs to its tenant: a stream's journal is named by `Tenant.scope` of its
response id, so another tenant finds nothing under that id (a 404, no 409 for reusing the id, no
way to cut or adopt the stream); a stored object records `Tenant.id` as its owner and is served
only where `Tenant.may_read` says so.

With no key configured there is one anonymous tenant (id ``""``) whose scope is the id itself.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from gateway.http.errors import ApiError

# 128 bits of the HMAC: no two keys of a deployment share a tenant, and the id stays short in key names.
TENANT_ID_HEX = 32


@dataclass(frozen=True, slots=True)
class Tenant:
    """The owner of a request and of what it leaves in Redis (journal, stored response)."""

    id: str  # "" for the anonymous tenant (no API key configured)

    def scope(self, object_id: str) -> str:
        """The name under which this tenant's object ``object_id`` (a client-visible id) lives in
        Redis: another tenant's object of the same id is another name."""
        return f"{self.id}/{object_id}" if self.id else object_id

    def may_read(self, owner: str) -> bool:
        """Whether this tenant may read (or cut, or continue) an object whose recorded owner is ``owner``."""
        return hmac.compare_digest(owner.encode(), self.id.encode())


ANONYMOUS = Tenant("")


def tenant_id(secret: bytes, key: str) -> str:
    """The tenant id of API key ``key`` under the deployment's tenant ``secret``."""
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:TENANT_ID_HEX]


def read_key_file(path: str) -> list[str]:
    """The keys of an API key file (a mounted secret): one a line, blank lines and ``#`` comments ignored."""
    lines = Path(path).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def split_keys(values: Iterable[str | None]) -> list[str]:
    """Keys given as flags or comma-separated lists (``CONVEYOR_API_KEY``), blanks dropped."""
    return [key.strip() for value in values if value for key in value.split(",") if key.strip()]


class ApiKeys:
    """The gateway's API keys, held only as tenant ids: `tenant_of` authenticates a request."""

    def __init__(self, keys: Iterable[str], secret: str) -> None:
        self._secret = secret.encode()
        self._tenants = sorted({tenant_id(self._secret, key) for key in keys})

    @property
    def required(self) -> bool:
        return bool(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    def tenant_of(self, request: Request) -> Tenant:
        """The tenant whose key authorizes ``request`` (kept on ``request.state.tenant``); a 401
        for a missing or wrong key. `ANONYMOUS` when no key is configured."""
        if not self._tenants:
            tenant = ANONYMOUS
        else:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            candidate = tenant_id(self._secret, given)
            # Every id compared, in constant time each: how long this takes says nothing about the key.
            matches = [hmac.compare_digest(candidate, known) for known in self._tenants]
            if not given or not any(matches):
                raise ApiError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
            tenant = Tenant(candidate)
        request.state.tenant = tenant
        return tenant


def request_tenant(request: Request) -> Tenant:
    """The tenant `ApiKeys.tenant_of` found for ``request`` (call that first)."""
    tenant: Tenant = request.state.tenant
    return tenant
