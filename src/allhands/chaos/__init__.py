"""Chaos: random faults of every kind over a long run (run.py) and the invariants the job must
keep through them (check.py), for ``allhands drill --chaos``."""
