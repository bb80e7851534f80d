"""Ways of cutting a model across the mesh, one module per technique, applied in the fixed order
of :func:`allhands.parallel.parallelize.parallelize`."""

from allhands.parallel.ac import apply_ac
from allhands.parallel.ddp import apply_ddp
from allhands.parallel.fsdp import apply_fsdp
from allhands.parallel.parallelize import clip_grad_norm, parallelize, transformer_blocks
from allhands.parallel.zero1 import apply_zero1

__all__ = ["apply_ac", "apply_ddp", "apply_fsdp", "apply_zero1", "clip_grad_norm", "parallelize",
           "transformer_blocks"]
