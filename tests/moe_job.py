"""``examples/train_moe.py`` as a job for tests/test_examples.py: the example's own ``main``, with
every step's loss kept at full precision (the example prints 6 decimals) and each rank's
resident memory after every step (``VmRSS``) and at its peak (``VmHWM``), written to
``--out DIR`` as ``rank<R>.json``. Arguments after ``--out DIR`` are the example's."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
import train_fsdp  # noqa: E402
import train_moe  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    out = sys.argv[sys.argv.index("--out") + 1]
    argv = [a for i, a in enumerate(sys.argv[1:], 1) if a != "--out" and sys.argv[i - 1] != "--out"]
    losses: list[float] = []
    rss: list[int] = []
    reported = train_fsdp.global_mean

    def global_mean(value, group=None) -> float:  # the loss the example prints, unrounded
        mean = reported(value, group)
        losses.append(mean)
        return mean

    train_fsdp.global_mean = global_mean
    hook = register_optimizer_step_post_hook(lambda *args: rss.append(_status_kib("VmRSS")))
    backend = train_moe.main(argv)
    hook.remove()
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"backend": backend, "losses": losses, "rss_kib": rss,
                   "peak_kib": _status_kib("VmHWM")}, f)
    train_fsdp.leave(backend)


if __name__ == "__main__":
    main()
