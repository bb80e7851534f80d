"""What ``run.compile`` did in this process by the end of the first step: the graphs dynamo
captured and how many of the graphs inductor compiled (forward and backward of each) it read
from its cache instead of compiling again. The launcher keeps that cache in a directory that
outlives the job (``~/.cache/allhands/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set), so
a restart, a resume or the next run of the same model reads what an earlier one compiled."""

from __future__ import annotations

from torch._dynamo.utils import counters


def compile_record() -> dict[str, int]:
    """This process's counts so far (torch's own counters: dynamo's unique graphs, inductor's
    FX graph cache hits and misses)."""
    return {"compile_graphs": int(counters["stats"]["unique_graphs"]),
            "compile_cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "compile_cache_misses": int(counters["inductor"]["fxgraph_cache_miss"])}


def compile_line(record: dict[str, int]) -> str:
    hits, misses = record["compile_cache_hits"], record["compile_cache_misses"]
    return (f"allhands: compiled {record['compile_graphs']} graph(s) in the first step; "
            f"{hits} of {hits + misses} inductor graph(s) read from its cache")
