"""Node handlers: one module per op family, each a few per-axis rules (see strategy.expand).

Adding an op is one registration: a target added to a family's tuple (``POINTWISE_OPS`` in
``pointwise.py``, ``BINARY_SELECT_OPS`` in ``sorting.py``) or one :func:`register` call. That gives
its strategies (the rules), its local kernel (the op itself on local shards unless the
registration passes ``kernel=``), its cost (priced by ``family``), ``autoshard ops``, and, for
the families ``pointwise`` and ``matmul``, its test: tests/test_handlers_generated.py derives the
op's inputs from its schema and simulates every strategy on each test mesh. An op whose inputs
the schema cannot give (a required ``int``/``float``/``bool``/``str`` argument, integer-only
operands) fails that test, naming itself, until it gets an entry in the test's ``OVERRIDES`` (or
``TESTED_ELSEWHERE``). Ops of other families need a hand-written case in their
tests/test_handlers_*.py. The README's op table lists the ops of the supported models' graphs,
and is regenerated, not edited: ``python bench/op_coverage.py && python bench/update_readme.py``
(tests/test_readme_commands.py fails when a registration changes it and it was not rerun).
"""
from . import matmul  # noqa: F401  (registers handlers)
from . import norms, pointwise, reductions  # noqa: F401  (registers handlers)
from . import attention, conv, embedding, loss, pooling  # noqa: F401  (registers handlers)
from . import reshape, permute_expand, indexing, identity, factory  # noqa: F401  (registers handlers)
from . import grouped_mm, sorting  # noqa: F401  (registers handlers)
from .registry import REGISTRY, Handler, handler_for, register, register_replicate_only

__all__ = ["REGISTRY", "Handler", "handler_for", "register", "register_replicate_only"]
