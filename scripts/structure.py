#!/usr/bin/env python3
"""Figures of the code's structure, to compare one layout of the repository with another.

    python scripts/structure.py                 # this checkout, as a table
    python scripts/structure.py --json          # the same as JSON
    python scripts/structure.py --root DIR      # another checkout (e.g. `git worktree add DIR REV`)
    python scripts/structure.py --longest 40    # list more of the functions over the limit
    python scripts/structure.py --route         # and the pipeline route (scripts/route.py)

What it counts, in the product's code (src/eagle3 and the Prefect layer: flows/ tasks/ blocks/):
modules and lines; functions longer than --max-lines (from `def` to their last line, docstring
included; a nested function counts on its own and inside its parent); `# noqa` comments; the
library's import layers (the `library-layers` contract in pyproject.toml) and the imports that go
against them: upward (a module importing one of a higher layer) and sideways (between two modules
of one layer whose members may not import each other, `|`). Every `import` counts, those inside
functions too; names under `if TYPE_CHECKING:` do not (eagle3.code_version's reading of imports).
It parses the measured checkout's files (`ast`) and imports nothing of it.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

from eagle3.code_version import absolute_name, run_nodes

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "eagle3"
PREFECT_LAYER = ("flows", "tasks", "blocks")


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


def function_lengths(tree: ast.AST, rel: str) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"


def measure(root: Path, max_lines: int) -> dict:
    files = product_files(root)
    layers, independent = library_layers(root)
    layer_of = {m: i for i, members in enumerate(layers) for m in members}
    long_functions: list[tuple[int, str]] = []
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
    return {
        "root": str(root),
        "modules": {group: len(paths) for group, paths in files.items()},
        "lines": lines,
        "config_py_lines": config_py.read_text().count("\n"),
        "max_function_lines": max_lines,
        "num_long_functions": len(long_functions),
        "long_functions": [{"lines": n, "where": where} for n, where in long_functions],
        "num_noqa": num_noqa,
        "num_library_layers": len(layers),
        "upward_imports": upward,
        "sideways_imports": sideways,
    }


def render(m: dict, longest: int) -> str:
    rows = [
        (
            "modules (library | Prefect layer)",
            f"{m['modules']['library']} | {m['modules']['prefect']}",
        ),
        ("lines (library | Prefect layer)", f"{m['lines']['library']} | {m['lines']['prefect']}"),
        ("lines of src/eagle3/config.py", m["config_py_lines"]),
        (f"functions over {m['max_function_lines']} lines", m["num_long_functions"]),
        ("`# noqa` comments", m["num_noqa"]),
        ("library import layers", m["num_library_layers"]),
        ("upward imports (library)", len(m["upward_imports"])),
        ("sideways imports between independent modules", len(m["sideways_imports"])),
    ]
    width = max(len(name) for name, _ in rows)
    out = [f"{name:<{width}}  {value}" for name, value in rows]
    if m["long_functions"] and longest:
        out += ["", f"longest functions (of {m['num_long_functions']}):"]
        out += [f"  {f['lines']:>4}  {f['where']}" for f in m["long_functions"][:longest]]
    for kind in ("upward_imports", "sideways_imports"):
        out += [f"{kind.replace('_', ' ')}: {edge}" for edge in m[kind]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure")
    parser.add_argument("--max-lines", type=int, default=60, help="a long function's limit")
    parser.add_argument("--longest", type=int, default=10, help="how many long functions to list")
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
    if args.json:
        print(json.dumps(m if route is None else {**m, "route": route}, indent=1))
    else:
        print(render(m, args.longest) + ("" if route is None else "\n\n" + render_route(route)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
