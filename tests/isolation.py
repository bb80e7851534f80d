"""Isolation of the tests that share a machine-wide resource, whatever runs them.

Two mechanisms, both plain file locks (``fcntl.flock``), so that neither depends on how a
scheduler (pytest-xdist's groups, two pytest runs side by side, a developer's own run) spreads
the tests:

- ``@pytest.mark.exclusive("netlab")``: the test holds the machine-wide lock ``netlab`` from its
  set-up to its teardown, so no two tests of that group run at once. A fixture that keeps such
  a resource alive between tests (a module's network lab) holds it too (:func:`exclusive`,
  re-entrant within a process). At collection, a test that builds a network lab (itself or
  through a fixture) without the mark is an error, and so is a lock directory that cannot be
  locked.
- :func:`shared_once`: a fixture's result (a trained job that tests only read) is built by
  the first pytest worker that asks for it, under a lock, in a directory every worker of the
  run sees; the others wait and read it.

And one rule: tests write only under temporary directories. The run gets a cache directory of
its own (``ALLHANDS_CACHE_DIR``, inherited by the workers and every process a test starts, so
the embedded corpus is prepared once per run and jobs share compiled kernels), and a run that
leaves anything new in the checkout's root or in the user's own allhands cache fails, naming it.
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from allhands.env import cache_dir

# Taken now, before a launcher in this process points tempfile at a private directory.
LOCK_DIR = Path(tempfile.gettempdir()) / f"allhands-test-locks-{os.geteuid()}"
# What a test that needs the netlab group builds: any of these in its source or its fixtures'.
NETLAB_SIGNS = ("Lab(", "netns")

_held: dict[str, tuple[int, int]] = {}  # name -> (fd, depth) held by this process
_guard = threading.Lock()


@contextlib.contextmanager
def exclusive(name: str) -> Iterator[None]:
    """Hold the machine-wide lock ``name`` (re-entrant within this process)."""
    with _guard:
        fd, depth = _held.get(name, (-1, 0))
    if depth == 0:
        LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(LOCK_DIR / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
    with _guard:
        _held[name] = (fd, depth + 1)
    try:
        yield
    finally:
        with _guard:
            fd, depth = _held[name]
            if depth == 1:
                del _held[name]
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            else:
                _held[name] = (fd, depth - 1)


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that every pytest-xdist worker of this run sees (the parent of each
    worker's own base directory), or this run's base directory without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_once(tmp_path_factory: pytest.TempPathFactory, key: str,
                build: Callable[[Path], Any]) -> Any:
    """``build(directory)``'s JSON-able result, computed once per test run across workers."""
    root = shared_root(tmp_path_factory)
    fd = os.open(root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        done = root / f"{key}.json"
        if done.exists():
            return json.loads(done.read_text())
        directory = root / key
        directory.mkdir()
        value = build(directory)
        done.write_text(json.dumps(value))
        return value
    finally:
        os.close(fd)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exclusive(name): holds the machine-wide lock NAME for the "
                            "whole test: no two tests of one group run at once (tests/isolation.py)")
    if not hasattr(config, "workerinput"):  # the controlling process (or the only one)
        # allhands' per-user cache (the embedded corpus, the GEMM peak, inductor's kernels) is
        # this run's own: the pytest-xdist workers and every process a test starts inherit it.
        before = os.environ.get("ALLHANDS_CACHE_DIR")
        user = cache_dir()  # the user's own, as allhands finds it outside the tests
        config.stash[_USER_CACHE_KEY] = (user, _tree(user))
        run_cache = tempfile.mkdtemp(prefix="allhands-test-cache-")
        os.environ["ALLHANDS_CACHE_DIR"] = run_cache

        def restore() -> None:
            shutil.rmtree(run_cache, ignore_errors=True)
            if before is None:
                os.environ.pop("ALLHANDS_CACHE_DIR", None)
            else:
                os.environ["ALLHANDS_CACHE_DIR"] = before

        config.add_cleanup(restore)


def _tree(root: Path) -> dict[str, int]:
    """Every path under ``root`` with its modification time (ns)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            p = Path(d) / name
            with contextlib.suppress(OSError):
                out[str(p.relative_to(root))] = p.lstat().st_mtime_ns
    return out


def _has_sign(obj: Any) -> bool:
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return False
    return any(sign in source for sign in NETLAB_SIGNS)


def _builds_lab(item: pytest.Item) -> bool:
    """The test, or a fixture it uses, builds a network lab (read from their source)."""
    if not _has_sign(getattr(item, "module", None)):
        return False
    info = getattr(item, "_fixtureinfo", None)
    defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
    return any(_has_sign(f) for f in (getattr(item, "function", None), *(d.func for d in defs)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fail loudly when isolation would not hold: a test that builds a network lab without the
    mark, or a lock directory that cannot be locked."""
    unmarked = [i.nodeid for i in items if not i.get_closest_marker("exclusive") and _builds_lab(i)]
    if unmarked:
        raise pytest.UsageError("these tests build a network lab but are not marked "
                                "@pytest.mark.exclusive(\"netlab\"), so two labs could run at once: "
                                + ", ".join(unmarked))
    try:
        with exclusive("collection-check"):
            pass
    except OSError as e:
        raise pytest.UsageError(f"cannot take the tests' machine-wide locks in {LOCK_DIR}: {e}")


@pytest.fixture(autouse=True)
def _exclusive_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    marks = [m.args[0] for m in request.node.iter_markers("exclusive")]
    with contextlib.ExitStack() as stack:
        for name in sorted(set(marks)):  # one order everywhere: no lock-order deadlock
            stack.enter_context(exclusive(name))
        yield


def _checkout_entries(config: pytest.Config) -> set[str]:
    return {p.name for p in config.rootpath.iterdir()}


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controlling process (or the only one)
        session.config.stash[_ROOT_KEY] = _checkout_entries(session.config)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tests write only under their own temporary directories: anything new in the checkout's
    root (a default ``runs/``), or anything written in the user's allhands cache, fails the run,
    named."""
    before = session.config.stash.get(_ROOT_KEY, None)
    if before is None:
        return
    new = sorted(_checkout_entries(session.config) - before - {".pytest_cache"})
    if new:
        print(f"\nERROR: the tests wrote into the checkout's root: {', '.join(new)}; a test must "
              f"write under its tmp_path")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    user, cache_before = session.config.stash.get(_USER_CACHE_KEY, (None, None))
    if user is not None:
        after = _tree(user)
        changed = sorted(k for k in after.keys() | cache_before.keys() if after.get(k) != cache_before.get(k))
        if changed:
            print(f"\nERROR: the tests wrote into the user's cache {user}: "
                  f"{', '.join(changed[:5])}; a process a test starts must inherit ALLHANDS_CACHE_DIR")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


_ROOT_KEY = pytest.StashKey[set]()
_USER_CACHE_KEY = pytest.StashKey[tuple]()
