"""Files other local users cannot plant or read: a private temporary directory per job, run
directories and secret files that must be the job user's own, and writes that never follow a
symlink.

The threat is another unprivileged user on the same host (SECURITY.md). In a shared, sticky
temporary directory they can create any name we have not yet created, or re-create one we
unlinked (torch's process spawner does exactly that with the pickle it reads a failed worker's
traceback from: ``torch/multiprocessing/spawn.py``, ``start_processes``); in a directory they
can write they can swap a file for a symlink to one only we may write. So the launcher and
everything it starts use a directory only this user can enter (``mkdtemp``: mode 0700, an
unguessable name), created fresh per job and removed at exit; run directories must be ours and
not writable by anyone else; and every file we create is mode 0600 (directories 0700) whatever
the umask, since checkpoints and metrics are the user's data.
"""

from __future__ import annotations

import contextlib
import os
import fcntl
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

PRIVATE_UMASK = 0o077
"""Files 0600, directories 0700: set for the whole job (launcher and workers inherit it)."""
_PREFIX = "allhands-"


def owner_problem(st: os.stat_result, what: str, path: str | Path) -> str | None:
    """Why a directory or file with status ``st`` is not safe for this user to trust, or None:
    it must belong to this user and be writable by no one else."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return (f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {uid}): another "
                f"user could change what the job reads or redirect what it writes; use a "
                f"directory of your own")
    if st.st_mode & 0o022:
        return (f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                f"they could swap its files for symlinks; run `chmod go-w {path}` or use a "
                f"private directory")
    return None


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Run the job with :data:`PRIVATE_UMASK` (workers inherit it), then restore the user's."""
    old = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def private_tmp() -> Iterator[Path]:
    """A fresh temporary directory only this user can enter, made the process's and its
    children's temporary directory (``tempfile.tempdir``, ``TMPDIR``) until it is removed.

    Its name carries this user's uid, and this process holds a lock on it while it runs, so that
    the next job of the same user removes one that a killed launcher left behind
    (:func:`sweep_stale`).
    """
    shared = tempfile.gettempdir()
    sweep_stale(Path(shared))
    # Made under a name the sweep does not match, locked, then renamed: a directory under the
    # swept name is locked from its first instant, so two launchers starting together (replica
    # groups forked at once) cannot sweep each other's before it is locked.
    pending = Path(tempfile.mkdtemp(prefix=f".{_PREFIX}{os.geteuid()}-", dir=shared))
    held = os.open(pending, os.O_RDONLY | os.O_DIRECTORY)  # not inherited (O_CLOEXEC by default)
    fcntl.flock(held, fcntl.LOCK_EX)
    path = Path(shared) / pending.name[1:]
    os.rename(pending, path)  # the random suffix is mkdtemp's: no other directory has this name
    saved_dir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = str(path)
    os.environ["TMPDIR"] = str(path)
    try:
        yield path
    finally:
        tempfile.tempdir = saved_dir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(path, ignore_errors=True)
        os.close(held)


def _bound_unix_sockets() -> set[str] | None:
    """The paths of the Unix sockets bound in every network namespace that one of this user's
    processes is in (Linux: /proc/PID/net/unix, one read per namespace), or None where /proc
    cannot tell. /proc/net/unix alone lists only this process's namespace: from a test's or a
    container's namespace sharing /tmp, a live forkserver elsewhere would look unbound."""
    seen: set[str] = set()
    bound: set[str] = set()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
                continue
            ns = os.readlink(f"/proc/{pid}/ns/net")
            if ns in seen:
                continue
            lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        seen.add(ns)
        bound |= {f[7] for f in map(str.split, lines) if len(f) > 7}
    return bound if seen else None


def sweep_stale_pymp(shared: Path) -> list[Path]:
    """Remove this user's multiprocessing ``pymp-*`` directories in ``shared`` that hold one or
    more sockets and nothing else, none of them bound any more: what a launcher killed by a
    signal (and its forkserver, if that did not get to it: forkstart.py) left behind. A live one
    is never touched (its forkserver's socket is bound), nor an empty one (a process that just
    made it has yet to bind its socket there); nothing is connected to."""
    # The directories first, then the bound sockets: a forkserver that makes its directory and
    # binds there after the listing is not a candidate, and one listed before the snapshot is in
    # it if still bound (a socket's file appears when it is bound). The other order swept a
    # forkserver started between the two reads (measured: a test worker's, mid-suite).
    candidates = []
    for d in shared.glob("pymp-*"):
        try:
            if d.is_symlink() or d.stat().st_uid != os.geteuid():
                continue
            entries = list(d.iterdir())
            if entries and all(stat.S_ISSOCK(e.lstat().st_mode) for e in entries):
                candidates.append((d, entries))
        except OSError:
            continue
    bound, removed = _bound_unix_sockets() if candidates else None, []
    if bound is None:
        return removed
    for d, entries in candidates:
        try:
            if all(str(e) not in bound for e in entries):
                for e in entries:
                    e.unlink()
                d.rmdir()  # refused if anything appeared there meanwhile
                removed.append(d)
        except OSError:
            continue
    return removed


def sweep_stale(shared: Path) -> list[Path]:
    """Remove private temporary directories of this user that no running launcher holds (the
    lock of a killed one went with it), and its dead multiprocessing directories
    (:func:`sweep_stale_pymp`); returns what was removed. Another user's are left alone."""
    removed = sweep_stale_pymp(shared)
    try:
        entries = [e for e in os.scandir(shared) if e.name.startswith(f"{_PREFIX}{os.geteuid()}-")]
    except OSError:
        return removed
    for e in entries:
        try:
            fd = os.open(e.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its launcher runs
            continue
        finally:
            os.close(fd)
        shutil.rmtree(e.path, ignore_errors=True)
        removed.append(Path(e.path))
    return removed


def open_private(path: str | Path, mode: str = "w", **kw):
    """``open(path, mode)`` for writing (``w``/``a``, text or binary) that refuses to follow a
    symlink at ``path`` (``O_NOFOLLOW``: ELOOP) and creates the file mode 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    fd = os.open(path, flags, 0o600)
    try:
        return os.fdopen(fd, mode, **kw)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` (mode 0600, never through a symlink)."""
    with open_private(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_owned_secret(path: str | Path) -> str:
    """The text of a secret file that belongs to this user and no one else may read or write.

    The checks are made on the file actually opened (``fstat``), so a path swapped between the
    check and the read changes nothing. Raises PermissionError with a one-line reason."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user (uid "
                                  f"{os.geteuid()}): whoever owns it can read or change the "
                                  f"secret; use a file of your own (`chmod 600`)")
        if st.st_mode & 0o077:
            raise PermissionError(f"{path} is readable or writable by other users (mode "
                                  f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}` and "
                                  f"start again")
        return f.read().decode("utf-8")
