"""The operator's tools: repairs as transitions (force, pause, resume), operations in bulk, and
retention (holds, purge with an archive, restore). Each is a mixin of the Engine, so the engine
module stays about firing."""

from __future__ import annotations
