#!/usr/bin/env python3
"""Figures of the code's structure, to compare one layout of the repository with another.

    python scripts/structure.py                 # this checkout, as a table
    python scripts/structure.py --json          # the same as JSON
    python scripts/structure.py --root DIR      # another checkout (e.g. `git worktree add DIR REV`)
    python scripts/structure.py --longest 40    # list more of the functions over the limit
    python scripts/structure.py --route         # and the pipeline route (scripts/route.py)
    python scripts/structure.py --long          # list every function over the limit
    python scripts/structure.py --clones 20     # list the longest repeated-code pairs

What it counts, in the product's code (src/eagle3 and the Prefect layer: flows/ tasks/ blocks/):
modules and lines; functions longer than --max-lines (from `def` to their last line, docstring
included; a nested function counts on its own and inside its parent), and of those the ones whose
docstring gives no reason (a line starting "Kept whole:"); `# noqa` comments; the library's
import layers (the `library-layers` contract in pyproject.toml) and the imports that go against
them: upward (a module importing one of a higher layer) and sideways (between two modules
of one layer whose members may not import each other, `|`). Every `import` counts, those inside
functions too; names under `if TYPE_CHECKING:` do not (eagle3.code_version's reading of imports).
It parses the measured checkout's files (`ast`) and imports nothing of it.

Repeated code, over every Python file of the checkout (git's tracked files where it is a git
checkout): each line is reduced to its tokens' shape (names, strings and numbers each become one
placeholder; keywords and operators stay; comments, blank lines and import lines dropped; a run of
consecutive lines of one shape, such as a list of fields, counts as one line). A pair is two
places whose runs of six or more such lines match (at least 30 tokens in every six); a longer run
counts once, and six lines found in more than 20 places are an idiom, not a copy.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import keyword
import re
import subprocess
import sys
import tokenize
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from eagle3.code_version import absolute_name, run_nodes

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "eagle3"
PREFECT_LAYER = ("flows", "tasks", "blocks")
#: a repeated-code pair: this many lines (of one shape each) at least, with this many tokens
CLONE_LINES = 6
CLONE_TOKENS = 30
#: a window of lines found in more places than this is a common idiom, not a copy
CLONE_MAX_PLACES = 20
_SKIPPED_TOKENS = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def product_files(root: Path) -> dict[str, list[Path]]:
    """{"library": src/eagle3's modules, "prefect": flows/ tasks/ blocks/'s}, sorted."""
    return {
        "library": sorted((root / "src" / LIBRARY).rglob("*.py")),
        "prefect": sorted(p for d in PREFECT_LAYER for p in (root / d).rglob("*.py")),
    }


def module_name(path: Path, root: Path) -> str:
    """eagle3.x.y for src/eagle3/x/y.py (eagle3.x for its package's __init__.py)."""
    parts = list(path.relative_to(root / "src").with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The absolute names of what `module` imports (modules, or a module's attribute)."""
    names = set()
    for node in run_nodes(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (
                absolute_name(module, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def library_layers(root: Path) -> tuple[list[list[str]], list[bool]]:
    """The library-layers contract: each layer's top-level modules under eagle3, top layer first,
    and whether that layer's members are independent (`|`) rather than free to import each other
    (`:`)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c.get("id") == "library-layers"]
    return (
        [[m.strip() for m in re.split(r"[|:]", layer)] for layer in layers],
        ["|" in layer for layer in layers],
    )


#: how a long function's docstring gives the reason it is not split (a line starting with it)
KEPT_WHOLE = "Kept whole:"


def function_lengths(tree: ast.AST, rel: str) -> Iterator[tuple[int, str, bool]]:
    """(lines, where, whether its docstring says why it is kept whole) of each function."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node) or ""
            reason = any(line.strip().startswith(KEPT_WHOLE) for line in doc.splitlines())
            yield node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}", reason


def python_files(root: Path) -> list[str]:
    """Every Python file of the checkout, relative to it: git's tracked ones in a git checkout."""
    if (root / ".git").exists():
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "*.py"], capture_output=True, text=True, check=True
        )
        return sorted(listed.stdout.split())
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if ".venv" not in p.parts)


def line_shapes(text: str) -> list[tuple[int, str, int]]:
    """(line number, shape, number of tokens) of each line that holds code: names, strings and
    numbers become one placeholder each; import lines are dropped, and a line of the same shape
    as the one before it (a list of fields, of arguments) joins it."""
    tokens_of_line: dict[int, list[str]] = defaultdict(list)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return []
    for t in tokens:
        if t.type in _SKIPPED_TOKENS:
            continue
        if t.type == tokenize.NAME:
            shape = t.string if keyword.iskeyword(t.string) or t.string == "self" else "N"
        elif t.type in (tokenize.STRING, getattr(tokenize, "FSTRING_START", tokenize.STRING)):
            shape = "S"
        elif t.type == tokenize.NUMBER:
            shape = "0"
        else:
            shape = t.string
        tokens_of_line[t.start[0]].append(shape)
    shapes: list[tuple[int, str, int]] = []
    for number in sorted(tokens_of_line):
        line = tokens_of_line[number]
        if line[0] in ("import", "from"):
            continue
        shape = " ".join(line)
        if shapes and shapes[-1][1] == shape:
            continue
        shapes.append((number, shape, len(line)))
    return shapes


def repeated_pairs(root: Path) -> list[dict]:
    """Pairs of places repeating CLONE_LINES or more lines of the same shape, longest first."""
    places: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for rel in python_files(root):
        shapes = line_shapes((root / rel).read_text(errors="replace"))
        for i in range(len(shapes) - CLONE_LINES + 1):
            window = shapes[i : i + CLONE_LINES]
            if sum(n for _, _, n in window) < CLONE_TOKENS:
                continue
            key = hashlib.sha1("\n".join(s for _, s, _ in window).encode()).hexdigest()
            places[key].append((rel, i, window[0][0]))
    matches: dict[tuple[str, str, int, int], tuple[int, int]] = {}
    for found in places.values():
        if len(found) > CLONE_MAX_PLACES:
            continue
        for a, (file_a, i_a, line_a) in enumerate(found):
            for file_b, i_b, line_b in found[a + 1 :]:
                if file_a == file_b and abs(i_a - i_b) < CLONE_LINES:
                    continue  # a window overlapping itself
                matches[(file_a, file_b, i_a, i_b)] = (line_a, line_b)
    pairs = []
    for (file_a, file_b, i_a, i_b), (line_a, line_b) in matches.items():
        if (file_a, file_b, i_a - 1, i_b - 1) in matches:
            continue  # inside a longer run, counted where it starts
        n = 1
        while (file_a, file_b, i_a + n, i_b + n) in matches:
            n += 1
        pairs.append(
            {"lines": n + CLONE_LINES - 1, "a": f"{file_a}:{line_a}", "b": f"{file_b}:{line_b}"}
        )
    pairs.sort(key=lambda p: (-p["lines"], p["a"], p["b"]))
    return pairs


def measure(root: Path, max_lines: int) -> dict:
    files = product_files(root)
    layers, independent = library_layers(root)
    layer_of = {m: i for i, members in enumerate(layers) for m in members}
    long_functions: list[tuple[int, str, bool]] = []
    upward: list[str] = []
    sideways: list[str] = []
    num_noqa = 0
    lines = {}
    for group, paths in files.items():
        lines[group] = 0
        for path in paths:
            text = path.read_text()
            rel = str(path.relative_to(root))
            lines[group] += text.count("\n")
            num_noqa += len(re.findall(r"#\s*noqa\b", text))
            tree = ast.parse(text, filename=rel)
            long_functions += [f for f in function_lengths(tree, rel) if f[0] > max_lines]
            if group != "library":
                continue
            module = module_name(path, root)
            top = module.split(".")[1] if "." in module else None
            for name in sorted(imported_names(tree, module, path.name == "__init__.py")):
                parts = name.split(".")
                if parts[0] != LIBRARY or len(parts) < 2 or top is None:
                    continue
                mine, theirs = layer_of.get(top), layer_of.get(parts[1])
                if mine is None or theirs is None or top == parts[1]:
                    continue
                if theirs < mine:
                    upward.append(f"{module} -> {name}")
                elif theirs == mine and independent[mine]:
                    sideways.append(f"{module} -> {name}")
    long_functions.sort(key=lambda f: (-f[0], f[1]))
    config_py = root / "src" / LIBRARY / "config.py"
    pairs = repeated_pairs(root)
    in_library = f"src/{LIBRARY}/"
    return {
        "root": str(root),
        "modules": {group: len(paths) for group, paths in files.items()},
        "lines": lines,
        "config_py_lines": config_py.read_text().count("\n"),
        "max_function_lines": max_lines,
        "num_long_functions": len(long_functions),
        "num_long_functions_unexplained": sum(not kept for _, _, kept in long_functions),
        "long_functions": [
            {"lines": n, "where": where, "kept_whole": kept} for n, where, kept in long_functions
        ],
        "num_noqa": num_noqa,
        "num_library_layers": len(layers),
        "upward_imports": upward,
        "sideways_imports": sideways,
        "num_repeated_pairs": len(pairs),
        "num_repeated_pairs_library": sum(
            p["a"].startswith(in_library) and p["b"].startswith(in_library) for p in pairs
        ),
        "repeated_pairs": pairs,
    }


def render(m: dict, longest: int, num_clones: int) -> str:
    rows = [
        (
            "modules (library | Prefect layer)",
            f"{m['modules']['library']} | {m['modules']['prefect']}",
        ),
        ("lines (library | Prefect layer)", f"{m['lines']['library']} | {m['lines']['prefect']}"),
        ("lines of src/eagle3/config.py", m["config_py_lines"]),
        (
            f"functions over {m['max_function_lines']} lines (without a reason)",
            f"{m['num_long_functions']} ({m['num_long_functions_unexplained']})",
        ),
        ("`# noqa` comments", m["num_noqa"]),
        ("library import layers", m["num_library_layers"]),
        ("upward imports (library)", len(m["upward_imports"])),
        ("sideways imports between independent modules", len(m["sideways_imports"])),
        (
            "repeated-code pairs (all Python files | library)",
            f"{m['num_repeated_pairs']} | {m['num_repeated_pairs_library']}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    out = [f"{name:<{width}}  {value}" for name, value in rows]
    if m["long_functions"] and longest:
        out += ["", f"longest functions (of {m['num_long_functions']}):"]
        out += [
            f"  {f['lines']:>4}  {f['where']}{'  (kept whole)' if f['kept_whole'] else ''}"
            for f in m["long_functions"][:longest]
        ]
    for kind in ("upward_imports", "sideways_imports"):
        out += [f"{kind.replace('_', ' ')}: {edge}" for edge in m[kind]]
    if num_clones:
        out += ["", f"longest repeated-code pairs (of {m['num_repeated_pairs']}):"]
        out += [f"  {p['lines']:>4}  {p['a']}  {p['b']}" for p in m["repeated_pairs"][:num_clones]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure")
    parser.add_argument("--max-lines", type=int, default=60, help="a long function's limit")
    parser.add_argument("--longest", type=int, default=10, help="how many long functions to list")
    parser.add_argument("--long", action="store_true", help="list every function over the limit")
    parser.add_argument(
        "--clones", type=int, default=0, metavar="N", help="list the N longest repeated-code pairs"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--route",
        action="store_true",
        help="add the pipeline route: the stops and climbs of the config (scripts/route.py)",
    )
    args = parser.parse_args(argv)
    m = measure(args.root.resolve(), args.max_lines)
    route = None
    if args.route:
        from route import measure_route, render_route  # scripts/route.py, beside this script

        route = measure_route(args.root.resolve())
    longest = m["num_long_functions"] if args.long else args.longest
    if args.json:
        print(json.dumps(m if route is None else {**m, "route": route}, indent=1))
    else:
        table = render(m, longest, args.clones)
        print(table + ("" if route is None else "\n\n" + render_route(route)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
