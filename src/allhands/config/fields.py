"""The one way a config field is declared: its default and its one-line doc, which
``allhands config show`` and docs/configuration.md print."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def _f(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)
