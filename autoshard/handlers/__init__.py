"""Node handlers: one module per op family, each a few per-axis rules (see strategy.expand)."""
from . import matmul  # noqa: F401  (registers handlers)
from . import norms, pointwise, reductions  # noqa: F401  (registers handlers)
from . import attention, conv, embedding, loss, pooling  # noqa: F401  (registers handlers)
from . import views, factory  # noqa: F401  (registers handlers)
from . import grouped_mm, sorting  # noqa: F401  (registers handlers)
from .registry import REGISTRY, Handler, handler_for, register, register_replicate_only

__all__ = ["REGISTRY", "Handler", "handler_for", "register", "register_replicate_only"]
