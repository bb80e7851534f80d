"""Every public name the manual shows is importable as shown: each dotted ``allhands.X.Y`` in a
code span or code block of README.md and docs/*.md, and each name a ``from allhands.X import a, b``
there imports, is a module or an attribute of one. No processes here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[^\n]*\n(.*?)^[ \t]*\1[ \t]*$", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# not part of a path (examples/slurm/allhands.sbatch) or of a longer name
DOTTED = re.compile(r"(?<![\w./-])allhands(?:\.[A-Za-z_]\w*)+")
FROM = re.compile(r"\bfrom[ \t]+(allhands(?:\.\w+)*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([\w \t,]+))")
# `allhands.json` (a checkpoint's metadata file) is a file name, not a Python name
FILE_SUFFIXES = {"json", "jsonl", "toml", "sbatch", "py", "md", "txt", "yaml", "log", "png"}


def names_in(text: str) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every allhands name shown in a code block or code span."""
    code = [(m.start(2), m.group(2)) for m in FENCE.finditer(text)]  # (offset in text, code)
    blanked = list(text)  # the spans outside the blocks, at their offsets in the file
    for m in FENCE.finditer(text):
        blanked[m.start():m.end()] = " " * (m.end() - m.start())
    code += [(m.start(2), m.group(2)) for m in SPAN.finditer("".join(blanked))]
    out = []
    for offset, chunk in code:
        for m in DOTTED.finditer(chunk):
            if m.group(0).rpartition(".")[2] not in FILE_SUFFIXES:
                out.append((text.count("\n", 0, offset + m.start()) + 1, m.group(0)))
        for m in FROM.finditer(chunk):
            line = text.count("\n", 0, offset + m.start()) + 1
            for item in (m.group(2) or m.group(3)).split(","):
                if item.split():  # `name` or `name as alias`
                    out.append((line, f"{m.group(1)}.{item.split()[0]}"))
    return sorted(set(out))


def importable(name: str) -> bool:
    """``name`` is a module, or an attribute (at any depth) of the longest module prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            raise  # a module that exists but fails to import is a bug to show, not a missing name
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_name_the_manual_shows_imports():
    shown = [(f"{path.relative_to(ROOT)}:{line}", name)
             for path in DOC_FILES for line, name in names_in(path.read_text())]
    names = {name for _, name in shown}
    # the scan finds what the manual is known to show, in prose spans and in code blocks
    assert {"allhands.train", "allhands.load_config", "allhands.models.from_hf", "allhands.muon.Muon",
            "allhands.models.Llama"} <= names, sorted(names)
    missing = [f"{where}: {name}" for where, name in shown if not importable(name)]
    assert not missing, "names the manual shows that do not import:\n" + "\n".join(missing)


def test_the_scan_sees_spans_blocks_and_imports_and_skips_files_and_prose():
    text = ("Prose allhands.not_code stays out; `allhands.models.GPT` and `allhands.json` and\n"
            "`examples/slurm/allhands.sbatch`.\n"
            "```python\n"
            "from allhands.muon import Muon, muon_matrices as mm\n"
            "a, b = allhands.nowhere.thing(1)\n"
            "from allhands.models import (GPT,\n    Llama)\n"
            "```\n")
    assert names_in(text) == [(1, "allhands.models.GPT"), (4, "allhands.muon"), (4, "allhands.muon.Muon"),
                              (4, "allhands.muon.muon_matrices"), (5, "allhands.nowhere.thing"),
                              (6, "allhands.models"), (6, "allhands.models.GPT"),
                              (6, "allhands.models.Llama")]
    assert importable("allhands.models.GPT") and importable("allhands.parallel.tensor")
    assert importable("allhands.models.to_hf")  # re-exported lazily from models/hf.py
    assert not importable("allhands.nowhere.thing") and not importable("allhands.models.nothing")
