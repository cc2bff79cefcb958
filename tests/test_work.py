"""``TPUWork``, the handle of one "tpu" call, as a state machine (unit tier, one process).

PENDING -> RUNNING (its program started) -> DONE (its finish step wrote the outputs), or
FAILED (the program could not start, it failed, or the watchdog gave up on it). Each test
drives one work through its states with real JAX arrays as the program's result blocks and
checks what a caller sees at each: ``is_completed``, ``wait``, ``result``, the future, the
done callbacks.
"""

from __future__ import annotations

import concurrent.futures
import threading

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.distributed as dist

from tpu_dist.collectives._work import TPUWork, WorkState


def _finish_into(out: torch.Tensor):
    def finish(results: list) -> list[torch.Tensor]:
        out.copy_(torch.tensor(np.asarray(results[0])))
        return [out]

    return finish


def test_a_started_program_is_completed_by_wait_once() -> None:
    out = torch.zeros(3)
    calls = []
    work = TPUWork("all_reduce")
    work.on_done(lambda error: calls.append(error))
    assert work.state is WorkState.PENDING and not work.is_completed()
    finish = _finish_into(out)
    work.start([jnp.arange(3.0)], lambda results: calls.append("finish") or finish(results))
    assert work.state is WorkState.RUNNING
    assert work.wait() is True
    assert work.state is WorkState.DONE and work.is_success() and work.exception() is None
    assert out.tolist() == [0.0, 1.0, 2.0]
    assert work.result() == [out] and work.wait() is True
    assert calls == ["finish", None]  # the finish step ran once, then the callbacks
    done_late = []
    work.on_done(done_late.append)  # after the end: called at once
    assert done_late == [None]


def test_a_program_started_later_runs_its_finish_when_it_has_started() -> None:
    out = torch.zeros(2)
    starting: concurrent.futures.Future = concurrent.futures.Future()
    work = TPUWork("all_reduce", poll=True)
    work.start_later(starting, _finish_into(out))
    assert work.state is WorkState.PENDING and not work.is_completed()
    threading.Timer(0.05, lambda: starting.set_result([jnp.ones(2)])).start()
    assert work.wait() is True
    assert out.tolist() == [1.0, 1.0] and work.state is WorkState.DONE


def test_a_program_that_could_not_start_fails_its_work_and_writes_nothing() -> None:
    out = torch.full((2,), 7.0)
    work = TPUWork("all_reduce")
    work.start_later(concurrent.futures.Future(), _finish_into(out))
    error = dist.DistBackendError("tpu_dist: could not start")
    work.fail(error)
    assert work.state is WorkState.FAILED and work.is_completed() and not work.is_success()
    with pytest.raises(dist.DistBackendError, match="could not start"):
        work.wait()
    assert out.tolist() == [7.0, 7.0]
    work.fail(dist.DistBackendError("second"))  # a failed work stays failed with its first error
    assert work.exception() is error


def test_an_interrupted_work_whose_program_never_started_raises_the_watchdogs_error() -> None:
    out = torch.zeros(2)
    work = TPUWork("all_reduce", poll=True)
    work.start_later(concurrent.futures.Future(), _finish_into(out))
    work.interrupt(dist.DistBackendError("tpu_dist: timed out"))
    assert work.is_completed()
    with pytest.raises(dist.DistBackendError, match="timed out"):
        work.wait()
    assert work.state is WorkState.FAILED and out.tolist() == [0.0, 0.0]


def test_the_future_completes_with_the_outputs() -> None:
    out = torch.zeros(2)
    work = TPUWork("all_reduce")
    work.start([jnp.full((2,), 3.0)], _finish_into(out))
    future = work.get_future()
    assert [t.tolist() for t in future.wait()] == [[3.0, 3.0]]


def test_a_completed_work_has_nothing_to_wait_for() -> None:
    out = torch.ones(1)
    work = TPUWork.completed("barrier", [out])
    assert work.state is WorkState.DONE and work.is_completed() and work.wait() is True
    assert work.result() == [out]
