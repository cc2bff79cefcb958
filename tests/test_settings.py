"""tpu_dist._settings: every TPU_DIST_* variable declared once, parsed strictly (one process)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from tpu_dist import _settings

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("setting", _settings.SETTINGS, ids=lambda s: s.env)
def test_defaults_parse(setting: _settings.Setting) -> None:
    value = setting.read({})
    if setting.default is None:
        assert value is None
    else:
        assert value == setting.parse(setting.default)
    assert setting.env.startswith("TPU_DIST_") and setting.help


@pytest.mark.parametrize(
    ("setting", "raw", "value"),
    [
        (_settings.PLATFORM, " CPU ", "cpu"),
        (_settings.TIMEOUT_POLICY, "raise", "raise"),
        (_settings.HEARTBEAT_TIMEOUT, "2.5", 2.5),
        (_settings.FLIGHT_RECORDER_SIZE, "7", 7),
        (_settings.NUM_SLICES, "+2", 2),
        (_settings.DEFAULT_FOR_CPU, "yes", True),
        (_settings.COMPILE_ONLY, "1", True),
        (_settings.BACKEND_NAME, "TPU_JAX", "tpu_jax"),
        (_settings.EXIT_CODE, "3", 3),
        (_settings.EXIT_CODE, "0", 0),
        (_settings.EXIT_CODE, " 255 ", 255),
        (_settings.PLATFORM, "", "auto"),  # empty is unset
        (_settings.HEARTBEAT_TIMEOUT, "0.1", 0.1),
        (_settings.HEARTBEAT_TIMEOUT, "1e3", 1000.0),
        (_settings.COORDINATOR_ADDRESS, "127.0.0.1:8476", "127.0.0.1:8476"),
        (_settings.COORDINATOR_ADDRESS, " node-0.example:1 ", "node-0.example:1"),
        (_settings.COORDINATION_SERVICE, "[::1]:65535", "[::1]:65535"),
        (_settings.COORDINATION_SERVICE, "10.0.0.1:0080", "10.0.0.1:80"),
    ],
)
def test_values(setting: _settings.Setting, raw: str, value: object) -> None:
    assert setting.read({setting.env: raw}) == value


@pytest.mark.parametrize(
    ("setting", "raw"),
    [
        (_settings.PLATFORM, "quantum"),
        (_settings.TIMEOUT_POLICY, "ignore"),
        (_settings.HEARTBEAT_TIMEOUT, "-1"),
        (_settings.HEARTBEAT_TIMEOUT, "soon"),
        (_settings.FLIGHT_RECORDER_SIZE, "0"),
        (_settings.NUM_SLICES, "1.5"),
        (_settings.DEFAULT_FOR_CPU, "maybe"),
        (_settings.COMPILE_ONLY, "yes"),
        (_settings.BACKEND_NAME, "my-backend"),
        (_settings.EXIT_CODE, "x"),
        (_settings.EXIT_CODE, "abc"),
        (_settings.EXIT_CODE, "-1"),
        (_settings.EXIT_CODE, "256"),
        (_settings.EXIT_CODE, "1.0"),
        (_settings.METADATA_TIMEOUT, "0"),
        (_settings.METADATA_TIMEOUT, "0.001"),
        # Issue 34: accepted, then the heartbeat thread spun and the store was blamed.
        (_settings.HEARTBEAT_TIMEOUT, "1e-9"),
        (_settings.HEARTBEAT_TIMEOUT, "0.05"),
        (_settings.HEARTBEAT_TIMEOUT, "inf"),
        (_settings.HEARTBEAT_TIMEOUT, "nan"),
        # Issue 34: an IndexError on rank 0, "Failed to start RPC server", an int() error.
        (_settings.COORDINATOR_ADDRESS, "garbage"),
        (_settings.COORDINATOR_ADDRESS, "127.0.0.1:notaport"),
        (_settings.COORDINATOR_ADDRESS, "127.0.0.1:0"),
        (_settings.COORDINATOR_ADDRESS, "127.0.0.1:65536"),
        (_settings.COORDINATOR_ADDRESS, ":8476"),
        (_settings.COORDINATOR_ADDRESS, "127.0.0.1:"),
        (_settings.COORDINATOR_ADDRESS, "::1:8476"),  # IPv6 without brackets
        (_settings.COORDINATOR_ADDRESS, "[]:8476"),
        (_settings.COORDINATOR_ADDRESS, "a host:8476"),
        (_settings.COORDINATION_SERVICE, "garbage"),
        (_settings.COORDINATION_SERVICE, "http://10.0.0.1:8476"),
    ],
)
def test_malformed_values_name_the_variable(setting: _settings.Setting, raw: str) -> None:
    with pytest.raises(ValueError) as info:
        setting.read({setting.env: raw})
    assert f"{setting.env}={raw!r}" in str(info.value)


@pytest.mark.parametrize(
    ("setting", "raw", "accepted"),
    [
        (_settings.COORDINATOR_ADDRESS, "garbage", "host:port with a port from 1 to 65535"),
        (_settings.COORDINATION_SERVICE, "1.2.3.4:99999", "host:port with a port from 1 to 65535"),
        (_settings.HEARTBEAT_TIMEOUT, "1e-9", "at least 0.1"),
        (_settings.EXIT_CODE, "abc", "an integer from 0 to 255"),
        (_settings.TIMEOUT_POLICY, "ignore", "abort, raise"),
    ],
)
def test_malformed_values_say_what_is_accepted(
    setting: _settings.Setting, raw: str, accepted: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(accepted)):
        setting.read({setting.env: raw})


def test_check_names_every_malformed_variable_at_once() -> None:
    _settings.check({})  # every default parses
    _settings.check({"TPU_DIST_COORDINATION_SERVICE": "10.0.0.1:8476", "TPU_DIST_EXIT_CODE": "7"})
    environ = {
        "TPU_DIST_COORDINATOR_ADDRESS": "garbage",
        "TPU_DIST_EXIT_CODE": "abc",
        "TPU_DIST_TIMEOUT_POLICY": "raise",  # fine
    }
    with pytest.raises(ValueError) as info:
        _settings.check(environ)
    message = str(info.value)
    assert "TPU_DIST_COORDINATOR_ADDRESS='garbage'" in message, message
    assert "TPU_DIST_EXIT_CODE='abc'" in message, message
    assert "TIMEOUT_POLICY" not in message, message


def test_library_reads_tpu_dist_variables_only_through_settings() -> None:
    # A TPU_DIST_* name as a string literal in library code is a second declaration, except
    # in the settings module, the launcher's flag table (_cli.py: --runtime, --tpu-base-port)
    # and the variables the launcher hands to its own worker entry (_worker.py).
    allowed = {"_settings.py", "_cli.py", "_worker.py"}
    offenders = []
    for path in (ROOT / "tpu_dist").rglob("*.py"):
        if path.name in allowed:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(?<!`)[\"']TPU_DIST_[A-Z_]+[\"'](?!`)", line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, offenders


def _settings_reference_tool():
    """``tools/settings_reference.py`` (not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location(
        "settings_reference", ROOT / "tools" / "settings_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_reference_is_current() -> None:
    # docs/reference/settings.md's table is generated from the declarations: a setting added,
    # removed or reworded without regenerating it fails here.
    tool = _settings_reference_tool()
    committed = tool.committed_table(tool.PAGE.read_text())
    assert committed == tool.render(_settings.SETTINGS), (
        "docs/reference/settings.md's settings table is stale: run "
        "python tools/settings_reference.py --write"
    )
    # Read back from the page itself: one row per declared setting, in declared order.
    rows = re.findall(r"^\| `(TPU_DIST_[A-Z_]+)` \|", committed, flags=re.MULTILINE)
    assert rows == [s.env for s in _settings.SETTINGS], rows
