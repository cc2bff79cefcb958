"""The examples, run as users run them: under ``tpu-launch`` and under ``torchrun``.

The launches (a few steps each, to keep the suite short):

1. ``tpu-launch examples/train_fsdp.py --steps 4 --save-every 2`` (4 ranks): FSDP2 training that
   saves DCP checkpoints ``step-2`` and ``step-4``. The test deletes ``step-4``, as if the job had
   died after step 2, and
2. ``torchrun examples/train_fsdp.py --steps 4 --resume`` (4 ranks) continues from ``step-2``:
   its steps 3 and 4 must print exactly the losses of the uninterrupted run.
3. The same resume again (2 ranks): nothing is left to train; it says so and reports step 4's
   loss, never ``nan``.
4. ``--backend gloo --steps 2`` into the same directory (2 ranks): gloo's losses match one
   process, and saving step 2 below the earlier ``step-4`` warns.
5. ``tpu-launch examples/train_fsdp_tp.py`` (4 ranks): TP inside a (2, 2) mesh.

The losses of 1, 4 and 5 are checked against the same model, data and seed trained in the test
process (the data-parallel ranks' losses averaged): equal up to float rounding, as the
reductions and sharded matmuls add in another order (the parity tests measure ~1e-7
relative); the tolerance is rel 1e-4.
6. ``torchrun examples/dtensor_jax.py`` (4 ranks): the JAX gradient matches torch's every step
   (the example raises otherwise) and the loss falls; ``--backend gloo`` is refused with the
   reason.
7. ``examples/collectives_tour.py`` on "tpu" (tpu-launch) and on gloo (torchrun), 4 ranks: every
   collective of the README's support table, checked on every rank, no deprecation warning.

Every training example's last line on stdout is ``final loss X after N steps``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
_STEP = re.compile(r"step\s+(\d+) \| loss ([0-9.]+)")
_FINAL = re.compile(r"final loss ([0-9.]+) after (\d+) steps$")


def _run(launcher: str, script: str, *args: str, nproc: int = 4,
         timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run an example on ``nproc`` ranks; fail the test (with its output) if it exits non-zero."""
    if launcher == "tpu-launch":
        command = [sys.executable, "-m", "tpu_dist.launch", "--nproc-per-node", str(nproc)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [*command, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, (
        f"{launcher} {script} exited with {proc.returncode}\n"
        f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    return proc


def _launch(launcher: str, script: str, *args: str, nproc: int = 4) -> tuple[dict[int, float], str]:
    """Run an example; return its {step: loss} and its last stdout line."""
    proc = _run(launcher, script, *args, nproc=nproc)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    losses = {int(m.group(1)): float(m.group(2)) for m in map(_STEP.search, lines) if m}
    return losses, lines[-1]


def _final(line: str) -> tuple[float, int]:
    m = _FINAL.search(line)
    assert m, f"the last line does not state the final loss: {line!r}"
    return float(m.group(1)), int(m.group(2))


def test_train_fsdp_checkpoint_and_resume(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    whole, last = _launch("tpu-launch", "train_fsdp.py", "--steps", "4", "--checkpoint-dir", str(ckpt),
                          "--save-every", "2")
    assert sorted(whole) == [1, 2, 3, 4] and _final(last) == (whole[4], 4)
    want = _single_process_losses(4, dp=4)
    for step, loss in whole.items():
        assert loss == pytest.approx(want[step], rel=1e-4), step
    assert whole[4] < whole[1]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]
    shutil.rmtree(ckpt / "step-4")  # the job "died" after saving step 2
    resumed, last = _launch("torchrun", "train_fsdp.py", "--steps", "4", "--checkpoint-dir", str(ckpt),
                            "--resume")
    assert resumed == {3: whole[3], 4: whole[4]}  # bit for bit, as printed
    assert _final(last) == (whole[4], 4)

    # The same resume again: step-4 is saved, nothing is left to train. It says so and reports
    # step 4's loss as the final one (the old code printed "final loss nan after 4 steps").
    proc = _run("tpu-launch", "train_fsdp.py", "--steps", "4", "--checkpoint-dir", str(ckpt), "--resume", nproc=2)
    assert not _STEP.search(proc.stdout), proc.stdout
    assert "nothing left to train: the checkpoint is at step 4 and --steps is 4" in proc.stdout
    assert _final(proc.stdout.strip().splitlines()[-1]) == (whole[4], 4)

    # A new run into the same directory on gloo (2 ranks): the same losses as one process, and
    # saving step 2 below the earlier run's step-4 warns that --resume would load step-4.
    proc = _run("torchrun", "train_fsdp.py", "--steps", "2", "--checkpoint-dir", str(ckpt), "--backend", "gloo",
                nproc=2)
    assert "FSDP2 on 2 ranks (gloo)" in proc.stdout  # dist.get_backend(), not the flag echoed
    gloo = {int(m.group(1)): float(m.group(2)) for m in _STEP.finditer(proc.stdout)}
    want = _single_process_losses(2, dp=2)
    assert sorted(gloo) == [1, 2] and _final(proc.stdout.strip().splitlines()[-1]) == (gloo[2], 2)
    for step, loss in gloo.items():
        assert loss == pytest.approx(want[step], rel=1e-4), step
    assert f"warning: {ckpt} also holds step-4 from an earlier run; --resume loads the newest" in proc.stderr


def test_train_fsdp_tp_matches_one_process() -> None:
    losses, last = _launch("tpu-launch", "train_fsdp_tp.py", "--steps", "3")
    assert sorted(losses) == [1, 2, 3] and _final(last) == (losses[3], 3)
    want = _single_process_losses(3, dp=2)
    for step, loss in losses.items():
        assert loss == pytest.approx(want[step], rel=1e-4), step


def _single_process_losses(steps: int, dp: int) -> dict[int, float]:
    """train_fsdp.py's model, data and seed in this process: ``dp`` ranks' losses averaged."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    ex = sys.modules.get("train_fsdp_reference")
    if ex is None:
        spec = importlib.util.spec_from_file_location("train_fsdp_reference", EXAMPLES / "train_fsdp.py")
        ex = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = ex  # dataclasses look their module up while it loads
        spec.loader.exec_module(ex)
    args = ex.parse_args([])
    torch.manual_seed(args.seed)
    model = ex.Decoder(ex.model_config(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = ex.corpus()
    losses = {}
    for step in range(1, steps + 1):
        inputs, targets = ex.batch(data, step, args.batch_size, args.seq_len, args.seed)
        loss = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                   for x, y in zip(inputs.chunk(dp), targets.chunk(dp))) / dp
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    return losses


def test_dtensor_jax() -> None:
    losses, last = _launch("torchrun", "dtensor_jax.py", "--steps", "4")
    final, steps = _final(last)
    assert sorted(losses) == [1, 2, 3, 4] and steps == 4 and final == losses[4]
    assert final < 0.5 * losses[1]


def test_dtensor_jax_refuses_gloo_with_the_reason() -> None:
    """One process, no launcher: the flag is parsed before any group exists."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "dtensor_jax.py"), "--backend", "gloo"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "this example needs the 'tpu' backend" in proc.stderr and "unrecognized" not in proc.stderr


# What the README's support table lists, as the tour's rank 0 names each check.
_TOUR_CHECKS = (
    "all_reduce SUM", "all_reduce MAX int32", "all_reduce int64", "all_gather_single bf16", "all_gather (list)",
    "reduce_scatter_single", "reduce_scatter (list)", "broadcast from 3", "scatter from 0", "gather to 0",
    "reduce PRODUCT to 0", "all_to_all_single uneven", "all_to_all (list)", "batch_isend_irecv ring", "send/recv pairs",
    "all_gather_object", "broadcast_object_list", "gather_object to 0", "scatter_object_list",
    "all_reduce in subgroup", "all_reduce async_op=True",
)


@pytest.mark.parametrize("launcher, backend", [("tpu-launch", "tpu"), ("torchrun", "gloo")])
def test_collectives_tour(launcher: str, backend: str) -> None:
    """Every collective of the support table runs and is checked on every rank (the example
    raises on a wrong result); with ``--backend gloo`` the same program runs on gloo; torch's
    deprecation warnings for the old all_gather_into_tensor / reduce_scatter_tensor names never
    appear."""
    proc = _run(launcher, "collectives_tour.py", "--backend", backend)
    shown = [m.group(1).strip() for m in re.finditer(r"\[tour\] (.{28}) -> ", proc.stdout)]
    assert sorted(shown) == sorted(_TOUR_CHECKS), shown
    last = proc.stdout.strip().splitlines()[-1]
    # rank 0 does 20 checks (it roots gather/reduce/gather_object); the odd ranks check a recv.
    assert last.endswith(f"every check passed on all 4 ranks ({backend}): checks per rank [20, 18, 17, 18]"), last
    assert "deprecated" not in proc.stderr and "FutureWarning" not in proc.stderr, proc.stderr[-3000:]
    if backend == "tpu":
        assert "20 repeated all_reduces" in proc.stdout and "no new program" in proc.stdout
