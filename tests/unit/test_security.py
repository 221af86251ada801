"""Token parsing and checking, and client token lookup (pure logic)."""

from __future__ import annotations

import json

import pytest

from services.common import errors, security

TOKEN = "a" * 16 + "-secret-value"


def test_token_file_lines_give_names_and_comments_are_skipped(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# ops\n\nalice:{TOKEN}\n{'b' * 20}\n")
    tokens = security.read_tokens("", str(path))
    assert tokens == {TOKEN: "alice", "b" * 20: "line4"}


def test_short_tokens_are_refused_without_echoing_them() -> None:
    with pytest.raises(errors.ValidationError) as err:
        security.read_tokens("short-one", "")
    assert "short-one" not in str(err.value)
    assert err.value.violations[0].field == "auth_token"


def test_unreadable_token_file_names_the_setting(tmp_path) -> None:
    with pytest.raises(errors.ValidationError) as err:
        security.read_tokens("", str(tmp_path / "missing"))
    assert err.value.violations[0].field == "auth_token_file"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"Bearer {TOKEN}", "token"),
        (f"bearer {TOKEN}", "token"),
        (TOKEN, None),
        (f"Bearer {TOKEN}x", None),
        (f"Basic {TOKEN}", None),
        ("Bearer ", None),
        ("", None),
    ],
)
def test_check_token(header: str, expected: str | None) -> None:
    assert security.check_token(header, {TOKEN: "token"}) == expected


def test_client_token_prefers_the_api_variable_then_files_then_the_controller_setting(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"alice:{TOKEN}\n")
    assert security.client_token({"REPLICAPLANE_API_TOKEN": "x" * 16}) == "x" * 16
    assert security.client_token({"REPLICAPLANE_API_TOKEN_FILE": str(path)}) == TOKEN
    assert security.client_token({"REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE": str(path)}) == TOKEN
    assert security.client_token({}) == ""


def test_tls_needs_all_three_files_and_names_each_missing_one(tmp_path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(errors.ValidationError) as err:
        security.Tls(cert_file=str(cert)).server_credentials("prober")
    assert [v.field for v in err.value.violations] == ["prober.tls_key_file", "prober.tls_ca_file"]
    assert not security.Tls().enabled


def test_client_token_falls_back_to_the_local_stack_only_for_its_own_controller(tmp_path, monkeypatch) -> None:
    state = tmp_path / ".state"
    state.mkdir()
    token_file = state / "api-token"
    token_file.write_text(f"{TOKEN}\n")
    (state / "stack.json").write_text(json.dumps({"controller": "127.0.0.1:50051", "token_file": str(token_file)}))
    monkeypatch.chdir(tmp_path)
    assert security.client_token({}, target="127.0.0.1:50051") == TOKEN
    # Never to another server, and never over what the environment says.
    assert security.client_token({}, target="10.0.0.1:50051") == ""
    assert security.client_token({"REPLICAPLANE_API_TOKEN": "x" * 16}, target="127.0.0.1:50051") == "x" * 16
    # A stack running on the user's own tokens records no token file.
    (state / "stack.json").write_text(json.dumps({"controller": "127.0.0.1:50051", "token_file": ""}))
    assert security.client_token({}, target="127.0.0.1:50051") == ""
    (state / "stack.json").write_text("{not json")
    assert security.client_token({}, target="127.0.0.1:50051") == ""
