"""The code version of a stage: the eagle3 sources it runs and the installed packages that shape
what it writes, read from its imports, so that no list of files has to be kept in step with them.

`import_closure(modules)` follows, from the given eagle3 modules, every `import` and
`from ... import` statement (at module level and inside functions; not those under
`if TYPE_CHECKING:`, which never run) and every string constant that names an eagle3 module (a
`python -m eagle3.capture.engine_main` child, a vLLM worker extension given as
"eagle3.vllm_ext.CaptureWorkerExtension"). A name resolves to the longest prefix of it that is a
module of the package (`from eagle3.model import draft` reaches eagle3.model.draft,
`from eagle3.config import ConfigError` eagle3.config), and a module brings in the `__init__` of
every package above it (importing eagle3.capture.run runs eagle3/capture/__init__.py). Nothing is
imported: the sources are parsed with `ast`, so a copy of the package elsewhere (`root`) reads the
same way.

`code_version(modules)` is a sha256 over the closure's files (module name and content) and
`external_packages(modules)`: the version of every installed distribution that the closure imports
(vLLM, torch, transformers, safetensors, ...: another vLLM computes other hidden states), plus the
COMPANIONS that shape their results without being imported (transformers' fast tokenizers, torch's
compiled kernels). A package imported but not installed (an optional one) counts as absent, so
installing it changes the version too.

Cost: a file is parsed once per process and kept by (path, size, mtime_ns), its sha256 likewise
(eagle3.io.sha256_file), the map from import names to distributions is read once per process
(~0.3 s); a stage's version then costs a stat() per module of its closure.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from eagle3.io import sha256_file

PACKAGE = "eagle3"
#: distributions that shape the output of one the closure imports without being imported
#: themselves: the tokenizers behind transformers' fast tokenizers, the kernels torch compiles
COMPANIONS = {"transformers": ("tokenizers",), "torch": ("triton",)}
_MODULE_NAME = re.compile(rf"{PACKAGE}(\.[A-Za-z_]\w*)+")


@dataclass(frozen=True)
class _Parsed:
    """What one source file refers to: names that may be eagle3 modules (absolute), and the
    top-level names of the other packages it imports."""

    internal: frozenset[str]
    external: frozenset[str]


def package_root() -> Path:
    """The directory of the installed eagle3 package."""
    return Path(__file__).resolve().parent


def module_file(name: str, root: Path) -> Path | None:
    """The source file of eagle3 module `name` under `root` (the package's directory), or None."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = root.joinpath(*parts[1:])
    candidates = [base / "__init__.py"] if len(parts) == 1 else [base.with_suffix(".py")]
    if len(parts) > 1:
        candidates.append(base / "__init__.py")
    return next((p for p in candidates if p.is_file()), None)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def run_nodes(node: ast.AST) -> Iterable[ast.AST]:
    """Every node under `node` except the bodies of `if TYPE_CHECKING:` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from run_nodes(other)
            continue
        yield child
        yield from run_nodes(child)


def absolute_name(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a relative import `from <level dots><name> import ...` in `module`."""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _parse_file(path: Path, module: str) -> _Parsed:
    tree = ast.parse(path.read_bytes(), filename=str(path))
    is_package = path.name == "__init__.py"
    internal: set[str] = set()
    external: set[str] = set()

    def add(name: str) -> None:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            internal.add(name)
        else:
            external.add(name.split(".")[0])

    for node in run_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = (
                absolute_name(module, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            add(base)
            if base == PACKAGE or base.startswith(PACKAGE + "."):
                internal.update(f"{base}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _MODULE_NAME.fullmatch(node.value)
        ):
            internal.add(node.value)
    external -= set(sys.stdlib_module_names) | {"__future__"}
    return _Parsed(frozenset(internal), frozenset(external))


_parsed: dict[tuple[str, str, int, int], _Parsed] = {}


def parse_imports(path: Path, module: str) -> _Parsed:
    """What `path` (eagle3 module `module`) refers to, parsed once per process and file version."""
    st = path.stat()
    key = (str(path), module, st.st_size, st.st_mtime_ns)
    if key not in _parsed:
        _parsed[key] = _parse_file(path, module)
    return _parsed[key]


def _closure(modules: Iterable[str], root: Path) -> dict[str, tuple[Path, _Parsed]]:
    """{module: (its file, what it refers to)} for `modules`' import closure."""
    files: dict[str, Path | None] = {}

    def file_of(name: str) -> Path | None:
        if name not in files:
            files[name] = module_file(name, root)
        return files[name]

    def resolve(name: str) -> list[str]:
        # the longest prefix of `name` that is a module, and the packages above it
        parts = name.split(".")
        while parts and file_of(".".join(parts)) is None:
            parts.pop()
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]

    found: dict[str, tuple[Path, _Parsed]] = {}
    seen: set[str] = set()
    todo = [m for name in modules for m in resolve(name)]
    while todo:
        name = todo.pop()
        path = file_of(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        found[name] = (path, parse_imports(path, name))
        for ref in found[name][1].internal:
            todo.extend(m for m in resolve(ref) if m not in seen)
    return dict(sorted(found.items()))


def import_closure(modules: Iterable[str], root: Path | None = None) -> tuple[str, ...]:
    """The eagle3 modules that running `modules` may execute, sorted (see the module docstring).
    `root`: the package's directory (default: this package)."""
    return tuple(_closure(modules, root or package_root()))


@functools.cache
def _distributions_by_import_name() -> dict[str, tuple[str, ...]]:
    found = importlib.metadata.packages_distributions()
    return {name: tuple(sorted(set(dists))) for name, dists in found.items()}


@functools.cache
def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def external_packages(modules: Iterable[str], root: Path | None = None) -> dict[str, str]:
    """{distribution: version} of the installed packages that `modules`' closure imports, with
    their COMPANIONS; an import name no distribution provides maps to "absent"."""
    return _external_packages(_closure(modules, root or package_root()))


def _external_packages(closure: dict[str, tuple[Path, _Parsed]]) -> dict[str, str]:
    names = sorted({name for _, parsed in closure.values() for name in parsed.external})
    by_name = _distributions_by_import_name()
    out: dict[str, str] = {}
    for name in names:
        dists = by_name.get(name)
        if not dists:
            out[f"import {name}"] = "absent"
        for dist in dists or ():
            out[dist] = _version(dist)
            for companion in COMPANIONS.get(dist, ()):
                out[companion] = _version(companion)
    return dict(sorted(out.items()))


def code_version(modules: Iterable[str], root: Path | None = None) -> str:
    """A sha256 (hex, 16 digits) over the files of `modules`' import closure and the versions of
    the external packages it imports: any edit to a module it can run, or another version of a
    package it imports, gives another value."""
    closure = _closure(modules, root or package_root())
    h = hashlib.sha256()
    for module, (path, _) in closure.items():
        h.update(f"{module}={sha256_file(path, memo=True)};".encode())
    for dist, version in _external_packages(closure).items():
        h.update(f"{dist}=={version};".encode())
    return h.hexdigest()[:16]
