"""TorchTitan 0.3.0 unchanged under ``tpu-launch --compile-only`` (issue 50): its own MoE config
on the emulated TorchTPU device, with expert parallelism.

Runs where TorchTitan is installed (``pip install "tpu-dist[torchtitan]"``: TorchTitan 0.3.0
and triton, which it imports even on a CPU build of torch); skipped elsewhere. One launch (about
30 s here, most of it TorchTitan's imports): ``-m torchtitan.train --module qwen3 --config
qwen3_moe_debug`` (8 layers of 64 experts, top 8, width 256) with expert parallelism 4 on the 4
devices of ``v5p:2x2x1``, a local tokenizer and dataset (``benchmarks/torchtitan_assets.py``),
sequence 512, 2 sequences a rank, one step. Checked against TorchTitan's own numbers: its FLOP
count per token (MFU's numerator) and the all-to-all sizes of balanced routing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("libtpu", reason="compile-only mode compiles with libtpu")
pytest.importorskip("torchtitan.trainer", reason="TorchTitan (pip install 'tpu-dist[torchtitan]')")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, BATCH, EP = 512, 2, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict]:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from torchtitan_assets import write_assets

    tmp = tmp_path_factory.mktemp("torchtitan")
    tokenizer, data = write_assets(str(tmp / "assets"))
    report = tmp / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "_tpu_dist_launch", "--emulate", "v5p:2x2x1", "--compile-only",
         "--compile-report", str(report), "-m", "torchtitan.train", "--module", "qwen3",
         "--config", "qwen3_moe_debug", "--hf-assets-path", tokenizer,
         "--dataloader.dataset", "c4_test", "--dataloader.dataset-path", data,
         "--training.steps", "1", "--training.seq-len", str(SEQ),
         "--training.local-batch-size", str(BATCH),
         "--parallelism.expert-parallel-degree", str(EP),
         # TorchTitan 0.3.0 on torch 2.13, on any backend (README, TorchTitan section)
         "--parallelism.spmd-backend", "partial_dtensor", "--training.disable-cuda-graphs",
         "--metrics.no-enable-tensorboard", "--profiler.no-enable-profiling"],
        cwd=str(tmp), env=env, capture_output=True, text=True, timeout=900,
    )
    data = json.loads(report.read_text()) if report.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, data


def _torchtitan_flops_per_token() -> tuple[int, int]:
    """TorchTitan's own count (its MFU numerator: 6 x non-embedding parameters, the active
    experts only, + 12 L H d_h s), and the norms' weights it counts among the parameters."""
    from torchtitan.models.qwen3 import model_registry

    config = model_registry("debugmodel_moe").model
    with torch.device("meta"):
        model = config.build()
    _, flops = config.get_nparams_and_flops(model, SEQ)
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    return flops, norms


def test_torchtitan_runs_on_the_emulated_torchtpu_device(run: tuple[int, str, dict]) -> None:
    """TorchTitan takes its TorchTPU path (its device module reports the emulated v5p); its one
    step is measured and every collective compiles. On torch 2.13 TorchTitan 0.3.0 then stops in
    its own code, after the step, calling torch 2.14's ``torch.distributed.set_timeout``."""
    code, out, report = run
    assert "TPU capacity: TPU v5p with 95.00GiB memory" in out, out[-3000:]
    if code != 0:
        assert not hasattr(torch.distributed, "set_timeout"), out[-3000:]
        assert "module 'torch.distributed' has no attribute 'set_timeout'" in out, out[-3000:]
    assert report["collectives"] and all(r["compiled"] for r in report["collectives"])
    assert report["step"]["steps_run"] == 1 and report["step_error"] is None


def test_the_step_counts_torchtitans_flops_flex_attention_and_experts(
        run: tuple[int, str, dict]) -> None:
    """The step's model FLOPs (3 x the forward's: FlexAttention over the whole square, the
    experts' grouped matmuls over the tokens balanced routing gives them) are TorchTitan's count
    per token times the tokens per device (2 x 512: expert parallelism does not divide them),
    but for the norms' weights, which TorchTitan counts among the 6 N and which do no matmul."""
    _, out, report = run
    step = report["step"]
    flops_per_token, norms = _torchtitan_flops_per_token()
    tokens = BATCH * SEQ
    assert step["tokens_per_device"] == tokens
    assert step["model_flops_per_device"] == (flops_per_token - 6 * norms) * tokens
    # Executed: more (activation checkpointing recomputes; attention's backward recomputes the
    # scores) and less (FlexAttention skips the blocks its causal mask leaves out).
    assert step["flops_per_device"] > step["model_flops_per_device"]


def test_expert_parallel_all_to_alls_have_the_sizes_of_balanced_routing(
        run: tuple[int, str, dict]) -> None:
    """Each rank's 1,024 tokens go to 8 experts each, of width 256, in bf16: 4 MiB a rank in
    every dispatch and combine all-to-all (4 a layer: forward and backward), 8 layers, and the
    4 bytes of each chunk's length (one chunk for each of the EP ranks); the report says the
    sizes assume balanced routing."""
    _, out, report = run
    data = [r for r in report["collectives"]
            if r["op"] == "all_to_all_single" and r["bytes_per_rank"] > 1024]
    assert [(r["group_size"], r["bytes_per_rank"], r["count"]) for r in data] == [
        (EP, BATCH * SEQ * 8 * 256 * 2 + EP * 4, 4 * 8)]
    assert any(a.startswith("balanced routing") for a in report["assumptions"])
    assert "assumed: balanced routing" in out
