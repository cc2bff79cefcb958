"""The ``python -m tpu_dist.mesh`` CLI: one real subprocess, the rest in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_dist.mesh.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_cli_subprocess_issue_example() -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(
        [sys.executable, "-m", "tpu_dist.mesh", "--topology", "v5p:16x16x24",
         "--num-slices", "2", "--ici", "1,384,16", "--dcn", "2,1,1", "--names", "dp,fsdp,tp"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "v5p 16x16x24 (v5p-12288), wraps around on x,y,z" in text
    assert "12288 chips" in text and "3072 hosts (1536 per slice" in text
    assert "mesh: (2, 384, 16) = ici (1, 384, 16) x dcn (2, 1, 1)" in text
    rows = {
        line.split()[0]: line.split()
        for line in text.splitlines()
        if line[:4] in ("dp  ", "fsdp", "tp  ")
    }
    assert rows["dp"][4] == "DCN" and "crosses slices" in text
    assert rows["fsdp"][4] == "ICI" and rows["fsdp"][-4] == "1/1.00"  # one hop between members
    assert rows["tp"][4] == "ICI" and rows["tp"][-4] == "1/1.00" and rows["tp"][-1] == "400"
    assert "dp: [0(0, 0, 0)s0, 6144(0, 0, 0)s1]" in text
    # The legend names the marks the members carry (it once said "[slice]" for "s0").
    assert "each member as rank(chip coordinates), then sN: slice N:" in text


def test_cli_without_dcn_and_on_v7x(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--topology", "tpu7x-16", "--ici", "8,2"]) == 0
    text = capsys.readouterr().out
    assert "16 devices (2 per chip)" in text
    assert "axis1  2     2    1    on-chip" in text
    assert "each member as rank(chip coordinates), then cK: core K of the chip:" in text
    assert "axis1: [0(0, 0, 0)c0, 1(0, 0, 0)c1]" in text
    assert main(["--topology", "v5p-8", "--num-slices", "2", "--ici", "2,4"]) == 0
    assert "ici (1, 4) x dcn (2, 1)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--topology", "v5p-8", "--ici", "3,2"], "must be 4"),
        (["--topology", "v9-8", "--ici", "4"], "unknown TPU generation 'v9'"),
        (["--topology", "v5p-8", "--ici", "a,b"], "comma-separated ints"),
        (["--topology", "v5p-8", "--ici", "2,2", "--names", "dp"], "--names needs 2"),
    ],
)
def test_cli_errors(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err
