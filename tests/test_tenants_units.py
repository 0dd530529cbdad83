"""Tenants (`gateway.http.tenants`): keys from flags, the environment and a key file; a tenant id
that every replica computes alike and that is not the key; scoped ids; the ownership check."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.requests import Request

from gateway.http.errors import ApiError
from gateway.http.server import build_parser, configured_keys
from gateway.http.tenants import ANONYMOUS, ApiKeys, Tenant, read_key_file, request_tenant

pytestmark = pytest.mark.unit


def _request(key: str | None) -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers})


def test_keys_come_from_repeated_flags_the_environment_and_a_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# the team's keys\n\nsk-file-1\n  sk-file-2  \n# sk-retired\n")
    monkeypatch.setenv("CONVEYOR_API_KEY", "sk-env-1, sk-env-2,")
    args = build_parser().parse_args(["--api-key", "sk-flag-1", "--api-key", "sk-flag-2", "--api-key-file", str(key_file)])
    assert configured_keys(args) == ["sk-flag-1", "sk-flag-2", "sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2"]
    assert read_key_file(str(key_file)) == ["sk-file-1", "sk-file-2"]
    monkeypatch.delenv("CONVEYOR_API_KEY")
    assert configured_keys(build_parser().parse_args([])) == []


def test_each_key_is_a_tenant_whose_id_is_neither_the_key_nor_secret_free() -> None:
    keys = ApiKeys(["sk-a", "sk-b"], "deployment-secret")
    a, b = keys.tenant_of(_request("sk-a")), keys.tenant_of(_request("sk-b"))
    assert a != b and "sk-a" not in a.id and len(a.id) == 32
    assert ApiKeys(["sk-a"], "deployment-secret").tenant_of(_request("sk-a")) == a  # another replica, same id
    assert ApiKeys(["sk-a"], "another-secret").tenant_of(_request("sk-a")) != a  # the secret keys the hash
    request = _request("sk-b")
    keys.tenant_of(request)
    assert request_tenant(request) == b
    for wrong in ("sk-c", "", None, "sk-a sk-b"):
        with pytest.raises(ApiError) as info:
            keys.tenant_of(_request(wrong))
        assert info.value.status == 401


def test_no_key_is_one_anonymous_tenant_whose_ids_are_unscoped() -> None:
    keys = ApiKeys([], "ns")
    assert not keys.required and keys.tenant_of(_request(None)) is ANONYMOUS
    assert ANONYMOUS.scope("my-id") == "my-id"


def test_ids_and_objects_are_scoped_by_tenant() -> None:
    a, b = Tenant("a" * 32), Tenant("b" * 32)
    assert a.scope("req-1") != b.scope("req-1") and a.scope("req-1").endswith("/req-1")
    assert a.may_read(a.id) and not a.may_read(b.id) and not b.may_read(a.id)
    assert not ANONYMOUS.may_read(a.id) and not a.may_read(ANONYMOUS.id)
