"""The console in a real browser: Debian's Chromium, driven by Playwright, against a real
`flowlock serve` process on PostgreSQL (a schema of its own) with tokens set.

It logs in, lists, filters, pages, opens an instance, forces it with a reason and sees the new
history row marked forced; pauses and resumes an instance and a workflow; watches the monitor
panel refresh; and checks that every page is refused without a session, that a post without
the CSRF token changes nothing, and that a read token cannot repair. Each page is
photographed into FLOWLOCK_SCREENSHOTS (default tests/artifacts/screenshots). About 15 s; the
monitor's test is marked slow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import Served, Services

import pg_budget

pytest.importorskip("playwright.sync_api", reason="the test extra's playwright is not installed")
from playwright.sync_api import Browser, Page, expect, sync_playwright

CHROMIUM = os.environ.get("FLOWLOCK_CHROMIUM", "/usr/bin/chromium")
OPS = "ops-browser-secret-0123456789"
VIEWER = "viewer-browser-secret-01234567"
SHOTS = Path(
    os.environ.get("FLOWLOCK_SCREENSHOTS")
    or Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
)
PAGES = ["/ui/", "/ui/instances/b-001", "/ui/workflows", "/ui/workflows/approval", "/ui/monitor"]

pytestmark = pytest.mark.skipif(
    shutil.which(CHROMIUM) is None,
    reason=f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)",
)


def _drop(url: str, schema: str) -> None:
    async def drop() -> None:
        conn = await pg_budget.connect(url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()

    # In a thread of its own: the test session may already run an event loop in this one.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, drop()).result(timeout=60)


def _seed(server: Served) -> None:
    """63 instances through the HTTP API: 60 approvals (b-001 ... b-060; every fifth approved),
    two countersigns and an inventory row (the monitor test's storm)."""
    auth = {"Authorization": f"Bearer {OPS}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=10.0) as client:
        for n in range(1, 61):
            made = client.post(
                "/instances",
                json={"workflow": "approval", "id": f"b-{n:03}", "data": {"amount": n * 10}},
            )
            assert made.status_code == 201, made.text
            if n % 5 == 0:
                fired = client.post(f"/instances/b-{n:03}/events/approve", json={"actor": "ann"})
                assert fired.status_code == 200, fired.text
        for n in (1, 2):
            made = client.post("/instances", json={"workflow": "countersign", "id": f"c-{n}"})
            assert made.status_code == 201, made.text
        made = client.post(
            "/instances", json={"workflow": "inventory", "id": "inv-hot", "data": {"stock": 0}}
        )
        assert made.status_code == 201, made.text


def _storm(url: str, stop: threading.Event, bound: float) -> int:
    """Restocks of one inventory row from 40 concurrent callers under the adaptive strategy
    until `stop` is set (at most `bound` seconds): optimistic attempts collide, and the monitor
    escalates the row. Returns how many were applied."""

    async def run() -> int:
        auth = {"Authorization": f"Bearer {OPS}"}
        body = {"payload": {"qty": 1}, "strategy": "adaptive"}
        deadline = asyncio.get_running_loop().time() + bound
        applied = 0
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30.0) as client:

            async def caller() -> None:
                nonlocal applied
                while not stop.is_set() and asyncio.get_running_loop().time() < deadline:
                    got = await client.post("/instances/inv-hot/events/restock", json=body)
                    assert got.status_code in (200, 503), got.text
                    applied += got.status_code == 200

            await asyncio.gather(*(caller() for _ in range(40)))
        return applied

    return asyncio.run(run())


@pytest.fixture(scope="module")
def server(pg_url: str) -> Iterator[Served]:
    schema = f"t_ui_{uuid.uuid4().hex[:10]}"
    tokens = f"ops:{OPS}:admin,viewer:{VIEWER}:read"
    try:
        with Services() as services:
            # Two workers: every page and post may land on either, so a session made by one
            # must be good at the other (the key is derived from the tokens, not per process).
            served = services.start(
                "--database-url", pg_url, "--schema", schema, workers=2,
                env={"FLOWLOCK_API_TOKEN": tokens},
            )  # fmt: skip
            _seed(served)
            yield served
    finally:
        _drop(pg_url, schema)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        launched = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield launched
        finally:
            launched.close()


def _shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _logged_in(browser: Browser, server: Served, secret: str) -> Page:
    context = browser.new_context(base_url=server.url, viewport={"width": 1360, "height": 900})
    page = context.new_page()
    page.goto("/ui/")
    expect(page).to_have_url(f"{server.url}/ui/login?next=%2Fui%2F")
    page.fill("input[name=secret]", secret)
    page.click("button:has-text('Log in')")
    expect(page).to_have_url(f"{server.url}/ui/")
    return page


def _history_kinds(page: Page) -> list[str | None]:
    return [li.get_attribute("data-kind") for li in page.locator("ol.timeline > li").all()]


def test_every_page_is_refused_without_a_session(browser: Browser, server: Served) -> None:
    context = browser.new_context(base_url=server.url)
    page = context.new_page()
    for path in PAGES:
        page.goto(path)
        assert page.url.startswith(f"{server.url}/ui/login?next="), (path, page.url)
        expect(page.locator("h1")).to_have_text("Log in")
        expect(page.locator("table.grid")).to_have_count(0)
        assert "amount" not in page.content()
    _shot(page, "01-login")
    page.fill("input[name=secret]", "not-a-token-of-this-service")
    page.click("button:has-text('Log in')")
    expect(page.locator(".flash.error")).to_contain_text("not valid")
    # A post with no session at all: 401, nothing done.
    got = context.request.post(
        "/ui/actions/pause", form={"target": "instance", "id": "b-001", "reason": "x"}
    )
    assert got.status == 401
    context.close()


def test_list_filter_page_and_open_an_instance(browser: Browser, server: Served) -> None:
    page = _logged_in(browser, server, OPS)
    expect(page.get_by_test_id("total")).to_have_text("63")
    assert page.locator("table.grid tbody tr").count() == 50
    _shot(page, "02-instances")
    page.click("a[rel=next]")
    assert page.locator("table.grid tbody tr").count() == 13
    page.goto("/ui/")
    page.select_option("select[name=workflow]", "approval")
    page.select_option("select[name=state]", "approved")
    page.click("button:has-text('Filter')")
    expect(page.get_by_test_id("total")).to_have_text("12")
    states = page.locator("table.grid tbody td:nth-child(3)").all_inner_texts()
    assert states == ["approved"] * 12
    _shot(page, "03-instances-filtered")
    page.fill("input[name=updated_after]", "2999-01-01T00:00:00")
    page.click("button:has-text('Filter')")
    expect(page.get_by_test_id("total")).to_have_text("0")
    assert "updated_after=2999-01-01T00%3A00" in page.url
    page.fill("input[name=updated_after]", "")
    page.click("button:has-text('Filter')")
    expect(page.get_by_test_id("total")).to_have_text("12")
    page.click("a:has-text('b-005')")
    expect(page.get_by_test_id("state")).to_have_text("approved")
    current = page.locator("svg.fl-diagram g.fl-current")
    expect(current).to_have_count(1)
    assert current.get_attribute("data-state") == "approved"
    expect(page.get_by_test_id("data")).to_contain_text('"amount": 50')
    assert _history_kinds(page) == ["transition"]
    # The seeding fired with the ops token: the token's principal is the actor, not the body's.
    expect(page.locator("ol.timeline")).to_contain_text("by ops")
    _shot(page, "04-instance")
    page.context.close()


def test_force_with_a_reason_shows_a_forced_history_row(browser: Browser, server: Served) -> None:
    page = _logged_in(browser, server, OPS)
    page.goto("/ui/instances/b-003")
    page.select_option("[data-testid=force-form] select[name=state]", "rejected")
    page.fill("[data-testid=force-form] input[name=reason]", "customer withdrew by phone")
    page.click("[data-testid=force-form] button:has-text('Force')")
    confirm = page.get_by_test_id("confirm")
    expect(confirm).to_contain_text("from pending to rejected")
    _shot(page, "05-force-confirm")
    page.click("button:has-text('Confirm force')")
    expect(page.locator(".flash.ok")).to_contain_text("forced")
    expect(page.get_by_test_id("state")).to_have_text("rejected")
    assert _history_kinds(page) == ["forced"]
    newest = page.locator("ol.timeline > li").first
    expect(newest.locator(".badge.forced")).to_have_text("forced")
    expect(newest).to_contain_text("customer withdrew by phone")
    expect(newest).to_contain_text("by ops")
    expect(newest).to_contain_text("pending → rejected")
    current = page.locator("svg.fl-diagram g.fl-current")
    assert current.get_attribute("data-state") == "rejected"
    _shot(page, "06-instance-forced")
    page.context.close()


def test_pause_and_resume_an_instance_and_a_workflow(browser: Browser, server: Served) -> None:
    page = _logged_in(browser, server, OPS)
    page.goto("/ui/instances/b-004")
    page.fill("[data-testid=pause-form] input[name=reason]", "investigating a double charge")
    page.click("[data-testid=pause-form] button:has-text('Pause')")
    page.click("button:has-text('Confirm pause')")
    expect(page.get_by_test_id("paused")).to_be_visible()
    assert _history_kinds(page) == ["pause"]
    _shot(page, "07-instance-paused")
    page.click("[data-testid=pause-form] button:has-text('Resume')")
    page.click("button:has-text('Confirm resume')")
    expect(page.get_by_test_id("paused")).to_have_count(0)
    assert _history_kinds(page) == ["resume", "pause"]

    page.goto("/ui/workflows")
    expect(page.locator("table.grid")).to_contain_text("countersign")
    _shot(page, "08-workflows")
    page.click("a:has-text('approval')")
    counts = page.get_by_test_id("counts")
    expect(counts).to_contain_text("pending")
    page.fill("[data-testid=workflow-pause-form] input[name=reason]", "bank outage")
    page.click("[data-testid=workflow-pause-form] button:has-text('Pause')")
    expect(page.get_by_test_id("confirm")).to_contain_text("refuse events")
    page.click("button:has-text('Confirm pause')")
    expect(page.get_by_test_id("workflow-paused")).to_be_visible()
    _shot(page, "09-workflow-paused")
    page.click("[data-testid=workflow-pause-form] button:has-text('Resume')")
    page.click("button:has-text('Confirm resume')")
    expect(page.get_by_test_id("workflow-paused")).to_have_count(0)
    page.context.close()


# Two 2 s polls and a storm: slow. The quick suite keeps tests/service/test_console.py's
# test_the_monitor_panel_is_polled_by_htmx and ..._shows_escalations_and_hot_instances.
@pytest.mark.slow
def test_the_monitor_panel_refreshes_itself_and_shows_a_storm(
    browser: Browser, server: Served
) -> None:
    page = _logged_in(browser, server, OPS)
    page.goto("/ui/monitor")
    expect(page.get_by_test_id("monitor-panel")).to_be_visible()
    with page.expect_response(lambda r: r.url.endswith("/ui/monitor/panel"), timeout=10_000) as r:
        pass
    assert r.value.status == 200
    expect(page.get_by_test_id("monitor-panel")).to_contain_text("escalated now")
    # Real contention on one row, while the page polls: the row shows up in the panel (hot in
    # the worker that saw its conflicts, escalated in both once the board shares it).
    # The storm lasts until the panel shows the row (it used to run a fixed 8 s).
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        storm = pool.submit(_storm, server.url, stop, 30.0)
        try:
            hot = page.locator("#monitor-panel a[href='/ui/instances/inv-hot']").first
            expect(hot).to_be_visible(timeout=20_000)
        finally:
            stop.set()
        _shot(page, "11-monitor-storm")
        applied = storm.result(timeout=60)
    assert applied > 0
    _shot(page, "10-monitor")
    page.context.close()


def test_a_post_without_csrf_and_a_read_token_change_nothing(
    browser: Browser, server: Served
) -> None:
    page = _logged_in(browser, server, OPS)
    body: dict[str, Any] = {
        "target": "instance",
        "id": "b-006",
        "state": "rejected",
        "reason": "no csrf",
        "confirmed": "yes",
        "expected_version": "1",
    }
    refused = page.context.request.post("/ui/actions/force", form=body)
    assert refused.status == 403
    page.goto("/ui/instances/b-006")
    expect(page.get_by_test_id("state")).to_have_text("pending")
    expect(page.get_by_test_id("version")).to_have_text("1")
    page.context.close()

    viewer = _logged_in(browser, server, VIEWER)
    viewer.goto("/ui/instances/b-006")
    expect(viewer.get_by_test_id("force-form")).to_have_count(0)
    csrf = viewer.locator("form[action='/ui/logout'] input[name=csrf]").get_attribute("value")
    assert csrf
    refused = viewer.context.request.post("/ui/actions/force", form={**body, "csrf": csrf})
    assert refused.status == 403
    assert "admin scope" in refused.text()
    viewer.reload()
    expect(viewer.get_by_test_id("version")).to_have_text("1")
    viewer.click("button:has-text('Log out')")
    expect(viewer).to_have_url(f"{server.url}/ui/login")
    viewer.goto("/ui/")
    assert viewer.url.startswith(f"{server.url}/ui/login")
    viewer.context.close()
