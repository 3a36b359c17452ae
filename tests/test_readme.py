"""The README and docs/ stay readable and true (issue 41 items 1-2, issue 43 item 7):

- README.md stays an admin's page (under 260 lines); no prose line of README.md or docs/*.md is
  over 200 characters (fenced code and table rows are exempt: a Markdown row cannot wrap);
  every docs/ file the README links to exists.
- The README's main path (the `$ cluster ...` lines of its ```console blocks, tests/fakes.py
  readme_commands) covers preflight -> fix -> up -> plan -> deploy -> bench -> status, and every
  one of its commands parses with the CLI's own argparse: a renamed subcommand or flag fails
  here, in the fast lane (tests/integration/test_readme_main_path.py runs them on a simulated cluster).
- scripts/test prints each lane's wall time and exit code at its end (scripts/lane_time.sh).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import README, REPO, readme_commands

MAX_PROSE = 200
MAX_README_LINES = 260
MAIN_PATH = ["preflight", "fix", "up", "plan", "deploy", "bench", "status"]


def long_prose_lines(text: str, limit: int = MAX_PROSE) -> list[tuple[int, int]]:
    """(line number, length) of every line over `limit` that is neither inside a fenced code
    block nor a table row."""
    found, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence and not line.lstrip().startswith("|") and len(line) > limit:
            found.append((number, len(line)))
    return found


def test_the_line_check_sees_a_long_prose_line_but_not_code_or_tables():
    long = "x " * 150
    text = f"# t\n\n```\n{long}\n```\n\n| a | {long} |\n\n- {long}\n"
    assert long_prose_lines(text) == [(9, len(long) + 2)]


@pytest.mark.parametrize("name", ["README.md"] + sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
def test_no_prose_line_is_over_200_characters(name):
    assert long_prose_lines((REPO / name).read_text()) == []


def test_the_readme_is_an_admins_page():
    assert len(README.read_text().splitlines()) < MAX_README_LINES


def test_every_docs_file_the_readme_links_exists():
    links = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    assert links and [link for link in links if not (REPO / link).is_file()] == []


def test_the_readmes_inventory_loads_and_its_head_is_the_bench_lines_address():
    from cluster.nodes.inventory import loads

    (block,) = re.findall(r"^```yaml\n(.*?)^```", README.read_text(), re.M | re.S)
    inventory = loads(block, "README.md")
    assert [n.role for n in inventory.nodes] == ["head", "worker"]
    (bench,) = [c for c in readme_commands(README.read_text()) if c.argv[0] == "bench"]
    assert f"//{inventory.nodes[0].address}:" in " ".join(bench.argv)


# ---------------------------------------------------------------- the main path


def parse_problem(argv: tuple[str, ...]) -> str | None:
    """Why the CLI's parser refuses `cluster ARGV...` (its own message), or None: it parses."""
    from cluster.cli import UsageProblem, build_parser

    parser = build_parser(list(argv))
    try:
        args, extras = parser.parse_known_args(list(argv))
    except UsageProblem as exc:
        return f"{exc.prog}: {exc.message}"
    if extras:
        return "unrecognized arguments: " + " ".join(extras)
    if getattr(args, "handler", None) is None:
        return "no subcommand"
    # argparse also takes a prefix of a flag (`--gpus` for `--gpus-per-node`): the README must
    # spell each flag whole, or a renamed `--x` -> `--x-y` would still pass.
    flags = {s for action in parser.subcommands[argv[0]]._actions for s in action.option_strings}
    unknown = [w for w in argv if w.startswith("--") and w.split("=", 1)[0] not in flags]
    return f"not a whole flag of `cluster {argv[0]}`: {' '.join(unknown)}" if unknown else None


def test_the_readme_reader_takes_console_blocks_only_with_their_exit_codes():
    text = ("```sh\ncluster init\n```\n```console\n$ cluster preflight     # exit 2\n"
            "output | not a command\n$ cluster up --yes\n```\n```yaml\n$ cluster down\n```\n")
    assert [(c.argv, c.exit_code) for c in readme_commands(text)] == [
        (("preflight",), 2), (("up", "--yes"), 0)]


def test_the_readme_main_path_is_complete_and_in_order():
    commands = [c.argv[0] for c in readme_commands(README.read_text())]
    assert [name for i, name in enumerate(commands) if i == 0 or commands[i - 1] != name] == MAIN_PATH


@pytest.mark.parametrize("command", readme_commands(README.read_text()), ids=lambda c: c.line[2:60])
def test_a_readme_command_parses_with_the_cli(command):
    assert parse_problem(command.argv) is None


@pytest.mark.parametrize("argv", [("prefligt",), ("plan", "--modle", "/m"), ("deploy", "--tp"),
                                  ("plan", "--gpus-per", "8")])
def test_a_renamed_or_mistyped_command_or_flag_is_refused(argv):
    """Control: the check above fails for a subcommand or flag the CLI does not have."""
    assert parse_problem(argv)


# ---------------------------------------------------------------- scripts/test's lane times


def bash(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f". {REPO / 'scripts' / 'lane_time.sh'}\n{script}"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("seconds, shown", [(0, "0:00"), (112, "1:52"), (3599, "59:59"),
                                            (3725, "1:02:05")])
def test_a_lane_duration_reads_as_minutes_and_seconds(seconds, shown):
    assert bash(f"lane_duration {seconds}").stdout == shown


def test_run_lane_prints_its_wall_time_and_returns_the_lanes_exit_code():
    p = bash('run_lane "1/3 fast" bash -c "echo in the lane; exit 3"; echo "rc=$?"')
    assert re.fullmatch(r"in the lane\nscripts/test: lane 1/3 fast: \d+:\d\d \(exit 3\)\nrc=3\n",
                        p.stdout), p.stdout


LANE_TESTS = """import pytest

def test_fast():
    assert {fast}

@pytest.mark.integration
def test_heavy():
    assert {heavy}

@pytest.mark.integration
@pytest.mark.alone
def test_alone():
    assert True
"""


def suite_copy(tmp_path: Path, fast_passes: bool, heavy_passes: bool = True) -> Path:
    """A checkout holding scripts/test as it is, a bootstrap that installs nothing, a .venv
    python that is this interpreter, the project's pytest markers, and three real tests: one
    per lane."""
    (tmp_path / "scripts").mkdir()
    for name in ("test", "lane_time.sh"):
        (tmp_path / "scripts" / name).write_bytes((REPO / "scripts" / name).read_bytes())
    executables = {"scripts/bootstrap": "#!/bin/sh\nexit 0\n",
                   ".venv/bin/python": f'#!/bin/sh\nexec {sys.executable} "$@" -p no:cacheprovider\n'}
    for name, text in executables.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "scripts" / "test").chmod(0o755)
    (tmp_path / "test_lanes.py").write_text(LANE_TESTS.format(fast=fast_passes,
                                                              heavy=heavy_passes))
    (tmp_path / "pyproject.toml").write_bytes((REPO / "pyproject.toml").read_bytes())
    return tmp_path


def run_suite(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CLUSTER_TEST_WORKERS": "1"}
    return subprocess.run([str(root / "scripts" / "test")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_scripts_test_prints_each_lanes_wall_time_at_its_end(tmp_path):
    p = run_suite(suite_copy(tmp_path, fast_passes=True))
    lines = re.findall(r"^scripts/test: lane \S+ \w+: .*$", p.stdout, re.M)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert [re.sub(r"\d+:\d\d", "M:SS", line) for line in lines] == [
        "scripts/test: lane 1/3 fast: M:SS (exit 0)", "scripts/test: lane 2/3 heavy: M:SS (exit 0)",
        "scripts/test: lane 3/3 alone: M:SS (exit 0)"]
    assert p.stdout.rstrip().endswith(lines[-1])
    assert "1 passed, 2 deselected" in p.stdout       # each lane ran its one test


def test_a_failed_heavy_lane_still_runs_the_alone_lane_and_fails_the_suite(tmp_path):
    p = run_suite(suite_copy(tmp_path, fast_passes=True, heavy_passes=False))
    assert p.returncode == 1, p.stdout[-3000:]
    assert [re.sub(r"\d+:\d\d", "M:SS", line) for line in re.findall(
        r"^scripts/test: lane \S+ \w+: .*$", p.stdout, re.M)] == [
        "scripts/test: lane 1/3 fast: M:SS (exit 0)", "scripts/test: lane 2/3 heavy: M:SS (exit 1)",
        "scripts/test: lane 3/3 alone: M:SS (exit 0)"]


def test_a_failed_fast_lane_prints_its_time_and_stops(tmp_path):
    p = run_suite(suite_copy(tmp_path, fast_passes=False))
    assert p.returncode == 1
    assert re.findall(r"^scripts/test: lane \S+ \w+: \d+:\d\d \(exit \d\)$", p.stdout, re.M) == [
        "scripts/test: lane 1/3 fast: " + re.search(r"fast: (\d+:\d\d)", p.stdout).group(1)
        + " (exit 1)"]
    assert "the heavy lanes were not run" in p.stderr
