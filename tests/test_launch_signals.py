"""A launcher that waits in the rendezvous for a node that never starts: it says which node it
waits for, and SIGTERM or SIGINT stops it at once (issue 34, item 5).

Both waits of a two-node static rendezvous are covered: node 0 (it hosts the store and waits for
node 1 to connect) and node 1 (node 0 never opens the store). torchrun is the reference for
SIGTERM: at that point its SIGTERM is still the default action, so it dies of the signal at once
(a shell or scheduler sees 143, as tpu-launch's 128 + 15). torchrun's SIGINT is held until the
rendezvous times out (15 min by default), so there the test asks more than torchrun does: 130
at once. The four launches and torchrun start together (the ``waits`` fixture); the only timing
asserted is a generous bound (the machine is shared).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.launch_worker import REPO, clean_env, free_port

WAIT_LINE = "is waiting for node"
"""The start of the launcher's progress line while it waits in the rendezvous."""
STARTUP_S = 120.0
"""How long a launcher may take to start and print its first progress line (loaded machine)."""
STOP_S = 10.0
"""How long a launcher may take to exit after the signal (measured: well under 1 s)."""
CASES = [(sig, node) for sig in (signal.SIGTERM, signal.SIGINT) for node in (0, 1)]


def _default_signals() -> None:
    # A child of a shell's background job inherits SIGINT ignored; give it the default, as a
    # terminal or a scheduler would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _Run:
    """One launcher (or torchrun) of a two-node job whose other node never starts; stderr is
    read line by line in a thread."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_default_signals,  # noqa: PLW1509 (two signal() calls, no locks)
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def stop_with(self, sig: int) -> tuple[int | None, float]:
        """Sends ``sig``; (exit code or None if still alive after :data:`STOP_S`, seconds)."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            code = None
        elapsed = time.monotonic() - start
        if code is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=5)
        return code, elapsed

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)


def _two_node_args(node: int, port: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port)]


@pytest.fixture(scope="module")
def waits() -> dict:
    """Every launcher of :data:`CASES` and torchrun's node 0, started at once, signalled once
    each launcher printed its progress line (or :data:`STARTUP_S` passed): case -> (exit code,
    seconds to exit, stderr, whether the progress line came before the signal)."""
    script = os.path.join(REPO, "tests", "launch_worker.py")
    runs = {
        case: _Run([sys.executable, "-m", "_tpu_dist_launch",
                    *_two_node_args(case[1], free_port()), script, "allreduce"])
        for case in CASES
    }
    torchrun = _Run([sys.executable, "-m", "torch.distributed.run",
                     *_two_node_args(0, free_port()), script, "allreduce"])
    deadline = time.monotonic() + STARTUP_S
    results = {}
    pending = dict(runs)
    while pending:
        for case, run in list(pending.items()):
            if run.saw(WAIT_LINE) or time.monotonic() > deadline or run.proc.poll() is not None:
                waited_line = run.saw(WAIT_LINE)
                code, elapsed = run.stop_with(case[0])
                results[case] = (code, elapsed, run.stderr, waited_line)
                del pending[case]
        time.sleep(0.2)
    results["torchrun"] = (*torchrun.stop_with(signal.SIGTERM), torchrun.stderr, False)
    return results


def test_torchrun_reference_dies_of_sigterm_at_once(waits: dict) -> None:
    code, elapsed, err, _ = waits["torchrun"]
    assert code == -signal.SIGTERM, f"torchrun: exit {code} after {elapsed:.1f} s\n{err}"


@pytest.mark.parametrize("sig,node", CASES, ids=[f"{s.name}-node{n}" for s, n in CASES])
def test_launcher_waiting_for_a_node_stops_at_once_on_signal(
    waits: dict, sig: signal.Signals, node: int
) -> None:
    code, elapsed, err, _ = waits[(sig, node)]
    assert code is not None, f"still alive {STOP_S} s after {sig.name}\n--- stderr\n{err}"
    # torchrun's SIGTERM death is 143 to a shell; tpu-launch exits 128 + N for every signal.
    assert code == 128 + sig, f"exit {code} {elapsed:.1f} s after {sig.name}\n--- stderr\n{err}"
    assert f"got {sig.name} while node {node} waited for the rendezvous at 127.0.0.1:" in err, err


@pytest.mark.parametrize("sig,node", CASES, ids=[f"{s.name}-node{n}" for s, n in CASES])
def test_launcher_says_which_node_it_waits_for(
    waits: dict, sig: signal.Signals, node: int
) -> None:
    _, _, err, waited_line = waits[(sig, node)]
    assert waited_line, f"no progress line within {STARTUP_S} s\n--- stderr\n{err}"
    expected = (
        "node 0 is waiting for node(s) 1 to join the rendezvous at 127.0.0.1:"
        if node == 0
        else "node 1 is waiting for node 0 to open the rendezvous store at 127.0.0.1:"
    )
    line = next((x for x in err.splitlines() if WAIT_LINE in x), "")
    assert expected in line, err
    assert "of the 900 s rendezvous timeout" in line, line
    if node == 0:
        assert "(1 of 2 joined," in line, line
