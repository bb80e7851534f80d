"""The layers of a config: defaults < TOML file < ``--set section.field=value``, and the TOML
form of the tree (``config.resolved.toml``, ``allhands config show``) that reads back equal."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from allhands.config.tree import Config, _merge, _type_of
from allhands.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _parse_literal(raw: str) -> Any:
    """Parse the right-hand side of ``--set`` as a TOML value, else take it as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_override(cfg: Config, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.field=value, e.g. optim.lr=3e-4")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: the key must be section.field, e.g. optim.lr")
    section, name = parts
    value = _parse_literal(raw.strip())
    # A string field keeps exactly what was typed (a run name "1e3" stays a string).
    node = getattr(cfg, section, None)
    if dataclasses.is_dataclass(node) and name in {f.name for f in dataclasses.fields(node)}:
        if _type_of(node, name) is str and not isinstance(value, str):
            value = raw.strip()
    _merge(cfg, {section: {name: value}}, "")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults < TOML file < overrides, then validated. Raises ConfigError."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing TOML file")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        _merge(cfg, data, "")
    for item in overrides:
        apply_override(cfg, item)
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'


def to_toml(cfg: Config, with_docs: bool = False) -> str:
    """Render the tree as TOML that :func:`load_config` reads back to an equal Config."""
    out: list[str] = []
    for sec in dataclasses.fields(cfg):
        node = getattr(cfg, sec.name)
        if out:
            out.append("")
        out.append(f"[{sec.name}]")
        for f in dataclasses.fields(node):
            line = f"{f.name} = {_toml_value(getattr(node, f.name))}"
            if with_docs:
                line = f"{line:<34} # {f.metadata.get('doc', '')}"
            out.append(line)
    return "\n".join(out) + "\n"
