"""Client-side reading of a spec file: relative `workdir` and `file_mounts` sources, as sky resolves them."""

from __future__ import annotations

import os

import pytest
import yaml

from services.common import specfile


@pytest.fixture
def layout(tmp_path):
    """A SkyPilot-like checkout: the YAML in examples/serve/app/, run from the root."""
    root = tmp_path / "repo"
    app = root / "examples" / "serve" / "app"
    app.mkdir(parents=True)
    (app / "server.py").write_text("print('hi')\n")
    return root, app


def test_a_relative_workdir_is_resolved_against_the_current_directory(layout) -> None:
    root, app = layout
    text = "# serve it\nworkdir: examples/serve/app  # the app\nrun: python3 server.py\n"
    resolved = specfile.resolve_paths(text, cwd=str(root), yaml_dir=str(app))
    assert resolved.text == f'# serve it\nworkdir: "{app}"\nrun: python3 server.py\n'
    assert resolved.notes == ()


def test_a_workdir_only_next_to_the_yaml_is_taken_from_there_with_a_note(layout, tmp_path) -> None:
    _, app = layout
    (app / "src").mkdir()
    resolved = specfile.resolve_paths("workdir: src\nrun: x\n", cwd=str(tmp_path), yaml_dir=str(app))
    assert yaml.safe_load(resolved.text)["workdir"] == str(app / "src")
    assert len(resolved.notes) == 1
    assert "not in the current directory" in resolved.notes[0]
    assert str(app / "src") in resolved.notes[0]


def test_when_both_exist_the_current_directory_wins_and_a_note_names_both(layout) -> None:
    root, app = layout
    (root / "src").mkdir()
    (app / "src").mkdir()
    resolved = specfile.resolve_paths("workdir: src\nrun: x\n", cwd=str(root), yaml_dir=str(app))
    assert yaml.safe_load(resolved.text)["workdir"] == str(root / "src")
    assert len(resolved.notes) == 1
    assert str(root / "src") in resolved.notes[0]
    assert str(app / "src") in resolved.notes[0]


def test_a_workdir_found_nowhere_is_an_error_naming_every_path_tried(layout, tmp_path) -> None:
    root, app = layout
    with pytest.raises(specfile.PathError) as info:
        specfile.resolve_paths("workdir: examples/serve/gone\nrun: x\n", cwd=str(root), yaml_dir=str(app))
    message = str(info.value)
    assert str(root / "examples" / "serve" / "gone") in message
    assert str(app / "examples" / "serve" / "gone") in message
    # In the YAML's own directory there is only one place to look.
    with pytest.raises(specfile.PathError) as info:
        specfile.resolve_paths("workdir: gone\n", cwd=str(app), yaml_dir=str(app))
    assert str(info.value) == f"workdir 'gone': no such path; tried {app / 'gone'}"


def test_relative_file_mount_sources_follow_the_same_rule_keeping_comments(layout) -> None:
    root, app = layout
    (root / "data").mkdir()
    (root / "data" / "a.txt").write_text("a")
    text = (
        "run: x\n"
        "file_mounts:\n"
        "  /data: data  # inputs\n"
        "  ~/a.txt: 'data/a.txt'\n"
        "  /remote: s3://bucket/x\n"
        "  /abs: /etc/hostname\n"
    )
    resolved = specfile.resolve_paths(text, cwd=str(root), yaml_dir=str(app))
    assert resolved.text == (
        "run: x\n"
        "file_mounts:\n"
        f'  /data: "{root / "data"}"  # inputs\n'
        f'  ~/a.txt: "{root / "data" / "a.txt"}"\n'
        "  /remote: s3://bucket/x\n"
        "  /abs: /etc/hostname\n"
    )


def test_a_layout_that_cannot_be_edited_in_place_is_dumped_with_the_same_meaning(layout) -> None:
    root, app = layout
    text = "file_mounts: {/data: examples/serve/app}\nrun: x\n"
    resolved = specfile.resolve_paths(text, cwd=str(root), yaml_dir=str(app))
    assert yaml.safe_load(resolved.text) == {"file_mounts": {"/data": str(app)}, "run": "x"}


@pytest.mark.parametrize(
    "text",
    [
        "name: x\nrun: true\n",
        "name: x\nworkdir: /abs/dir\n",
        "name: x\nworkdir: ~/dir\n",
        "name: x\nworkdir: $APP_DIR\nenvs:\n  APP_DIR: /srv/app\n",
        "file_mounts:\n  /x: gs://bucket\n  /y: {source: s3://b, mode: MOUNT}\n",
        "- not a mapping\n",
    ],
)
def test_absolute_missing_templated_and_remote_paths_are_left_alone(text: str, tmp_path) -> None:
    assert specfile.resolve_paths(text, cwd=str(tmp_path), yaml_dir="/elsewhere") == specfile.Resolved(text)


def test_load_resolves_against_the_process_directory(layout, monkeypatch) -> None:
    root, app = layout
    path = app / "task.yaml"
    path.write_text("workdir: examples/serve/app\nrun: python3 server.py\n")
    monkeypatch.chdir(root)
    assert yaml.safe_load(specfile.read_spec(str(path)))["workdir"] == str(app)
    monkeypatch.chdir(app)
    with pytest.raises(specfile.PathError):
        specfile.read_spec(os.path.join("task.yaml"))


def test_replicactl_up_names_the_paths_it_tried_in_one_line(layout, tmp_path, monkeypatch, capsys) -> None:
    import io

    from services.cli import main

    root, app = layout
    path = app / "task.yaml"
    path.write_text("service:\n  replicas: 1\nworkdir: examples/serve/nope\nrun: x\n")
    monkeypatch.chdir(root)
    out, err = io.StringIO(), io.StringIO()
    code = main.run(["--controller", "127.0.0.1:1", "up", str(path)], out=out, err=err)
    assert code == main.BAD_INPUT
    assert err.getvalue() == (
        f"error: workdir 'examples/serve/nope': no such path; tried {root}/examples/serve/nope (current directory)"
        f" and {app}/examples/serve/nope (next to the YAML)\n"
    )
