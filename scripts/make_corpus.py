"""Regenerate src/allhands/data/corpus.txt.gz: English prose from the docstrings of CPython's
standard library (PSF licence), so the default job trains on real text with nothing downloaded.

The file is generated once and shipped, so every install trains on identical bytes whatever
its Python version. Run: python scripts/make_corpus.py [--min-mb 1.5]
"""
import argparse
import ast
import gzip
import sysconfig
from pathlib import Path


def docstrings(path: Path):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 100 and doc.count(" ") > len(doc) / 12:
                yield doc.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-mb", type=float, default=1.0)
    ap.add_argument("--out", default=str(Path(__file__).parents[1] / "src/allhands/data/corpus.txt.gz"))
    args = ap.parse_args()
    lib = Path(sysconfig.get_paths()["stdlib"])
    seen, parts, size = set(), [], 0
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        for doc in docstrings(path):
            if doc not in seen:
                seen.add(doc)
                parts.append(doc)
                size += len(doc.encode()) + 2
    text = "\n\n".join(parts) + "\n"
    if size < args.min_mb * 2**20:
        raise SystemExit(f"only {size / 2**20:.2f} MiB of docstrings found; need {args.min_mb}")
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:
        f.write(text.encode("utf-8"))
    print(f"wrote {args.out}: {len(text.encode()) / 2**20:.2f} MiB of text from {len(parts)} docstrings")


if __name__ == "__main__":
    main()
