"""The pipeline schedules torch ships, what each needs, and the checks of ``parallel.pp_*``.

The names are torch's ``Schedule<Name>`` classes (torch.distributed.pipelining.schedules,
torch 2.13) in lower case without "Schedule". What each takes was measured on gloo with the
reference GPT: the gradients of one step at pp=2 and pp=4 against one process (relative 1e-6),
for every microbatch count that divides the batch from 1 to 18; torch's own constructor refuses
the rest with a ValueError these checks turn into one line before any worker starts.
"""

from __future__ import annotations

from allhands.errors import ConfigError

# lower-case name -> torch's class name
PP_SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",                              # Huang et al. 2019
    "1f1b": "Schedule1F1B",                                # Narayanan et al. 2021 (PipeDream-Flush)
    "interleaved1f1b": "ScheduleInterleaved1F1B",          # Narayanan et al. 2021
    "loopedbfs": "ScheduleLoopedBFS",                      # Lamy-Poirier 2023
    "interleavedzerobubble": "ScheduleInterleavedZeroBubble",  # Qi et al. 2024, ZB1P
    "zbvzerobubble": "ScheduleZBVZeroBubble",              # Qi et al. 2024, section 6
    "dualpipev": "ScheduleDualPipeV",                      # DeepSeek-V3 2024 (DualPipe, folded)
}
PP_SCHEDULES = tuple(PP_SCHEDULE_CLASSES)
SINGLE_STAGE = ("gpipe", "1f1b")                           # one stage per rank
V_SCHEDULES = ("zbvzerobubble", "dualpipev")               # exactly two stages per rank, as a V
LOOPED = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble")  # >= 2 stages per rank, looped
ZERO_BUBBLE = ("interleavedzerobubble", "zbvzerobubble", "dualpipev")  # backward split in two
ROUNDS = ("interleaved1f1b", "interleavedzerobubble")      # run microbatches in rounds of pp


def pp_stages_per_rank(p) -> int:
    """``parallel.pp_stages_per_rank`` resolved (0: 1 for gpipe/1f1b, 2 for the rest)."""
    return p.pp_stages_per_rank or (1 if p.pp_schedule in SINGLE_STAGE else 2)


def pp_microbatches(p, pp: int) -> int:
    """``parallel.pp_microbatches`` resolved (0: one per stage)."""
    return p.pp_microbatches or pp * pp_stages_per_rank(p)


def check_stages_per_rank(p, pp: int) -> int:
    """The resolved stages per rank, or ConfigError naming what the schedule needs."""
    s, v = p.pp_schedule, pp_stages_per_rank(p)
    if pp == 1:
        if p.pp_stages_per_rank > 1:
            raise ConfigError("parallel.pp_stages_per_rank: several stages per rank need parallel.pp > 1")
        return v
    if s in SINGLE_STAGE and v != 1:
        raise ConfigError(f"parallel.pp_stages_per_rank: {s} runs one stage per rank, got {v}; "
                          f"use parallel.pp_schedule=interleaved1f1b for several")
    if s in V_SCHEDULES and v != 2:
        raise ConfigError(f"parallel.pp_stages_per_rank: {s} runs exactly 2 stages per rank (a V: "
                          f"rank r holds stages r and 2*pp-1-r), got {v}; use 2 (or 0)")
    if s in LOOPED and v < 2:
        raise ConfigError(f"parallel.pp_stages_per_rank: {s} needs >= 2 stages per rank, got "
                          f"{v}; use 2 (or 0) or parallel.pp_schedule=1f1b")
    return v


def check_microbatches(p, pp: int, mb: int) -> None:
    """ConfigError when schedule ``p.pp_schedule`` cannot run ``mb`` microbatches over ``pp`` ranks."""
    s, stages = p.pp_schedule, pp * pp_stages_per_rank(p)
    if s == "1f1b" and mb < pp:
        raise ConfigError(f"parallel.pp_microbatches: 1f1b needs at least parallel.pp={pp} "
                          f"microbatches to fill the pipeline, got {mb}")
    if s == "dualpipev" and mb < stages:
        raise ConfigError(f"parallel.pp_microbatches: dualpipev needs at least as many microbatches as "
                          f"stages (2 x parallel.pp = {stages}), got {mb}")
    rounds = max(1, mb // pp)
    if s in ROUNDS and mb % rounds:
        raise ConfigError(f"parallel.pp_microbatches: {s} runs rounds of pp={pp} microbatches; "
                          f"{mb} is not a multiple of its {rounds} rounds (mb // pp), use a multiple of {pp}")

