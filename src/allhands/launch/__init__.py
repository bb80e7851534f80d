"""Starting and keeping workers alive: the launcher, the run directory, the restart policy, the
single-node supervisor, the multi-node elastic agent and the narrow rendezvous."""
