"""The console at /ui, in-process (httpx on the ASGI app, the memory store): every page, the
login and its cookies, and every refusal (no session, no or a wrong CSRF token, another origin,
a scope too small), each checked to change nothing. The same pages in a real browser against a
real `flowlock serve` are in tests/service_proc/test_console_browser.py."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest

from flowlock.service.console.session import Keys
from flowlock.service.settings import parse_tokens
from service.console_kit import FORM, OPS, TOKENS, VIEWER, WRITER, console, csrf_of, log_in
from service.kit import Service

PAGES = [
    "/ui/",
    "/ui/?workflow=approval&state=pending",
    "/ui/instances/a-1",
    "/ui/workflows",
    "/ui/workflows/approval",
    "/ui/monitor",
    "/ui/monitor/panel",
]


@pytest.fixture
async def svc() -> AsyncIterator[Service]:
    async with console() as running:
        engine = running.engine
        for n in range(1, 56):
            await engine.create("approval", instance_id=f"a-{n}", data={"n": n})
        await engine.fire("a-2", "approve", actor="ann")
        await engine.create("countersign", instance_id="c-1")
        yield running


async def _state(svc: Service, iid: str) -> tuple[str, int]:
    inst = await svc.engine.get(iid)
    return inst.state, inst.version


@pytest.mark.parametrize("path", PAGES)
async def test_every_page_redirects_to_login_without_a_session(svc: Service, path: str) -> None:
    got = await svc.client.get(path)
    assert got.status_code == 303, got.text
    assert got.headers["location"].startswith("/ui/login?next=")
    assert "a-1" not in got.text and "approval" not in got.text
    if path == "/ui/monitor/panel":
        got = await svc.client.get(path, headers={"hx-request": "true"})
        # htmx polls this one: 401, and HX-Redirect sends the whole page to the login form.
        assert got.status_code == 401, got.text
        assert got.headers["hx-redirect"].startswith("/ui/login?next=")


async def test_a_forged_or_foreign_session_is_no_session(svc: Service) -> None:
    keys = Keys(parse_tokens("ops:another-secret-0123456789:admin"))
    foreign, _ = keys.issue("ops", "admin")
    for cookie in (foreign, "e30.AAAA", "garbage", foreign.replace(".", "x.", 1)):
        svc.client.cookies.set("flowlock_session", cookie, path="/ui")
        got = await svc.client.get("/ui/")
        assert got.status_code == 303, (cookie, got.text)
        assert got.headers["location"].startswith("/ui/login")


async def test_an_expired_session_is_no_session(svc: Service) -> None:
    keys = Keys(parse_tokens(TOKENS))
    old, _ = keys.issue("ops", "admin", seconds=-1)
    svc.client.cookies.set("flowlock_session", old, path="/ui")
    got = await svc.client.get("/ui/")
    assert got.status_code == 303


async def test_every_worker_accepts_a_session_another_made_and_a_rotated_token_ends_it() -> None:
    """The key is derived from the tokens: the same tokens agree, a changed one refuses."""
    async with console() as first, console() as second:
        await log_in(first.client, OPS)
        cookie = first.client.cookies["flowlock_session"]
        second.client.cookies.set("flowlock_session", cookie, path="/ui")
        assert (await second.client.get("/ui/")).status_code == 200
    rotated = TOKENS.replace(OPS, OPS[::-1])
    async with console(rotated) as third:
        third.client.cookies.set("flowlock_session", cookie, path="/ui")
        assert (await third.client.get("/ui/")).status_code == 303


@pytest.mark.parametrize("path", ["/ui/static/console.css", "/ui/static/htmx.min.js"])
async def test_static_files_need_no_session(svc: Service, path: str) -> None:
    got = await svc.client.get(path)
    assert got.status_code == 200
    assert len(got.content) > 1000


async def test_htmx_is_vendored_with_its_license() -> None:
    async with console(None) as svc:
        got = await svc.client.get("/ui/static/htmx.min.js")
        assert got.text.startswith("/*! htmx.org 2.")
        assert "Zero-Clause BSD" in got.text.splitlines()[0]
        lic = await svc.client.get("/ui/static/htmx.LICENSE")
        assert "Zero-Clause BSD" in lic.text


async def test_login_sets_a_strict_http_only_cookie_on_ui_and_every_page_answers(
    svc: Service,
) -> None:
    form = await svc.client.get("/ui/login")
    done = await svc.client.post(
        "/ui/login", data={"csrf": csrf_of(form.text), "secret": OPS, "next": "/ui/workflows"}
    )
    assert done.status_code == 303 and done.headers["location"] == "/ui/workflows"
    cookie = next(c for c in done.headers.get_list("set-cookie") if "flowlock_session=" in c)
    attrs = {a.strip().lower() for a in cookie.split(";")}
    assert {"httponly", "path=/ui", "samesite=strict"} <= attrs
    assert "secure" not in attrs  # plain http here; https below
    for path in PAGES:
        got = await svc.client.get(path)
        assert got.status_code == 200, (path, got.text)
        assert got.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in got.headers["content-security-policy"]
        assert got.headers["cache-control"] == "no-store"


async def test_the_cookie_is_secure_over_https() -> None:
    async with console(base_url="https://localhost") as svc:
        form = await svc.client.get("/ui/login")
        done = await svc.client.post("/ui/login", data={"csrf": csrf_of(form.text), "secret": OPS})
        cookie = next(c for c in done.headers.get_list("set-cookie") if "flowlock_session=" in c)
        assert "secure" in {a.strip().lower() for a in cookie.split(";")}


async def test_a_wrong_token_is_refused(svc: Service) -> None:
    page = (await svc.client.get("/ui/login")).text
    for secret in (OPS + "x", OPS[:-1], "", "not-a-token-at-all-0000"):
        # Each answer is a new form with a CSRF token of its own.
        got = await svc.client.post("/ui/login", data={"csrf": csrf_of(page), "secret": secret})
        page = got.text
        assert got.status_code == 401, got.text
        assert "not valid" in got.text
        assert "flowlock_session" not in got.headers.get("set-cookie", "")


async def test_login_needs_its_form_csrf_token_and_the_same_origin(svc: Service) -> None:
    form = await svc.client.get("/ui/login")
    token = csrf_of(form.text)
    no_csrf = await svc.client.post("/ui/login", data={"secret": OPS})
    assert no_csrf.status_code == 403
    other = await svc.client.post(
        "/ui/login", data={"csrf": token, "secret": OPS}, headers={"origin": "http://evil.test"}
    )
    assert other.status_code == 403
    svc.client.cookies.clear()
    no_cookie = await svc.client.post("/ui/login", data={"csrf": token, "secret": OPS})
    assert no_cookie.status_code == 403
    assert "flowlock_session" not in no_cookie.headers.get("set-cookie", "")


async def test_next_never_leaves_the_console(svc: Service) -> None:
    for target in ("https://evil.test/", "//evil.test/ui/", "/instances"):
        form = await svc.client.get("/ui/login")
        done = await svc.client.post(
            "/ui/login", data={"csrf": csrf_of(form.text), "secret": OPS, "next": target}
        )
        assert done.headers["location"] == "/ui/", target


async def test_instances_filter_and_keyset_pages(svc: Service) -> None:
    await log_in(svc.client, OPS)
    first = await svc.client.get("/ui/", params={"workflow": "approval"})
    assert '<strong data-testid="total">55</strong>' in first.text
    ids = re.findall(r'href="/ui/instances/(a-\d+)"', first.text)
    assert len(ids) == 50
    nxt = re.search(r'rel="next" href="([^"]+)"', first.text)
    assert nxt is not None
    second = await svc.client.get(nxt.group(1).replace("&amp;", "&"))
    more = re.findall(r'href="/ui/instances/(a-\d+)"', second.text)
    assert len(more) == 5 and not set(more) & set(ids)
    assert 'rel="next"' not in second.text
    later = await svc.client.get("/ui/", params={"updated_after": "2999-01-01T00:00"})
    assert '<strong data-testid="total">0</strong>' in later.text
    assert "No instance matches these filters." in later.text
    earlier = await svc.client.get("/ui/", params={"updated_before": "2999-01-01T00:00+02:00"})
    assert '<strong data-testid="total">56</strong>' in earlier.text
    approved = await svc.client.get("/ui/", params={"workflow": "approval", "state": "approved"})
    assert re.findall(r'href="/ui/instances/([^"]+)"', approved.text) == ["a-2"]


async def test_a_bad_filter_says_what_is_wrong_and_keeps_the_form(svc: Service) -> None:
    await log_in(svc.client, OPS)
    got = await svc.client.get("/ui/", params={"updated_before": "yesterday"})
    assert got.status_code == 422
    assert "is not a date and time" in got.text
    assert 'name="updated_before"' in got.text


async def test_the_instance_page_shows_diagram_data_and_history(svc: Service) -> None:
    await log_in(svc.client, OPS)
    got = await svc.client.get("/ui/instances/a-2")
    assert got.status_code == 200
    assert re.search(r'<g class="fl-state fl-current fl-final" data-state="approved">', got.text)
    assert "&#34;n&#34;: 2" in got.text
    assert 'data-kind="transition"' in got.text and "by <strong>ann</strong>" in got.text
    missing = await svc.client.get("/ui/instances/nope")
    assert missing.status_code == 404


async def test_the_workflow_page_counts_per_state(svc: Service) -> None:
    await log_in(svc.client, OPS)
    got = await svc.client.get("/ui/workflows/approval")
    counts = dict(re.findall(r'state=(\w+)">(\d+)</a>', got.text))
    assert counts == {"pending": "54", "approved": "1", "rejected": "0"}
    assert (await svc.client.get("/ui/workflows/nope")).status_code == 404


async def test_the_monitor_panel_is_polled_by_htmx(svc: Service) -> None:
    await log_in(svc.client, OPS)
    page = await svc.client.get("/ui/monitor")
    assert 'hx-get="/ui/monitor/panel"' in page.text and 'hx-trigger="every 2s"' in page.text
    panel = await svc.client.get("/ui/monitor/panel", headers={"hx-request": "true"})
    assert panel.text.lstrip().startswith('<div id="monitor-panel"')
    assert "<html" not in panel.text


@pytest.mark.parametrize("action", ["force", "pause", "resume"])
async def test_a_post_without_csrf_is_refused_and_changes_nothing(
    svc: Service, action: str
) -> None:
    await log_in(svc.client, OPS)
    before = await _state(svc, "a-1")
    body = {"target": "instance", "id": "a-1", "state": "rejected", "reason": "r",
            "confirmed": "yes", "expected_version": "1"}  # fmt: skip
    got = await svc.client.post(f"/ui/actions/{action}", data=body)
    assert got.status_code == 403, got.text
    wrong = await svc.client.post(f"/ui/actions/{action}", data={**body, "csrf": "x" * 43})
    assert wrong.status_code == 403
    assert await _state(svc, "a-1") == before


async def test_a_csrf_token_is_good_for_its_own_session_only(svc: Service) -> None:
    mine = await log_in(svc.client, OPS)
    async with console() as other:
        theirs = await log_in(other.client, OPS)
    assert mine != theirs
    before = await _state(svc, "a-1")
    got = await svc.client.post(
        "/ui/actions/force",
        data={"csrf": theirs, "target": "instance", "id": "a-1", "state": "rejected",
              "reason": "r", "confirmed": "yes", "expected_version": "1"},
    )  # fmt: skip
    assert got.status_code == 403
    assert await _state(svc, "a-1") == before


async def test_a_post_from_another_origin_is_refused(svc: Service) -> None:
    csrf = await log_in(svc.client, OPS)
    got = await svc.client.post(
        "/ui/actions/pause",
        data={"csrf": csrf, "target": "instance", "id": "a-1", "reason": "r"},
        headers={"origin": "http://evil.test"},
    )
    assert got.status_code == 403


async def test_a_post_without_a_session_is_401(svc: Service) -> None:
    got = await svc.client.post(
        "/ui/actions/pause", data={"target": "instance", "id": "a-1", "reason": "r"}
    )
    assert got.status_code == 401
    assert got.headers["hx-redirect"].startswith("/ui/login")


@pytest.mark.parametrize("secret", [VIEWER, WRITER], ids=["read", "write"])
async def test_repairs_need_the_admin_scope(svc: Service, secret: str) -> None:
    csrf = await log_in(svc.client, secret)
    page = await svc.client.get("/ui/instances/a-1")
    assert 'action="/ui/actions/force"' not in page.text
    before = await _state(svc, "a-1")
    for action in ("force", "pause"):
        got = await svc.client.post(
            f"/ui/actions/{action}",
            data={"csrf": csrf, "target": "instance", "id": "a-1", "state": "rejected",
                  "reason": "r", "confirmed": "yes", "expected_version": "1"},
        )  # fmt: skip
        assert got.status_code == 403, got.text
        assert "admin scope" in got.text
    assert await _state(svc, "a-1") == before


async def test_logout_ends_the_session_in_the_browser(svc: Service) -> None:
    csrf = await log_in(svc.client, OPS)
    refused = await svc.client.post("/ui/logout", data={})
    assert refused.status_code == 403
    done = await svc.client.post("/ui/logout", data={"csrf": csrf})
    assert done.status_code == 303 and done.headers["location"] == "/ui/login"
    assert (await svc.client.get("/ui/")).status_code == 303


async def test_an_open_console_needs_no_login_but_still_checks_csrf() -> None:
    async with console(None) as svc:
        await svc.engine.create("approval", instance_id="o-1")
        page = await svc.client.get("/ui/")
        assert page.status_code == 200
        assert "open console" in page.text
        assert "flowlock_session=" in page.headers["set-cookie"]
        assert (await svc.client.get("/ui/login")).status_code == 303
        refused = await svc.client.post(
            "/ui/actions/pause", data={"target": "instance", "id": "o-1", "reason": "r"}
        )
        assert refused.status_code == 403
        inst = await svc.client.get("/ui/instances/o-1")
        fresh = httpx.AsyncClient(transport=svc.client._transport, base_url="http://127.0.0.1")
        async with fresh:
            # A CSRF token from another browser's session does not fit this one's.
            got = await fresh.post(
                "/ui/actions/pause",
                data={"csrf": csrf_of(inst.text), "target": "instance", "id": "o-1",
                      "reason": "r", "confirmed": "yes"},
            )  # fmt: skip
            assert got.status_code == 403
        assert (await svc.engine.get("o-1")).version == 1


async def test_console_routes_are_not_in_the_openapi_document(svc: Service) -> None:
    schema = (
        await svc.client.get("/openapi.json", headers={"authorization": f"Bearer {OPS}"})
    ).json()
    assert not [p for p in schema["paths"] if p.startswith("/ui")]


async def test_the_confirmation_page_comes_first_and_a_non_form_body_is_refused(
    svc: Service,
) -> None:
    csrf = await log_in(svc.client, OPS)
    confirm = await svc.client.post(
        "/ui/actions/force",
        data={"csrf": csrf, "target": "instance", "id": "a-1", "state": "rejected", "reason": "x"},
    )
    assert confirm.status_code == 200
    assert 'data-testid="confirm"' in confirm.text
    assert 'name="confirmed" value="yes"' in confirm.text
    assert 'name="expected_version" value="1"' in confirm.text
    assert await _state(svc, "a-1") == ("pending", 1)
    bad_state = await svc.client.post(
        "/ui/actions/force",
        data={"csrf": csrf, "target": "instance", "id": "a-1", "state": "nope", "reason": "x"},
    )
    assert bad_state.status_code == 422 and "is not a state of workflow" in bad_state.text
    no_reason = await svc.client.post(
        "/ui/actions/pause", data={"csrf": csrf, "target": "instance", "id": "a-1", "reason": " "}
    )
    assert no_reason.status_code == 422 and "needs a reason" in no_reason.text
    as_json = await svc.client.post("/ui/actions/pause", json={"csrf": csrf}, headers={})
    assert as_json.status_code == 403
    assert FORM["content-type"] not in as_json.request.headers.get("content-type", "")


async def _confirmed(svc: Service, csrf: str, action: str, **fields: str) -> httpx.Response:
    """The action's confirmation page, then its Confirm post (the form the page carries)."""
    confirm = await svc.client.post(f"/ui/actions/{action}", data={"csrf": csrf, **fields})
    assert confirm.status_code == 200, confirm.text
    hidden = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', confirm.text))
    return await svc.client.post(f"/ui/actions/{action}", data=hidden)


async def test_force_confirmed_writes_one_forced_row_and_a_double_click_applies_once(
    svc: Service,
) -> None:
    csrf = await log_in(svc.client, OPS)
    fields = {"target": "instance", "id": "a-7", "state": "approved", "reason": "paid offline"}
    confirm = await svc.client.post("/ui/actions/force", data={"csrf": csrf, **fields})
    hidden = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', confirm.text))
    first = await svc.client.post("/ui/actions/force", data=hidden)
    again = await svc.client.post("/ui/actions/force", data=hidden)  # the same form, twice
    assert first.status_code == again.status_code == 303, again.text
    assert first.headers["location"] == "/ui/instances/a-7?done=forced"
    history = await svc.engine.history("a-7")
    assert [(e.kind, e.actor, e.reason, e.to_state) for e in history] == [
        ("forced", "ops", "paid offline", "approved")
    ]
    page = await svc.client.get("/ui/instances/a-7?done=forced")
    assert 'data-kind="forced"' in page.text and "paid offline" in page.text
    assert "the instance was forced" in page.text


async def test_a_force_confirmed_on_a_version_since_left_is_refused(svc: Service) -> None:
    csrf = await log_in(svc.client, OPS)
    fields = {"target": "instance", "id": "a-8", "state": "rejected", "reason": "stuck"}
    confirm = await svc.client.post("/ui/actions/force", data={"csrf": csrf, **fields})
    hidden = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', confirm.text))
    await svc.engine.fire("a-8", "approve", actor="bob")  # moves while the operator reads
    refused = await svc.client.post("/ui/actions/force", data=hidden)
    assert refused.status_code == 412, refused.text  # as the HTTP API answers a stale If-Match
    assert "re-read it and decide again" in refused.text
    assert 'href="/ui/instances/a-8"' in refused.text
    assert await _state(svc, "a-8") == ("approved", 2)


async def test_pause_and_resume_an_instance_from_the_console(svc: Service) -> None:
    csrf = await log_in(svc.client, OPS)
    paused = await _confirmed(svc, csrf, "pause", target="instance", id="a-9", reason="fraud check")
    assert paused.status_code == 303
    assert (await svc.engine.get("a-9")).paused
    page = await svc.client.get("/ui/instances/a-9")
    assert 'data-testid="paused"' in page.text and 'action="/ui/actions/resume"' in page.text
    resumed = await _confirmed(svc, csrf, "resume", target="instance", id="a-9", reason="")
    assert resumed.status_code == 303
    inst = await svc.engine.get("a-9")
    assert not inst.paused
    kinds = [(e.kind, e.actor, e.reason) for e in await svc.engine.history("a-9")]
    assert kinds == [("pause", "ops", "fraud check"), ("resume", "ops", None)]


async def test_a_reason_is_bounded_as_the_engine_bounds_it(svc: Service) -> None:
    """The console takes any reason the engine takes (up to MAX_REASON characters, not a bound
    of its own) and refuses a longer one before its confirmation page, writing nothing."""
    from flowlock.core.admin import MAX_REASON

    csrf = await log_in(svc.client, OPS)
    longest = ("why " * MAX_REASON)[:MAX_REASON].strip() + "."
    assert 1000 < len(longest) <= MAX_REASON
    done = await _confirmed(svc, csrf, "pause", target="instance", id="a-10", reason=longest)
    assert done.status_code == 303, done.text
    (row,) = await svc.engine.history("a-10")
    assert row.reason == longest
    too_long = await svc.client.post(
        "/ui/actions/pause",
        data={"csrf": csrf, "target": "instance", "id": "a-11", "reason": "x" * (MAX_REASON + 1)},
    )
    assert too_long.status_code == 422, too_long.text
    assert str(MAX_REASON) in too_long.text
    assert await _state(svc, "a-11") == ("pending", 1)


async def test_pause_and_resume_a_workflow_from_the_console(svc: Service) -> None:
    csrf = await log_in(svc.client, OPS)
    done = await _confirmed(svc, csrf, "pause", target="workflow", id="approval", reason="outage")
    assert done.headers["location"] == "/ui/workflows/approval?done=paused"
    [pause] = await svc.engine.workflow_pauses()
    assert (pause.workflow, pause.reason, pause.actor) == ("approval", "outage", "ops")
    page = await svc.client.get("/ui/workflows/approval")
    assert 'data-testid="workflow-paused"' in page.text
    listed = await svc.client.get("/ui/")
    assert "workflow paused" in listed.text
    await _confirmed(svc, csrf, "resume", target="workflow", id="approval", reason="over")
    assert await svc.engine.workflow_pauses() == []
    refused = await svc.client.post(
        "/ui/actions/force",
        data={"csrf": csrf, "target": "workflow", "id": "approval", "state": "x", "reason": "r"},
    )
    assert refused.status_code == 422


async def test_the_monitor_panel_shows_escalations_and_hot_instances(svc: Service) -> None:
    await log_in(svc.client, OPS)
    monitor = svc.engine.monitor
    monitor.record("a-3", conflict=True)  # makes the key tracked
    for n in range(30):
        monitor.record("a-3", conflict=n % 2 == 0)
    monitor.record("a-4", conflict=True)
    for n in range(10):
        monitor.record("a-4", conflict=n == 0)
    panel = await svc.client.get("/ui/monitor/panel")
    assert '<span class="n" data-testid="active">1</span>' in panel.text
    assert 'href="/ui/instances/a-3"' in panel.text and "conflict rate" in panel.text
    assert "10.0%" in panel.text  # a-4: 1 conflict in 10 attempts, tracked but not escalated


async def test_ui_without_a_slash_and_an_unknown_action(svc: Service) -> None:
    root = await svc.client.get("/ui")
    assert root.status_code == 307 and root.headers["location"] == "/ui/"
    csrf = await log_in(svc.client, OPS)
    unknown = await svc.client.post(
        "/ui/actions/delete", data={"csrf": csrf, "target": "instance", "id": "a-1"}
    )
    assert unknown.status_code == 404
    assert await _state(svc, "a-1") == ("pending", 1)
