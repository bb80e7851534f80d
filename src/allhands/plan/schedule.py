"""Pipeline schedules as the trainer runs them (parallel/pipeline.py on torch's
``torch.distributed.pipelining``): which blocks each pipeline rank holds, how many microbatches'
activations it keeps at once, and its bubble.

Split: ``pp x v`` stages (``v`` = ``parallel.pp_stages_per_rank``) of ``n_layer // stages``
blocks, the first ``n_layer % stages`` stages one more (pipeline.py's ``balanced_split``; the
embedding rides with stage 0, the head with the last). Placement (pipeline.py's
``stage_ids_of``): looped, rank ``r`` holds ``r, r + pp, ...``; the V schedules fold two stages
into a V, rank ``r`` holds ``r`` and ``2 pp - 1 - r`` (so rank 0 holds the embedding and the
head). The busiest rank sets the step.

Bubble, in units of one microbatch through a rank's whole share (``t_mb``), split into forward
``F``, input-gradient backward ``B`` and weight-gradient ``W`` (F + B + W = t_mb):
gpipe and 1F1B ``(pp - 1) t_mb`` (Narayanan et al. 2021); interleaved 1F1B and looped BFS
``(pp - 1) t_mb / v`` (the same paper; Lamy-Poirier 2023); interleaved zero bubble (ZB-H1 looped,
Qi et al. 2024) ``(pp - 1)(F + B - W) / v``; ZB-V and DualPipeV ``(pp - 1)(F + B - 2 W) / v``,
none when the weight gradients fill it (Qi et al. 2024, section 6).

Activations held, in microbatches of a rank's whole share, by rank ``r``: gpipe and looped BFS
every microbatch; 1F1B ``pp - r``; interleaved ``((v - 1) pp + 2 (pp - r - 1) + 1) / v``
(Megatron-LM's warm-up count, which torch's interleaved schedules follow); ZB-V ``pp`` on every
rank (the paper's "same memory as 1F1B", spread evenly by the V); DualPipeV ``pp + 1``
(DeepSeek-V3 2024, Table 2); never more than the microbatches.
"""

from __future__ import annotations

# the schedule names of config/pipeline.py (kept here as strings: the planner needs no torch)
SINGLE = ("gpipe", "1f1b")
V_SHAPED = ("zbvzerobubble", "dualpipev")
# what the search tries beside 1F1B: the interleaved schedule and the zero-bubble V, each with
# two stages per rank (config/pipeline.py's default for them)
SEARCHED = (("1f1b", 1), ("interleaved1f1b", 2), ("zbvzerobubble", 2))


def stage_blocks(n_layer: int, stages: int) -> list[int]:
    base, extra = divmod(n_layer, stages)  # parallel/pipeline.py's balanced_split
    return [base + (1 if s < extra else 0) for s in range(stages)]


def stage_ids(rank: int, pp: int, v: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``rank`` holds (parallel/pipeline.py's ``stage_ids_of``)."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(v)]


def rank_layers(n_layer: int, pp: int, v: int = 1, schedule: str = "1f1b") -> list[tuple[list[range], bool, bool]]:
    """Per pipeline rank: (the block ranges of its stages, holds the first stage, holds the last)."""
    stages = pp * v
    blocks = stage_blocks(n_layer, stages)
    starts = [sum(blocks[:s]) for s in range(stages)]
    out = []
    for r in range(pp):
        ids = stage_ids(r, pp, v, schedule)
        out.append(([range(starts[s], starts[s] + blocks[s]) for s in ids], 0 in ids, stages - 1 in ids))
    return out


def in_flight(schedule: str, pp: int, v: int, microbatches: int, rank: int = 0) -> float:
    """Microbatches (of a rank's whole share) whose activations pipeline rank ``rank`` holds at once."""
    if pp == 1:
        return 1.0
    if schedule in ("gpipe", "loopedbfs"):
        held = float(microbatches)
    elif schedule == "1f1b":
        held = float(pp - rank)
    elif schedule == "zbvzerobubble":  # the V evens the ranks out
        held = float(pp)
    elif schedule == "dualpipev":
        held = pp + 1.0
    else:  # interleaved1f1b, interleavedzerobubble: Megatron-LM's warm-up chunks + 1
        held = ((v - 1) * pp + 2 * (pp - rank - 1) + 1) / v
    return min(held, float(microbatches))


def bubble(schedule: str, pp: int, v: int, f: float, b: float, w: float) -> float:
    """Idle seconds of one pass of the pipeline for forward ``f``, input-gradient ``b`` and
    weight-gradient ``w`` seconds of one microbatch through a rank's whole share."""
    if pp == 1:
        return 0.0
    if schedule in SINGLE:
        return (pp - 1) * (f + b + w)
    if schedule in ("interleaved1f1b", "loopedbfs"):
        return (pp - 1) * (f + b + w) / v
    if schedule == "interleavedzerobubble":
        return (pp - 1) * max(0.0, f + b - w) / v
    return (pp - 1) * max(0.0, f + b - 2 * w) / v  # zbvzerobubble, dualpipev
