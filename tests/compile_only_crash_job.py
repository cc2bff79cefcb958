"""A job with one program libtpu's compiler cannot compile (docs/reference/libtpu.md): run with
``tpu-launch --emulate tpu7x:16x16x32 --compile-only`` (tests/test_compile_only.py).

A psum over one core of every chip of ``tpu7x:16x16x32`` (8,192 of its 16,384 devices, all in
one slice) kills the compiler with SIGFPE (measured; over all 16,384 devices, or over 8,192 of
``16x16x16``, it compiles). The programs before and after it compile.
"""

import torch
import torch.distributed as dist

import tpu_dist

dist.init_process_group(tpu_dist.BACKEND)
world = dist.get_world_size()
one_core_per_chip = dist.new_group(list(range(0, world, 2)))
first_host = dist.new_group(list(range(4)))
dist.all_reduce(torch.ones(64), group=first_host)
if dist.get_rank() % 2 == 0:
    dist.all_reduce(torch.ones(256), group=one_core_per_chip)  # the compiler dies on this one
dist.all_reduce(torch.ones(64))
dist.destroy_process_group()
