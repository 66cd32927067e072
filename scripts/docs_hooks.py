"""mkdocs hooks: the pages generated from the code, so that they cannot drift from it.

- ``index.md``: README.md, its ``docs/`` links made relative to the site;
- ``reference/api.md``: one mkdocstrings entry per name in ``recorder_client.__all__``;
- ``reference/cli.md``: every ``rollout-recorder`` command and flag, from the argparse parser.

``mkdocs build`` calls :func:`on_files`; the tests call the page functions directly.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Names in __all__ that are not documented objects of their own.
_NOT_OBJECTS = {"__version__"}


def index_page() -> str:
    """README.md with its links into docs/ pointing at the site's pages."""
    text = (ROOT / "README.md").read_text()
    return re.sub(r"\]\(docs/", "](", text)


def api_page() -> str:
    """An entry per public name, in ``__all__`` order, each from the module defining it."""
    import recorder_client

    exports = recorder_client._EXPORTS
    names = [n for n in recorder_client.__all__ if n not in _NOT_OBJECTS]
    missing = sorted(set(names) - set(exports))
    if missing:
        raise ValueError(f"recorder_client.__all__: expected a defining module for {missing}")
    lines = [
        "# API reference",
        "",
        "Every public name of `recorder_client` (its `__all__`), generated from the docstrings. "
        "Import each from the package: `from recorder_client import RolloutRecorder`.",
        "",
        f"`recorder_client.__version__` is `{recorder_client.__version__}`.",
        "",
    ]
    for name in names:
        lines += [f"## {name}", "", f"::: recorder_client.{exports[name]}.{name}", ""]
    return "\n".join(lines)


def _subcommands(parser: argparse.ArgumentParser, prefix: str, summary: str = ""):
    """(command line, its help line, parser) for the parser and every subcommand under it,
    depth first."""
    yield prefix, summary, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from _subcommands(sub, f"{prefix} {name}", helps.get(name, ""))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flag_row(action: argparse.Action) -> str | None:
    if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
        return None
    names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest.upper()}`"
    if action.nargs == 0:
        value = ""
    else:
        metavar = action.metavar or (action.dest.upper() if action.option_strings else "")
        value = f"`{metavar}`" if metavar else ""
        if action.choices:
            value = " \\| ".join(f"`{c}`" for c in action.choices)
    default = action.default
    shown = "" if default in (None, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
    help_text = (action.help or "").replace("%(default)s", str(default))
    if help_text == argparse.SUPPRESS:
        return None
    required = " (required)" if action.required and action.option_strings else ""
    return f"| {names} | {value} | {shown} | {_cell(help_text)}{required} |"


def cli_page() -> str:
    """Every command's usage line and flags, from ``recorder_server.cli.main.build_parser``."""
    from recorder_server.cli.main import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps usage lines at the terminal's width
    try:
        parser = build_parser()
        lines = [
            "# Command-line reference",
            "",
            "Generated from the argparse definitions in `server/cli/`; how the commands behave "
            "is on [the command line](../cli.md).",
            "",
        ]
        for command, summary, sub in _subcommands(parser, "rollout-recorder"):
            lines += [f"## `{command}`", ""]
            about = sub.description or summary
            if about:
                lines += [about[0].upper() + about[1:], ""]
            lines += ["```text", sub.format_usage().strip(), "```", ""]
            rows = [r for r in map(_flag_row, sub._actions) if r]
            if rows:
                lines += ["| Flag | Value | Default | Meaning |", "| --- | --- | --- | --- |"]
                lines += [*rows, ""]
        return "\n".join(lines)
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    for path, content in (
        ("index.md", index_page()),
        ("reference/api.md", api_page()),
        ("reference/cli.md", cli_page()),
    ):
        files.append(File.generated(config, path, content=content))
    return files
