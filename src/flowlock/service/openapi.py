"""The service's OpenAPI document, as `docs/openapi.json` holds it.

`python -m flowlock.service.openapi > docs/openapi.json` writes it again. A test fails
while the committed file differs. It names the package version, so a version bump
regenerates it in the same commit.
"""

from __future__ import annotations

import json
import sys

from flowlock.service.app import create_app

__all__ = ["document", "main"]


def document() -> str:
    """The default app's OpenAPI document: pretty-printed, keys sorted, a final newline.

    Stable text, so an API change shows as a readable diff.
    """
    schema = create_app().openapi()
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main() -> None:
    # As UTF-8 bytes whatever the locale: the file is UTF-8 JSON.
    sys.stdout.buffer.write(document().encode("utf-8"))


if __name__ == "__main__":
    main()
