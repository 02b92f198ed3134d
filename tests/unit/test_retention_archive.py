"""The retention archive's format on its own: a line round-trips an instance verbatim, a batch
whose delete failed is cut off again, and a manifest that does not match its file is refused
(ArchiveInvalid, naming the file) before a single line is handed out."""

from __future__ import annotations

import gzip
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flowlock.admin.archive import (
    ArchiveWriter,
    decode_line,
    encode_line,
    manifest_path,
    read_archive,
)
from flowlock.core.errors import InvalidInput
from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.retention import ArchivedInstance, ArchiveInvalid, CreateRecord

AT = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def _item(n: int) -> ArchivedInstance:
    iid = f"i-{n}"
    entry = HistoryEntry(
        iid, 2, "approve", "pending", "approved", "ann", f"r-{n}", "optimistic",
        {"n": n, "ok": True}, AT, 7, {"why": "ü"},
    )  # fmt: skip
    history = (entry,)
    inst = Instance(
        iid, "approval", "approved", 2, {"n": n, "ok": True}, "approve", AT, AT, 2,
        paused=n % 2 == 0,
    )  # fmt: skip
    return ArchivedInstance(inst, history, 7, CreateRecord(f"mk-{n}", "pending", {"n": n}))


def test_a_line_gives_back_the_instance_verbatim() -> None:
    item = _item(4)
    raw = encode_line(item)
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert decode_line(raw) == item
    assert decode_line(encode_line(_item(3))) == _item(3)


def test_a_batch_is_cut_off_when_its_delete_fails(tmp_path: Path) -> None:
    path = tmp_path / "a.gz"
    writer = ArchiveWriter(path, {"workflow": "approval"})
    writer.write([encode_line(_item(1)), encode_line(_item(2))])
    mark = writer.mark()
    writer.write([encode_line(_item(3))])
    writer.undo(mark)
    writer.write([encode_line(_item(4))])
    writer.close()
    manifest = json.loads(manifest_path(path).read_text())
    assert (manifest["lines"], manifest["workflow"], manifest["format"]) == (
        3, "approval", "flowlock-archive",
    )  # fmt: skip
    assert [a.instance.id for a in read_archive(path)] == ["i-1", "i-2", "i-4"]
    with pytest.raises(InvalidInput, match="never overwritten"):
        ArchiveWriter(path, {})


def test_a_manifest_that_does_not_match_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "b.gz"
    writer = ArchiveWriter(path, {})
    writer.write([encode_line(_item(1))])
    writer.close()
    where = manifest_path(path)
    manifest = json.loads(where.read_text())
    where.write_text(json.dumps({**manifest, "lines": 2}))
    with pytest.raises(ArchiveInvalid, match=r"b\.gz.*holds 1 line\(s\), but the manifest says 2"):
        read_archive(path)
    where.write_text(json.dumps({**manifest, "format": "other"}))
    with pytest.raises(ArchiveInvalid, match="not a flowlock archive manifest"):
        read_archive(path)
    where.write_text(json.dumps(manifest))
    path.write_bytes(gzip.compress(b'{"instance": {}}\n'))
    with pytest.raises(ArchiveInvalid, match="sha256"):
        read_archive(path)
    with pytest.raises(ArchiveInvalid, match="line 1 is not an archived instance"):
        list(read_archive(path, verify=False))
    with pytest.raises(ArchiveInvalid, match="no such file"):
        read_archive(tmp_path / "missing.gz")
