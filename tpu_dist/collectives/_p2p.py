"""Point-to-point ops: sends and receives as XLA programs both ends run, matched as gloo does.

An XLA program needs both ends: a send from rank a to rank b and the receive it meets run the
same two-device permute program, which blocks until both have started it. gloo matches a
receive with the oldest unmatched send of the same sender, group and tag, and lets every
posted op progress on its own: a send completes once its receive is posted (it waits for it:
two ranks that both ``send`` before they ``recv`` hang on gloo, measured), a receive once its
send is posted, whatever else is pending. Schedules rely on that: torch's interleaved 1F1B
posts forward sends it waits on only at the end of the step, and receives well before it waits
on them.

Each direction between two ranks (a -> b) is a *channel*, with a helper thread on each end
(a :class:`~._dispatch.Lane`):

* the sender's thread sends the ops in the order they were posted: for each, a header program
  (:data:`~._plan.P2P_HEADER_WORDS` int32 words: the group, the tag and the message's size in
  words), then the data program of that size (:attr:`~._plan.P2PPlan.header`,
  :attr:`~._plan.P2PPlan.key`);
* the receiver's thread runs while a posted receive waits for its message: it receives the
  next header, takes the oldest posted receive of that group and tag and runs the data program
  into it. A message that no posted receive matches yet is received all the same and kept (as
  gloo keeps an unexpected message) until a receive for it is posted, which completes at once.

So both ends of a channel run the same programs in the same order (the sender's), and a send
waits for its receiver to have posted *a* receive from it, not a particular one: any order of
``send``/``recv``/``isend``/``irecv``/``batch_isend_irecv`` and waits that completes on gloo
completes here, with the same matching (by group and tag, oldest first). Channels are
independent: each has threads of its own on both ends, so a send from a to b never waits
behind a receive from b to a or behind another pair's op. That needs XLA:CPU, which runs the
programs one thread starts in order but those of different threads side by side (measured,
jaxlib 0.10.2), and gloo's matching: all permute programs send under one gloo slot, told apart
by their sender (so the two directions of a pair never meet each other's messages, while two
programs of one direction would: the channel's thread runs them one after another), and
collectives use other slots (so sends and receives never wait for collectives on the same ranks,
nor these for them).

A receive whose message is larger or smaller than its tensor fails with a ``DistBackendError``
saying both sizes (gloo aborts the receiving process when the message is larger, and fills the
front of a larger tensor).
"""

from __future__ import annotations

import concurrent.futures
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tpu_dist.collectives import _plan, _plan_blocks, _plan_p2p
from tpu_dist.collectives._dispatch import Lane, settle

if TYPE_CHECKING:
    from tpu_dist.collectives._lowering import ProgramCache

_MAGIC = 0x54445032
"""First word of every header: a header that does not start with it means the two ends of a
channel ran different programs (a bug of tpu_dist), said as such instead of misread."""

_WORDS_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}
"""The word dtype of each word size (:func:`._plan_blocks.words`)."""


@dataclass
class P2POp:
    """A planned send or receive, posted to its channel."""

    plan: _plan.P2PPlan
    devices: tuple
    """The two JAX devices of the pair, the lower global rank's first."""
    seq: int
    """Its number among this rank's ops of the same kind in its direction (1 for the first):
    the same on both ends where every message of the direction has one group and tag."""
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    """Resolves to the data program's result blocks once it has started (``[]`` for an empty
    message), or to the error that kept it from starting or matching."""

    @property
    def direction(self) -> tuple[int, int]:
        """(sender, receiver) global ranks."""
        low, high = self.plan.pair
        me = high if self.plan.peer == low else low
        return (me, self.plan.peer) if self.plan.op == "send" else (self.plan.peer, me)


@dataclass(frozen=True)
class _Header:
    group: int
    """:func:`_group_id` of the message's group."""
    tag: int
    words: int
    word_size: int

    def encode(self) -> torch.Tensor:
        low, high = _int32(self.words & 0xFFFFFFFF), _int32(self.words >> 32)
        values = [_MAGIC, self.group, _int32(self.tag), low, high, self.word_size]
        values += [0] * (_plan.P2P_HEADER_WORDS - len(values))
        return torch.tensor(values, dtype=torch.int32)

    @classmethod
    def decode(cls, block: torch.Tensor) -> _Header:
        magic, group, tag, low, high, word_size, *_ = block.tolist()
        if magic != _MAGIC or word_size not in _WORDS_BY_SIZE:
            raise RuntimeError(
                f"tpu_dist: a point-to-point header arrived damaged ({block.tolist()}): the two "
                "ends of the channel ran different programs. This is a bug in tpu_dist; "
                "please report it."
            )
        return cls(group, tag, (low & 0xFFFFFFFF) | (high << 32), word_size)

    @property
    def nbytes(self) -> int:
        return self.words * self.word_size


def _int32(value: int) -> int:
    """``value``'s low 32 bits as a signed int32."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _group_id(name: str) -> int:
    """A group's name as one int32 word (the same on every rank: torch names groups alike)."""
    return _int32(zlib.crc32(name.encode()))


def _header_of(plan: _plan.P2PPlan) -> _Header:
    return _Header(_group_id(plan.group), plan.tag, plan.block.numel(), plan.block.element_size())


@dataclass
class _Message:
    """A message received: its header and its data program's result blocks."""

    header: _Header
    outs: list

    @property
    def key(self) -> tuple[int, int]:
        return (self.header.group, self.header.tag)


class P2PChannels:
    """The point-to-point channels of this process, one per direction (module doc); the
    runtime's, handed to every group's pipeline."""

    def __init__(
        self,
        programs: ProgramCache,
        to_jax: Callable[[torch.Tensor], object],
        to_torch: Callable[[object], torch.Tensor],
    ) -> None:
        self._programs = programs
        self._to_jax = to_jax
        self._to_torch = to_torch
        self._lock = threading.Lock()
        self._senders: dict[tuple[int, int], Lane] = {}
        self._receivers: dict[tuple[int, int], _Receiver] = {}
        self._seq: dict[tuple[int, int, str], int] = {}

    def next_seq(self, plan: _plan.P2PPlan, direction: tuple[int, int]) -> int:
        """The number of the next op of ``plan``'s kind in ``direction`` (sender, receiver)."""
        key = (*direction, plan.op)
        with self._lock:
            seq = self._seq[key] = self._seq.get(key, 0) + 1
        return seq

    def post(self, op: P2POp) -> None:
        """Hand ``op`` to its channel: a send is sent after every send posted before it to
        the same rank; a receive completes when its message arrives (or has arrived)."""
        direction = op.direction
        with self._lock:
            if op.plan.op == "send":
                sender = self._senders.get(direction)
                if sender is None:
                    name = f"tpu_dist-p2p-send-{direction[0]}-{direction[1]}"
                    sender = self._senders[direction] = Lane(name, self._send)
            else:
                receiver = self._receivers.get(direction)
                if receiver is None:
                    receiver = self._receivers[direction] = _Receiver(self, direction)
        if op.plan.op == "send":
            sender.put(op)
        else:
            receiver.post(op)

    def _send(self, op: P2POp) -> None:
        """On the sender's thread of ``op``'s channel: its header, then its data."""
        plan = op.plan
        try:
            header = self._to_jax(_header_of(plan).encode())
            self._programs.run(plan.header, op.devices, [header])
            outs = [] if plan.key is None else self._programs.run(
                plan.key, op.devices, [self._to_jax(plan.block)]
            )
        except BaseException as err:  # the op's own failure, raised by its wait()
            settle(op.future, error=err)
        else:
            settle(op.future, outs)


class _Receiver:
    """The receiving end of one channel: posted receives, kept messages, and the thread that
    receives while a posted receive waits (module doc)."""

    def __init__(self, channels: P2PChannels, direction: tuple[int, int]) -> None:
        self._c = channels
        self._direction = direction
        self._lock = threading.Lock()
        self._posted: list[P2POp] = []
        self._kept: list[_Message] = []
        """Messages that arrived before a receive for them was posted, oldest first."""
        self._serving = False
        self._lane = Lane(f"tpu_dist-p2p-recv-{direction[0]}-{direction[1]}", self._serve)

    def post(self, op: P2POp) -> None:
        with self._lock:
            message = _take(self._kept, _channel_key(op.plan), lambda m: m.key)
            if message is None:
                self._posted.append(op)
                start, self._serving = not self._serving, True
        if message is not None:
            self._deliver(op, message)
        elif start:
            self._lane.put(None)

    def _serve(self, _: object) -> None:
        """Receive messages while a posted receive waits for one."""
        while True:
            with self._lock:
                if not self._posted:
                    self._serving = False
                    return
                first = self._posted[0]
            try:
                message, op = self._receive(first)
            except BaseException as err:  # the channel is broken: every waiting receive fails
                with self._lock:
                    failed, self._posted, self._serving = self._posted, [], False
                for waiting in failed:
                    settle(waiting.future, error=err)
                return
            if op is None:
                with self._lock:  # a receive posted since the header arrived takes it now
                    op = _take(self._posted, message.key, _op_key)
                    if op is None:
                        self._kept.append(message)
            if op is not None:
                self._deliver(op, message)

    def _receive(self, first: P2POp) -> tuple[_Message, P2POp | None]:
        """The channel's next message (its header, then its data), and the oldest posted
        receive it matches, if any (taken off the posted ones). ``first``: any posted receive
        (every op of the channel has the same devices and programs but the data's)."""
        c, plan, devices = self._c, first.plan, first.devices
        empty = torch.zeros(_plan.P2P_HEADER_WORDS, dtype=torch.int32)
        (block,) = c._programs.run(plan.header, devices, [c._to_jax(empty)])
        header = _Header.decode(c._to_torch(block))
        with self._lock:
            op = _take(self._posted, (header.group, header.tag), _op_key)
        if not header.words:
            return _Message(header, []), op
        words = _WORDS_BY_SIZE[header.word_size]
        into = torch.empty(header.words, dtype=words)
        if op is not None and (op.plan.block.dtype, op.plan.block.numel()) == (words, header.words):
            into = op.plan.block  # the receive's own tensor: nothing to allocate
        key = _plan_p2p.permute_key(
            plan.header.devices, header.words, _plan_blocks.DTYPE_NAMES[words],
            plan.header.params == ((0, 1),),
        )
        return _Message(header, c._programs.run(key, devices, [c._to_jax(into)])), op

    def _deliver(self, op: P2POp, message: _Message) -> None:
        """Complete ``op`` with ``message``'s data, if the sizes agree."""
        mine = op.plan.block.numel() * op.plan.block.element_size()
        if message.header.nbytes != mine:
            settle(op.future, error=dist.DistBackendError(
                f"tpu_dist: {op.plan.description} from rank {self._direction[0]} matched a send "
                f"of {message.header.nbytes} bytes, but its tensor holds {mine} bytes: a "
                "receive's tensor must have the size of the tensor sent to it (gloo aborts the "
                "receiving process when the message is larger)."
            ))
            return
        settle(op.future, message.outs)


def _channel_key(plan: _plan.P2PPlan) -> tuple[int, int]:
    """What a message and a receive match on within a channel: (group, tag)."""
    return (_group_id(plan.group), plan.tag)


def _op_key(op: P2POp) -> tuple[int, int]:
    return _channel_key(op.plan)


def _take(items: list, key: tuple[int, int], key_of: Callable[[object], tuple[int, int]]):
    """Remove and return the first of ``items`` whose ``key_of`` is ``key``, or None."""
    for i, item in enumerate(items):
        if key_of(item) == key:
            return items.pop(i)
    return None
