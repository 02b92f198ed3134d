"""The service's OpenAPI document, as `docs/openapi.json` holds it.

`python -m flowlock.service.openapi > docs/openapi.json` writes it again; a test fails while
the committed file differs from what [`flowlock.service.create_app`][flowlock.service.create_app]
describes. The document names the package version (`info.version`), so a release that bumps the
version regenerates it in the same commit.
"""

from __future__ import annotations

import json
import sys

from flowlock.service.app import create_app

__all__ = ["document", "main"]


def document() -> str:
    """The OpenAPI document of the default app: pretty-printed, keys sorted, a final newline
    (stable text, so a change to the API shows as a readable diff)."""
    schema = create_app().openapi()
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main() -> None:
    # As UTF-8 bytes whatever the locale: the file is UTF-8 JSON.
    sys.stdout.buffer.write(document().encode("utf-8"))


if __name__ == "__main__":
    main()
