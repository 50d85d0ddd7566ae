"""The docs cannot drift from the CLI: every `hloserve ...` command line in the README's and docs'
shell blocks is parsed by the real parser (options, choices, arity), and every Python block compiles.
The README's OpenAI example is executed against a real server in tests/server/test_serve_default.py,
and its command walkthrough (every line whose inputs exist here) in tests/test_readme_commands.py."""
from __future__ import annotations

import glob
import os
import re
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


def blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        with open(path) as f:
            for block in re.findall(rf"```{lang}\n(.*?)```", f.read(), flags=re.S):
                out.append((os.path.relpath(path, REPO), block))
    return out


def command_lines() -> list[tuple[str, str]]:
    lines = []
    for where, block in blocks("(?:bash|sh|shell)?"):
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("hloserve "):
                lines.append((where, line))
    return lines


@pytest.mark.parametrize("where,line", command_lines(), ids=lambda x: x if "hloserve" not in x else x[:60])
def test_documented_command_parses(where, line):
    from hloserve.server.cli import build_parser
    argv = shlex.split(line, comments=True)[1:]
    try:
        build_parser(argv[0]).parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `{line}` does not parse (exit {e.code})")


def test_there_are_documented_commands():
    assert len(command_lines()) >= 15


@pytest.mark.parametrize("where,block", blocks("python"), ids=lambda x: x[:40])
def test_python_blocks_compile(where, block):
    compile(block, where, "exec")
