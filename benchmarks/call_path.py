"""Which of tpu_dist's files one ``dist.all_reduce(t)`` walks through, in order (issue 32).

Run on 2 ranks (``tpu-launch --nproc-per-node 2 benchmarks/call_path.py``; or with
``PYTHONPATH=<another tree>`` to read another version). After a warm-up call, rank 0 traces one
synchronous all_reduce of 4 floats on the calling thread (``sys.settrace``) and prints:

* the tpu_dist files in the order the call is in them (a new entry each time it moves to
  another file, returns included), the number of such switches, and how many go back into a
  file already read;
* the *calls* from one file into another (returns not counted), and how many of them call
  back into a file the call reached earlier (a later stage calling into an earlier one: a
  closure defined there, a helper looked up from below).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import tpu_dist  # noqa: F401  (registers the backend)

ROOT = os.path.dirname(os.path.abspath(tpu_dist.__file__)) + os.sep


def _trace_one_all_reduce() -> tuple[list[str], list[tuple[str, str]]]:
    path: list[str] = []
    calls: list[tuple[str, str]] = []

    def tracer(frame, event, arg):  # noqa: ANN001 (sys.settrace's signature)
        filename = frame.f_code.co_filename
        if filename.startswith(ROOT):
            name = filename[len(ROOT):]
            if not path or path[-1] != name:
                path.append(name)
            caller = frame.f_back.f_code.co_filename if frame.f_back else ""
            if event == "call" and caller.startswith(ROOT) and caller != filename:
                calls.append((caller[len(ROOT):], name))
        return tracer

    t = torch.ones(4)
    sys.settrace(tracer)
    try:
        dist.all_reduce(t)
    finally:
        sys.settrace(None)
    assert torch.equal(t, torch.full((4,), float(dist.get_world_size())))
    return path, calls


def main() -> None:
    dist.init_process_group(tpu_dist.BACKEND)
    dist.all_reduce(torch.ones(4))  # warm: the program is compiled and cached
    path, calls = _trace_one_all_reduce()
    if dist.get_rank() == 0:
        seen: set[str] = set()
        back = 0
        for name in path:
            back += name in seen
            seen.add(name)
        print(" -> ".join(path))
        print(
            f"files: {len(seen)}, switches: {len(path) - 1}, back into a file already read: "
            f"{back}"
        )
        order = {name: i for i, name in reversed(list(enumerate(path)))}
        backward = [(a, b) for a, b in calls if order[b] < order[a]]
        print(f"calls between files: {len(calls)}, into a file reached earlier: {len(backward)}")
        for a, b in sorted(set(backward)):
            print(f"  back: {a} -> {b} ({backward.count((a, b))}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
