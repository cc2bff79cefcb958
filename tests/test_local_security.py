"""Local attacks on the files tpu_dist writes and reads (issue 34, items 2 and 3).

Another user of the same machine must not be able to make a job run their program (the compile
cache loads executables) or overwrite a file the job can write (flight records). Each test
reproduces one attack as it was found and checks it is refused. The tests run as root here, so
"another user" is uid :data:`OTHER` given files and directories made in ``tmp_path``
(``os.chown``); what the attacker does between a check and a use is done by the test itself.

Tier (a), in this process: the checks of a cache directory and its parents, and flight-record
dumps. Tier (b), a fresh process each (one CPU process with two devices, real XLA): the
compile cache's loads (forked from the suite's forkserver), and a dump that hits the file size
limit (``python -c``).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.fresh_process import script_result
from tests.harness import World
from tpu_dist.collectives import _compile_cache, flight_recorder

ROOT = Path(__file__).resolve().parents[1]
OTHER = 65534
"""The other user's uid (``nobody``)."""
ME = os.getuid()

pytestmark = pytest.mark.skipif(
    ME != 0, reason="simulating another user needs os.chown to another uid (root)"
)


def _as_other(*paths: Path) -> None:
    for path in paths:
        os.chown(path, OTHER, OTHER, follow_symlinks=False)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- tier (a): the compile cache's directory and its parents --------------------------------


@pytest.mark.parametrize("who", ["group/other-writable", "another user's"])
def test_cache_under_a_parent_others_can_write_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, who: str
) -> None:
    # Whoever can write the parent can rename the cache away and put their own in its place.
    parent = tmp_path / "parent"
    parent.mkdir()
    if who == "group/other-writable":
        parent.chmod(0o777)  # not sticky
        found = f"owned by uid {ME} (you are {ME}) with mode 777"
    else:
        parent.chmod(0o755)
        _as_other(parent)
        found = f"owned by uid {OTHER} (you are {ME}) with mode 755"
    cache = parent / "xla"
    cache.mkdir(mode=0o700)  # the cache itself is ours and private
    with caplog.at_level(logging.WARNING, logger=_compile_cache.__name__):
        assert _compile_cache.CompileCache().private_directory(cache) is None
    (warning,) = _warnings(caplog)
    assert f"not using the compile cache {cache}: its parent directory {parent} " in warning
    assert found in warning and "TPU_DIST_COMPILE_CACHE" in warning, warning


@pytest.mark.parametrize("group", ["ours", "another"])
def test_cache_under_a_parent_its_group_can_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, group: str
) -> None:
    # Writable by the user's private group (root's "root", no other member, here), as
    # ~/.cache is with Ubuntu's umask 002: used. By another group: refused.
    parent = tmp_path / "parent"
    parent.mkdir()
    parent.chmod(0o775)
    if group == "another":
        os.chown(parent, ME, OTHER)
    cache = parent / "xla"
    with caplog.at_level(logging.WARNING, logger=_compile_cache.__name__):
        used = _compile_cache.CompileCache().private_directory(cache)
    if group == "ours":
        assert used == cache and not _warnings(caplog)
    else:
        assert used is None
        (warning,) = _warnings(caplog)
        assert f"its parent directory {parent} is owned by uid {ME} (you are {ME}) with mode " \
            "775" in warning, warning


def test_cache_under_a_sticky_directory_like_tmp_is_used(tmp_path: Path) -> None:
    # In a sticky directory others can add entries but not rename or remove ours.
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    cache = sticky / "me" / "xla"
    assert _compile_cache.CompileCache().private_directory(cache) == cache
    for made in (cache, cache.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.stat().st_uid == ME


def test_cache_through_a_link_another_user_planted_in_a_sticky_directory_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The link (owned by the other user, in a directory anyone can add to) points at a
    # directory of ours: without the check, the cache would go wherever they say.
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = sticky / "xla"
    link.symlink_to(mine)
    _as_other(link)
    with caplog.at_level(logging.WARNING, logger=_compile_cache.__name__):
        assert _compile_cache.CompileCache().private_directory(link) is None
    (warning,) = _warnings(caplog)
    assert f"{link} is a symbolic link owned by uid {OTHER}" in warning, warning


def test_cache_through_a_link_of_our_own_is_used(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (tmp_path / "xla").symlink_to("mine")
    assert _compile_cache.CompileCache().private_directory(tmp_path / "xla") == tmp_path / "xla"
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "up").symlink_to("../mine/sub")  # relative, with "..", made on the way
    assert _compile_cache.CompileCache().private_directory(tmp_path / "deep" / "up") is not None
    assert (mine / "sub").is_dir() and stat.S_IMODE((mine / "sub").stat().st_mode) == 0o700


# -- tier (b): loads of the compile cache, a process each ------------------------------------

def _build_one(rank: int, world_size: int, cache: str, swap_to: str) -> tuple[str, str]:
    """In a process of its own: build one all_reduce program on two CPU devices through
    ``TPU_DIST_COMPILE_CACHE=cache`` (the world's environment); with ``swap_to``, the
    attacker swaps the checked directory for a link to theirs before the build. Returns where
    the program came from and what tpu_dist logged (its warnings)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_enable_compilation_cache", False)  # only tpu_dist's cache
    from tpu_dist.collectives import ProgramKey
    from tpu_dist.collectives._lowering import ProgramCache

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tpu_dist").addHandler(handler)
    assert os.environ["TPU_DIST_COMPILE_CACHE"] == cache
    devices = jax.devices("cpu")[:2]
    key = ProgramKey("allreduce", (0, 1), ((8, "float32"),), ("SUM",), "xla")
    programs = ProgramCache()
    programs.platform = "cpu"
    assert programs.disk.directory("cpu") is not None  # checked now
    if swap_to:  # the attacker, after the check: the checked directory becomes a link to theirs
        os.rename(cache, cache + ".checked")
        os.symlink(swap_to, cache)
    programs.program(key, devices)
    return programs.origins[key], "\n".join(records)


def _build(cache: Path, swap_to: Path | None = None) -> tuple[str, str]:
    """Build one all_reduce program in a fresh process with ``TPU_DIST_COMPILE_CACHE=cache``
    (forked from the suite's forkserver, which imported torch and JAX but never started a JAX
    backend or compiled); returns where it came from (``"disk"``: loaded from the cache,
    ``"compiled"``) and the process's warnings."""
    env = {"TPU_DIST_COMPILE_CACHE": str(cache), "JAX_COMPILATION_CACHE_DIR": None}
    with World(1, backend="tpu", init=False, env=env, timeout=180) as world:
        return world.run(_build_one, str(cache), str(swap_to or ""))[0]


@pytest.fixture(scope="module")
def theirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The other user's cache directory, holding a real program for the key :func:`_build`
    asks for (one they could have built to do anything), all owned by them, mode 755/644."""
    evil = tmp_path_factory.mktemp("evil") / "xla"
    assert _build(evil)[0] == "compiled"
    (entry,) = evil.glob("*.xla")
    evil.chmod(0o755)
    entry.chmod(0o644)
    _as_other(evil, entry)
    return evil


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_cache_directory_swapped_for_a_link_after_the_check_is_not_followed(
    tmp_path: Path, theirs: Path
) -> None:
    # The attack of issue 34: the directory passed its check; then a user who can write its
    # parent replaced it by a link to their own, and the next load ran their program.
    before = _files(theirs)
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    origin, stderr = _build(home / "xla", swap_to=theirs)
    assert origin == "compiled", stderr[-3000:]  # not "disk": their program was not loaded
    assert _files(theirs) == before  # and nothing was written there
    # Everything went through the directory that was checked, now renamed aside.
    assert len(list((home / "xla.checked").glob("*.xla"))) == 1


@pytest.mark.parametrize("planted", ["their file", "a link to their file"])
def test_cache_entry_that_is_not_ours_is_not_loaded(
    tmp_path: Path, theirs: Path, planted: str
) -> None:
    cache = tmp_path / "xla"
    cache.mkdir(mode=0o700)
    (source,) = theirs.glob("*.xla")
    entry = cache / source.name
    if planted == "their file":
        entry.write_bytes(source.read_bytes())
        entry.chmod(0o644)
        _as_other(entry)
        found = f"not using {entry}: it is owned by uid {OTHER} (you are {ME}) with mode 644"
    else:
        entry.symlink_to(source)
        found = f"not using {entry}: it is a symbolic link"
    origin, stderr = _build(cache)
    assert origin == "compiled", stderr[-3000:]
    assert stderr.count("not using") == 1 and found in stderr, stderr[-3000:]
    # Compiled again and stored in its place: the next process loads our own, silently.
    assert not entry.is_symlink() and entry.stat().st_uid == ME
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    origin, stderr = _build(cache)
    assert origin == "disk" and "not using" not in stderr, stderr[-3000:]


# -- tier (a): flight-record dumps ----------------------------------------------------------


def _recorder(n: int = 3) -> flight_recorder.FlightRecorder:
    recorder = flight_recorder.FlightRecorder(100, rank=0)
    for seq in range(n):
        entry = recorder.record("0", [0, 1], seq, "allreduce", [(8, "float32")], ("SUM",))
        recorder.finish(entry)
    return recorder


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file only the job's user may read and write (root's 0600 file in the issue)."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def tmpdir_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$TMPDIR`` (the default flight-record directory's parent) is a sticky ``tmp_path/tmp``,
    and ``TPU_DIST_FLIGHT_RECORDER_DIR`` is not set."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv(flight_recorder.DIR_ENV, raising=False)
    return tmp


def _plant(directory: Path, victim: Path) -> None:
    """The other user's links to ``victim`` at the names a dump of rank 0 writes: the record,
    and the temporary file before it (its old name ended in the pid, which is easy to guess)."""
    for name in ("tpu_dist_fr_rank0.json", f"tpu_dist_fr_rank0.json.tmp{os.getpid()}"):
        (directory / name).symlink_to(victim)
        _as_other(directory / name)


def test_dump_into_a_shared_directory_never_writes_through_a_planted_link(
    tmp_path: Path, victim: Path
) -> None:
    # A directory named on purpose (TPU_DIST_FLIGHT_RECORDER_DIR) may be shared: the dump
    # must still only ever write a file of its own.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    _as_other(shared)
    _plant(shared, victim)
    path = _recorder().dump(str(shared))
    assert victim.read_bytes() == b"precious\n"
    record = Path(path)
    assert record == shared / "tpu_dist_fr_rank0.json" and not record.is_symlink()
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert json.loads(record.read_text())["rank"] == 0
    # The planted temporary name is still theirs, and no temporary file of ours is left.
    planted_tmp = f"tpu_dist_fr_rank0.json.tmp{os.getpid()}"
    assert _files(shared) == sorted(["tpu_dist_fr_rank0.json", planted_tmp])


def test_default_directory_is_this_users_own(tmpdir_is: Path) -> None:
    path = Path(_recorder().dump())
    directory = tmpdir_is / f"tpu_dist_flight_recorder-{ME}"
    assert path == directory / "tpu_dist_fr_rank0.json"
    assert flight_recorder.default_dir() == str(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _files(directory) == ["tpu_dist_fr_rank0.json"]
    _recorder(5).dump()  # again: replaced in place
    assert len(json.loads(path.read_text())["entries"]) == 5
    assert _files(directory) == ["tpu_dist_fr_rank0.json"]


@pytest.mark.parametrize("made", ["their directory", "a link to their directory", "ours, mode 777"])
def test_default_directory_made_by_someone_else_is_refused(
    tmpdir_is: Path, tmp_path: Path, victim: Path, made: str
) -> None:
    # The other user came first: the directory at the default name (today's and the old one)
    # is theirs, with links to the victim where the dump writes.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    _plant(theirs, victim)
    _as_other(theirs)
    default = tmpdir_is / f"tpu_dist_flight_recorder-{ME}"
    old = tmpdir_is / "tpu_dist_flight_recorder"
    old.symlink_to(theirs)
    _as_other(old)
    if made == "their directory":
        default.mkdir()
        default.chmod(0o777)
        _plant(default, victim)
        _as_other(default)
        found = f"it is owned by uid {OTHER} (you are {ME}) with mode 777"
    elif made == "a link to their directory":
        default.symlink_to(theirs)
        _as_other(default)
        found = "it is a symbolic link"
    else:
        default.mkdir()
        default.chmod(0o777)
        found = f"it is owned by uid {ME} (you are {ME}) with mode 777"
    planted = {d: _files(d) for d in (theirs, default) if not d.is_symlink()}
    with pytest.raises(PermissionError) as raised:
        _recorder().dump()
    message = str(raised.value)
    assert message.startswith(f"not writing the flight record to {default}: {found}"), message
    assert flight_recorder.DIR_ENV in message
    assert victim.read_bytes() == b"precious\n"
    assert {d: _files(d) for d in planted} == planted  # nothing of ours written there


_FULL_DISK = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    from tpu_dist.collectives.flight_recorder import FlightRecorder

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    recorder = FlightRecorder(1000, rank=0)
    recorder.record("0", [0, 1], 0, "allreduce", [(8, "float32")], ("SUM",))
    recorder.dump(sys.argv[1])  # fits
    for seq in range(1, 200):
        recorder.record("0", [0, 1], seq, "allreduce", [(8, "float32")], ("SUM",))
    try:
        recorder.dump(sys.argv[1])
        error = None
    except OSError as err:
        error = err.errno
    print("RESULT" + json.dumps({"errno": error}))
    """
)


def test_dump_that_fails_to_write_leaves_nothing_behind(tmp_path: Path) -> None:
    # A full disk, as a file size limit (RLIMIT_FSIZE) of 4 KiB in a process of its own: the
    # second, bigger record cannot be written. The first stays; no temporary file is left.
    directory = tmp_path / "records"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    result = script_result(_FULL_DISK, str(directory), env=env, timeout=180)
    assert result["errno"] == 27  # EFBIG: File too large
    assert _files(directory) == ["tpu_dist_fr_rank0.json"]
    assert len(json.loads((directory / "tpu_dist_fr_rank0.json").read_text())["entries"]) == 1


def test_analyzer_reads_the_default_directory(tmpdir_is: Path) -> None:
    # `python -m tpu_dist.collectives.flight_recorder` without DIR reads where dumps go.
    _recorder().dump()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmpdir_is)}
    env.pop(flight_recorder.DIR_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "tpu_dist.collectives.flight_recorder"],
                          env=env, capture_output=True, text=True, timeout=120)
    expected = f"flight records of ranks [0] in {tmpdir_is / f'tpu_dist_flight_recorder-{ME}'}"
    assert proc.stdout.splitlines()[:1] == [expected], (proc.stdout, proc.stderr[-2000:])
