"""The examples, run as users run them: under ``tpu-launch`` and under ``torchrun``, 4 ranks.

Four launches (each starts 4 processes; a few steps each, to keep the suite short):

1. ``tpu-launch examples/train_fsdp.py --steps 4 --save-every 2``: FSDP2 training that saves
   DCP checkpoints ``step-2`` and ``step-4``. The test deletes ``step-4``, as if the job had died
   after step 2, and
2. ``torchrun examples/train_fsdp.py --steps 4 --resume`` continues from ``step-2``: its steps
   3 and 4 must print exactly the losses of the uninterrupted run.
3. ``tpu-launch examples/train_fsdp_tp.py``: TP inside a (2, 2) mesh.

The losses of 1 and 3 are checked against the same model, data and seed trained in the test
process (the data-parallel ranks' losses averaged): equal up to float rounding, as the
reductions and sharded matmuls add in another order (the parity tests measure ~1e-7
relative); the tolerance is rel 1e-4.
4. ``torchrun examples/dtensor_jax.py``: the JAX gradient matches torch's every step (the
   example raises otherwise) and the loss falls.

Every example's last line on stdout is ``final loss X after N steps``.
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


def _launch(launcher: str, script: str, *args: str, timeout: float = 300.0) -> tuple[dict[int, float], str]:
    """Run an example on 4 ranks; return its {step: loss} and its last stdout line."""
    if launcher == "tpu-launch":
        command = [sys.executable, "-m", "tpu_dist.launch", "--nproc-per-node", "4"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [*command, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, (
        f"{launcher} {script} exited with {proc.returncode}\n"
        f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
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
