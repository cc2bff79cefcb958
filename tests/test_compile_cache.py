"""tpu_dist.collectives._compile_cache: compiled collective programs kept on disk.

Tier (a), in this process: where the cache lives, and that a directory others could write to
is refused. Tier (b), fresh single-rank "tpu" worlds (each a process of its own that has
compiled nothing before, real JAX and XLA, one after another on the same directories):
programs come back from the cache equal to a fresh compile, a damaged entry is compiled again
with a warning, ``TPU_DIST_COMPILE_CACHE=0`` turns the cache off, and, the regression this file
exists for, a program JAX's own persistent cache loaded is never stored (XLA:CPU serializes a
loaded program without its kernels, and the next process failed with ``NOT_FOUND: Function ...
not found`` when it ran it).
"""

from __future__ import annotations

import logging
import os
import stat
import textwrap
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import pytest

from tpu_dist import _settings
from tests.fresh_process import cpu_devices_env, script_result
from tests.harness import World
from tpu_dist.collectives import _compile_cache


# -- tier (a): the directory ---------------------------------------------------------------


def test_choice_selects_the_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = tmp_path / "tpu_dist" / "xla"
    assert _compile_cache.default_directory() == default
    assert _compile_cache.choose_directory("auto", "cpu") == default
    assert _compile_cache.choose_directory("auto", "tpu") is None
    assert _compile_cache.choose_directory("auto", "gpu") is None
    assert _compile_cache.choose_directory("on", "tpu") == default
    assert _compile_cache.choose_directory("off", "cpu") is None
    assert _compile_cache.choose_directory("/some/where", "tpu") == Path("/some/where")


@pytest.mark.parametrize(
    ("raw", "value"),
    [("0", "off"), ("OFF", "off"), ("no", "off"), ("1", "on"), ("true", "on"), ("", "auto"),
     (" auto ", "auto"), ("/tmp/x/../y", "/tmp/y")],
)
def test_setting_values(raw: str, value: str) -> None:
    assert _settings.COMPILE_CACHE.read({_settings.COMPILE_CACHE.env: raw}) == value


def test_setting_refuses_a_relative_path() -> None:
    # Ranks may start in different directories: a relative path would split the cache.
    with pytest.raises(ValueError, match=r"TPU_DIST_COMPILE_CACHE='cache/xla'.*absolute"):
        _settings.COMPILE_CACHE.read({_settings.COMPILE_CACHE.env: "cache/xla"})


def test_directory_is_created_private(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b"
    assert _compile_cache.CompileCache().private_directory(path) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert path.stat().st_uid == os.getuid()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_directory_writable_by_others_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int
) -> None:
    path = tmp_path / f"shared{mode:o}"
    path.mkdir()
    path.chmod(mode)
    with caplog.at_level(logging.WARNING, logger=_compile_cache.__name__):
        assert _compile_cache.CompileCache().private_directory(path) is None
    assert f"not using the compile cache {path}" in caplog.text
    assert f"mode {mode:o}" in caplog.text and "TPU_DIST_COMPILE_CACHE" in caplog.text


def test_directory_of_another_user_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    owner = path.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)  # we are someone else now
    with caplog.at_level(logging.WARNING, logger=_compile_cache.__name__):
        assert _compile_cache.CompileCache().private_directory(path) is None
    assert f"owned by uid {owner} (you are {owner + 1})" in caplog.text


# -- tier (b): single-rank worlds, one process each ----------------------------------------

def _single_rank_world(rank: int, world_size: int, jax_cache: str | None) -> dict:
    """The body of :func:`_run_world`: one all_reduce with a kernel (premul sum) and one
    without, in a process that has not compiled anything yet."""
    import jax

    from tpu_dist.collectives import _runtime, compile_count

    # JAX read the suite's JAX_COMPILATION_CACHE_DIR when the forkserver imported it: this
    # world's choice must go to its config (the world's environment comes too late for JAX).
    jax.config.update("jax_compilation_cache_dir", jax_cache)
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Collect()
    logging.getLogger("tpu_dist").addHandler(handler)
    try:
        dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=1)
        x = torch.arange(1, 6, dtype=torch.float32)
        y = torch.arange(7, dtype=torch.int32)
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.5))  # a kernel: x * 2.5
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        texts = sorted(p.compiled.as_text() for p in _runtime.get().programs.by_key.values())
        compiled = compile_count()
        dist.destroy_process_group()
    finally:
        logging.getLogger("tpu_dist").removeHandler(handler)
    return {
        "x": x.tolist(), "y": y.tolist(), "compiled": compiled, "warnings": warnings,
        "programs": len(texts), "texts": texts,
    }


def _run_world(cache: str, jax_cache: Path | None = None, xdg: Path | None = None) -> dict:
    """One single-rank world in a process of its own (forked from the suite's forkserver, which
    has imported torch and JAX but never started a JAX backend or compiled); ``xdg``: its
    ``XDG_CACHE_HOME`` (the default directory's parent; never the user's own)."""
    env = {
        "TPU_DIST_PLATFORM": "cpu", "TPU_DIST_COMPILE_CACHE": cache,
        "XDG_CACHE_HOME": str(xdg or Path(cache).parent / "xdg"),
        "JAX_COMPILATION_CACHE_DIR": None if jax_cache is None else str(jax_cache),
    }
    with World(1, backend="tpu", init=False, env=env, timeout=180) as world:
        return world.run(_single_rank_world, None if jax_cache is None else str(jax_cache))[0]


def _expected() -> tuple[list[float], list[int]]:
    x = (np.arange(1, 6, dtype=np.float32) * np.float32(2.5)).tolist()
    return x, list(range(7))


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.xla"))


def test_loaded_programs_equal_a_fresh_compile(tmp_path: Path) -> None:
    cache = tmp_path / "xla"
    cold = _run_world(str(cache))
    assert (cold["x"], cold["y"]) == _expected() and not cold["warnings"]
    assert cold["programs"] == 2 and len(_entries(cache)) == 2
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    warm = _run_world(str(cache))
    assert (warm["x"], warm["y"]) == _expected() and not warm["warnings"]
    # Loaded, not compiled: the entries were read (compile_count counts loads too) and
    # XLA's optimized programs are the ones the cold process compiled, op for op.
    assert warm["compiled"] == cold["compiled"] == 2
    assert warm["texts"] == cold["texts"]
    off = _run_world("0")
    assert off["texts"] == cold["texts"]


def test_cache_off_writes_nothing_and_auto_is_on_for_cpu(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    off = _run_world("0", xdg=xdg)
    assert (off["x"], off["y"]) == _expected() and not off["warnings"]
    assert not xdg.exists()
    auto = _run_world("auto", xdg=xdg)
    assert (auto["x"], auto["y"]) == _expected() and not auto["warnings"]
    assert len(_entries(xdg / "tpu_dist" / "xla")) == 2


def test_damaged_entries_are_compiled_again_with_a_warning(tmp_path: Path) -> None:
    cache = tmp_path / "xla"
    _run_world(str(cache))
    first, second = _entries(cache)
    whole = first.read_bytes()
    first.write_bytes(whole[: len(whole) // 2])  # truncated
    flipped = bytearray(second.read_bytes())
    flipped[-100] ^= 0xFF  # one byte damaged inside the program
    second.write_bytes(bytes(flipped))
    result = _run_world(str(cache))
    assert (result["x"], result["y"]) == _expected()
    assert len(result["warnings"]) == 2, result["warnings"]
    for path in (first, second):
        assert any(
            str(path) in warning and "damaged or truncated" in warning
            for warning in result["warnings"]
        ), result["warnings"]
    # Replaced by the recompiled programs: the next process loads them without a word.
    again = _run_world(str(cache))
    assert (again["x"], again["y"]) == _expected() and not again["warnings"]
    assert again["texts"] == result["texts"]


def test_programs_loaded_by_jax_persistent_cache_are_not_stored(tmp_path: Path) -> None:
    # The bug that kept the cache out of main: with JAX_COMPILATION_CACHE_DIR on (as in this
    # suite), lowered.compile() hands back a program loaded from JAX's cache; serialized again
    # for ours, it lost its kernels' object code, and the next process to load it failed when
    # it ran it (NOT_FOUND: Function broadcast_multiply_fusion not found (type id: 1)).
    jax_cache, cache = tmp_path / "jax", tmp_path / "xla"
    _run_world("0", jax_cache)  # fills JAX's cache only
    assert any(jax_cache.iterdir())
    served = _run_world(str(cache), jax_cache)  # JAX's cache serves; ours must not store
    assert (served["x"], served["y"]) == _expected()
    after = _run_world(str(cache), jax_cache)  # loads what ours stored, if anything
    assert (after["x"], after["y"]) == _expected()
    assert _entries(cache) == []
    alone = _run_world(str(cache))  # without JAX's cache: compiles, stores, and then loads
    assert (alone["x"], alone["y"]) == _expected() and len(_entries(cache)) == 2
    loaded = _run_world(str(cache), jax_cache)
    assert (loaded["x"], loaded["y"]) == _expected() and not loaded["warnings"]


def _init_fails(rank: int, world_size: int, cwd: str) -> str:
    os.chdir(cwd)
    try:
        dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=1)
    except ValueError as err:
        return f"ValueError: {err}"
    dist.destroy_process_group()
    return "no error"


def test_malformed_setting_fails_init_naming_the_variable(tmp_path: Path) -> None:
    env = {"TPU_DIST_PLATFORM": "cpu", "TPU_DIST_COMPILE_CACHE": "relative/dir"}
    with World(1, backend="tpu", init=False, env=env) as world:
        got = world.run(_init_fails, str(tmp_path))[0]
    # Every variable is checked at init (issue 34 item 6); the message names each bad one.
    assert got.startswith("ValueError: tpu_dist: malformed environment:"), got
    assert "TPU_DIST_COMPILE_CACHE='relative/dir'" in got, got
    assert not (tmp_path / "relative").exists()


_NAMES = textwrap.dedent(
    """
    import dataclasses, json
    import jax
    from tpu_dist.collectives import ProgramKey
    from tpu_dist.collectives._compile_cache import entry_name

    devices = jax.devices("cpu")
    base = ProgramKey("allreduce", (0, 1), ((8, "float32"),), ("SUM",), "exchange")
    changed = {
        "kind": "allgather", "blocks": ((9, "float32"),), "params": ("MAX",), "algorithm": "xla",
        "groups": 2,  # a family program of two groups of one over the same two devices
    }
    assert set(changed) | {"devices"} == {f.name for f in dataclasses.fields(ProgramKey)}, (
        "a new field")
    names = [entry_name(base, devices[:2])]
    names += [entry_name(dataclasses.replace(base, **{f: v}), devices[:2])
              for f, v in changed.items()]
    names.append(entry_name(dataclasses.replace(base, devices=(0,)), devices[:1]))  # 1 device
    other = [entry_name(dataclasses.replace(base, devices=(3, 1)), [devices[3], devices[1]])]
    print("RESULT" + json.dumps({"names": names, "other_devices": other}))
    """
)


def test_every_field_of_the_program_key_names_its_own_entry() -> None:
    """Two programs that differ in any field of their key (the algorithm too: an exchange and
    XLA's all-reduce of the same blocks; the number of groups of a family program) or in their
    group's size must never share a cache
    entry; on CPU, groups of the same size and layout on other devices do (one process's
    devices here: [3, 1] finds [0, 1]'s entry, loaded onto its own devices)."""
    out = script_result(_NAMES, env=cpu_devices_env(4), timeout=120)
    names = out["names"]
    assert len(names) == 7 and len(set(names)) == 7, names
    assert out["other_devices"] == names[:1]


# -- tier (c): ranks of one world share the host's compilations ----------------------------


def _new_programs_counting_compilations(rank: int, world_size: int) -> dict:
    """Three collectives of shapes no earlier test used; what XLA compiled in this process
    (JAX's own compile event, independent of tpu_dist) and the results."""
    import jax

    compiled: list[float] = []

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration)

    # JAX's persistent cache (the suite's, read by the forkserver's JAX) would hand a rank a
    # program compiled in an earlier session, which is never stored (see above): off here.
    was_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        x = torch.arange(13, dtype=torch.float64) * (rank + 1)
        dist.all_reduce(x)
        gathered = torch.empty(17 * world_size, dtype=torch.int16)
        dist.all_gather_into_tensor(gathered, torch.full((17,), rank, dtype=torch.int16))
        scattered = torch.empty(3, dtype=torch.float32)
        dist.reduce_scatter_tensor(scattered, torch.arange(3.0 * world_size) + rank)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.config.update("jax_enable_compilation_cache", was_on)
    return {
        "compiled": len(compiled), "x": x.tolist(), "gathered": gathered.tolist(),
        "scattered": scattered.tolist(),
    }


def test_one_rank_of_the_host_compiles_a_new_program_the_others_load_it(tmp_path: Path) -> None:
    cache = tmp_path / "xla"
    env = {"TPU_DIST_COMPILE_CACHE": str(cache)}
    with World(3, "tpu", env=env) as world:
        results = world.run(_new_programs_counting_compilations)
    n = 3
    ranks = np.arange(n)
    for rank, got in enumerate(results):
        assert got["x"] == (np.arange(13, dtype=np.float64) * (ranks + 1).sum()).tolist()
        assert got["gathered"] == np.repeat(ranks, 17).tolist()
        whole = sum(np.arange(3.0 * n) + r for r in ranks)
        assert got["scattered"] == whole[3 * rank:3 * rank + 3].tolist()
    # Each of the three programs was compiled by one rank and loaded by the two others.
    assert sum(got["compiled"] for got in results) == 3, results
    assert len(_entries(cache)) == 3
