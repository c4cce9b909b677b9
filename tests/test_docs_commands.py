"""Every command line in README.md, docs/scaling.md, docs/decisions/ and benchmarks/README.md works
as written (docs/operations.md's are run by tests/test_prefect_server.py).

Each documented command is found (fenced blocks and inline code spans) and must be classified here:
an `eagle3` command is parsed by the real CLI parser with its placeholders filled in (FILE = every
preset in configs/ for `eagle3 plan`, `h200|b300|...` = each alternative), and run for real where
that is cheap (`eagle3 plan` on every preset and profile, configs loaded and validated);
`bash scripts/demo.sh` runs with --dry-run (the eagle3 command it would run, checked the same way);
`bash benchmarks/offline_gpu/host.sh run|start ... -- CMD`: CMD is checked the same way (an eagle3
or a benchmark command); `bash scripts/test.sh ...` runs with --dry-run (its pytest
command must parse); any other benchmark command (`python benchmarks/X.py --flag ...`,
`bash benchmarks/X.sh ...`) must name an existing script that defines every flag it passes; the rest
names the test that runs it.
A new command in the docs that fits none of these fails the test, so the docs cannot drift
unnoticed.
"""

from __future__ import annotations

import functools
import itertools
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from eagle3.cli import build_parser as _build_parser
from eagle3.cli import main
from eagle3.config import load_pipeline_config
from eagle3.stages import stage_names

ROOT = Path(__file__).resolve().parents[1]
DOCS = (
    "README.md",
    "docs/scaling.md",
    "benchmarks/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "decisions").glob("*.md")),
)
PRESETS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml"))

#: documented commands run by other tests (command prefix -> where)
COVERED_ELSEWHERE = {
    "python scripts/scaling_plans.py": (
        "tests/test_plan.py::test_scaling_doc_figures_come_from_the_command"
    ),
    "prefect ": "tests/test_prefect_server.py (a real server, pools, deployments and workers)",
    "EAGLE3_REPO_DIR=$PWD prefect ": "tests/test_prefect_server.py",
    "EAGLE3_REPO_DIR=$PWD bash scripts/deploy.sh": "tests/test_prefect_server.py (runs deploy.sh)",
    "python -m eagle3_prefect.flows.worker": "tests/test_prefect_server.py (starts the workers)",
    "eagle3 hardware profile": "not a command: the Prefect block type's name "
    "(blocks/eagle3_blocks.py)",
}

#: placeholder -> value when parsing (FILE of `eagle3 plan` / `run` is every preset instead)
PLACEHOLDERS = {
    "T": "target",
    "D": "chats.jsonl",
    "DIR": "out",
    "PREPARED": "prepared",
    "N": "8",
    "FILE": "x.yaml",
    "DIR[,DIR...]": "a,b",
    "your.yaml": "configs/demo.yaml",
}


def documented_commands() -> list[tuple[str, str, bool]]:
    """(where, command, whole) for every command line in the docs: fenced bash/console lines (whole
    command lines) and inline code spans that start with a command (in prose: a whole command, or a
    mention such as `eagle3 run --no-prefect` whose flags must exist)."""
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
            lines = block.replace("\\\n", " ").splitlines()
            # a shell block is all commands; in any other block only `$ ` lines are (the rest is
            # output)
            prompted = lang not in ("bash", "sh", "shell") or any(
                line.startswith("$ ") for line in lines
            )
            for line in lines:
                if prompted and not line.startswith("$ "):
                    continue  # a command's printed output
                cmd = re.sub(r"\s+#.*$", "", line.removeprefix("$ ")).strip()
                if cmd and not cmd.startswith("#"):
                    found.append((doc, " ".join(cmd.split()), True))
        for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"(\.venv/bin/)?eagle3 [a-z]|bash scripts/|python scripts/|" + BENCH, span):
                found.append((doc, span, False))
    return found


#: a benchmark command: `[PYTHONPATH=src] [.venv/bin/]python[3] benchmarks/X.py ...` or `bash
#: benchmarks/X.sh ...`
BENCH = r"(PYTHONPATH=src )?((\.venv/bin/)?python3? |bash )benchmarks/"


def check_benchmark(cmd: str, capsys) -> None:
    """The script exists and defines every --flag the command passes (argparse's add_argument or the
    shell's case); the command offline_gpu/host.sh runs is checked the same way."""
    argv = shlex.split(re.sub(r"^PYTHONPATH=src ", "", cmd))
    script = next(a for a in argv if a.startswith("benchmarks/"))
    path = ROOT / script
    assert path.is_file(), f"`{cmd}`: {script} does not exist"
    rest = argv[argv.index(script) + 1 :]
    own = rest[: rest.index("--")] if "--" in rest else rest
    text = path.read_text()
    for flag in (a.split("=")[0] for a in own if a.startswith("--")):
        assert f'"{flag}"' in text or f"{flag})" in text, f"`{cmd}`: {script} defines no {flag}"
    if script == "benchmarks/offline_gpu/host.sh" and own[:1] in (["run"], ["start"]):
        inner = " ".join(rest[len(own) + 1 :])
        torchrun = re.match(r"python3? -m torch\.distributed\.run .*?(benchmarks/.*)", inner)
        if torchrun:  # the script torchrun starts, checked as a benchmark command
            inner = f"python3 {torchrun.group(1)}"
        if re.match(r"python3? -m eagle3\.cli ", inner):
            check_eagle3([shlex.split(inner)[3:]], capsys)
        else:
            assert re.match(BENCH, inner), f"`{cmd}`: runs neither eagle3 nor a benchmark"
            check_benchmark(inner, capsys)


def expand(cmd: str) -> list[list[str]]:
    """argv lists for `eagle3 ...` with placeholders filled in and `a|b|c` alternatives expanded."""
    cmd = re.sub(
        r"\[([^\]]*)\]", r"\1", cmd.replace("DIR[,DIR...]", "a,b")
    )  # optional parts: include them
    argv = shlex.split(cmd)[1:]
    options: list[list[str]] = []
    for i, tok in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if tok == "<stage>":
            options.append(list(stage_names("pipeline")))
        elif "|" in tok:
            options.append(tok.split("|"))
        elif tok == "FILE" and prev == "--config" and argv[0] in ("plan", "run"):
            options.append(PRESETS)
        elif tok in PLACEHOLDERS and re.match(r"--(num-|mean-|draft-vocab-size)", prev):
            options.append(["8"])  # a number, whatever the doc calls it
        else:
            options.append([PLACEHOLDERS.get(tok, tok)])
    combos = [list(p) for p in itertools.product(*options)]
    if (
        len(options) > 1
        and PRESETS in options
        and any(len(o) > 1 and o is not PRESETS for o in options)
    ):
        # every preset once and every alternative at least once, not the whole product (each plan
        # costs ~0.5 s)
        alt = next(o for o in options if len(o) > 1 and o is not PRESETS)
        i, j = options.index(PRESETS), options.index(alt)
        combos = [c for c in combos if alt.index(c[j]) == PRESETS.index(c[i]) % len(alt)]
    return combos


@functools.cache
def build_parser():
    return _build_parser()  # ~0.4 s each: once per test session


def subcommand_flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {o for action in sub.choices[command]._actions for o in action.option_strings}


def check_eagle3(argvs: list[list[str]], capsys, whole: bool = True) -> None:
    parser = build_parser()
    for argv in argvs:
        if not whole:  # a mention in prose: the command and its flags exist
            flags = subcommand_flags(argv[0])
            assert all(a in flags for a in argv[1:] if a.startswith("--")), (
                f"`eagle3 {shlex.join(argv)}`: unknown flag"
            )
            if not set(argv[1:]) & {"--config", "--target", "--draft", "--data", "--checkpoint"}:
                continue

        if "--help" in argv:
            with pytest.raises(SystemExit) as e:
                parser.parse_args(argv)
            assert e.value.code == 0, argv
            continue
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # argparse's own error (unknown flag, missing argument)
            raise AssertionError(
                f"`eagle3 {shlex.join(argv)}` does not parse: {capsys.readouterr().err}"
            ) from e
        if args.command == "plan" and Path(args.config).is_file():
            rc = main(argv)
            out = capsys.readouterr()
            assert rc == 0, f"`eagle3 {shlex.join(argv)}` failed: {out.err}"
            assert "mode" in out.out and "storage" in out.out
        elif args.command == "run" and Path(args.config).is_file():
            load_pipeline_config(args.config)


def test_every_documented_command_works(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    commands = documented_commands()
    assert len(commands) >= 15, commands  # the extraction itself works
    unclassified = []
    for where, cmd, whole in commands:
        if any(cmd.startswith(prefix) for prefix in COVERED_ELSEWHERE):
            continue
        if re.match(r"(\.venv/bin/)?eagle3 ", cmd):
            check_eagle3(expand(cmd), capsys, whole)
        elif re.match(BENCH, cmd):
            check_benchmark(cmd, capsys)
        elif cmd.startswith("bash scripts/test.sh"):
            check_test_command(cmd)
        elif cmd.startswith("bash scripts/demo.sh"):
            p = subprocess.run(
                ["bash", "scripts/demo.sh", "--dry-run", *shlex.split(cmd)[2:]],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert p.returncode == 0, p.stderr
            check_eagle3([shlex.split(p.stdout.strip().splitlines()[-1])[1:]], capsys)
        else:
            unclassified.append(f"{where}: {cmd}")
    assert not unclassified, "documented commands no test runs: " + "; ".join(unclassified)


QUICK_MARKS = "not vllm and not slow and not prefect"


def check_test_command(cmd: str) -> None:
    """`bash scripts/test.sh [ARGS]` with --dry-run: it accepts ARGS and prints a pytest command
    that pytest parses (the suite itself is what CI runs); --quick selects the quick tier by
    marks."""
    argv = shlex.split(cmd)[2:]
    p = subprocess.run(
        ["bash", "scripts/test.sh", "--dry-run", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0, f"`{cmd}`: {p.stderr}"
    pytest_argv = shlex.split(p.stdout.strip().splitlines()[-1])
    assert pytest_argv[:3] == [".venv/bin/python", "-m", "pytest"], f"`{cmd}` runs {pytest_argv}"
    if "--quick" in argv:
        assert QUICK_MARKS in pytest_argv and "tests/quick_guard" in p.stdout, p.stdout
    config = pytest.Config.fromdictargs({}, pytest_argv[3:])  # pyproject's addopts and these
    assert config.getoption("markexpr") == (QUICK_MARKS if "--quick" in argv else "")


def test_plan_runs_on_every_preset_without_size_flags(capsys, monkeypatch):
    """`eagle3 plan --config <preset> --hardware <profile>` (it once demanded --target-config, then
    --num-samples); the preset's plan: section supplies both, and a flag still overrides it."""
    monkeypatch.chdir(ROOT)
    for preset in PRESETS:
        assert load_pipeline_config(preset).plan.get("target_config"), (
            f"{preset} has no plan.target_config"
        )
        assert main(["plan", "--config", preset, "--hardware", "b300", "--format", "json"]) == 0, (
            capsys.readouterr().err
        )
        assert '"mode"' in capsys.readouterr().out
    assert (
        main(
            [
                "plan",
                "--config",
                "configs/kimi-k2.5.yaml",
                "--hardware",
                "b300",
                "--num-samples",
                "1234",
                "--format",
                "json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"num_samples": 1234' in out and "samples from --num-samples" in out
    assert "plan.mean_tokens" in out  # the rest still from the preset
