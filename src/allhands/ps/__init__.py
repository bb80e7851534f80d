"""The parameter server (DistBelief's Downpour SGD, Dean et al. 2012): ``parallel.sync = "ps"``.

The last ``ps.servers`` ranks hold the parameters cut into byte-balanced pieces and apply every
update; the other ranks are workers that push gradients and pull parameters. Its own package
because it is its own protocol:

- ``client.py``  the worker side, a sync strategy (``PSSync``) the one training loop calls
- ``server.py``  the server loop: rounds (sync), Downpour (async), bounded staleness
- ``replies.py`` when a server answers a worker, per mode
- ``shard.py``   a server's slice of the parameters and its optimizer, checkpointed
- ``rows.py``    embedding tables whose rows are fetched on demand
- ``messages.py`` the worker's sends and receives to each server, a failed link remembered
- ``wire.py``    roles, the byte-balanced shard plan, the request header, point-to-point transport
- ``links.py``   replica mode: one link per worker and server incarnation, over a MAC'd store
- ``start.py``   the mode's start-up in a worker process: a server, or a worker's trainer

It imports ``allhands.sync.base`` (the strategy interface) and nothing of ``allhands.replica``.
"""
