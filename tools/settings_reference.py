"""The table of ``docs/reference/settings.md``, generated from ``tpu_dist/_settings.py``.

Every ``TPU_DIST_*`` variable the library reads is declared once, in ``tpu_dist/_settings.py``
(name, default, help, parser). The reference page's table is made from those declarations by
this script and never typed by hand; ``tests/test_settings.py`` fails when the committed table
is not what this script makes (a setting added, removed or reworded without regenerating)::

    python tools/settings_reference.py            # print the table
    python tools/settings_reference.py --write    # put it into docs/reference/settings.md
    python tools/settings_reference.py --check    # exit 1 if the committed table is stale

The table sits between the two marker lines below in the page; the rest of the page is prose.
The settings module is loaded from its file, not through ``import tpu_dist`` (which imports
torch and JAX and registers the backend): it imports only the standard library.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_FILE = ROOT / "tpu_dist" / "_settings.py"
PAGE = ROOT / "docs" / "reference" / "settings.md"
BEGIN = (
    "<!-- BEGIN settings table: generated from tpu_dist/_settings.py by "
    "tools/settings_reference.py --write; do not edit by hand -->"
)
END = "<!-- END settings table -->"


def load_settings() -> ModuleType:
    """``tpu_dist/_settings.py`` as a module of its own, without importing ``tpu_dist``."""
    name = "_tpu_dist_settings_for_reference"
    spec = importlib.util.spec_from_file_location(name, SETTINGS_FILE)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {SETTINGS_FILE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _cell(text: str) -> str:
    """One line of markdown: ``|`` escaped, ``<`` and ``>`` as entities (``<uid>`` is no tag)."""
    text = " ".join(text.split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render(settings: Sequence) -> str:
    """The markdown table of ``settings`` (``Setting`` objects), in their declared order."""
    lines = [
        "| variable | default | meaning |",
        "|---|---|---|",
    ]
    for setting in settings:
        default = "unset" if setting.default is None else f"`{setting.default}`"
        lines.append(f"| `{setting.env}` | {default} | {_cell(setting.help)} |")
    return "\n".join(lines) + "\n"


def committed_table(page: str) -> str:
    """The table between the markers of ``page`` (the page's text).

    Raises:
        ValueError: the page lacks a marker, or has them in the wrong order.
    """
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(
            f"{PAGE.relative_to(ROOT)} must hold the lines {BEGIN!r} and {END!r}, in that "
            "order, around the generated table."
        )
    return page[start + len(BEGIN):end].strip("\n") + "\n"


def with_table(page: str, table: str) -> str:
    """``page`` with the text between its markers replaced by ``table``."""
    committed_table(page)  # raises if the markers are missing
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite the table in {PAGE}")
    mode.add_argument("--check", action="store_true", help="exit 1 if the committed table is stale")
    args = parser.parse_args(argv)
    table = render(load_settings().SETTINGS)
    if args.write:
        PAGE.write_text(with_table(PAGE.read_text(), table))
        print(f"wrote the settings table into {PAGE.relative_to(ROOT)}")
    elif args.check:
        if committed_table(PAGE.read_text()) != table:
            print(
                f"{PAGE.relative_to(ROOT)}: the settings table is stale; run "
                "python tools/settings_reference.py --write",
                file=sys.stderr,
            )
            return 1
        print(f"{PAGE.relative_to(ROOT)}: the settings table is current")
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
