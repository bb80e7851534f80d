"""Ways of cutting a model across the mesh, one module per technique, applied in a fixed order."""

from allhands.parallel.ddp import apply_ddp

__all__ = ["apply_ddp"]
