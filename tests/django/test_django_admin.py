"""The admin pages over flowlock's tables, through Django's test client: the list with its
filters and search, an instance with its history inline, nothing editable, and the actions
(fire an event, force a state) with a request id per form, so a form sent twice applies once."""

from __future__ import annotations

import re
import uuid
from typing import Any

import dj_kit
import pytest

pytestmark = pytest.mark.usefixtures("django_project")

CHANGELIST = "/admin/flowlock/instance/"


@pytest.fixture
def client() -> Any:
    from django.test import Client

    c = Client()
    assert c.login(username=dj_kit.USER, password=dj_kit.PASSWORD)
    return c


@pytest.fixture
def prefix() -> str:
    """Ids of this test's own instances start with it."""
    return f"adm{uuid.uuid4().hex[:8]}-"


def _make(prefix: str) -> dict[str, str]:
    from flowlock.contrib.django import engine

    ids = {
        "a": f"{prefix}a",
        "b": f"{prefix}b",
        "c": f"{prefix}c",
        "t": f"{prefix}t",
    }
    eng = engine()
    for key in ("a", "b", "c"):
        eng.create("approval", instance_id=ids[key], data={"amount": 10})
    eng.create("tally", instance_id=ids["t"])
    eng.fire(ids["c"], "approve", actor="carol", payload={"note": "ok by me"})
    return ids


def _listed(html: str, prefix: str) -> set[str]:
    return set(re.findall(rf"({re.escape(prefix)}[a-z])</a>", html))


def test_list_filters_by_workflow_and_state_and_searches_by_id(client: Any, prefix: str) -> None:
    ids = _make(prefix)
    page = client.get(CHANGELIST, {"q": prefix})
    assert page.status_code == 200
    assert _listed(page.content.decode(), prefix) == set(ids.values())
    pending = client.get(CHANGELIST, {"q": prefix, "workflow": "approval", "state": "pending"})
    assert _listed(pending.content.decode(), prefix) == {ids["a"], ids["b"]}
    tally = client.get(CHANGELIST, {"q": prefix, "workflow": "tally"})
    assert _listed(tally.content.decode(), prefix) == {ids["t"]}
    exact = client.get(CHANGELIST, {"q": ids["c"]})
    assert _listed(exact.content.decode(), prefix) == {ids["c"]}
    # The filters offer the workflows and states found.
    html = page.content.decode()
    assert "workflow=tally" in html and "state=approved" in html


def test_an_instance_shows_its_history_inline_and_nothing_is_editable(
    client: Any, prefix: str
) -> None:
    ids = _make(prefix)
    page = client.get(f"{CHANGELIST}{ids['c']}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "carol" in html and "ok by me" in html and "approve" in html
    assert 'name="_save"' not in html  # read-only: no save button
    assert client.get(f"{CHANGELIST}add/").status_code == 403
    assert client.get(f"{CHANGELIST}{ids['c']}/delete/").status_code == 403
    # A POST to the change page writes nothing.
    assert client.post(f"{CHANGELIST}{ids['c']}/change/", {"state": "pending"}).status_code == 403
    from flowlock.contrib.django import engine

    assert engine().get(ids["c"]).state == "approved"


def _form(client: Any, action: str, ids: list[str]) -> str:
    """Open the action's form on `ids`; its request id."""
    page = client.post(CHANGELIST, {"action": action, "_selected_action": ids, "index": 0})
    assert page.status_code == 200, page.content[:500]
    html = page.content.decode()
    for iid in ids:
        assert iid in html
    found = re.search(r'name="request_id" value="(django-admin-[0-9a-f]+)"', html)
    assert found is not None, html
    return found.group(1)


def _submit(client: Any, action: str, ids: list[str], **fields: str) -> str:
    page = client.post(
        CHANGELIST,
        {"action": action, "_selected_action": ids, "apply": "yes", **fields},
        follow=True,
    )
    assert page.status_code == 200
    # The admin shows a message with its first letter capitalised.
    return str(page.content.decode()).replace("&#x27;", "'").lower()


def test_fire_action_applies_once_when_submitted_twice(client: Any, prefix: str) -> None:
    from flowlock.contrib.django import engine

    ids = _make(prefix)
    chosen = [ids["a"], ids["b"], ids["c"]]
    rid = _form(client, "fire_event", chosen)
    fields = {"event": "approve", "payload": '{"ticket": "OPS-1"}', "request_id": rid}
    first = _submit(client, "fire_event", chosen, **fields)
    assert "fire 'approve': 2 applied" in first, first
    assert "1 already done" in first  # c was approved already: a no-op
    second = _submit(client, "fire_event", chosen, **fields)  # the double click
    assert "fire 'approve': 0 applied" in second
    for key in ("a", "b"):
        history = engine().history(ids[key])
        assert [(h.event, h.actor, h.payload) for h in history] == [
            ("approve", dj_kit.USER, {"ticket": "OPS-1"})
        ]
        assert history[0].request_id == f"{rid}:{ids[key]}"
    # A new form is a new request: refused now, since the instances moved on.
    again = _submit(
        client, "fire_event", [ids["a"]], event="reject", payload="{}",
        request_id=_form(client, "fire_event", [ids["a"]]),
    )  # fmt: skip
    assert "1 refused" in again and "'reject' is not allowed" in again
    assert engine().get(ids["a"]).version == 2


def test_fire_action_refuses_a_bad_form(client: Any, prefix: str) -> None:
    from flowlock.contrib.django import engine

    ids = _make(prefix)
    rid = _form(client, "fire_event", [ids["a"]])
    page = _submit(client, "fire_event", [ids["a"]], event="approve", payload="[1]", request_id=rid)
    assert "the payload must be a json object" in page
    forged = _submit(
        client, "fire_event", [ids["a"]], event="approve", payload="{}", request_id="x"
    )
    assert "open the form again" in forged
    assert engine().get(ids["a"]).version == 1


def test_actions_need_the_operators_permission(prefix: str) -> None:
    from django.contrib.auth.models import Permission, User
    from django.test import Client

    from flowlock.contrib.django import engine

    ids = _make(prefix)
    name = f"viewer-{uuid.uuid4().hex[:6]}"
    viewer = User.objects.create_user(name, password="viewer-pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_instance"))
    c = Client()
    assert c.login(username=name, password="viewer-pw")
    page = c.get(CHANGELIST, {"q": prefix})
    assert page.status_code == 200 and ids["a"] in page.content.decode()
    assert "fire_event" not in page.content.decode()
    c.post(
        CHANGELIST,
        {"action": "fire_event", "_selected_action": [ids["a"]], "apply": "yes",
         "event": "approve", "payload": "{}", "request_id": "django-admin-0"},
    )  # fmt: skip
    assert engine().get(ids["a"]).version == 1
    assert Client().get(CHANGELIST).status_code == 302  # not logged in: to the login page


def test_force_action_moves_with_a_reason_once_when_submitted_twice(
    client: Any, prefix: str
) -> None:
    from flowlock.contrib.django import engine

    ids = _make(prefix)
    chosen = [ids["a"], ids["c"]]
    rid = _form(client, "force_state", chosen)
    page = client.post(CHANGELIST, {"action": "force_state", "_selected_action": chosen})
    assert '<option value="archived">' in page.content.decode()  # the workflow's states
    fields = {"state": "archived", "reason": "cleanup, ticket OPS-2", "request_id": rid}
    first = _submit(client, "force_state", chosen, **fields)
    assert "force 'archived': 2 applied" in first, first
    second = _submit(client, "force_state", chosen, **fields)  # the double click
    assert "force 'archived': 0 applied" in second and "2 already done" in second
    for iid in chosen:
        last = engine().history(iid)[-1]
        assert last.forced and last.to_state == "archived"
        assert (last.reason, last.actor) == ("cleanup, ticket OPS-2", dj_kit.USER)
        assert last.request_id == f"{rid}:{iid}"
        assert sum(h.forced for h in engine().history(iid)) == 1
    # The history inline shows the forced row with its reason.
    detail = client.get(f"{CHANGELIST}{ids['a']}/change/").content.decode()
    assert "flowlock:force" in detail and "cleanup, ticket OPS-2" in detail
    # A reason is required, and the state must be one the form offers; nothing moves.
    rid = _form(client, "force_state", [ids["b"]])
    blank = _submit(client, "force_state", [ids["b"]], state="archived", reason="", request_id=rid)
    assert "this field is required" in blank
    bogus = _submit(client, "force_state", [ids["b"]], state="nowhere", reason="x", request_id=rid)
    assert "select a valid choice" in bogus
    assert engine().get(ids["b"]).version == 1


def test_force_works_on_a_paused_instance_and_fire_is_refused(client: Any, prefix: str) -> None:
    from flowlock.contrib.django import engine

    ids = _make(prefix)
    engine().pause(ids["a"], reason="investigating", actor="ops")
    fire = _submit(
        client, "fire_event", [ids["a"]], event="approve", payload="{}",
        request_id=_form(client, "fire_event", [ids["a"]]),
    )  # fmt: skip
    assert "1 refused" in fire and "paused" in fire
    force = _submit(
        client, "force_state", [ids["a"]], state="rejected", reason="customer asked",
        request_id=_form(client, "force_state", [ids["a"]]),
    )  # fmt: skip
    assert "1 applied" in force
    inst = engine().get(ids["a"])
    assert (inst.state, inst.paused) == ("rejected", True)
    listed = client.get(CHANGELIST, {"q": prefix, "paused__exact": "1"}).content.decode()
    assert _listed(listed, prefix) == {ids["a"]}


def test_a_paused_workflow_shows_on_its_instances_and_on_a_page_of_its_own(
    client: Any, prefix: str
) -> None:
    from flowlock.contrib.django import engine

    iid = f"{prefix}e"
    engine().create("errand", instance_id=iid)
    engine().pause(workflow="errand", reason="supplier outage", actor="ops")
    try:
        listed = client.get(CHANGELIST, {"q": prefix}).content.decode()
        row = listed[listed.index(f"{iid}</a>") :].split("</tr>")[0]
        assert row.count('alt="True"') == 1  # workflow paused; the instance's own pause: no
        pauses = client.get("/admin/flowlock/workflowpause/").content.decode()
        assert "errand" in pauses and "supplier outage" in pauses
        assert client.get("/admin/flowlock/workflowpause/add/").status_code == 403
        fired = _submit(
            client, "fire_event", [iid], event="finish", payload="{}",
            request_id=_form(client, "fire_event", [iid]),
        )  # fmt: skip
        assert "1 refused" in fired and "paused" in fired
    finally:
        engine().resume(workflow="errand", actor="ops")
    assert "supplier outage" not in client.get("/admin/flowlock/workflowpause/").content.decode()
    assert engine().fire(iid, "finish").applied
