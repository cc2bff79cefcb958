"""Work objects: what a "tpu" collective returns, and how it completes.

A :class:`TPUWork` is the *complete* stage of a collective's life (plan -> track -> dispatch ->
complete). Its state is one field, :class:`WorkState`:

* ``PENDING``: issued, its XLA program not started yet (an ``async_op=True`` call whose program
  the dispatcher thread has not started, a point-to-point op whose message has not come);
* ``RUNNING``: the program was started; its result blocks are JAX arrays that may not be ready;
* ``DONE``: the finish step ran: the outputs are written;
* ``FAILED``: the program, its start or its finish step failed (or the watchdog gave up on
  it); the error is raised by every ``wait()`` and the outputs are left as they were.

The stages that feed it use a narrow API: the dispatcher's caller hands it the started program
(:meth:`TPUWork.start`, :meth:`TPUWork.start_later`) or the error that kept it from starting
(:meth:`TPUWork.fail`); tracking registers a callback for its end (:meth:`TPUWork.on_done`);
the watchdog completes a finished one nobody waits on (:meth:`TPUWork.complete_if_finished`),
or interrupts one that will never finish (:meth:`TPUWork.interrupt`).

The finish step runs exactly once, on whichever thread gets there first (and before it, the
finish steps of every earlier unfinished work of the same group, so a collective's completion
implies its predecessors' outputs):

* ``work.wait()`` (what every synchronous torch.distributed call does),
* ``work.is_completed()`` once the arrays are ready,
* the completion thread (:class:`Completer`, the runtime's, handed to the work), once
  ``work.get_future()`` has been asked for (DDP comm hooks chain on the future without waiting
  on the work),
* the watchdog thread, about a second after the program finished, for a work
  nobody waits on (as gloo's and NCCL's outputs appear without ``wait()``),
* the exit handler, for every work still in flight when the interpreter exits.

``wait(timeout)`` does what c10d's ``Work::wait`` (and so gloo's collectives) does: when the
collective has not completed within ``timeout`` it raises ``RuntimeError`` ("Operation timed
out!") and the collective stays in flight; a later ``wait()`` completes it. A zero or absent
timeout waits for as long as it takes (the group's timeout and the watchdog still apply).
"""

from __future__ import annotations

import concurrent.futures
import enum
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta

import jax
import torch
import torch.distributed as dist

from tpu_dist.collectives import _jaxlib

#: Longest sleep between readiness checks of a polled work (TPU_DIST_TIMEOUT_POLICY=raise).
_MAX_POLL_SLEEP = 2e-4
#: Longest sleep between readiness checks of a ``wait(timeout)``.
_MAX_TIMED_SLEEP = 1e-3

Finish = Callable[[list[jax.Array]], list[torch.Tensor]]
"""An op's finish step: the program's result blocks in, the op's output tensors out (written)."""


class WorkState(enum.Enum):
    """Where a :class:`TPUWork` stands (see the module docstring)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


_ENDED = (WorkState.DONE, WorkState.FAILED)


class TPUWork(dist._Work):
    """The handle of one "tpu" collective call (see the module docstring)."""

    def __init__(
        self,
        description: str,
        *,
        poll: bool = False,
        explain: Callable[[BaseException], dist.DistBackendError] | None = None,
        complete_earlier: Callable[[TPUWork], None] | None = None,
        before_wait: Callable[[bool], None] | None = None,
        completer: Completer | None = None,
    ) -> None:
        """A work in state ``PENDING``.

        Args:
            description: The op as users know it (``all_reduce``, ``send (peer 1, tag 0)``).
            poll: Wait by polling, so that :meth:`interrupt` reaches a waiter (raise policy).
            explain: Turns an XLA error into the ``DistBackendError`` users get.
            complete_earlier: Completes the group's earlier works than the one it is given
                (called with this work before finishing). Taking the work as an argument,
                not closing over it, keeps the work out of a reference cycle: a finished work
                and the outputs it holds are freed as soon as the caller drops it, not at the
                next run of Python's cyclic garbage collector (issue 51: FSDP2's unsharded
                parameters were kept alive that way, step after step).
            before_wait: Called with ``block`` before any wait: starts what the work waits on
                (the sender of a receive from any source, then the receive).
                ``block=False`` for a ``wait(timeout)``: start without waiting inline.
            completer: The process's completion thread, which completes the work once its
                future is asked for (:meth:`get_future`).
        """
        super().__init__()
        self._description = description
        self._poll = poll
        self._explain = explain
        self._complete_earlier = complete_earlier
        self._before_wait = before_wait
        self._lock = threading.Lock()
        self._state = WorkState.PENDING
        self._arrays: list[jax.Array] = []
        self._starting: concurrent.futures.Future | None = None
        self._finish: Finish | None = None
        self._interrupted: BaseException | None = None
        self._error: BaseException | None = None
        self._result: list[torch.Tensor] = []
        self._future: torch.futures.Future | None = None
        self._done_callbacks: list[Callable[[BaseException | None], None]] = []
        self._source: int | None = None
        self._completer = completer

    @classmethod
    def completed(cls, description: str, result: list[torch.Tensor]) -> TPUWork:
        """A work that is already ``DONE`` with ``result`` (nothing to communicate)."""
        work = cls(description)
        work._result = result
        work._state = WorkState.DONE
        return work

    # -- the narrow API of the stages before this one --------------------------------------

    @property
    def state(self) -> WorkState:
        """This work's :class:`WorkState`."""
        return self._state

    @property
    def description(self) -> str:
        return self._description

    @property
    def done(self) -> bool:
        """True once ``DONE`` or ``FAILED``."""
        return self._state in _ENDED

    def start(self, arrays: Sequence[jax.Array], finish: Finish) -> None:
        """The program was started: ``arrays`` are its result blocks, ``finish`` writes them."""
        self._arrays = list(arrays)
        self._finish = finish
        self._state = WorkState.RUNNING

    def start_later(self, starting: concurrent.futures.Future, finish: Finish) -> None:
        """The dispatcher thread starts the program: ``starting`` resolves to its result blocks
        (or to the error that kept it from starting)."""
        self._starting = starting
        self._finish = finish
        # Through a weak reference: the future outlives the work's need of it (the dispatcher
        # thread holds its last job), and a bound method would keep the work and its outputs.
        mine = weakref.ref(self)

        def started(_: concurrent.futures.Future) -> None:
            work = mine()
            if work is not None:
                work._started()

        starting.add_done_callback(started)

    def _started(self) -> None:
        with self._lock:
            if self._state is WorkState.PENDING:
                self._state = WorkState.RUNNING

    def fail(self, error: BaseException) -> None:
        """The program could not be started: the work is ``FAILED`` with ``error``."""
        with self._lock:
            if self._state in _ENDED:
                return
            self._error = error
            self._release()
            self._state = WorkState.FAILED
            future = self._future
        self._ended(future)

    def received_from(self, source: int) -> None:
        """A receive from any source learnt its sender (group rank ``source``)."""
        self._source = source

    def on_done(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(error or None)`` once the work ends (at once if it has)."""
        with self._lock:
            if self._state not in _ENDED:
                self._done_callbacks.append(callback)
                return
        callback(self._error)

    def interrupt(self, error: BaseException) -> None:
        """Fail a work whose program will never finish (the watchdog's: ``raise`` policy, or
        peers that exited): its waiters raise ``error``. Polling waiters see it at their next
        look; one waiting for a program that has not started (a receive whose sender exited
        before sending) is woken through the start's future, which its starter then leaves
        as it is (:func:`._dispatch.settle`)."""
        self._interrupted = error
        starting = self._starting
        if starting is not None:
            try:
                starting.set_exception(error)
            except concurrent.futures.InvalidStateError:  # started (or failed) already
                pass

    def complete_if_finished(self) -> bool:
        """Complete the work if its program has finished (never blocks); True once ended."""
        if self._state not in _ENDED and self._finish is not None and self._outputs_ready():
            self.complete(flush=False)
        return self._state in _ENDED

    # -- completion -------------------------------------------------------------------------

    def _outputs_ready(self) -> bool:
        """True once waiting would not block (the program ran, or its start failed)."""
        starting = self._starting
        if starting is not None:
            if not starting.done():
                return False
            if starting.exception() is not None:
                return True
            return all(a.is_ready() for a in starting.result())
        if self._state is WorkState.PENDING:
            return False  # nothing started yet (a receive from any source before its wait)
        return all(a.is_ready() for a in self._arrays)

    def _await_start(self) -> None:
        """Wait until an ``async_op`` program has been started; its blocks become pending."""
        starting = self._starting
        if starting is None:
            return
        outs = wait_interruptibly(self, starting) if self._poll else starting.result()
        self._arrays = list(outs)
        self._starting = None

    def _await_arrays(self) -> None:
        self._await_start()
        if not self._poll:
            for array in self._arrays:
                array.block_until_ready()
            return
        # Poll, so that the watchdog can fail a program that will never finish. The sleep
        # stays short: every microsecond slept after the data arrived is added to the call.
        delay = 5e-5
        while not all(a.is_ready() for a in self._arrays):
            if self._interrupted is not None:
                raise self._interrupted
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_SLEEP)
        for array in self._arrays:
            array.block_until_ready()  # raises the program's own error, if any

    def complete(self, *, flush: bool = True) -> None:
        """Wait for the program and run the finish step once; ``flush=False`` skips
        ``before_wait`` (a receive from any source's search for its sender), for helper
        threads."""
        before_wait, complete_earlier = self._before_wait, self._complete_earlier
        if flush and before_wait is not None and self._state not in _ENDED:
            before_wait(True)
        if complete_earlier is not None and self._state not in _ENDED:
            # Earlier works of the group first: when a collective is complete, so are the
            # outputs of every collective issued before it on the group (as on gloo).
            complete_earlier(self)
        with self._lock:
            if self._state in _ENDED:
                return
            try:
                if self._finish is None:
                    raise dist.DistBackendError(
                        f"tpu_dist: {self._description} was never started (its program was "
                        "not dispatched); this is a bug in tpu_dist."
                    )
                with torch.no_grad(), _jaxlib.x64_scope():
                    self._await_arrays()
                    self._result = self._finish(self._arrays)
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
            self._release()
            _jaxlib.collect_garbage()  # frees result blocks whose tensors are gone
            self._state = WorkState.FAILED if self._error is not None else WorkState.DONE
            future = self._future
        self._ended(future)

    def _release(self) -> None:
        """Drop what only an unfinished work needs: its result blocks, its finish step and
        the callables of the stages before it (which may refer back to this work, a point-to-
        point op's do), so that an ended work holds nothing but its outputs."""
        self._arrays = []
        self._starting = None
        self._finish = None
        self._explain = None
        self._complete_earlier = None
        self._before_wait = None

    def _ended(self, future: torch.futures.Future | None) -> None:
        callbacks, self._done_callbacks = self._done_callbacks, []
        for callback in callbacks:
            callback(self._error)
        if future is not None:
            self._settle(future)

    def _settle(self, future: torch.futures.Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._result)

    def _await_until(self, deadline: float, timeout: float) -> None:
        """Block until the outputs are ready, for at most until ``deadline``.

        Raises:
            RuntimeError: not ready by then (the work stays in flight).
        """
        before_wait = self._before_wait
        if before_wait is not None:
            before_wait(False)
        delay = 5e-5
        while self._state not in _ENDED and not self._outputs_ready():
            if self._interrupted is not None:
                return  # completing raises it
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"tpu_dist: {self._description}: Operation timed out! wait(timeout="
                    f"{timeout:g} s) returned before the collective completed; it is still in "
                    "flight (a later wait() completes it, as on gloo)."
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_TIMED_SLEEP)

    # -- torch's Work API ---------------------------------------------------------------------

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective is done and the outputs are written.

        Args:
            timeout: Give up waiting after this long (zero or None: no limit), as c10d's
                ``Work.wait``: the collective stays in flight.

        Raises:
            RuntimeError: ``timeout`` passed first ("Operation timed out!").
            torch.distributed.DistBackendError: the collective failed.
        """
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        if seconds > 0 and self._state not in _ENDED:
            self._await_until(time.monotonic() + seconds, seconds)
        self.complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the outputs are written (or the collective failed); never blocks."""
        if self._state not in _ENDED:
            before_wait = self._before_wait
            if before_wait is not None:
                before_wait(True)
            self.complete_if_finished()
        return self._state in _ENDED

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
        return self._state is WorkState.DONE

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
                if self._state in _ENDED:
                    self._settle(self._future)
                elif self._completer is not None:
                    self._completer.submit(self)
                else:  # a work made without the runtime's completion thread (tests)
                    threading.Thread(target=self.complete, daemon=True).start()
            return self._future


def wait_interruptibly(work: TPUWork, future: concurrent.futures.Future) -> list:
    """``future.result()``, giving up with the watchdog's error if it interrupts ``work``."""
    delay = 5e-5
    while True:
        try:
            return future.result(timeout=delay)
        except concurrent.futures.TimeoutError:
            if work._interrupted is not None:
                raise work._interrupted from None
            delay = min(delay * 2, _MAX_POLL_SLEEP)


class Completer:
    """A daemon thread that completes works whose future was asked for (one per process, the
    runtime's)."""

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
            work.complete()

