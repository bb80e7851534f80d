"""The one form of a config error: the field's dotted path, the value, and what is allowed."""

from __future__ import annotations

from typing import Any

from allhands.errors import ConfigError


def check(ok: bool, path: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{path}: {value!r} is not allowed; {allowed}")
