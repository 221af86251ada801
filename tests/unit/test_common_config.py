"""Settings loading: defaults < config file < environment < overrides; bad values are named."""

from __future__ import annotations

import dataclasses

import pytest

from services.common import config, errors


@dataclasses.dataclass(frozen=True)
class Demo:
    """Settings of a made-up service."""

    listen_addr: str = "127.0.0.1:1"
    workers: int = 2
    ratio: float = 0.5
    verbose: bool = False
    peers: tuple[str, ...] = ()
    token_file: str | None = None


def write_config(tmp_path, text: str) -> dict[str, str]:
    path = tmp_path / "replicaplane.yaml"
    path.write_text(text)
    return {config.CONFIG_FILE_ENV: str(path)}


def test_env_names_follow_the_section_and_field() -> None:
    assert config.env_name("controller", "listen_addr") == "REPLICAPLANE_CONTROLLER_LISTEN_ADDR"
    assert config.env_name("prober", "port_file") == "REPLICAPLANE_PROBER_PORT_FILE"


def test_defaults_apply_when_nothing_is_set() -> None:
    assert config.load(Demo, "demo", environ={}) == Demo()


def test_file_overrides_defaults_and_only_its_section_counts(tmp_path) -> None:
    env = write_config(tmp_path, "demo:\n  workers: 8\n  peers: [a:1, b:2]\nother:\n  workers: 99\n")
    settings = config.load(Demo, "demo", environ=env)
    assert settings.workers == 8
    assert settings.peers == ("a:1", "b:2")
    assert settings.listen_addr == "127.0.0.1:1"


def test_env_overrides_file_and_overrides_win_over_env(tmp_path) -> None:
    env = write_config(tmp_path, "demo:\n  workers: 8\n  ratio: 0.25\n")
    env |= {"REPLICAPLANE_DEMO_WORKERS": "16", "REPLICAPLANE_DEMO_LISTEN_ADDR": "0.0.0.0:9"}
    settings = config.load(Demo, "demo", environ=env)
    assert (settings.workers, settings.ratio, settings.listen_addr) == (16, 0.25, "0.0.0.0:9")
    assert config.load(Demo, "demo", environ=env, workers=3).workers == 3


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("Yes", True), ("on", True), ("0", False), ("off", False)],
)
def test_booleans_accept_the_usual_spellings(raw: str, expected: bool) -> None:
    assert config.load(Demo, "demo", environ={"REPLICAPLANE_DEMO_VERBOSE": raw}).verbose is expected


def test_lists_come_from_comma_separated_env_values() -> None:
    settings = config.load(Demo, "demo", environ={"REPLICAPLANE_DEMO_PEERS": "a:1, b:2,"})
    assert settings.peers == ("a:1", "b:2")


def test_optional_values_are_none_when_empty() -> None:
    assert config.load(Demo, "demo", environ={"REPLICAPLANE_DEMO_TOKEN_FILE": ""}).token_file is None
    assert config.load(Demo, "demo", environ={"REPLICAPLANE_DEMO_TOKEN_FILE": "/t"}).token_file == "/t"


def test_every_bad_value_is_reported_with_its_field_and_source(tmp_path) -> None:
    env = write_config(tmp_path, "demo:\n  ratio: lots\n  colour: blue\n")
    env |= {"REPLICAPLANE_DEMO_WORKERS": "many", "REPLICAPLANE_DEMO_VERBOSE": "perhaps"}
    with pytest.raises(errors.ValidationError) as caught:
        config.load(Demo, "demo", environ=env)
    by_field = {v.field: v.description for v in caught.value.violations}
    assert set(by_field) == {"demo.workers", "demo.verbose", "demo.ratio", "demo.colour"}
    assert "REPLICAPLANE_DEMO_WORKERS" in by_field["demo.workers"]
    assert "expected int" in by_field["demo.workers"]
    assert "expected a boolean" in by_field["demo.verbose"]
    assert "replicaplane.yaml:demo.ratio" in by_field["demo.ratio"]
    assert by_field["demo.colour"] == "unknown setting"
    assert "demo settings" in str(caught.value)


def test_unset_environment_variables_leave_file_values(tmp_path) -> None:
    env = write_config(tmp_path, "demo:\n  listen_addr: 10.0.0.1:5\n")
    env["REPLICAPLANE_OTHER_LISTEN_ADDR"] = "ignored:1"
    assert config.load(Demo, "demo", environ=env).listen_addr == "10.0.0.1:5"


def test_settings_are_frozen() -> None:
    settings = config.load(Demo, "demo", environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.workers = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (None, "No such file or directory"),
        ("demo: [1,\n", "not valid YAML (line 2)"),
        ("- a\n- b\n", "must be a mapping of sections"),
        ("demo: 3\n", "must be a mapping of settings"),
    ],
)
def test_a_config_file_that_cannot_be_used_names_the_setting(tmp_path, text: str | None, why: str) -> None:
    env = write_config(tmp_path, text) if text is not None else {config.CONFIG_FILE_ENV: str(tmp_path / "none.yaml")}
    with pytest.raises(errors.ValidationError) as caught:
        config.load(Demo, "demo", environ=env)
    assert "REPLICAPLANE_CONFIG" in str(caught.value) and why in str(caught.value)
    assert "[1," not in str(caught.value)  # the file's text is not quoted: it may hold a secret
