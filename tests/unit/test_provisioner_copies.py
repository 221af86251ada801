"""Copies into a replica's working directory: limits, the state dir, links, holes, cancellation."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from services.provisioner import copies

BIG = copies.Limits(max_bytes=1 << 40, max_entries=1_000_000)


def _holes(path, size: int) -> None:
    with open(path, "wb") as fh:
        fh.truncate(size)


def _tree(root) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "run.sh").write_text("echo hi\n")
    os.chmod(root / "run.sh", 0o755)
    (root / "link").symlink_to("/etc/hostname")
    (root / "dirlink").symlink_to(root / "pkg")
    os.mkfifo(root / "pipe")


def test_a_tree_is_copied_with_modes_and_links_as_links_and_pipes_skipped(tmp_path) -> None:
    source, target = tmp_path / "src", tmp_path / "dst"
    _tree(source)
    skipped = copies.copy("workdir", str(source), str(target), copies.Budget(BIG))
    assert skipped == [str(source / "pipe")]
    assert (target / "pkg" / "mod.py").read_text() == "x = 1\n"
    assert os.stat(target / "run.sh").st_mode & 0o777 == 0o755
    assert os.readlink(target / "link") == "/etc/hostname"
    assert os.readlink(target / "dirlink") == str(source / "pkg")
    assert not (target / "pipe").exists()


def test_holes_stay_holes(tmp_path) -> None:
    source = tmp_path / "sparse.bin"
    with open(source, "wb") as fh:
        fh.write(b"head")
        fh.seek(64 << 20)
        fh.write(b"tail")
    target = tmp_path / "copy.bin"
    copies.copy("file mount /x", str(source), str(target), copies.Budget(BIG))
    assert target.read_bytes() == source.read_bytes()
    assert os.stat(target).st_blocks * 512 <= 4 << 20  # 64 MB apparent; only the chunks with data on disk


@pytest.mark.parametrize(
    ("limits", "setting"),
    [
        (copies.Limits(max_bytes=10, max_entries=100), "local_copy_max_mb"),
        (copies.Limits(max_bytes=1 << 30, max_entries=3), "local_copy_max_files"),
    ],
)
def test_a_tree_over_a_limit_is_refused_before_anything_is_written(tmp_path, limits, setting) -> None:
    source = tmp_path / "src"
    _tree(source)
    with pytest.raises(copies.TooLargeError) as info:
        copies.measure("workdir", str(source), copies.Budget(limits))
    assert info.value.label == "workdir"
    assert setting in info.value.reason
    assert f"REPLICAPLANE_PROVISIONER_{setting.upper()}" in info.value.reason
    # The copy enforces the same limits while it runs (a tree may grow after it was counted).
    with pytest.raises(copies.TooLargeError):
        copies.copy("workdir", str(source), str(tmp_path / "dst"), copies.Budget(limits))


def test_the_state_dir_is_never_a_source(tmp_path) -> None:
    state = tmp_path / "app" / ".state" / "provisioner"
    state.mkdir(parents=True)
    assert "contains the provisioner's state directory" in copies.overlap(str(tmp_path / "app"), str(state))
    assert "contains" in copies.overlap(str(tmp_path), str(state))
    assert "inside the provisioner's state directory" in copies.overlap(str(state / "local"), str(state))
    assert copies.overlap(str(tmp_path / "app" / ".state-other"), str(state)) == ""
    (tmp_path / "via-link").symlink_to(tmp_path / "app")
    assert copies.overlap(str(tmp_path / "via-link"), str(state)) != ""


def test_measuring_stops_at_its_deadline(tmp_path) -> None:
    source = tmp_path / "src"
    _tree(source)
    assert copies.measure("workdir", str(source), copies.Budget(BIG), deadline=time.monotonic() - 1) is False
    assert copies.measure("workdir", str(source), copies.Budget(BIG)) is True


async def test_a_cancelled_copy_stops_within_a_chunk_and_the_caller_does_not_wait(tmp_path) -> None:
    source = tmp_path / "huge.bin"
    _holes(source, 1 << 40)  # 1 TiB of holes: reading it takes minutes, writing it takes no disk
    budget = copies.Budget(copies.Limits(max_bytes=1 << 41, max_entries=10))
    stopped = threading.Event()

    def work() -> None:
        try:
            copies.copy("workdir", str(source), str(tmp_path / "out.bin"), budget)
        finally:
            stopped.set()

    task = asyncio.create_task(copies.in_thread(work, budget.cancel))
    while budget.bytes < 64 << 20:
        await asyncio.sleep(0.01)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stopped.is_set()  # the thread is done, so removing its files races with nothing
    assert time.monotonic() - started < 2
    assert budget.bytes < 1 << 40
