"""Replica groups (``fault.mode = "replica"``): survivors keep training while a failed group restarts
or a spare takes its place, and the returning group heals from a live peer (torchft's idea, built
on torch's own process groups and stores).

- ``membership.py`` a decided quorum (members, steps, incarnations, shares of the batch)
- ``quorum.py``  the groups' quorum: forming it, one process group per quorum id, the reduce
- ``spares.py``  hot spares: claim a dead group's place, hand it over
- ``heal.py``    a joiner takes the most advanced member's state; the loop hooks of the mode
- ``start.py``   the mode's start-up in a worker process: join, claim or wait, then train

Nothing in ``allhands.sync`` or ``allhands.ps`` imports it.
"""
