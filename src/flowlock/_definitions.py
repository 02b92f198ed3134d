"""The engine's versioned definitions: register, the versions stored, and which version a new
instance runs (a mixin of `flowlock.Engine`).

`register` stores the workflow's canonical form in the engine's store (a DefinitionStore): the
same form is the same version, a changed one the next. The engine keeps every version it
registered (its Registry), so an instance pinned to an older one runs that one's code here.
docs/definitions.md says how to run a deploy with it.
"""

from __future__ import annotations

import logging
from typing import Any

from flowlock.core.definition import Workflow
from flowlock.core.errors import InvalidInput, UnknownWorkflow
from flowlock.core.versions import DefinitionVersion, Registry, canonical, content_hash
from flowlock.stores.base import DefinitionStore, Store
from flowlock.strategies.base import Strategy
from flowlock.strategies.table import unknown_strategy

__all__ = ["DefinitionMethods"]

log = logging.getLogger("flowlock")


class DefinitionMethods:
    """`flowlock.Engine`'s definition versions; the engine is `self`."""

    _store: Store
    _workflows: Registry
    _strategies: dict[str, Strategy]
    _default: str
    _open: bool
    _per_definition_strategy: bool
    # Registered before the engine opened: stored, in order, when it opens.
    _unsaved: list[Workflow]

    def _start_services(self) -> None: ...  # the engine's

    def _index_payloads(self) -> None: ...  # flowlock._payload_checks

    def _check_open(self) -> None: ...  # the engine's

    async def aclose(self) -> None: ...  # the engine's

    async def count(self, workflow: str | None = None, state: Any = None) -> int:  # the engine's
        raise NotImplementedError

    async def register(self, workflow: Workflow) -> DefinitionVersion:
        """Make `workflow` available to `create` and `fire`, and store its definition.

        An identical definition is the version stored before (`new` False); a changed one is
        the next version (`new` True). Either is returned and logged. New instances run the
        newest version registered here; an instance keeps the version it was created with, so
        register an older version's Workflow too while instances still run it (the newest
        last). A warning names instances sitting in states this version lacks.

        Before the engine is open nothing is stored (nothing connects): the answer is version
        0, and the definition is stored when the engine opens.
        """
        if not isinstance(workflow, Workflow):
            raise InvalidInput(
                f"register() takes a flowlock.Workflow, not {type(workflow).__name__}"
            )
        for name in (workflow.strategy, *(t.strategy for t in workflow.transitions.values())):
            if name is not None and name not in self._strategies:
                raise InvalidInput(unknown_strategy(name, self._strategies))
        for warning in workflow.safety_warnings(self._default):
            log.warning("flowlock: %s", warning)
        form = canonical(workflow)
        stored = DefinitionVersion(workflow.name, 0, content_hash(form), None, form)
        if not self._open or not isinstance(self._store, DefinitionStore):
            if not self._open:
                self._unsaved.append(workflow)
            self._workflows.add(workflow, None)
        else:
            stored = await self._save(workflow, stored)
        self._index_payloads()
        self._start_services()
        self._per_definition_strategy = any(
            wf.strategy is not None or any(t.strategy for t in wf.transitions.values())
            for wf in self._workflows.values()
        )
        return stored

    async def _save(self, workflow: Workflow, form: DefinitionVersion) -> DefinitionVersion:
        """Store `workflow` (its canonical form and hash in `form`), add it to the registry as
        the version stored, log it, and warn about instances in states it lacks."""
        store = self._store
        assert isinstance(store, DefinitionStore)
        stored = await store.save_definition(workflow.name, form.hash, form.definition)
        self._workflows.add(workflow, stored.version)
        log.info(
            "flowlock: workflow %r version %d (%s)",
            workflow.name,
            stored.version,
            "new" if stored.new else "unchanged",
        )
        await self._warn_stranded(store, workflow, stored.version)
        return stored

    async def _save_unsaved(self) -> None:
        """Store the workflows registered before the engine opened, in the order registered
        (`open` calls it). When that fails the engine is closed again and the error raised;
        the workflows stay to be stored by the next `open`."""
        if not isinstance(self._store, DefinitionStore):
            self._unsaved.clear()
            return
        try:
            while self._unsaved:
                workflow = self._unsaved[0]
                form = canonical(workflow)
                made = DefinitionVersion(workflow.name, 0, content_hash(form), None, form)
                await self._save(workflow, made)
                self._unsaved.pop(0)
        except BaseException:
            await self.aclose()
            raise

    async def _warn_stranded(
        self, store: DefinitionStore, workflow: Workflow, version: int
    ) -> None:
        """Warn when instances sit in states of the earlier versions that `version` lacks: one
        read per earlier version (by key) and one indexed count, only when states were dropped."""
        dropped: set[str] = set()
        for earlier in range(1, version):
            found = await store.definition(workflow.name, earlier)
            if found is not None:
                dropped.update(found.definition.get("states", ()))
        dropped -= set(workflow.states)
        if not dropped:
            return
        states = sorted(dropped)
        stranded = await self.count(workflow=workflow.name, state=states)
        if stranded:
            log.warning(
                "flowlock: %d instance(s) of workflow %r are in states version %d lacks (%s); "
                "they keep running their own version: keep its Workflow registered in every "
                "process, or migrate them (engine.migrate)",
                stranded,
                workflow.name,
                version,
                ", ".join(states),
            )

    def _creating(self, name: str, version: int | None) -> tuple[Workflow, int | None]:
        """The definition a new instance of `name` runs and its version: the newest registered
        here, or `version`. UnknownWorkflow, InvalidInput, or DefinitionMismatch for a
        version this engine has not registered."""
        wf = self._workflows.get(name) if isinstance(name, str) else None
        if wf is None:
            raise UnknownWorkflow(str(name), tuple(self._workflows))
        if version is None:
            return wf, self._workflows.newest_version(wf.name)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise InvalidInput(
                f"version must be a definition version number (1 or more), not {version!r}; "
                "nothing was written"
            )
        pinned = self._workflows.pinned(wf.name, version)
        assert pinned is not None
        return pinned, version

    @property
    def registry(self) -> Registry:
        """Every workflow version this engine registered (`pinned` finds an instance's)."""
        return self._workflows

    async def definitions(self, workflow: str | None = None) -> list[DefinitionVersion]:
        """The stored definition versions (of `workflow` when given), by workflow then version,
        each with how many instances run it (`instances`). Empty on a store that keeps none."""
        self._check_open()
        if workflow is not None and not isinstance(workflow, str):
            raise InvalidInput(f"workflow must be a name, not {workflow!r}")
        store = self._store
        if not isinstance(store, DefinitionStore):
            return []
        return await store.definitions(workflow)
