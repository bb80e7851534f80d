"""Planning before launch: every layout of a job on a cluster with its predicted per-rank memory,
step time and MFU (search.py, estimate.py, cluster.py); ``plan.check`` runs the ones that fit
this machine and compares."""

from allhands.plan.cluster import PRESETS, Cluster, local_cluster, parse_cluster
from allhands.plan.estimate import Estimate, Layout, estimate, stage_params
from allhands.plan.search import layouts, plan, with_layout

__all__ = ["PRESETS", "Cluster", "Estimate", "Layout", "estimate", "layouts", "local_cluster",
           "parse_cluster", "plan", "stage_params", "with_layout"]
