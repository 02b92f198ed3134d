"""POST /admin/bulk behind tokens: an admin token runs it, and its principal is the actor of
every row written (a body's actor is ignored); a write token is refused (403) and nothing is
written; the force's UnknownState and a run's failures come back as the engine says them."""

from __future__ import annotations

from bulk_kit import METER, meter
from flowlock.service import ServiceSettings
from flowlock.service.settings import parse_tokens
from service.kit import assert_problem, served

OPS = "ops-secret-0123456789abcdef"
APP = "app-secret-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {OPS}"}
WRITE = {"Authorization": f"Bearer {APP}"}


async def test_an_admin_token_runs_a_bulk_force_as_its_principal() -> None:
    tokens = parse_tokens(f"ops:{OPS}:admin,app:{APP}:write")
    async with served(ServiceSettings(api_tokens=tokens), workflows=[meter()]) as svc:
        ids = [f"h-{i}" for i in range(6)]
        for iid in ids:
            await svc.engine.create(METER, instance_id=iid, data={"n": 0})
        body = {"action": "force", "workflow": METER, "state": "held",
                "reason": "stuck after the outage", "actor": "someone-else"}  # fmt: skip
        refused = await svc.client.post("/admin/bulk", json=body, headers=WRITE)
        problem = assert_problem(refused, 403, "insufficient-scope")
        assert problem["needed"] == "admin"
        assert {(await svc.engine.get(i)).version for i in ids} == {1}

        unknown = await svc.client.post(
            "/admin/bulk", json={**body, "state": "nowhere"}, headers=ADMIN
        )
        assert_problem(unknown, 422, "unknown-state")

        done = await svc.client.post("/admin/bulk", json=body, headers=ADMIN)
        assert done.status_code == 200, done.text
        report = done.json()
        assert (report["matched"], report["applied"], report["failed"]) == (6, 6, {})
        for iid in ids:
            (row,) = await svc.engine.history(iid)
            assert row.forced and row.actor == "ops"
            assert row.request_id == f"bulk:{report['operation_id']}:{iid}"

        await svc.engine.fire(ids[0], "close")
        fired = await svc.client.post(
            "/admin/bulk", json={"action": "fire", "workflow": METER, "event": "close"},
            headers=ADMIN,
        )  # fmt: skip
        answer = fired.json()
        assert (answer["applied"], answer["skipped"]) == (5, 1)  # the closed one: nothing to do
