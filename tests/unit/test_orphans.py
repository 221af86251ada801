"""Orphans (which provisioner replicas no record refers to, which a reap covers), the controller
id kept outside the store, and the store's durability default."""

from __future__ import annotations

import os

import pytest

from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import errors
from services.controller import identity, orphans, server, store

ME = "ctl-me"


def _replica(name: str, owner: str = ME, state: int = prov_res.REPLICA_STATE_RUNNING) -> prov_res.ProvisionedReplica:
    service, rid, _ = name.split("-")
    r = prov_res.ProvisionedReplica(
        name=name, service=service, replica_id=int(rid), version=2, state=state, owner=owner, endpoint="http://x:1"
    )
    r.create_time.FromSeconds(1_700_000_000)
    return r


RECORDS = {"web": {1: "web-1-aaaa", 2: "web-2-aaaa"}, "api": {}}
REPLICAS = [
    _replica("web-1-aaaa"),  # referenced
    _replica("web-2-bbbb"),  # same service and id, another incarnation
    _replica("web-3-aaaa"),  # no such replica record
    _replica("lost-1-cccc"),  # no such service (its store was lost)
    _replica("old-1-dddd", owner=""),  # launched before owners existed
    _replica("theirs-1-eeee", owner="ctl-other"),
    _replica("gone-1-ffff", state=prov_res.REPLICA_STATE_TERMINATED),
]


def test_find_lists_every_unreferenced_replica_with_why_in_name_order() -> None:
    found = orphans.find(REPLICAS, records=RECORDS, controller_id=ME)
    assert [(o.replica_name, o.owned_by_this_controller, o.state, o.reason) for o in found] == [
        ("gone-1-ffff", True, "TERMINATED", 'no service "gone"'),
        ("lost-1-cccc", True, "RUNNING", 'no service "lost"'),
        ("old-1-dddd", True, "RUNNING", 'no service "old"'),
        ("theirs-1-eeee", False, "RUNNING", 'no service "theirs"'),
        ("web-2-bbbb", True, "RUNNING", 'replica 2 of service "web" is web-2-aaaa (another incarnation)'),
        ("web-3-aaaa", True, "RUNNING", 'service "web" has no replica 3'),
    ]
    lost = next(o for o in found if o.replica_name == "lost-1-cccc")
    assert (lost.service_name, lost.replica_id, lost.version, lost.owner) == ("lost", 1, 2, ME)
    assert lost.create_time.seconds == 1_700_000_000 and lost.endpoint == "http://x:1"


@pytest.mark.parametrize(
    ("owner", "all_owners", "names", "chosen", "skipped"),
    [
        # Default: this controller's own (and unowned) orphans, never another owner's.
        ("", False, [], ["gone-1-ffff", "lost-1-cccc", "old-1-dddd", "web-2-bbbb", "web-3-aaaa"], []),
        ("ctl-other", False, [], ["theirs-1-eeee"], []),
        ("nobody", False, [], [], []),
        ("", True, [], ["gone-1-ffff", "lost-1-cccc", "old-1-dddd", "theirs-1-eeee", "web-2-bbbb", "web-3-aaaa"], []),
        ("", False, ["lost-1-cccc", "lost-1-cccc"], ["lost-1-cccc"], []),
        (
            "",
            False,
            ["theirs-1-eeee", "web-1-aaaa", "nope-1-0000", "lost-1-cccc"],
            ["lost-1-cccc"],
            [
                ("theirs-1-eeee", "owned by controller ctl-other, not this one: pass its id as owner, or all_owners"),
                ("web-1-aaaa", "not an orphan: a record of this controller refers to it"),
                ("nope-1-0000", "no such replica at the provisioner"),
            ],
        ),
        ("", True, ["theirs-1-eeee"], ["theirs-1-eeee"], []),
    ],
)
def test_select_reaps_this_controllers_own_unless_told_otherwise(
    owner: str, all_owners: bool, names: list[str], chosen: list[str], skipped: list[tuple[str, str]]
) -> None:
    found = orphans.find(REPLICAS, records=RECORDS, controller_id=ME)
    known = {r.name for r in REPLICAS}
    got, skips = orphans.select(found, owner=owner, all_owners=all_owners, names=names, known=known)
    assert [o.replica_name for o in got] == chosen
    assert [(s.replica_name, s.reason) for s in skips] == skipped


@pytest.mark.parametrize(
    ("owner", "all_owners", "names", "fields"),
    [
        ("ctl-other", True, [], ["all_owners"]),
        ("x" * 129, False, [], ["owner"]),
        ("a\nb", False, [], ["owner"]),
        ("", False, ["ok-1", "", "has space", "y" * 254], ["replica_names[1]", "replica_names[2]", "replica_names[3]"]),
        ("", False, ["n"] * 1001, ["replica_names"]),
    ],
)
def test_bad_reap_requests_name_each_field(owner: str, all_owners: bool, names: list[str], fields: list[str]) -> None:
    with pytest.raises(errors.ValidationError) as info:
        orphans.check_reap(owner, all_owners, names)
    assert [v.field for v in info.value.violations] == fields


# ---- the controller id ---------------------------------------------------------------------


def test_a_new_controller_gets_an_id_in_a_file_that_outlives_its_store(tmp_path) -> None:
    state = str(tmp_path / "ctl")
    first = identity.resolve(state, setting="", stored="")
    assert len(first) == 32 and identity.read_file(state) == first
    assert oct(os.stat(os.path.join(state, identity.ID_FILE)).st_mode & 0o777) == "0o600"
    # The store is lost (a new one knows no id): the file keeps it.
    assert identity.resolve(state, setting="", stored="") == first
    # A store restored from another controller's backup does not change it either.
    assert identity.resolve(state, setting="", stored="someone-else") == first


def test_an_id_kept_only_in_the_store_moves_into_the_file(tmp_path) -> None:
    state = str(tmp_path / "ctl")
    assert identity.resolve(state, setting="", stored="from-store") == "from-store"
    assert identity.read_file(state) == "from-store"


def test_the_setting_wins_and_is_kept_in_the_file(tmp_path) -> None:
    state = str(tmp_path / "ctl")
    identity.write_file(state, "old-id")
    assert identity.resolve(state, setting="ctl-a", stored="old-id") == "ctl-a"
    assert identity.read_file(state) == "ctl-a"


def test_an_unusable_id_file_falls_back_to_the_store(tmp_path) -> None:
    state = tmp_path / "ctl"
    state.mkdir()
    (state / identity.ID_FILE).write_text("two words\n")
    assert identity.resolve(str(state), setting="", stored="from-store") == "from-store"
    assert identity.read_file(str(state)) == "from-store"


@pytest.mark.parametrize("bad", ["", "x" * 129, "has space", "tab\there"])
def test_malformed_ids_are_refused(bad: str) -> None:
    assert identity.problem(bad)


def test_bad_settings_stop_the_controller_naming_each() -> None:
    with pytest.raises(errors.ValidationError) as info:
        server.check(server.Settings(store_synchronous="OFF", controller_id="two words"))
    assert [v.field for v in info.value.violations] == ["controller.store_synchronous", "controller.controller_id"]
    server.check(server.Settings(store_synchronous="normal", controller_id="ctl-1"))


def test_the_store_keeps_a_second_copy_of_the_id(tmp_path) -> None:
    with store.Store(str(tmp_path / "state.db")) as db:
        assert db.stored_controller_id() == ""
        db.set_controller_id("ctl-1")
        assert db.stored_controller_id() == "ctl-1" == db.controller_id()


# ---- durability ----------------------------------------------------------------------------


def test_the_store_fsyncs_every_commit_by_default(tmp_path) -> None:
    with store.Store(str(tmp_path / "state.db")) as db:
        assert db._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    with store.Store(str(tmp_path / "other.db"), synchronous="NORMAL") as db:
        assert db._db.execute("PRAGMA synchronous").fetchone()[0] == 1
    assert server.Settings().store_synchronous == "FULL"
