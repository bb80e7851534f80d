"""The package's imports point only down its layers (docs/architecture.md), with no cycle.

Read from the source with stdlib ``ast``: every ``import``/``from ... import`` of an allhands
module, at any depth (a function-level import is an import too). A module may import its own
layer or any layer below; an upward import or a cycle fails, naming the pair.
"""

from __future__ import annotations

import ast
import io
from pathlib import Path

from pyflakes.api import checkRecursive
from pyflakes.reporter import Reporter

SRC = Path(__file__).resolve().parents[1] / "src" / "allhands"

# Bottom to top. A module is placed by its longest listed prefix.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("config", "configdoc", "env", "faults", "heartbeat", "netlab", "safefs", "authstore",
     "stopflag", "hooks", "paths"),
    ("collective",),  # allhands' own collectives, below models and muon that use it; mesh registers its groups
    ("data", "models", "metrics", "trackers", "report", "admission", "jobcheck", "job", "optim", "muon", "flops"),
    ("mesh",),
    ("parallel", "sync", "memory", "plan"),
    ("checkpoint",),
    ("ps", "replica"),  # the two modes beyond lock-step: what the loop and its strategy call
    ("trainer", "steplog", "evaluate", "trainer_checkpoints", "agree"),
    ("lockstep",),  # the common path of a worker: mesh -> Trainer -> fit
    ("worker", "ps.start", "replica.start"),  # each mode's start-up; the worker's registry of them
    ("launch",),
    ("drill", "chaos", "allhands", "plan.check", "plan.calibrate"),  # "allhands": the package itself, the Python API
    ("cli",),
]


def modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        rel = f.relative_to(SRC.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = f
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: allhands modules it imports}``."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    keep = len(m.split(".")) - node.level + (1 if is_pkg else 0)
                    base = ".".join(m.split(".")[:keep] + ([base] if base else []))
                # `from pkg import sub` imports the submodule; `from mod import name`, mod
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != m:
                    edges[m].add(n)
    return edges


def layer(module: str) -> int:
    name = module.removeprefix("allhands.") if module != "allhands" else "allhands"
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    assert found is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for m in modules():
        layer(m)


def test_imports_point_down():
    edges = imports(modules())
    upward = [f"{m} (layer {layer(m)}) imports {n} (layer {layer(n)})"
              for m in sorted(edges) for n in sorted(edges[m]) if layer(n) > layer(m)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle():
    found = cycles(imports(modules()))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    """The checks above can fail: a made-up graph with one of each is caught."""
    edges = {"allhands.mesh": {"allhands.trainer"}, "allhands.trainer": {"allhands.mesh"}}
    assert cycles(edges) == [["allhands.mesh", "allhands.trainer"]]
    assert layer("allhands.trainer") > layer("allhands.mesh")
    assert layer("allhands.checkpoint.safe") == layer("allhands.checkpoint")


def test_modules_are_small_and_say_their_idea():
    """Under 400 lines each; each file opens with a docstring (the one idea it holds)."""
    for m, f in modules().items():
        text = f.read_text()
        assert len(text.splitlines()) <= 400, f"{f.relative_to(SRC.parent)} has " \
            f"{len(text.splitlines())} lines; split it (one idea per module)"
        if text.strip():
            assert ast.get_docstring(ast.parse(text)), f"{f.relative_to(SRC.parent)} has no docstring"


def test_no_unused_names_or_undefined_ones():
    """pyflakes over the package, benchmarks, examples and tests: an unused import or an undefined
    name is a merge left half-done."""
    out = io.StringIO()
    root = SRC.parent.parent
    found = checkRecursive([str(root / d) for d in ("src", "bench", "examples", "tests")],
                           Reporter(out, out))
    assert found == 0, out.getvalue()
