"""The docs follow the code: the API page names every public name, the command-line page every
command and flag; every flag the pages name is a flag of its command; docs/metrics.md is what a
running server exposes. (`make docs` builds the whole site with --strict; `make test` runs it.)"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
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


# Counters that only move on a fault (a refusal, a full disk, a lost or undecodable chunk, a
# failed write): a healthy run never emits them, so they are left out of the run below.
FAULT_COUNTERS = {
    "rollout_recorder_chunks_dropped_full_total",
    "rollout_recorder_chunks_rejected_total",
    "rollout_recorder_chunks_corrupt_total",
    "rollout_recorder_chunks_refused_no_space_total",
    "rollout_recorder_sequences_lost_total",
    "rollout_recorder_feed_errors_total",
    "rollout_recorder_episodes_too_long_for_store_total",
    "rollout_recorder_dataset_write_failures_total",
}


def documented_prometheus_names(text: str) -> list[str]:
    """The Prometheus column of docs/metrics.md as patterns (`<name>` matches one name)."""
    names = []
    for row in re.findall(r"^\|[^|]*\| `([^`]+)` \|", text, re.M):
        first, *suffixes = [part.strip() for part in row.split(",")]
        names.append(first)
        names.extend(first[: -len("_bucket")] + suffix for suffix in suffixes)
    return names


def scraped_names(exposition: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line[:1] != "#"}


def matches(name: str, pattern: str) -> bool:
    return (
        re.fullmatch(re.escape(pattern).replace(re.escape("<name>"), "[a-z0-9_]+"), name)
        is not None
    )


def unmatched(names, patterns) -> list[str]:
    """The names no pattern matches."""
    return sorted(n for n in names if not any(matches(n, p) for p in patterns))


def test_documented_names_parse_as_the_scrape_names():
    """The two helpers below agree on a hand-made table and exposition (so that the server
    test cannot pass by parsing nothing)."""
    table = (
        "| `A/x` | `rollout_recorder_x_total` | counter | session | X. |\n"
        "| `A/outcome_<name>` | `rollout_recorder_outcome_<name>_total` | counter | session | Y. |\n"
        "| `Episode/return` | `rollout_recorder_r_bucket, _sum, _count` | histogram | session | R. |\n"
        "| `Episode/count` | - | episode summary | session | C. |\n"
    )
    patterns = documented_prometheus_names(table)
    assert patterns == [
        "rollout_recorder_x_total",
        "rollout_recorder_outcome_<name>_total",
        "rollout_recorder_r_bucket",
        "rollout_recorder_r_sum",
        "rollout_recorder_r_count",
    ]
    exposition = (
        "# TYPE rollout_recorder_x_total counter\n"
        'rollout_recorder_x_total{session="s"} 1.0\n'
        'rollout_recorder_outcome_win_total{session="s"} 2.0\n'
        'rollout_recorder_r_bucket{le="+Inf",session="s"} 3.0\n'
        'rollout_recorder_y{session="s"} 3.0\n'
    )
    names = scraped_names(exposition)
    assert unmatched(names, patterns) == ["rollout_recorder_y"]
    assert [p for p in patterns if not any(matches(n, p) for n in names)] == [
        "rollout_recorder_r_sum",
        "rollout_recorder_r_count",
    ]


def test_every_documented_metric_is_what_a_running_server_exposes(tmp_path):
    """docs/metrics.md against a real server's /metrics after a run with a store, utilities,
    outcome codes and a dataset sink: every name exposed is documented, and every documented
    name is exposed (fault counters aside)."""
    pytest.importorskip("prometheus_client")
    pytest.importorskip("pyarrow")
    import time
    import urllib.request

    import numpy as np

    from recorder_client import (
        CellField,
        RolloutRecorder,
        TrajectoryTrainingConfiguration,
        UtilityConfig,
    )
    from recorder_server import ServerOptions, start_server
    from recorder_server.dataset.sink import DatasetOptions

    patterns = documented_prometheus_names((ROOT / "docs" / "metrics.md").read_text())
    assert len(patterns) > 40
    running = start_server(
        ServerOptions(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path / "data"),
            metrics_listen="127.0.0.1:0",
            dataset=DatasetOptions(uri=str(tmp_path / "dataset"), node_id="n", flush_seconds=0.2),
        )
    )
    try:
        config = TrajectoryTrainingConfiguration(
            cell_fields=(CellField("player_positions", (0,), bucket=2, name="x"),),
            utilities=(UtilityConfig("reach", gamma=0.9),),
        )
        rng = np.random.default_rng(0)
        T, N = 16, 3
        with RolloutRecorder(
            record_states=True, capture=config, target=running.address, session="docs"
        ) as rec:
            for _ in range(4):
                done = rng.random((T, N)) < 0.2
                rec.record(
                    {
                        "action": rng.integers(0, 4, (T, N)),
                        "reward": rng.random((T, N)),
                        "done": done,
                    },
                    {"player_positions": rng.integers(0, 8, (T, N, 1))},
                    outcome=np.where(done, 1, 0),
                )
            rec.flush()
            rec.capture.sample_start()  # the store caught up, and handed out a start
            deadline = time.monotonic() + 30
            while True:  # the dataset sink writes within its flush interval
                url = f"http://{running.metrics_address}/metrics"
                names = scraped_names(urllib.request.urlopen(url, timeout=10).read().decode())
                if "rollout_recorder_dataset_files_written_total" in names:
                    break
                assert time.monotonic() < deadline, "the dataset sink wrote no file in 30 s"
                time.sleep(0.2)
    finally:
        running.stop(grace=0)
    assert unmatched(names, patterns) == [], "exposed by the server, missing from docs/metrics.md"
    never = [
        p for p in patterns if p not in FAULT_COUNTERS and not any(matches(n, p) for n in names)
    ]
    assert never == [], "documented in docs/metrics.md, not exposed by a running server"


DOC_PAGES = ["README.md"] + [
    f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "performance.md"
]


def command_lines(text: str) -> list[str]:
    """What a reader would type or read as a command: the lines of shell blocks
    (continuations joined) and inline code spans (which may wrap)."""
    blocks = r"^```[a-z]*\n(.*?)^```"
    lines = []
    for block in re.findall(blocks, text, re.S | re.M):
        lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(blocks, "", text, flags=re.S | re.M)
    return lines + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def flags_by_command(line: str, commands: dict[tuple[str, ...], set[str]]):
    """Each ``(command, flag)`` a line gives to a rollout-recorder command: after
    ``rollout-recorder`` or ``python -m recorder_server`` and its subcommand words, or after
    a bare command name followed by a flag (prose such as ``serve --dataset-uri``), up to a
    comment, a pipe or another command."""
    tokens = line.split()
    command = None
    for i, token in enumerate(tokens):
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in ("#", "|", "&&", ";"):
            command = None
        elif token == "rollout-recorder" or (token == "recorder_server" and tokens[i - 1] == "-m"):
            command = ()
        elif command is not None and (*command, token) in commands:
            command = (*command, token)
        elif command is None and (token,) in commands and following.startswith("--"):
            command = (token,)
        elif command is not None and re.match(r"--[a-z]", token):
            yield command, re.match(r"--[a-z][a-z0-9-]*", token).group()


def test_flags_in_the_docs_belong_to_their_command():
    """Every ``--flag`` a page gives to a command (``rollout-recorder export --to``,
    ``serve --dataset-uri``) is one of that command's flags."""
    commands = {
        tuple(name.split()[1:]): {f for a in parser._actions for f in a.option_strings}
        for name, parser in every_command(build_parser())
    }
    checked = []
    wrong = []
    for page in DOC_PAGES:
        for line in command_lines((ROOT / page).read_text()):
            for command, flag in flags_by_command(line, commands):
                checked.append(flag)
                if flag not in commands[command]:
                    wrong.append(
                        f"{page}: `{line}`: rollout-recorder {' '.join(command)} has no {flag}"
                    )
    assert len(checked) > 20  # the pages' commands were found
    assert wrong == []


# Flags the pages give to other tools: docker compose, pytest, mkdocs.
OTHER_TOOLS_FLAGS = {"--build", "--profile", "--env-file", "--dist", "--strict"}


def test_every_flag_in_the_docs_is_a_flag_of_some_command():
    """Prose names flags without their command (``--token-file``, ``--wal-fsync``): each is a
    flag of some rollout-recorder command, or of one of the other tools named."""
    known = {
        flag
        for _, parser in every_command(build_parser())
        for action in parser._actions
        for flag in action.option_strings
    }
    wrong = []
    seen = 0
    for page in DOC_PAGES:
        for number, line in enumerate((ROOT / page).read_text().splitlines(), 1):
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
                seen += 1
                if flag not in known | OTHER_TOOLS_FLAGS:
                    wrong.append(f"{page}:{number}: {flag}")
    assert seen > 100
    assert wrong == []


def documented_callables() -> dict[str, object]:
    """The client's public callables by name: recorder_client's, the recorder's and its
    capture's methods, and the Trajectory's."""
    from recorder_client.capture import RemoteCapture

    found = {n: getattr(recorder_client, n) for n in recorder_client.__all__}
    for cls in (recorder_client.RolloutRecorder, RemoteCapture, recorder_client.Trajectory):
        for name, member in vars(cls).items():
            if not name.startswith("_") and callable(member):
                found.setdefault(name, member)
    return {n: c for n, c in found.items() if callable(c)}


def wrong_keywords(text: str, callables: dict[str, object]) -> list[str]:
    """``name(kw=...)`` calls in ``text`` whose keyword ``name`` does not take (calls on a
    Gymnasium env, ``envs.reset(seed=0)``, are the env's)."""
    wrong = []
    for match in re.finditer(r"(?<![\w.])((?:\w+\.)*)(\w+)\(([^()]*)\)", text):
        owner, name, args = match.groups()
        if name not in callables or owner.startswith(("env.", "envs.", "gym.")):
            continue
        try:
            params = inspect.signature(callables[name]).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        for keyword in re.findall(r"(?<![=\w.])([a-z_]\w*)=(?!=)", args):
            if keyword not in params:
                wrong.append(f"{match.group(0)}: {name}() takes no {keyword}=")
    return wrong


def test_keywords_in_the_docs_are_parameters():
    """Every keyword a page passes to a client callable (``RolloutRecorder(record_obs=...)``,
    ``finish(pad_incomplete=...)``, ``read_episodes(..., nodes=...)``) is one of its
    parameters."""
    callables = documented_callables()
    assert wrong_keywords("finish(pad_incomplete=False) finish(padded=True)", callables) == [
        "finish(padded=True): finish() takes no padded="
    ]
    wrong = []
    for page in DOC_PAGES:
        wrong += [f"{page}: {w}" for w in wrong_keywords((ROOT / page).read_text(), callables)]
    assert wrong == []


REPO_PATH = re.compile(
    r"(?:client|server|tests|deploy|bench|examples|scripts|docs|proto)/[\w./-]*"
    r"|[\w.-]+\.(?:yml|yaml|toml|py|example|env)|Makefile|Dockerfile"
)


def test_every_repository_path_the_docs_name_exists():
    """A path in backticks (``deploy/kubernetes/daemonset.yaml``, ``tests/test_core.py``) is in
    the repository, or is one git ignores because tests or runs make it (``tests/artifacts/``)."""
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    seen, missing = 0, []
    for page in DOC_PAGES:
        for path in re.findall(r"`([^`\s]+)`", (ROOT / page).read_text()):
            if not REPO_PATH.fullmatch(path):
                continue
            seen += 1
            if not (ROOT / path).exists() and path not in ignored:
                missing.append(f"{page}: {path}")
    assert seen > 20
    assert missing == []
