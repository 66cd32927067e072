"""The docs site's generated pages follow the code: the API page names every public name, the
command-line page every command and flag. (`make docs` builds the whole site with --strict;
`make test` runs it.)"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import recorder_client
from recorder_server.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_page_lists_every_public_name():
    page = hooks().api_page()
    documented = re.findall(r"^::: recorder_client\.\w+\.(\w+)$", page, re.M)
    public = [n for n in recorder_client.__all__ if n != "__version__"]
    assert documented == public
    for name in public:  # each entry names the object the package exports under that name
        module = re.search(rf"^::: (recorder_client\.\w+)\.{name}$", page, re.M).group(1)
        assert getattr(importlib.import_module(module), name) is getattr(recorder_client, name)
    assert recorder_client.__version__ in page


def every_command(parser: argparse.ArgumentParser, prefix: str = "rollout-recorder"):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_command(sub, f"{prefix} {name}")


def test_cli_page_lists_every_command_and_flag():
    page = hooks().cli_page()
    commands = list(every_command(build_parser()))
    assert len(commands) > 8  # serve, demo, status, sessions list ... all found
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    by_command = {s.split("\n", 1)[0].strip("`"): s for s in sections}
    assert list(by_command) == [c for c, _ in commands]
    for command, parser in commands:
        section = by_command[command]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in section, f"{command}: {flag} missing from the CLI page"
    assert "`--http-listen`" in by_command["rollout-recorder serve"]


def test_readme_links_resolve_to_docs_pages():
    """Every docs/ link of the README names a page (the site's home is the README)."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(docs/([^)#]+)", readme)
    assert links
    for link in links:
        assert (ROOT / "docs" / link).is_file(), f"README.md links docs/{link}, which is missing"


def test_make_test_builds_the_docs_strictly():
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "$(MAKE) --no-print-directory docs" in test_recipe
    docs_recipe = makefile.split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "mkdocs build --strict" in docs_recipe
    assert "'.[server,dev,docs]'" in makefile


def test_the_site_builds_strictly(tmp_path):
    """The whole site, as `make docs` builds it: a broken link, anchor or page fails."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
        + ["--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "Queue one (T, N) chunk and return" in api  # record()'s docstring, rendered
