"""Ways of cutting a model across the mesh, one module per technique, applied in the fixed order
of :func:`allhands.parallel.parallelize.parallelize`."""

from allhands.parallel.ddp import apply_ddp
from allhands.parallel.parallelize import parallelize

__all__ = ["apply_ddp", "parallelize"]
