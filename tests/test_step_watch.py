"""The step watch's protocol, on an in-process store with ranks as threads (no process group).

What tests/distributed and tests/test_runtime_errors.py check end to end on 4 gloo ranks is here made
exact: who raises when, the store keys not piling up over many legal skipped steps, the timed waits of
a collective, and the error when a rank never gives its word.
"""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from autoshard.runtime.replicas import ReplicaMismatchError
from autoshard.runtime.step_watch import POLL_S, SkippedBackwardError, StepWatch, StepWatchStoreError

pytestmark = pytest.mark.timeout(60)


def _watches(world: int, *, barrier: bool = False, timeout_s: float = 20) -> tuple[dist.HashStore, list[StepWatch]]:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store, [StepWatch("m", barrier=barrier, store=store, rank=r, world=world) for r in range(world)]


def _on_threads(fns) -> list[BaseException | None]:
    """Run one function per rank on its own thread; what each raised (None if nothing)."""
    errors: list[BaseException | None] = [None] * len(fns)

    def run(i):
        try:
            fns[i]()
        except BaseException as e:             # reported to the test, which asserts on it
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return errors


def test_every_rank_skipping_is_legal_and_the_keys_do_not_pile_up() -> None:
    store, watches = _watches(3)

    def loop(w: StepWatch):
        def run():
            for step in range(40):
                w.before_forward()
                s = w.new_step()
                if step % 3 == 0:                # every rank: backward on every third step only
                    w.backward_started(s)
        return run

    assert _on_threads([loop(w) for w in watches]) == [None, None, None]
    # one bwd key per rank, and each rank's skip key of the last skipped step it judged
    assert store.num_keys() <= 2 * 3, store.num_keys()
    assert not store.check(["autoshard/steps/m/error"])


def test_a_rank_that_skips_is_an_error_on_it_and_then_on_every_other_rank() -> None:
    store, (w0, w1, w2) = _watches(3)
    for w in (w0, w1, w2):
        w.before_forward()
        w.new_step()
    w0.backward_started(0)
    w1.backward_started(0)
    w0.before_forward()                          # rank 0 goes on: rank 2 has not told yet
    with pytest.raises(SkippedBackwardError, match=r"^rank 2 did not run backward on training step 1 .*"
                                                   r"while ranks 0, 1 did.*same training loop on every rank"):
        w2.before_forward()
    with pytest.raises(SkippedBackwardError, match=r"^rank 2 did not run backward on training step 1 "):
        w2.before_forward()                      # the rank that knows raises at every later call
    time.sleep(POLL_S)                           # the others read the diagnosis once a slice has passed
    for w in (w0, w1, w2):
        with pytest.raises(SkippedBackwardError, match=r"^rank 2 did not run backward on training step 1 "):
            w.before_forward()


class _CountingStore:
    """A store that counts ``check`` calls (the diagnosis reads)."""

    def __init__(self, store: dist.HashStore) -> None:
        self.store, self.checks = store, 0
        self.timeout = store.timeout

    def check(self, keys):
        self.checks += 1
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_calls_read_the_diagnosis_at_most_once_per_slice_and_a_posted_one_reaches_the_next_read() -> None:
    store = _CountingStore(dist.HashStore())
    w = StepWatch("m", store=store, rank=0, world=1)
    for _ in range(50):                          # a training loop of fast steps: one read, then none
        w.before_forward()
        w.backward_started(w.new_step())
    assert store.checks == 1, store.checks
    store.set("autoshard/steps/m/error", "rank 3 did not run backward on training step 7")
    w.before_forward()                           # within the slice: not read yet
    time.sleep(POLL_S)
    with pytest.raises(SkippedBackwardError, match="rank 3 did not run backward on training step 7"):
        w.before_forward()
    assert store.checks == 2, store.checks


def test_with_barrier_every_rank_raises_at_the_same_call() -> None:
    store, watches = _watches(3, barrier=True)
    for w in watches:
        w.before_forward()
        w.new_step()
    watches[0].backward_started(0)
    watches[2].backward_started(0)
    errors = _on_threads([w.before_forward for w in watches])
    for rank, e in enumerate(errors):
        assert isinstance(e, SkippedBackwardError) and str(e).startswith("rank 1 did not run backward on training "
                                                                          "step 1 "), (rank, e)


class _PendingWork:
    """A collective that never completes (its peer is not coming): ``wait(timeout)`` as gloo's."""

    def wait(self, timeout=None):
        time.sleep(timeout.total_seconds())
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


class _FailedWork:
    def wait(self, timeout=None):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4005")

    def is_completed(self) -> bool:
        return True


def test_a_collective_that_waits_for_the_skipping_rank_raises_its_diagnosis_within_a_slice() -> None:
    store, (w0, w1) = _watches(2)
    for w in (w0, w1):
        w.before_forward()
        w.new_step()
    w0.backward_started(0)
    waited: list[float] = []

    def runner():                                # rank 0 waits in its gradient all-reduce
        start = time.monotonic()
        try:
            w0.wait(_PendingWork())
        finally:
            waited.append(time.monotonic() - start)

    def skipper():                               # rank 1 calls the model again without backward
        time.sleep(2 * POLL_S)
        w1.before_forward()

    errors = _on_threads([runner, skipper])
    assert all(isinstance(e, SkippedBackwardError) for e in errors), errors
    assert waited[0] < 2 * POLL_S + 2, waited


def test_a_failed_collective_is_explained_by_a_diagnosis_and_otherwise_re_raised() -> None:
    store, (w0, w1) = _watches(2)
    with pytest.raises(RuntimeError, match="Connection closed by peer") as info:
        w0.wait(_FailedWork())
    assert not isinstance(info.value, SkippedBackwardError)
    store.set("autoshard/steps/m/error", "rank 1 did not run backward on training step 3 ...")
    with pytest.raises(SkippedBackwardError, match="rank 1 did not run backward on training step 3") as info:
        w0.wait(_FailedWork())
    assert "Connection closed by peer" in str(info.value.__cause__)


def test_a_rank_that_never_gives_its_word_is_an_error_after_the_store_timeout() -> None:
    store, (w0, w1) = _watches(2, timeout_s=1)
    w0.before_forward()
    w0.new_step()
    start = time.monotonic()
    with pytest.raises(ReplicaMismatchError, match=r"rank 0 did not run backward on training step 1 and waited "
                                                   r"1 s for rank 1 .*same training loop") as info:
        w0.before_forward()
    assert not isinstance(info.value, SkippedBackwardError)
    assert time.monotonic() - start < 5


class _SlowStore:
    """A store whose writes take ``delay_s`` (a server thread waiting for a core), or fail with ``fail``."""

    def __init__(self, delay_s: float = 0.0, fail: BaseException | None = None) -> None:
        self.store, self.delay_s, self.fail = dist.HashStore(), delay_s, fail
        self.timeout = self.store.timeout
        self.writes: list[str] = []

    def set(self, key, value):
        time.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        self.writes.append(key)
        self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)



def test_the_start_of_backward_does_not_wait_for_the_store_and_its_word_still_arrives() -> None:
    store = _SlowStore(delay_s=0.5)
    w0 = StepWatch("m", store=store, rank=0, world=2)
    w1 = StepWatch("m", store=store, rank=1, world=2)
    for w in (w0, w1):
        w.before_forward()
        w.new_step()
    start = time.monotonic()
    w0.backward_started(0)
    assert time.monotonic() - start < 0.25, "the start of backward waited for the store's reply"
    # rank 1 skipped the step rank 0 ran: it waits for rank 0's word, written in the background
    with pytest.raises(SkippedBackwardError, match=r"^rank 1 did not run backward on training step 1 .*while rank 0 did"):
        w1.before_forward()


def test_a_skip_key_is_written_after_the_words_posted_before_it() -> None:
    store = _SlowStore(delay_s=0.2)
    w0 = StepWatch("m", store=store, rank=0, world=1)
    w0.before_forward()
    w0.backward_started(w0.new_step())           # step 0 ran backward (its word in flight) ...
    w0.before_forward()
    w0.new_step()                                # ... step 1 did not
    w0.before_forward()
    assert store.writes == ["autoshard/steps/m/bwd/0", "autoshard/steps/m/skip/1/0"], store.writes


def test_a_word_the_store_refused_is_an_error_at_the_next_step() -> None:
    store = _SlowStore(fail=RuntimeError("Connection reset by peer"))
    w0 = StepWatch("m", store=store, rank=0, world=1)
    w0.before_forward()
    w0.backward_started(w0.new_step())
    deadline = time.monotonic() + 10
    with pytest.raises(StepWatchStoreError, match=r"could not write 'autoshard/steps/m/bwd/0'.*Connection reset by peer"
                                                  r".*restart the job"):
        while time.monotonic() < deadline:      # the failure reaches the first post after it
            w0.before_forward()
            w0.backward_started(w0.new_step())
            time.sleep(0.01)
