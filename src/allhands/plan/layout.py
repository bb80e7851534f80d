"""A layout as the planner prices it: the mesh's sizes (dp_replicate, dp_shard, tp, pp, cp, ep),
the ZeRO stage, the pipeline's microbatches and schedule, activation checkpointing and compile;
its name in the plan's table and the ``--set`` items that train it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    zero: int
    microbatches: int = 1  # pipeline microbatches (1 without pp)
    ac: str = "none"
    compile: bool = False
    cp: int = 1  # context parallel: each rank holds 1/cp of every sequence
    ep: int = 1  # expert parallel: each rank of an ep group holds 1/ep of every MoE layer's experts
    schedule: str = "1f1b"  # parallel.pp_schedule (schedule.py prices each)
    stages_per_rank: int = 1  # parallel.pp_stages_per_rank: 2 for the interleaved and V schedules

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def grad_view(self) -> "Layout":
        """The layout as its gradient reduction sees it: the cp ranks of a group hold the same
        parameters, so they join the data-parallel ranks (FSDP shards over dp_shard x cp)."""
        if self.cp == 1:
            return self
        if self.zero >= 1:
            return dataclasses.replace(self, dp_shard=self.dp_shard * self.cp, cp=1)
        return dataclasses.replace(self, dp_replicate=self.dp_replicate * self.cp, cp=1)

    def overrides(self) -> list[str]:
        """The ``--set`` items that train this layout."""
        return [f"parallel.dp_replicate={self.dp_replicate}", f"parallel.dp_shard={self.dp_shard}",
                f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.zero={self.zero}",
                f"parallel.pp_microbatches={self.microbatches if self.pp > 1 else 0}",
                f"parallel.ac={self.ac}", f"run.compile={str(self.compile).lower()}",
                f"parallel.cp={self.cp}"] + ([f"parallel.ep={self.ep}"] if self.ep > 1 else []) + (
                [f"parallel.pp_schedule={self.schedule}", f"parallel.pp_stages_per_rank={self.stages_per_rank}"]
                if self.pp > 1 else [])

    def name(self) -> str:
        parts = [f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_shard > 1 and self.dp_replicate > 1
                 else f"dp{self.dp}", f"zero{self.zero}"]
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"pp{self.pp}/m{self.microbatches}"] if self.pp > 1 else []
        parts += [f"{self.schedule}/v{self.stages_per_rank}"] if self.pp > 1 and self.schedule != "1f1b" else []
        parts += [f"ac:{self.ac}"] if self.ac != "none" else []
        parts += ["compile"] if self.compile else []
        return " ".join(parts)
