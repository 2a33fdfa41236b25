"""Every rank runs backward on the same training steps, or every rank gets an error in seconds.

A rank that skips ``loss.backward()`` on a step the others run would leave them waiting in the
backward's collectives until the collective timeout, or pair its next forward's collectives with
their backward's (a hang, or silently wrong numbers). :class:`StepWatch` tells that apart from the
legal forward-without-backward on every rank (evaluation under grad mode) through the process
group's key-value store, without a collective on the normal path:

- a *step* is a call of the parallel model whose outputs need a gradient; steps are numbered alike
  on every rank because every rank runs the same calls.
- when backward of step ``s`` starts on rank ``r`` (a gradient reaches the step's outputs, before
  any backward collective) ``r`` sets its key ``bwd/r`` to ``s`` (one store write per step, made by a
  background thread, :class:`_LatestWriter`, so that backward does not wait for the store's reply:
  on 4 gloo ranks sharing 2 cores that round trip waits for the store's server thread to get a core,
  and written inline it cost cnn-12's 6-11 ms steps 1.3-1.5 ms each; see ``bench/step_watch_overhead.py``);
- at the next call of the model, a rank whose step ``s`` got no backward posts ``skip/s/r`` and
  waits until every rank has said what it did with step ``s``: ran backward (``bwd/q >= s`` and no
  ``skip/s/q``) or skipped it too (``skip/s/q``). All skipped: legal, it goes on. Some ran, some
  skipped: it writes a diagnosis (which ranks skipped backward on which step, what to do) to the
  store key ``error`` and raises :class:`SkippedBackwardError`;
- every other rank learns it within :data:`POLL_S`: each collective of the runtime waits in slices
  of :data:`POLL_S` (``Work.wait(timeout)`` returns as soon as the collective completes, so a
  normal step pays nothing) and, between slices and when a collective fails, reads the ``error``
  key; a call of the model reads it too, at most once per :data:`POLL_S`, which reaches ranks whose
  plan has no backward collective to wait in, within a slice of their calls. (A read at every call
  cost up to 2 ms per call on 4 gloo ranks sharing 2 cores, where the store's server thread waits
  for a core: ``bench/step_watch_overhead.py``.)

With ``check_inputs="always"`` every rank waits at every call for every rank's word on the last
step (a store barrier), so all ranks raise at the same call. The keys are per model (``name``, the
same on every rank). A rank's ``skip`` keys are deleted once every rank has moved past them.
Polling is for gloo (CPU) only: an NCCL wait does not block the host, and a timed wait on it would.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch.distributed as dist

from .replicas import ReplicaMismatchError

__all__ = ["POLL_S", "SkippedBackwardError", "StepWatch", "StepWatchStoreError"]

POLL_S = 0.25
"""Seconds a collective waits before it looks for a diagnosis in the store (and again after each slice)."""

_POLL = datetime.timedelta(seconds=POLL_S)
_LOCAL_TIMEOUT = "Operation timed out"      # what Work.wait(timeout) raises when the slice ran out


class SkippedBackwardError(ReplicaMismatchError):
    """Some ranks ran backward of a training step and others did not (raised on every rank)."""


class StepWatchStoreError(RuntimeError):
    """The step watch could not write this rank's word to the process group's store."""


class _LatestWriter:
    """Writes the latest value posted for one store key from a background thread.

    :meth:`post` returns at once; values posted while a write is under way collapse into the latest
    (the key says the last step whose backward started: readers compare it with ``>=``, so an
    intermediate value carries nothing a later one does not). :meth:`flush` waits until the last
    value posted is in the store, so that a write made after it (a skip key) is never seen before
    it. A failed write is raised (as :class:`StepWatchStoreError`) at the next post or flush."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key
        self._cond = threading.Condition()
        self._pending: str | None = None
        self._writing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def post(self, value: str) -> None:
        with self._cond:
            self._raise_failure()
            self._pending = value
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"autoshard-step-watch:{self.key}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self) -> None:
        with self._cond:
            while (self._pending is not None or self._writing) and self._error is None:
                self._cond.wait()
            self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise StepWatchStoreError(
                f"the step watch could not write {self.key!r} to the process group's store ({self._error}); the "
                f"store (torchrun's rendezvous) is gone or unreachable, so this rank cannot tell the others which "
                f"steps it ran backward on: restart the job") from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                value, self._pending, self._writing = self._pending, None, True
            try:
                self.store.set(self.key, value)
            except BaseException as e:  # handed to the training thread at its next post or flush
                with self._cond:
                    self._error, self._writing = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class StepWatch:
    """This rank's word on each training step of one parallel model, and its view of the others'
    (see the module docstring). ``name``: the model's key prefix, equal on every rank; ``barrier``:
    wait for every rank's word at every call (``check_inputs="always"``); ``poll``: wait for
    collectives in slices (gloo). ``store``, ``rank``, ``world``: the default process group's unless given."""

    def __init__(self, name: str, *, barrier: bool = False, poll: bool = True, store: Any = None,
                 rank: int | None = None, world: int | None = None) -> None:
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self.prefix = f"autoshard/steps/{name}/"
        self.barrier, self.poll = barrier, poll
        self.timeout_s = self.store.timeout.total_seconds()
        self.steps = 0                       # calls whose outputs need a gradient
        self.ran: set[int] = set()           # those of them whose backward started here (not yet judged)
        self.started = -1                    # the last step whose backward started here (the value of bwd/rank)
        self.decided = -1                    # the last step this rank gave its word on
        self.posted: list[int] = []          # steps whose skip key this rank posted and has not deleted
        self.diagnosis: str | None = None
        self._error_key = self.prefix + "error"
        self._next_read = 0.0                # monotonic time of the next call that reads the error key
        self._bwd_writer = _LatestWriter(self.store, self._bwd_key(self.rank))

    def _bwd_key(self, rank: int) -> str:
        return f"{self.prefix}bwd/{rank}"

    def _skip_key(self, step: int, rank: int) -> str:
        return f"{self.prefix}skip/{step}/{rank}"

    # -- what the parallel module reports -------------------------------------------------------

    def new_step(self) -> int:
        """A call whose outputs need a gradient: its step number (from 0)."""
        self.steps += 1
        return self.steps - 1

    def backward_started(self, step: int) -> None:
        """A gradient reached an output of ``step``: its backward runs here (before any collective of it)."""
        self.ran.add(step)
        if step > self.started:
            self.started = step
            self._bwd_writer.post(str(step))

    def before_forward(self) -> None:
        """At each call of the model, before any collective: raise :class:`SkippedBackwardError` if a
        rank diagnosed a skipped backward, or if this rank skipped the last step's backward while
        another ran it; with ``barrier``, also if another skipped it while this rank ran it. The error
        key is read at most once per :data:`POLL_S` of calls."""
        now = time.monotonic()
        if self.diagnosis is not None or now >= self._next_read:    # a known diagnosis raises unread
            self._next_read = now + POLL_S
            self.check()
        step = self.steps - 1
        if step <= self.decided:
            return
        self.decided = step
        mine = step in self.ran
        self.ran = {s for s in self.ran if s > step}
        if not mine:
            self._bwd_writer.flush()         # readers take a skip key over a later step's bwd: keep them in order
            self.store.set(self._skip_key(step, self.rank), "1")
            self.posted.append(step)
        if mine and not self.barrier:
            return
        words = self._words(step, mine)
        skipped = [r for r, ran in sorted(words.items()) if not ran]
        if skipped and len(skipped) < self.world:
            ran = [r for r, ran in sorted(words.items()) if ran]
            self.diagnosis = (
                f"{_ranks(skipped)} did not run backward on training step {step + 1} (call {step + 1} of the "
                f"parallel model whose outputs need a gradient) while {_ranks(ran)} did: every rank must call "
                f"backward on the same steps, or their gradients and collectives no longer pair up. Run the same "
                f"training loop on every rank (a forward without backward, e.g. evaluation under grad mode, is fine "
                f"when every rank does it; torch.no_grad() makes it no step at all). This model cannot go on: "
                f"the error is raised on every rank")
            self.store.set(self._error_key, self.diagnosis)
            raise SkippedBackwardError(self.diagnosis)
        for s in [s for s in self.posted if s < step]:     # every rank has moved past them
            self.store.delete_key(self._skip_key(s, self.rank))
        self.posted = [s for s in self.posted if s >= step]

    def _word(self, rank: int, step: int) -> bool | None:
        """Whether ``rank`` ran backward on ``step`` (True), skipped it (False), or has not said yet."""
        key = self._bwd_key(rank)
        started = int(self.store.get(key)) if self.store.check([key]) else -1    # read before the skip key:
        if self.store.check([self._skip_key(step, rank)]):                         # a skip is posted before a
            return False                                                           # later step's bwd
        return True if started >= step else None

    def _words(self, step: int, mine: bool) -> dict[int, bool]:
        words = {self.rank: mine}
        pending = [r for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + self.timeout_s
        delay = 0.001
        while True:
            for r in list(pending):
                word = self._word(r, step)
                if word is not None:
                    words[r] = word
                    pending.remove(r)
            if not pending:
                return words
            self.check()
            if time.monotonic() > deadline:
                raise ReplicaMismatchError(
                    f"rank {self.rank} {'ran' if mine else 'did not run'} backward on training step {step + 1} and "
                    f"waited {self.timeout_s:.0f} s for {_ranks(pending)} to run backward on it or call the model "
                    f"again; they did neither: every rank must run the same training loop")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    # -- what the collectives and every call read ---------------------------------------------------

    def check(self, cause: BaseException | None = None) -> None:
        """Raise :class:`SkippedBackwardError` if a rank has posted a diagnosis (from ``cause``: the
        failed collective it explains)."""
        if self.diagnosis is None and self.store.check([self._error_key]):
            self.diagnosis = self.store.get(self._error_key).decode()
        if self.diagnosis is not None:
            raise SkippedBackwardError(self.diagnosis) from cause

    def wait(self, work: Any) -> None:
        """Wait for a collective; a diagnosis posted meanwhile (or explaining its failure) is raised."""
        if not self.poll:
            work.wait()
            return
        while True:
            try:
                work.wait(_POLL)
                return
            except RuntimeError as e:
                if not work.is_completed() and _LOCAL_TIMEOUT in str(e):
                    self.check()               # the collective goes on: wait another slice
                    continue
                self.check(cause=e)
                raise
