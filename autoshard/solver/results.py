"""What the solver takes and returns: :class:`SolverOptions` in, :class:`Solution` out (the strategy
per node, the memory decision per segment, the modeled :class:`TimePrediction` and
:class:`MemoryPrediction`, and how the solve went), and :data:`Reshard` (where edges may reshard).
Plain data: no PuLP here."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..decisions import DECISIONS


Reshard = bool | frozenset[str]
"""Where edges may reshard (``solve(reshard=...)``): True everywhere; False nowhere but into the
graph's outputs (penalised); a set of CGNode names: only out of those nodes and into the outputs."""


@dataclass(frozen=True)
class SolverOptions:
    memory_budget: int | None = None          # bytes per device; None = unconstrained
    optimizer_bytes_per_param: float = 8.0    # AdamW fp32: exp_avg + exp_avg_sq
    decisions: tuple[str, ...] = DECISIONS    # memory decisions the solver may use
    solver: str = "highs"                     # "highs" (highspy) or "cbc"
    time_limit: float = 60.0
    gap_rel: float = 0.0
    threads: int | None = None
    fixed_decision: str | None = None         # force one memory decision on every segment (baselines)
    break_symmetry: bool = True               # order decisions of identical unaliased blocks (.symmetry)


@dataclass
class MemoryPrediction:
    """Bytes per device at the training peak."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    param_copies: float = 0.0     # parameters read larger than stored (gathered), held until backward
    grad_buckets: float = 0.0     # the runtime's gradient bucket buffers (bucketed gradients, reduce dtype)
    activations: float = 0.0      # kept activations incl. checkpoints
    working_set: float = 0.0      # largest recomputed/offloaded segment brought back
    post_segment: float = 0.0     # part of activations saved after the last segment: freed by the
                                  # backward before any segment's working set is brought back
    backward_peak: float = 0.0    # activations live at the worst rebuild in backward, given where
                                  # each decision sits in the block sequence (0: nothing rebuilt)

    @property
    def bound(self) -> float:
        """The position-free peak the ILP bounds by the budget: every segment's held activations
        are counted as live while the largest working set is rebuilt."""
        return self.static + max(self.activations, self.activations - self.post_segment + self.working_set)

    @property
    def peak(self) -> float:
        """The modeled peak: the end of forward, or the worst rebuild in backward, when a segment's
        working set comes back while only the segments before it still hold activations (at most
        :attr:`bound`)."""
        return self.static + max(self.activations, self.backward_peak)

    @property
    def static(self) -> float:
        """What is held for the whole step: parameters, gradients, optimizer state, the parameter
        copies read until backward, and the gradient buckets (kept from step to step)."""
        return self.params + self.grads + self.optimizer + self.param_copies + self.grad_buckets

    def to_dict(self) -> dict:
        return {**self.__dict__, "peak": self.peak, "bound": self.bound}


@dataclass
class TimePrediction:
    """Seconds of one training step, by kind."""

    compute: float = 0.0
    comm: float = 0.0
    reshard: float = 0.0
    recompute: float = 0.0
    offload: float = 0.0
    grad_sync: float = 0.0        # bucketed gradient all-reduces the step waits for (not hidden)
    optimizer: float = 0.0
    sync_wait: float = 0.0        # collectives' waits for ranks that drifted apart (see .sync_wait)

    @property
    def total(self) -> float:
        return (self.compute + self.comm + self.reshard + self.recompute + self.offload + self.grad_sync
                + self.optimizer + self.sync_wait)

    def to_dict(self) -> dict:
        return {**self.__dict__, "total": self.total}


@dataclass
class Solution:
    choice: dict[str, int]                     # CGNode name -> strategy index
    decisions: dict[str, str]                  # segment -> memory decision
    time: TimePrediction
    memory: MemoryPrediction
    status: str
    objective: float
    build_seconds: float
    solve_seconds: float
    n_variables: int
    n_constraints: int
    solver: str
    stats: dict = field(default_factory=dict)
    bound: float | None = None     # proven lower bound on the objective (seconds), when the solver reports one

    @property
    def gap(self) -> float | None:
        """Relative distance to the proven bound: 0 when optimal; how far a time-limited solve may be off."""
        if self.bound is None or self.objective <= 0:
            return None
        return max(0.0, (self.objective - self.bound) / self.objective)
