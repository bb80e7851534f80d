"""When a server answers a worker: the rule of each ``ps.mode`` (sync rounds, async at once,
ssp's staleness bound) over the replies that wait, as a pure function the server calls after each
request and the tests call without processes."""

from __future__ import annotations

Waiting = list[tuple[int, int, bool]]  # (worker, its clock, with parameters) replies due


def due_replies(waiting: Waiting, mode: str, in_round: set[int], clocks: list[int], active: set[int],
                max_staleness: int) -> tuple[list[tuple[int, int, bool]], Waiting]:
    """Which replies go now, as (worker, clock gap to the slowest active worker, with
    parameters), and which wait: all go, except under sync a worker whose push is in the round
    not yet applied, and under ssp an active worker more than ``max_staleness`` ahead. A sync
    pull without a push (a worker's start) goes at once: held until the round that the other
    workers' first pushes opened, it would wait for its own push, which follows the reply.
    The replies go slowest worker first: under ssp the slowest paces everyone, so a reply to it
    that queued behind the released leaders' parameter transfers would slow them all."""
    slowest = min((clocks[k] for k in active), default=0)
    go, keep = [], []
    for src, clock, pull in sorted(waiting, key=lambda r: r[1]):
        gap = clock - slowest
        held = (mode == "sync" and src in in_round or
                mode == "ssp" and gap > max_staleness and src in active)
        (keep if held else go).append((src, clock, pull) if held else (src, gap, pull))
    return go, keep
