"""Work objects: what a "tpu" collective returns, and how it completes.

JAX dispatch is asynchronous: when a collective method returns, its XLA
program is queued and its results are JAX arrays that are not ready yet (for
``async_op=True`` calls, the program may not even have been started: the
backend's dispatcher thread starts it). :class:`TPUWork` completes the call:
it waits for the start and for those arrays, and runs the op's *finish* step,
which copies results into the caller's output tensors.
The finish step runs exactly once, on whichever thread gets there first (and
before it, the finish steps of every earlier unfinished work of the same
group, so a collective's completion implies its predecessors' outputs):

* ``work.wait()`` (what every synchronous torch.distributed call does),
* ``work.is_completed()`` once the arrays are ready,
* the completion thread, once ``work.get_future()`` has been asked for (DDP
  comm hooks chain on the future without waiting on the work),
* the watchdog thread, about a second after the program finished, for a work
  nobody waits on (as gloo's and NCCL's outputs appear without ``wait()``),
* the exit handler, for every work still in flight when the interpreter exits.

If the program or the finish step fails, the error is kept and raised by
every ``wait()``; the output tensors are then left as they were.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import jax
import torch
import torch.distributed as dist

from tpu_dist.collectives import _runtime

#: Longest sleep between readiness checks of a polled work (TPU_DIST_TIMEOUT_POLICY=raise).
_MAX_POLL_SLEEP = 2e-4


class TPUWork(dist._Work):
    """The handle of one "tpu" collective call (see the module docstring)."""

    def __init__(
        self,
        description: str,
        pending: Sequence[jax.Array] = (),
        finish: Callable[[], list[torch.Tensor]] | None = None,
        before_wait: Callable[[], None] | None = None,
        on_done: Callable[[BaseException | None], None] | None = None,
        poll: bool = False,
        explain: Callable[[BaseException], dist.DistBackendError] | None = None,
        complete_earlier: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._complete_earlier = complete_earlier
        self._source: int | None = None
        """The sender's group rank, for a receive from any source."""
        self._description = description
        self._pending = list(pending)
        self._finish = finish
        self._before_wait = before_wait
        self._on_done = on_done
        self._poll = poll
        self._explain = explain
        self._failed_from_outside: BaseException | None = None
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._result: list[torch.Tensor] = []
        self._future: torch.futures.Future | None = None
        self._dispatching: concurrent.futures.Future | None = None

    @classmethod
    def completed(cls, description: str, result: list[torch.Tensor]) -> TPUWork:
        """A work that is already complete with ``result`` (nothing to communicate)."""
        work = cls(description, (), lambda: result)
        work._complete()
        return work

    def _attach(self, pending: Sequence[jax.Array], finish: Callable[[], list[torch.Tensor]]) -> None:
        """Give a deferred work (point-to-point) its dispatched arrays and finish step."""
        self._pending = list(pending)
        self._finish = finish

    def _attach_dispatch(
        self, dispatching: concurrent.futures.Future, finish: Callable[[], list[torch.Tensor]]
    ) -> None:
        """Give an ``async_op`` work the future of its program's start and its finish step;
        the finish step finds the program's result blocks in ``self._pending``."""
        self._dispatching = dispatching
        self._finish = finish

    def _fail(self, error: BaseException) -> None:
        """Fail a work whose program will never finish (the watchdog's ``raise`` policy)."""
        self._failed_from_outside = error

    def _await_dispatch(self) -> None:
        """Wait until an ``async_op`` program has been started; its blocks become pending."""
        dispatching = self._dispatching
        if dispatching is None:
            return
        if self._poll:
            outs = wait_interruptibly(self, dispatching)
        else:
            outs = dispatching.result()
        self._pending = list(outs)
        self._dispatching = None

    def _outputs_ready(self) -> bool:
        """True once waiting would not block (the program ran, or its start failed)."""
        dispatching = self._dispatching
        if dispatching is None:
            return all(a.is_ready() for a in self._pending)
        if not dispatching.done():
            return False
        if dispatching.exception() is not None:
            return True
        return all(a.is_ready() for a in dispatching.result())

    def _await_arrays(self) -> None:
        self._await_dispatch()
        if not self._poll:
            for array in self._pending:
                array.block_until_ready()
            return
        # Poll, so that the watchdog can fail a program that will never finish. The sleep
        # stays short: every microsecond slept after the data arrived is added to the call.
        delay = 5e-5
        while not all(a.is_ready() for a in self._pending):
            if self._failed_from_outside is not None:
                raise self._failed_from_outside
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_SLEEP)
        for array in self._pending:
            array.block_until_ready()  # raises the program's own error, if any

    def _complete(self, *, flush: bool = True) -> None:
        """Wait for the program and run the finish step once; ``flush=False`` skips
        ``before_wait`` (dispatching queued point-to-point ops), for helper threads."""
        if flush and self._before_wait is not None:
            self._before_wait()
        if self._complete_earlier is not None and not self._done:
            # Earlier works of the group first: when a collective is complete, so are the
            # outputs of every collective issued before it on the group (as on gloo).
            self._complete_earlier()
        with self._lock:
            if self._done:
                return
            try:
                with torch.no_grad(), _runtime.x64_scope():
                    self._await_arrays()
                    self._result = self._finish()
            except dist.DistBackendError as err:
                self._error = err
            except Exception as err:  # kept and raised on every wait()
                if self._explain is not None:
                    self._error = self._explain(err)
                else:
                    self._error = dist.DistBackendError(
                        f"tpu_dist: {self._description} failed: {err}"
                    )
                self._error.__cause__ = err
            self._pending = []
            _runtime.release_results()
            self._dispatching = None
            self._finish = None
            self._done = True
            future = self._future
        if self._on_done is not None:
            self._on_done(self._error)
        if future is not None:
            self._settle(future)

    def _complete_if_finished(self) -> bool:
        """Complete the work if its program has finished (never blocks); True once done."""
        if not self._done and self._finish is not None and self._outputs_ready():
            self._complete(flush=False)
        return self._done

    def _settle(self, future: torch.futures.Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective is done and the outputs are written.

        Raises:
            torch.distributed.DistBackendError: the collective failed.
        """
        self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the outputs are written (or the collective failed); never blocks."""
        if not self._done:
            if self._before_wait is not None:
                self._before_wait()
            self._complete_if_finished()
        return self._done

    def _source_rank(self) -> int:
        """The group rank a receive from any source got its data from (as gloo's)."""
        self.wait()
        if self._source is None:
            raise RuntimeError(
                f"tpu_dist: _source_rank() is defined for a receive from any source; "
                f"this work is {self._description!r}."
            )
        return self._source

    def is_success(self) -> bool:
        """True if the collective completed without error."""
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        """The error the collective failed with, if any."""
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The output tensors, once complete (as gloo's Work.result())."""
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A future completed with the output tensors when the collective is done."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done:
                    self._settle(self._future)
                else:
                    _completer.submit(self)
            return self._future


def wait_interruptibly(work: TPUWork, future: concurrent.futures.Future) -> list:
    """``future.result()``, giving up with the watchdog's error if it fails ``work``."""
    delay = 5e-5
    while True:
        try:
            return future.result(timeout=delay)
        except concurrent.futures.TimeoutError:
            if work._failed_from_outside is not None:
                raise work._failed_from_outside from None
            delay = min(delay * 2, _MAX_POLL_SLEEP)


class _Completer:
    """One daemon thread per process that completes works whose future was asked for."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[TPUWork] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work: TPUWork) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="tpu_dist-completer", daemon=True
                )
                self._thread.start()
        self._queue.put(work)

    def _loop(self) -> None:
        while True:
            work = self._queue.get()
            work._complete()


_completer = _Completer()
