"""Every ``TPU_DIST_*`` environment variable tpu_dist's library code reads, declared once.

Each :class:`Setting` holds a variable's name, its default, its help text and a strict parser;
:meth:`Setting.read` returns the typed value and names the variable (and the value it had) in
the error when it is malformed. Code that needs a setting reads it through its declaration here,
never through ``os.environ`` directly, and reads it once, when the object that uses it is built
(the JAX runtime at its start, the watchdog when it starts, the flight recorder at import, the
registration at ``import tpu_dist``).

:func:`check` parses them all; the JAX runtime calls it on every rank before it starts, so a
malformed value is the same ``ValueError`` on every rank, never an error on the one rank that
reads it first and a crash on the others.

The launcher's own flags (``tpu-launch --emulate`` / ``TPU_DIST_TOPOLOGY``, ``--tpu-base-port``
/ ``TPU_DIST_TPU_BASE_PORT``, ...) are declared with their flags in
:mod:`tpu_dist.launch._cli`; where a flag's variable is also read by library code, the flag uses
the name declared here. Variables the launcher hands only to its own worker entry
(``TPU_DIST_LAUNCH_*``) are declared in :mod:`tpu_dist.launch._worker`.

This module imports neither torch nor JAX, but as a submodule of ``tpu_dist`` it is reached
only through ``tpu_dist/__init__.py``, which imports both: code that must stay free of them (the
launcher's worker entry, :mod:`tpu_dist.launch._worker`) spells out the names it needs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

Platform = Literal["auto", "cpu", "tpu", "gpu"]
Policy = Literal["abort", "raise"]

PLATFORMS: tuple[Platform, ...] = ("auto", "cpu", "tpu", "gpu")
POLICIES: tuple[Policy, ...] = ("abort", "raise")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting(Generic[T]):
    """One environment variable: its name, default, meaning and parser, declared once."""

    env: str
    """The variable's name, ``TPU_DIST_...``."""
    default: str | None
    """The raw value used when the variable is unset or empty; None: the setting has no
    value then (:meth:`read` returns None)."""
    help: str
    """What the variable does: one line of docs/reference/settings.md's table, which
    ``tools/settings_reference.py`` generates from these declarations."""
    parse: Callable[[str], T]
    """Turns the raw value into the typed one; raises ``ValueError(reason)`` if malformed."""

    def read(self, environ: Mapping[str, str] | None = None) -> T | None:
        """The typed value from ``environ`` (default: ``os.environ``).

        Raises:
            ValueError: the value is malformed; the message names the variable and its value.
        """
        environ = os.environ if environ is None else environ
        raw = environ.get(self.env)
        if raw is None or not raw.strip():
            if self.default is None:
                return None
            raw = self.default
        try:
            return self.parse(raw)
        except ValueError as err:
            raise ValueError(f"{self.env}={raw!r} {err}") from None

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """:meth:`read` for a setting with a default (never None)."""
        return self.read(environ)  # type: ignore[return-value]


def _choice(choices: tuple[str, ...], what: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"is not {what}; use one of {', '.join(choices)}.")
        return value

    return parse


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("is not a switch: use 1 (on) or 0 (off).")


def _zero_or_one(raw: str) -> bool:
    value = raw.strip()
    if value not in ("0", "1"):
        raise ValueError("is not a switch: use 1 (on) or 0 (off).")
    return value == "1"


def _seconds(minimum: float, example: str) -> Callable[[str], float]:
    """A number of seconds, at least ``minimum`` (shorter is no timeout: it would fire on a
    healthy job), finite."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not minimum <= value < math.inf:
            raise ValueError(
                f"is not a usable number of seconds: use a finite number of at least "
                f"{minimum:g}, e.g. {example}."
            )
        return value

    return parse


def _address(raw: str) -> str:
    """``host:port`` (an IPv6 host in brackets, ``[::1]:8476``), port 1-65535."""
    text = raw.strip()
    host, colon, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
    ok = (
        bool(colon) and port.isdigit() and 1 <= int(port) <= 65535
        and bool(host) and not any(c.isspace() for c in host)
        and (bracketed or ("[" not in host and "]" not in host and ":" not in host))
    )
    if not ok:
        raise ValueError(
            "is not an address: use host:port with a port from 1 to 65535, e.g. "
            "10.0.0.1:8476 or [fd00::1]:8476 (an IPv6 host in brackets)."
        )
    return f"{host}:{int(port)}"


def _positive_int(example: str) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        text = raw.strip()
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1 or str(value) != text.lstrip("+"):
            raise ValueError(f"must be a positive int, got {raw!r}; e.g. {example}.")
        return value

    return parse


def _exit_code(raw: str) -> int:
    text = raw.strip()
    if not text.isdigit() or int(text) > 255:
        raise ValueError("is not an exit code: use an integer from 0 to 255.")
    return int(text)


def _attempt(raw: str) -> int:
    text = raw.strip()
    if not text.isdigit():
        raise ValueError(f"is not a launch attempt (0, 1, ...), got {raw!r}.")
    return int(text)


def _text(raw: str) -> str:
    return raw.strip()


def _cache_choice(raw: str) -> str:
    value = raw.strip()
    lowered = value.lower()
    if lowered == "auto":
        return "auto"
    if lowered in ("0", "off", "false", "no"):
        return "off"
    if lowered in ("1", "on", "true", "yes"):
        return "on"
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        raise ValueError(
            "is neither a switch nor an absolute directory path: use 0 (off), 1 (on, the "
            "default directory) or a path such as /tmp/my_xla_cache."
        )
    return os.path.normpath(path)


def _backend_name(raw: str) -> str:
    name = raw.strip().lower()
    if not name.isidentifier():
        raise ValueError("is not a usable backend name; use a short identifier such as 'tpu_jax'.")
    return name


# -- the collectives' runtime ----------------------------------------------------------------

PLATFORM: Setting[str] = Setting(
    env="TPU_DIST_PLATFORM",
    default="auto",
    help="Where collectives run: auto (TPU when attached, else CPU), cpu, tpu, gpu.",
    parse=_choice(PLATFORMS, "a platform tpu_dist knows"),
)
COORDINATOR_ADDRESS: Setting[str] = Setting(
    env="TPU_DIST_COORDINATOR_ADDRESS",
    default=None,
    help="host:port of JAX's coordination service (default: rank 0's MASTER_ADDR and a free "
    "port).",
    parse=_address,
)
COORDINATION_SERVICE: Setting[str] = Setting(
    env="TPU_DIST_COORDINATION_SERVICE",
    default=None,
    help="host:port of a JAX coordination service that runs outside the ranks (tpu-launch "
    "starts one per attempt and sets it); every rank, rank 0 included, connects as a client. "
    "Unset: rank 0 hosts the service.",
    parse=_address,
)
TIMEOUT_POLICY: Setting[str] = Setting(
    env="TPU_DIST_TIMEOUT_POLICY",
    default="abort",
    help="What a timed-out or orphaned collective does: abort (dump the flight record, end "
    "the process) or raise (DistBackendError from wait(), the group marked failed).",
    parse=_choice(POLICIES, "a timeout policy"),
)
HEARTBEAT_TIMEOUT: Setting[float] = Setting(
    env="TPU_DIST_HEARTBEAT_TIMEOUT",
    default="10",
    help="Seconds without a heartbeat after which a peer on this host whose process is dead "
    "counts as gone (at least 0.1). A stopped (SIGSTOP) or silent peer is given the group's "
    "timeout.",
    parse=_seconds(0.1, "10"),
)
FLIGHT_RECORDER_DIR: Setting[str] = Setting(
    env="TPU_DIST_FLIGHT_RECORDER_DIR",
    default=None,
    help="Where flight records are written (default: $TMPDIR/tpu_dist_flight_recorder-<uid>).",
    parse=_text,
)
FLIGHT_RECORDER_SIZE: Setting[int] = Setting(
    env="TPU_DIST_FLIGHT_RECORDER_SIZE",
    default="2000",
    help="How many recent collectives the flight recorder keeps.",
    parse=_positive_int("2000"),
)
EXIT_CODE: Setting[int] = Setting(
    env="TPU_DIST_EXIT_CODE",
    default=None,
    help="The exit code the program is leaving with (set by tpu-launch's worker entry as the "
    "program runs, so it is read when the process exits, not once).",
    parse=_exit_code,
)
LAUNCH_ATTEMPT: Setting[int] = Setting(
    env="TPU_DIST_LAUNCH_ATTEMPT",
    default=None,
    help="This launch attempt, the same on every node (set by tpu-launch for each attempt; "
    "without it, TORCHELASTIC_RESTART_COUNT, which can differ between nodes).",
    parse=_attempt,
)
COMPILE_ONLY: Setting[bool] = Setting(
    env="TPU_DIST_COMPILE_ONLY",
    default="0",
    help="1: 'tpu' groups record collectives instead of running them (tpu-launch "
    "--compile-only sets it).",
    parse=_zero_or_one,
)

COMPILE_CACHE: Setting[str] = Setting(
    env="TPU_DIST_COMPILE_CACHE",
    default="auto",
    help="The on-disk cache of compiled collective programs: auto (on for the CPU platform, in "
    "$XDG_CACHE_HOME/tpu_dist/xla or ~/.cache/tpu_dist/xla; off on TPU and GPU), 0 (off), 1 "
    "(on, that directory, every platform) or an absolute directory path (on, there).",
    parse=_cache_choice,
)

PROGRAM_CACHE_MB: Setting[int] = Setting(
    env="TPU_DIST_PROGRAM_CACHE_MB",
    default="128",
    help="MiB of memory a process's compiled collective programs may hold (about 0.5 MiB "
    "each on CPU); past it the least recently used are dropped and built again when needed "
    "(on CPU usually loaded in milliseconds).",
    parse=_positive_int("128"),
)

# -- registration ----------------------------------------------------------------------------

BACKEND_NAME: Setting[str] = Setting(
    env="TPU_DIST_BACKEND_NAME",
    default="tpu",
    help="The torch.distributed backend name tpu_dist registers under. When it is taken by "
    "another package, tpu_dist registers under 'tpu_jax' instead and warns.",
    parse=_backend_name,
)
DEFAULT_FOR_CPU: Setting[bool] = Setting(
    env="TPU_DIST_DEFAULT_FOR_CPU",
    default="0",
    help="1: at import, make tpu_dist torch's default backend for CPU tensors (what "
    "init_process_group() without a backend and get_default_backend_for_device('cpu') use). "
    "0 (default): gloo stays the default.",
    parse=_bool,
)

# -- topology (emulation) --------------------------------------------------------------------

TOPOLOGY: Setting[str] = Setting(
    env="TPU_DIST_TOPOLOGY",
    default=None,
    help="The TPU topology CPU-emulated ranks pretend to run on: an accelerator type "
    "('v5p-128', 'v5litepod-16') or 'generation:topology' ('v5p:16x16x24'). Unset: real "
    "TPU devices if the 'tpu' backend runs on TPUs, else a default that fits the world size.",
    parse=_text,
)
NUM_SLICES: Setting[int] = Setting(
    env="TPU_DIST_NUM_SLICES",
    default="1",
    help="Slices of TPU_DIST_TOPOLOGY, joined by DCN (a positive int).",
    parse=_positive_int("2"),
)

# -- the launcher's TPU discovery --------------------------------------------------------------

METADATA_URL: Setting[str] = Setting(
    env="TPU_DIST_METADATA_URL",
    default=None,
    help="The GCE metadata server's base URL (default http://169.254.169.254/computeMetadata/v1"
    ", or GCE_METADATA_IP's).",
    parse=_text,
)
METADATA_TIMEOUT: Setting[float] = Setting(
    env="TPU_DIST_METADATA_TIMEOUT",
    default="1",
    help="Seconds for one metadata request, connection included (at least 0.01).",
    parse=_seconds(0.01, "1"),
)

LAUNCH_PRELOAD: Setting[bool] = Setting(
    env="TPU_DIST_LAUNCH_PRELOAD",
    default="1",
    help="1: tpu-launch forks its workers from a process that imported torch and JAX once (a "
    "zygote, tpu_dist.launch._zygote), and runs a --compile-only job in its own process; 0: "
    "every worker, and the compile-only job, starts as a fresh interpreter.",
    parse=_bool,
)

SETTINGS: tuple[Setting, ...] = (
    PLATFORM, COORDINATOR_ADDRESS, COORDINATION_SERVICE, TIMEOUT_POLICY, HEARTBEAT_TIMEOUT, FLIGHT_RECORDER_DIR,
    FLIGHT_RECORDER_SIZE, EXIT_CODE, LAUNCH_ATTEMPT, COMPILE_ONLY, COMPILE_CACHE, PROGRAM_CACHE_MB,
    BACKEND_NAME, DEFAULT_FOR_CPU, TOPOLOGY, NUM_SLICES, METADATA_URL, METADATA_TIMEOUT, LAUNCH_PRELOAD,
)
"""Every declared setting, in the order above."""


def check(environ: Mapping[str, str] | None = None) -> None:
    """Parse every declared setting from ``environ`` (default: ``os.environ``).

    The runtime calls this on every rank when the default "tpu" group is created, before JAX
    starts or any rank talks to another, so that a malformed value is the same ``ValueError``
    on every rank (with the same environment) instead of an error on the rank that reads it
    first and a crash on the others.

    Raises:
        ValueError: one or more values are malformed; the message names each variable, its
            value and what is accepted.
    """
    problems = []
    for setting in SETTINGS:
        try:
            setting.read(environ)
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ValueError("tpu_dist: malformed environment: " + " ".join(problems))
