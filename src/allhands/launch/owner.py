"""Whether this process is allhands' own: the ``allhands`` command itself (not a script, notebook
or test runner that calls the API or the CLI's ``main``), a replica group's spawned launcher, or
a process forked from a server of ours. Only such a process's state (its logging, warnings,
``sys.stdout``, open files) is ours to copy: launch/forkstart.py forks the workers' server from it
instead of spawning one. Kept apart from forkstart so that the command marks itself before it
imports torch."""

from __future__ import annotations

_own = [False]


def mark_own() -> None:
    """This process runs allhands alone from here on."""
    _own[0] = True


def is_own() -> bool:
    return _own[0]
