"""The retention archive: gzip JSON Lines, one instance with its history per line, and a manifest
beside it (`<file>.manifest.json`) with the file's sha256 and line count.

A purge appends each batch as a gzip member of its own (concatenated members are one gzip
stream), flushed and fsynced before the batch's delete commits: a crash never loses an instance
that was deleted. docs/operations.md describes the format field by field.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Final

from flowlock.core.errors import InvalidInput
from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.retention import ArchivedInstance, ArchiveInvalid, CreateRecord

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ArchiveMark",
    "ArchiveWriter",
    "check_new",
    "decode_line",
    "encode_line",
    "manifest_path",
    "read_archive",
]

FORMAT: Final = "flowlock-archive"
FORMAT_VERSION: Final = 1
_CHUNK: Final = 1 << 20


def manifest_path(path: str | os.PathLike[str]) -> Path:
    """Where the manifest of the archive at `path` is: beside it, `<file>.manifest.json`."""
    p = Path(path)
    return p.with_name(p.name + ".manifest.json")


def _when(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="microseconds")


def _moment(text: object) -> datetime | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"a timestamp must be ISO 8601 text, not {text!r}")
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def encode_line(item: ArchivedInstance) -> bytes:
    """One archive line (JSON and a newline) for `item`."""
    inst = item.instance
    made = item.created
    line = {
        "instance": {
            "id": inst.id,
            "workflow": inst.workflow,
            "state": inst.state,
            "version": inst.version,
            "data": inst.data,
            "last_event": inst.last_event,
            "created_at": _when(inst.created_at),
            "updated_at": _when(inst.updated_at),
            "stay_version": inst.stay_version,
            "paused": inst.paused,
            "fencing_token": item.fencing_token,
            "definition_version": inst.definition_version,
        },
        "created": None
        if made is None
        else {"request_id": made.request_id, "state": made.state, "data": made.data},
        "history": [
            {
                "version": e.version,
                "event": e.event,
                "from_state": e.from_state,
                "to_state": e.to_state,
                "actor": e.actor,
                "request_id": e.request_id,
                "strategy": e.strategy,
                "data": e.data,
                "at": _when(e.at),
                "fencing_token": e.fencing_token,
                "payload": e.payload,
                "definition_version": e.definition_version,
            }
            for e in item.history
        ],
    }
    text = json.dumps(line, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode() + b"\n"


def decode_line(raw: bytes) -> ArchivedInstance:
    """The archived instance of one line. ValueError (or KeyError, TypeError) says what is
    wrong; the reader turns it into ArchiveInvalid naming the file and line."""
    line = json.loads(raw)
    i = line["instance"]
    inst = Instance(
        id=_text(i["id"]),
        workflow=_text(i["workflow"]),
        state=_text(i["state"]),
        version=int(i["version"]),
        data=_object(i["data"]),
        last_event=i["last_event"],
        created_at=_moment(i["created_at"]),
        updated_at=_moment(i["updated_at"]),
        stay_version=i["stay_version"],
        paused=bool(i.get("paused", False)),
        definition_version=i.get("definition_version"),  # absent from older archives
    )
    made = line["created"]
    history = tuple(
        HistoryEntry(
            instance_id=inst.id,
            version=int(h["version"]),
            event=_text(h["event"]),
            from_state=_text(h["from_state"]),
            to_state=_text(h["to_state"]),
            actor=h["actor"],
            request_id=h["request_id"],
            strategy=_text(h["strategy"]),
            data=_object(h["data"]),
            at=_moment(h["at"]),
            fencing_token=h["fencing_token"],
            payload=_object(h["payload"]),
            definition_version=h.get("definition_version"),
        )
        for h in line["history"]
    )
    return ArchivedInstance(
        inst,
        history,
        i["fencing_token"],
        None
        if made is None
        else CreateRecord(_text(made["request_id"]), _text(made["state"]), _object(made["data"])),
    )


def _text(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected non-empty text, found {value!r}")
    return value


def _object(value: object) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, found {value!r}")
    return value


def check_new(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path, once neither it nor its manifest exists (InvalidInput otherwise)."""
    try:
        p = Path(path)
    except TypeError:
        raise InvalidInput(f"archive must be a file path, not {path!r}") from None
    for taken in (p, manifest_path(p)):
        if taken.exists():
            raise InvalidInput(
                f"{str(taken)!r} exists: an archive is never overwritten; pass a new file "
                "name. Nothing was purged"
            )
    return p


@dataclass(slots=True)
class ArchiveMark:
    """Where an archive was before a batch: `ArchiveWriter.undo` takes it back there."""

    size: int
    lines: int
    digest: Any  # a hashlib object's copy


class ArchiveWriter:
    """Appends batches to a new archive file; `close` writes the manifest.

    Each `write` is one gzip member, flushed and fsynced before it returns. `mark` and `undo`
    take the file back to where it was before a batch whose delete failed (its instances were
    not deleted, so they do not belong in the archive)."""

    def __init__(self, path: str | os.PathLike[str], meta: Mapping[str, Any]) -> None:
        self.path = check_new(path)
        self._meta = dict(meta)
        self._manifest = manifest_path(self.path)
        try:
            self._file: IO[bytes] = open(self.path, "xb")  # noqa: SIM115 - closed by close()
        except FileExistsError:
            raise InvalidInput(
                f"{str(self.path)!r} exists: an archive is never overwritten; pass a new file "
                "name. Nothing was purged"
            ) from None
        except OSError as exc:
            raise InvalidInput(
                f"cannot create the archive {str(self.path)!r}: {exc.strerror or exc}. Nothing "
                "was purged"
            ) from exc
        self._sha = hashlib.sha256()
        self._size = 0
        self.lines = 0

    def mark(self) -> ArchiveMark:
        return ArchiveMark(self._size, self.lines, self._sha.copy())

    def write(self, lines: Sequence[bytes]) -> None:
        """Append `lines` as one gzip member, then flush and fsync the file."""
        if not lines:
            return
        member = gzip.compress(b"".join(lines), compresslevel=6, mtime=0)
        self._file.write(member)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._sha.update(member)
        self._size += len(member)
        self.lines += len(lines)

    def undo(self, mark: ArchiveMark) -> None:
        """Cut the file back to `mark` (the batch after it never deleted anything)."""
        self._file.truncate(mark.size)
        self._file.seek(mark.size)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._size, self.lines, self._sha = mark.size, mark.lines, mark.digest

    def close(self) -> Path:
        """Close the file and write its manifest (atomically: a temporary file renamed)."""
        with contextlib.suppress(OSError):
            self._file.close()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "file": self.path.name,
            "sha256": self._sha.hexdigest(),
            "bytes": self._size,
            "lines": self.lines,
            **self._meta,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        temporary = self._manifest.with_name(self._manifest.name + ".tmp")
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump(manifest, out, indent=2)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self._manifest)
        _sync_dir(self._manifest.parent)
        return self._manifest


def _sync_dir(folder: Path) -> None:
    """fsync a directory, so a rename in it survives a crash (where the platform allows)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _checked(path: Path) -> Mapping[str, Any]:
    """The manifest of `path`, once it matches the file (format, size, sha256)."""
    where = manifest_path(path)
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArchiveInvalid(
            path,
            f"its manifest {where.name!r} is missing (a purge that did not finish writes none); "
            "restore it without the check (restore(verify=False), --no-verify) to read every "
            "complete line",
        ) from None
    except (OSError, ValueError) as exc:
        raise ArchiveInvalid(path, f"its manifest {where.name!r} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArchiveInvalid(path, f"{where.name!r} is not a flowlock archive manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArchiveInvalid(
            path,
            f"format version {manifest.get('format_version')!r} is not {FORMAT_VERSION}, the "
            "one this flowlock reads; restore it with the flowlock that wrote it",
        )
    sha = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
    except OSError as exc:
        raise ArchiveInvalid(path, f"it cannot be read: {exc.strerror or exc}") from exc
    if sha.hexdigest() != manifest.get("sha256"):
        raise ArchiveInvalid(
            path,
            f"its sha256 is {sha.hexdigest()}, but the manifest says {manifest.get('sha256')}: "
            "the file was changed or damaged after the purge wrote it",
        )
    return manifest


def read_archive(
    path: str | os.PathLike[str], *, verify: bool = True
) -> Iterator[ArchivedInstance]:
    """The archived instances of `path`, in file order.

    With `verify`, every check runs before this returns, so a bad archive restores nothing:
    the manifest must be there and match the file (sha256), and every line must decode, as many
    as the manifest says (ArchiveInvalid otherwise). Without it, no manifest is needed and a
    torn last member (a crash mid-write, before its batch's delete could commit) ends the
    reading quietly."""
    p = Path(path)
    if not p.is_file():
        raise ArchiveInvalid(p, "no such file")
    if verify:
        manifest = _checked(p)
        number = sum(1 for _ in _lines(p, strict=True))
        if manifest.get("lines") != number:
            raise ArchiveInvalid(
                p, f"it holds {number} line(s), but the manifest says {manifest.get('lines')}"
            )
    return _lines(p, strict=verify)


def _lines(p: Path, *, strict: bool) -> Iterator[ArchivedInstance]:
    number = 0
    try:
        with gzip.open(p, "rb") as lines:
            for raw in lines:
                number += 1
                try:
                    yield decode_line(raw)
                except (ValueError, KeyError, TypeError) as exc:
                    raise ArchiveInvalid(
                        p, f"line {number} is not an archived instance ({exc})"
                    ) from exc
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        if strict:
            raise ArchiveInvalid(p, f"it is not a complete gzip file ({exc})") from exc
        # A torn tail: its batch's delete never committed, so nothing is lost by stopping.
    except OSError as exc:
        raise ArchiveInvalid(p, f"it cannot be read: {exc.strerror or exc}") from exc
