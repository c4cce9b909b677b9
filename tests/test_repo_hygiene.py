"""The repository speaks of features, dates and hardware, never of how it was built.

No work-session or issue numbers (in any spelling: with a space, a hyphen or an underscore, plural,
possessive, or a bare capital-S tag) and no talk of who did the work, in any file git tracks or
would add: code, tests, docs, configs, results, and the file names themselves. Cite the date and the
feature instead ("the 2026-12-02 lever sweep", "the integrity checks"), and name a machine by its
hardware ("the H200 host", "a 2-core CPU"). A hit is reported as path:line with the offending text.

And code and configuration (Python, shell, YAML, TOML) keep to 100 characters a line, pragma
comments included.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: what may not appear (the character classes keep this file from matching itself)
FORBIDDEN = {
    "a session number": re.compile(r"(?i)(?<![a-z])sessions?[\s_-]*\d"),
    "an issue number": re.compile(r"(?i)(?<![a-z])issues?[\s_-]*\d"),
    "a session tag": re.compile(r"\bS\d{1,2}\b"),
    "talk of who built it": re.compile(
        r"(?i)\bthe l[e]ad\b(?! time)|\bl[e]ad's\b|\bwork[p]lace\b|\bdevic[e] tool\b|`devic[e]` "
        r"tool|\bhelpe[r] (?:branch(?:es)?|sessions?)\b|\bthe bri[e]f\b|\bbri[e]f's\b"
    ),
}


def repository_files() -> list[str]:
    """Every file git tracks or would add (untracked and not ignored), relative to the root."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): nothing to list")
    return sorted({name for name in out.decode().split("\0") if name and (ROOT / name).is_file()})


def find_hits(name: str, text: str | None) -> list[str]:
    """'path:line: what: text' for each forbidden match in the file name and (if text) its lines."""
    hits = [
        f"{name}: {what} in the file name" for what, pat in FORBIDDEN.items() if pat.search(name)
    ]
    for number, line in enumerate((text or "").splitlines(), start=1):
        for what, pat in FORBIDDEN.items():
            m = pat.search(line)
            if m:
                start = max(0, m.start() - 40)
                hits.append(f"{name}:{number}: {what}: ...{line[start : m.end() + 40].strip()}...")
    return hits


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte in its first 8 KiB)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def test_the_patterns_catch_every_spelling():
    # the forbidden spellings are assembled here so that this file does not contain them itself
    session, issue = "sess" + "ion", "iss" + "ue"
    for bad in (
        f"{session.title()} 17",
        f"{session}-17",
        f"realbench_{session}17.md",
        f"{session}s 9–13",
        f"{issue} 14's goal",
        f"{issue}s 14, 18",
        f"{issue}-20 check",
        f"{issue}19_path",
        "the S" + "17 run",
        "the le" + "ad's tool",
        "this work" + "place",
        "hel" + "per branches",
    ):
        assert find_hits("x.md", bad), bad
    for fine in (
        f"the {issue}'s shape",
        f"a {session} of Prefect",
        "s1 = shards[0]",
        "sample s1",
        "vllm-project/vllm#55005",
        "lead time",
        "the 2-core CPU",
        "the H200 host",
    ):
        assert not find_hits("x.md", fine), fine
    assert find_hits(f"benchmarks/results/demo_{session}9.md", None)  # the file name alone


def test_no_session_or_issue_numbers_anywhere():
    hits = []
    for name in repository_files():
        hits += find_hits(name, read_text(ROOT / name))
    assert not hits, f"{len(hits)} hit(s); cite the date and the feature instead:\n" + "\n".join(
        hits[:200]
    )


#: the files whose lines are code or configuration (Markdown prose and data files are not)
CODE_SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".toml")
MAX_LINE_CHARS = 100


def long_lines(name: str, text: str) -> list[str]:
    """'path:line: N characters' for each line over MAX_LINE_CHARS characters (not bytes)."""
    return [
        f"{name}:{number}: {len(line)} characters"
        for number, line in enumerate(text.splitlines(), start=1)
        if len(line) > MAX_LINE_CHARS
    ]


def test_long_lines_are_found_by_characters_not_bytes():
    assert long_lines("x.sh", "a" * 101) == ["x.sh:1: 101 characters"]
    assert not long_lines("x.sh", "→" * 100)  # 300 bytes, 100 characters
    # ruff leaves a line ending in a pragma comment alone; this check does not
    assert long_lines("x.py", "x = 1" + " " * 70 + "# noqa: E501 - " + "y" * 20)


def test_code_and_config_lines_fit_in_100_characters():
    hits = []
    for name in repository_files():
        if name.endswith(CODE_SUFFIXES) or name == ".ci/run":
            hits += long_lines(name, read_text(ROOT / name) or "")
    assert not hits, f"{len(hits)} line(s) over {MAX_LINE_CHARS} characters:\n" + "\n".join(
        hits[:100]
    )
