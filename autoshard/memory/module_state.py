"""Module state inside checkpoint regions: in-place-updated inputs (buffers such as batch-norm
running statistics) passed by reference, and updated once per step even when a region is recomputed."""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["STATE_META", "StateRef", "state_of", "state_ref", "update_state_once"]


STATE_META = "module_state"
"""On placeholders (set by the runtime): the value is module state that ops update in place (a
buffer such as batch-norm running statistics). A checkpoint region takes such an input by
reference (:class:`StateRef`) rather than as a saved tensor, whose version check would fail
once the region has updated it."""


class StateRef:
    """A tensor handed to a checkpoint region by reference (see :data:`STATE_META`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


def state_ref(tensor: Any) -> StateRef:
    return StateRef(tensor)


def state_of(ref: StateRef) -> Any:
    return ref.tensor


def update_state_once(fn: Callable[..., Any], state: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; when it runs again in backward (the recomputation of a checkpoint
    region), the module state at positions ``state`` is handed in as copies, so that in-place
    updates (running statistics, batch counters) happen once per step, as in the model."""
    if torch._C._current_graph_task_id() != -1:
        args = tuple(a.clone() if i in state and isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
    return fn(*args, **kwargs)
