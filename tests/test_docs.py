"""The manual stays true: its marked code blocks run, its config page is generated, it points nowhere outside.

Marker convention: a fenced code block in README.md or docs/*.md is run by this file when the
line right before its opening fence is exactly ``<!-- run -->`` (invisible when rendered):

    <!-- run -->
    ```bash
    allhands train examples/configs/tiny.toml --set run.steps=4 --set run.dir=runs/tiny
    ```

- ``bash``/``sh`` blocks run with ``bash -euo pipefail`` and ``python`` blocks with
  ``sys.executable``, each in a fresh temporary directory that holds a link to the repository's
  ``examples/``; the venv's ``bin/`` is first on PATH, so ``allhands`` is this checkout's.
- Blocks are run exactly as written, so a marked block must itself be small (a few seconds:
  ``examples/configs/tiny.toml`` and ``--set run.steps=4``).
- Blocks that cannot run here (``make``, multi-node commands, Slurm, Kubernetes, long jobs) are
  simply not marked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- run -->"
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
TIMEOUT_S = 300  # per block; a block takes seconds on an idle machine, minutes on a loaded one


def marked_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line number, language, code) of every block whose fence follows the marker line."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == MARKER:
            fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
            m = re.match(r"^(`{3,})\s*(\w+)", fence)
            assert m, f"{path.name}:{i + 1}: {MARKER} must be followed by a fence with a language"
            lang = LANGS.get(m.group(2))
            assert lang, f"{path.name}:{i + 2}: cannot run a '{m.group(2)}' block"
            end = i + 2
            while end < len(lines) and not lines[end].strip().startswith(m.group(1)):
                end += 1
            out.append((i + 2, lang, "\n".join(lines[i + 2:end]) + "\n"))
            i = end
        i += 1
    return out


BLOCKS = [pytest.param(path, line, lang, code, id=f"{path.relative_to(ROOT)}:{line}")
          for path in DOC_FILES for line, lang, code in marked_blocks(path)]


def test_the_manual_has_runnable_blocks():
    assert len(BLOCKS) >= 5, "expected the README and docs/ to mark their runnable blocks"
    readme = [b for b in BLOCKS if b.values[0].name == "README.md"]
    assert any(b.values[2] == "python" for b in readme), "the README's Python API example must be marked"


@pytest.mark.parametrize("path,line,lang,code", BLOCKS)
def test_marked_block_runs(path, line, lang, code, tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    if lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        (tmp_path / "block.py").write_text(code)
        cmd = [sys.executable, "block.py"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, (f"{path.relative_to(ROOT)}:{line}: the {lang} block exited "
                               f"{p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}")


def test_configuration_page_is_generated_from_the_config_dataclasses():
    from allhands.configdoc import markdown

    page = ROOT / "docs" / "configuration.md"
    assert page.exists() and page.read_text() == markdown(), (
        "docs/configuration.md differs from the config dataclasses; regenerate it with "
        "`.venv/bin/python -m allhands.configdoc > docs/configuration.md`")


def test_configuration_page_lists_every_field():
    import dataclasses

    from allhands.config import Config
    from allhands.configdoc import markdown

    text = markdown()
    for sec in dataclasses.fields(Config):
        assert f"## `[{sec.name}]`" in text
        for f in dataclasses.fields(getattr(Config(), sec.name)):
            assert f"| `{sec.name}.{f.name}` |" in text, f"{sec.name}.{f.name} missing"
            assert f.metadata.get("doc"), f"{sec.name}.{f.name} has no doc"


def test_configdoc_runs_as_a_module():
    p = subprocess.run([sys.executable, "-m", "allhands.configdoc"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("# Configuration"), p.stderr


# Pointers outside the repository (notes that are not in it) and at the tracker's issue numbers.
OUTSIDE = re.compile(r"FACTS\.md|\.\./shared|DESIGN\.md|STYLE\.md|\bissues? \d", re.IGNORECASE)


def _outside_refs(paths: list[Path]) -> list[str]:
    hits = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return hits


def test_docs_point_nowhere_outside_the_repository():
    docs = [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "BENCHMARKS.md",
            *sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file() and p.suffix != ".png")]
    hits = _outside_refs(docs)
    assert not hits, ("documentation must not cite files outside the repository or issue numbers; "
                      "state the fact instead:\n" + "\n".join(hits))


def test_src_points_nowhere_outside_the_repository():
    hits = _outside_refs(sorted((ROOT / "src" / "allhands").rglob("*.py")))
    assert not hits, ("docstrings and comments in src/allhands must not cite files outside the "
                      "repository or issue numbers; state the fact instead:\n" + "\n".join(hits))


def test_relative_links_in_the_manual_resolve():
    for path in [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "BENCHMARKS.md", *DOC_FILES[1:]]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)}: broken link {target}"
