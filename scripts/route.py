#!/usr/bin/env python3
"""The pipeline route: the calls that the config `eagle3 run --no-prefect` starts with takes through
the library, read from the source (`ast`; nothing of the measured checkout is imported).

    python scripts/route.py                   # this checkout: the figures, then the route
    python scripts/route.py --root DIR        # another checkout (e.g. `git worktree add DIR REV`)
    python scripts/structure.py --route       # the same figures beside the structure's

The walk starts at `eagle3.pipeline.run_pipeline(cfg)`. A *stop* is a call that hands on the config
or a part of it: an argument that derives from the config (a name assigned from it, an attribute,
a call on it) passed to a parameter annotated with a config class (a class of eagle3.config,
eagle3.config.fields or eagle3.config.train_options, or a subclass), or a method called on such a
value.
Each function is walked once, in source order, at its first stop; a later stop at it counts but is
not walked again. A call of a function that another call returned (the stage registry calling the
stage it looked up) stops at every stage function the library declares as a "module:function"
string; a call of a declared callable field (a stage's `enabled`) stops at the lambdas given for it.

The route is the sequence of the stops' modules; its *head* is the part before it first leaves the
pipeline's own modules (eagle3.pipeline, the config modules, the stage declaration and registry).
A *visit* is a run of stops in one module; a *climb* is a step of the route to a module of a higher
layer of the `library-layers` contract (pyproject.toml) than the stop before it: the data going back
up after a trip down.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "eagle3"
START = ("eagle3.pipeline", "run_pipeline")
#: modules whose classes (and their subclasses) are configs
CONFIG_MODULES = ("eagle3.config", "eagle3.config.fields", "eagle3.config.train_options")
#: the pipeline's own modules: the route's head is its stops before it leaves them
HEAD_MODULES = (START[0], "eagle3.stages", "eagle3.stage_graph", *CONFIG_MODULES)
_DECLARED_FUNCTION = re.compile(rf"^{LIBRARY}(\.\w+)+:\w+$")

Key = tuple[str, str]  # (module, qualified name)


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> absolute dotted name
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)  # top-level and methods
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)


@dataclass
class Stop:
    caller: str  # module
    callee: Key
    walked: bool  # first arrival (its body was walked from here)


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def load_library(root: Path) -> dict[str, Module]:
    modules = {}
    src = root / "src"
    for path in sorted((src / LIBRARY).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        tree = ast.parse(path.read_text(), filename=str(path))
        m = Module(name, path, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    m.imports[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name
            elif isinstance(node, ast.ImportFrom):
                base = (
                    _absolute(name, is_package, node.level, node.module)
                    if node.level
                    else node.module or ""
                )
                for a in node.names:
                    m.imports[a.asname or a.name] = f"{base}.{a.name}"
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                m.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                m.classes[node.name] = node
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        m.functions[f"{node.name}.{item.name}"] = item
        modules[name] = m
    return modules


class Library:
    """Name resolution over the parsed library."""

    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        self.config_classes = {
            k
            for k in self._all_classes()
            if (k[0] in CONFIG_MODULES or self._derives_config(k)) and self._is_model(k)
        }

    def _all_classes(self) -> Iterator[Key]:
        for m in self.modules.values():
            for c in m.classes:
                yield (m.name, c)

    def resolve(self, dotted: str, depth: int = 0) -> Key | str | None:
        """`eagle3.a.b.name` -> (module, name) of a function or class, or a module name."""
        if depth > 8 or not dotted.startswith(LIBRARY):
            return None
        if dotted in self.modules:
            return dotted
        module, _, attr = dotted.rpartition(".")
        m = self.modules.get(module)
        if m is None:
            found = self.resolve(module, depth + 1)
            if isinstance(found, tuple):  # Class.method
                return (found[0], f"{found[1]}.{attr}")
            return None
        if attr in m.functions or attr in m.classes:
            return (module, attr)
        if attr in m.imports:
            return self.resolve(m.imports[attr], depth + 1)
        if "__getattr__" in m.functions:  # a lazy attribute of a package: a module it imports
            for target in m.imports.values():
                if target in self.modules and attr in self.modules[target].functions:
                    return (target, attr)
        return None

    def home(self, module: str, name: str) -> str:
        """The module that defines the global `name` that `module` uses."""
        target = self.modules[module].imports.get(name)
        if target:
            parent = target.rpartition(".")[0]
            if parent in self.modules:
                return self.home(parent, name)
        return module

    def resolve_in(self, module: str, name: str) -> Key | str | None:
        m = self.modules[module]
        if name in m.functions or name in m.classes:
            return (module, name)
        if name in m.imports:
            return self.resolve(m.imports[name])
        return None

    def bases(self, cls: Key) -> list[Key]:
        node = self.modules[cls[0]].classes[cls[1]]
        out = []
        for b in node.bases:
            name = _dotted(b)
            found = self.resolve_in(cls[0], name.split(".")[0]) if name else None
            if isinstance(found, tuple) and found[1] in self.modules[found[0]].classes:
                out.append(found)
        return out

    def _derives_config(self, cls: Key, depth: int = 0) -> bool:
        if depth > 10:
            return False
        return any(
            b[0] in CONFIG_MODULES or self._derives_config(b, depth + 1) for b in self.bases(cls)
        )

    def _is_model(self, cls: Key, depth: int = 0) -> bool:
        """Whether `cls` derives from pydantic's BaseModel (a config, not a value type)."""
        node = self.modules[cls[0]].classes[cls[1]]
        if any(_dotted(b).split(".")[-1] == "BaseModel" for b in node.bases):
            return True
        return depth < 10 and any(self._is_model(b, depth + 1) for b in self.bases(cls))

    def method(self, cls: Key, name: str, depth: int = 0) -> Key | None:
        if depth > 10:
            return None
        if f"{cls[1]}.{name}" in self.modules[cls[0]].functions:
            return (cls[0], f"{cls[1]}.{name}")
        for b in self.bases(cls):
            found = self.method(b, name, depth + 1)
            if found:
                return found
        return None

    def field_type(self, cls: Key, name: str, depth: int = 0) -> ast.expr | None:
        if depth > 10:
            return None
        for item in self.modules[cls[0]].classes[cls[1]].body:
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and item.target.id == name
            ):
                return item.annotation
        for b in self.bases(cls):
            found = self.field_type(b, name, depth + 1)
            if found is not None:
                return found
        return None

    def class_of(self, module: str, annotation: ast.expr | None) -> Key | list | None:
        """The library class an annotation names (X, X | None, "X"), a list of them for
        tuple[...], else None."""
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(annotation, ast.BinOp):  # X | None
            return self.class_of(module, annotation.left) or self.class_of(module, annotation.right)
        if isinstance(annotation, ast.Subscript) and _dotted(annotation.value) == "tuple":
            elts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else []
            return [self.class_of(module, e) for e in elts]
        name = _dotted(annotation)
        if not name:
            return None
        head, _, rest = name.partition(".")
        found = self.resolve_in(module, head)
        if isinstance(found, str) and rest:
            found = self.resolve(f"{found}.{rest}")
        if isinstance(found, tuple) and found[1] in self.modules[found[0]].classes:
            return found
        return None

    def global_item_class(self, module: str, name: str) -> Key | None:
        """The value class of a module-level `NAME: dict[K, V]` (here or where it is imported
        from)."""
        home = self.home(module, name)
        for node in self.modules[home].tree.body:
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
                and isinstance(node.annotation, ast.Subscript)
                and isinstance(node.annotation.slice, ast.Tuple)
            ):
                cls = self.class_of(home, node.annotation.slice.elts[-1])
                return cls if isinstance(cls, tuple) else None
        return None

    def declared_functions(self) -> list[Key]:
        """Every "eagle3.module:function" string constant of the library, in source order."""
        out = []
        for m in self.modules.values():
            for node in ast.walk(m.tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if _DECLARED_FUNCTION.match(node.value):
                        mod, func = node.value.split(":")
                        found = self.resolve(f"{mod}.{func}")
                        if isinstance(found, tuple) and found not in out:
                            out.append(found)
        return out


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _params(fn: ast.FunctionDef | ast.Lambda) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs]


class Walk:
    def __init__(self, lib: Library):
        self.lib = lib
        self.stops: list[Stop] = []
        self.walked: set[Key] = set()
        self._declared = lib.declared_functions()

    # -- values ---------------------------------------------------------------------------------

    def _type(self, module: str, expr: ast.expr, env: dict[str, object]) -> object:
        """(tainted?, class) of an expression: tainted values derive from the config."""
        if isinstance(expr, ast.Name):
            return env.get(expr.id, (False, None))
        if isinstance(expr, ast.Attribute):
            tainted, cls = self._type(module, expr.value, env)
            if not tainted:
                return (False, None)
            if isinstance(cls, tuple):
                return (True, self.lib.class_of(cls[0], self.lib.field_type(cls, expr.attr)))
            return (True, None)
        if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name):
            if expr.value.id not in env:  # a module's table, e.g. `STAGES: dict[str, Stage]`
                return (False, self.lib.global_item_class(module, expr.value.id))
        if isinstance(expr, ast.Subscript | ast.Starred):
            return (self._type(module, expr.value, env)[0], None)
        if isinstance(expr, ast.Call):
            return self._call_value.get(id(expr), (False, None))
        tainted = any(
            self._type(module, child, env)[0]
            for child in ast.iter_child_nodes(expr)
            if isinstance(child, ast.expr)
        )
        return (tainted, None)

    # -- the walk -------------------------------------------------------------------------------

    def run(self) -> list[Stop]:
        self._call_value: dict[int, tuple[bool, object]] = {}
        fn = self.lib.modules[START[0]].functions[START[1]]
        self.stops.append(Stop(START[0], START, True))
        self.walked.add(START)
        self._walk_function(
            START, fn, {_params(fn)[0].arg: (True, self._param_class(START, fn, 0))}
        )
        return self.stops

    def _param_class(self, key: Key, fn: ast.FunctionDef, i: int) -> object:
        return self.lib.class_of(key[0], _params(fn)[i].annotation)

    def _walk_function(self, key: Key, fn: ast.AST, env: dict[str, object]) -> None:
        body = fn.body if isinstance(fn.body, list) else [ast.Expr(fn.body)]
        for stmt in body:
            self._statement(key, stmt, env)

    def _statement(self, key: Key, stmt: ast.stmt, env: dict[str, object]) -> None:
        module = key[0]
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):  # a closure: walk it here
            self._walk_function(key, stmt, env)
            return
        if isinstance(stmt, ast.ClassDef):
            return
        exprs = [
            child
            for name, child in ast.iter_fields(stmt)
            if name not in ("body", "orelse", "finalbody", "handlers", "targets", "target")
            for child in (child if isinstance(child, list) else [child])
            if isinstance(child, ast.expr)
        ]
        if isinstance(stmt, ast.With):
            exprs = [item.context_expr for item in stmt.items]
        for expr in exprs:
            self._calls(key, expr, env)
        if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign) and stmt.value:
            value = self._type(module, stmt.value, env)
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                self._bind(t, value, env)
        if isinstance(stmt, ast.For):
            self._bind(stmt.target, (self._type(module, stmt.iter, env)[0], None), env)
        if isinstance(stmt, ast.With):
            for item in stmt.items:
                if item.optional_vars is not None:
                    value = (self._type(module, item.context_expr, env)[0], None)
                    self._bind(item.optional_vars, value, env)
        for name in ("body", "orelse", "finalbody"):
            for child in getattr(stmt, name, None) or []:
                self._statement(key, child, env)
        for handler in getattr(stmt, "handlers", None) or []:
            for child in handler.body:
                self._statement(key, child, env)

    def _bind(self, target: ast.expr, value: tuple[bool, object], env: dict[str, object]) -> None:
        tainted, cls = value
        if isinstance(target, ast.Name):
            env[target.id] = (tainted, cls)
        elif isinstance(target, ast.Tuple | ast.List):
            classes = cls if isinstance(cls, list) else [None] * len(target.elts)
            for t, c in zip(target.elts, classes, strict=False):
                self._bind(t, (tainted, c), env)

    def _calls(self, key: Key, expr: ast.expr, env: dict[str, object]) -> None:
        """The calls in `expr`, arguments before the call that takes them."""
        if isinstance(expr, ast.Lambda):
            return
        for child in ast.iter_child_nodes(expr):
            if isinstance(child, ast.expr):
                self._calls(key, child, env)
            elif isinstance(child, ast.keyword | ast.comprehension):
                for sub in ast.iter_child_nodes(child):
                    if isinstance(sub, ast.expr):
                        self._calls(key, sub, env)
        if isinstance(expr, ast.ListComp | ast.GeneratorExp | ast.SetComp | ast.DictComp):
            for gen in expr.generators:  # the loop variable of a comprehension over the config
                self._bind(gen.target, (self._type(key[0], gen.iter, env)[0], None), env)
        if isinstance(expr, ast.Call):
            self._call(key, expr, env)
        if isinstance(expr, ast.NamedExpr):
            self._bind(expr.target, self._type(key[0], expr.value, env), env)

    def _call(self, key: Key, call: ast.Call, env: dict[str, object]) -> None:
        module = key[0]
        args = [self._type(module, a, env) for a in call.args]
        kwargs = {k.arg: self._type(module, k.value, env) for k in call.keywords if k.arg}
        any_tainted = any(t for t, _ in [*args, *kwargs.values()])
        func = call.func
        receiver = (False, None)
        callee: Key | None = None
        if isinstance(func, ast.Name):
            found = self.lib.resolve_in(module, func.id)
            callee = found if isinstance(found, tuple) else None
        elif isinstance(func, ast.Attribute):
            dotted = _dotted(func.value)
            head = dotted.split(".")[0] if dotted else ""
            if head and head not in env and head != "self":
                found = self.lib.resolve_in(module, head)
                if isinstance(found, str):  # a module
                    rest = dotted[len(head) :]
                    found = self.lib.resolve(f"{found}{rest}.{func.attr}")
                    callee = found if isinstance(found, tuple) else None
                elif isinstance(found, tuple):  # Class.method
                    callee = self.lib.method(found, func.attr)
            else:
                receiver = self._type(module, func.value, env)
                cls = receiver[1]
                if head == "self" and dotted == "self" and "." in key[1]:
                    cls = (module, key[1].split(".")[0])
                    receiver = (env.get("self", (False, None))[0], cls)
                if isinstance(cls, tuple):
                    callee = self.lib.method(cls, func.attr)
                    if callee is None and self._callable_field(cls, func.attr):
                        if any_tainted:
                            self._declared_callables(key, cls, func.attr)
                        self._call_value[id(call)] = (any_tainted, None)
                        return
                elif receiver[0]:
                    found = [
                        m for c in self.lib.config_classes if (m := self.lib.method(c, func.attr))
                    ]
                    callee = found[0] if len(set(found)) == 1 else None
        elif isinstance(func, ast.Call) and any_tainted:  # a function another call returned
            for target in self._declared:
                self._stop(key, target, [(True, None)], {}, (False, None), declared=True)
            self._call_value[id(call)] = (True, None)
            return
        result = (any_tainted or receiver[0], None)
        if callee is not None and callee[1] in self.lib.modules[callee[0]].functions:
            fn = self.lib.modules[callee[0]].functions[callee[1]]
            if self._stop(key, callee, args, kwargs, receiver):
                result = (True, self.lib.class_of(callee[0], fn.returns))
            else:
                result = (result[0], self.lib.class_of(callee[0], fn.returns))
        elif callee is not None:  # a class: constructing one from the config
            result = (any_tainted, callee if any_tainted else None)
        self._call_value[id(call)] = result

    def _callable_field(self, cls: Key, name: str) -> bool:
        ann = self.lib.field_type(cls, name)
        return ann is not None and "Callable" in ast.unparse(ann)

    def _declared_callables(self, key: Key, cls: Key, name: str) -> None:
        """A call of a stage's `enabled`: a stop at the lambdas given for it in the declaration."""
        target = (cls[0], f"{cls[1]}.{name}")
        first = target not in self.walked
        self.stops.append(Stop(key[0], target, first))
        if not first:
            return
        self.walked.add(target)
        for m in self.lib.modules.values():
            for node in ast.walk(m.tree):
                if isinstance(node, ast.keyword) and node.arg == name:
                    if isinstance(node.value, ast.Lambda) and node.value.args.args:
                        lam = node.value
                        self._walk_function(
                            (m.name, target[1]), lam, {lam.args.args[0].arg: (True, None)}
                        )

    def _stop(
        self,
        key: Key,
        callee: Key,
        args: list[tuple[bool, object]],
        kwargs: dict[str, tuple[bool, object]],
        receiver: tuple[bool, object],
        declared: bool = False,
    ) -> bool:
        """Record a stop when the call hands the config to `callee`; walk it the first time."""
        fn = self.lib.modules[callee[0]].functions[callee[1]]
        params = _params(fn)
        is_method = "." in callee[1] and params and params[0].arg in ("self", "cls")
        env: dict[str, object] = {}
        if is_method:
            cls_key = (callee[0], callee[1].split(".")[0])
            if receiver[0] and cls_key in self.lib.config_classes:
                env[params[0].arg] = (True, cls_key)
            params = params[1:]
        for p, value in [
            *zip(params, args, strict=False),
            *((p, kwargs[p.arg]) for p in params if p.arg in kwargs),
        ]:
            cls = self.lib.class_of(callee[0], p.annotation)
            if value[0] and isinstance(cls, tuple) and cls in self.lib.config_classes:
                env[p.arg] = (True, cls)
            elif value[0] and declared:  # a stage function: its config, whatever its annotation
                env[p.arg] = (True, cls)
        if not env:
            return False
        first = callee not in self.walked
        self.stops.append(Stop(key[0], callee, first))
        if first:
            self.walked.add(callee)
            self._walk_function(callee, fn, env)
        return True


def layer_index(root: Path) -> dict[str, int]:
    config = tomllib.loads((root / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c.get("id") == "library-layers"]
    return {m.strip(): i for i, layer in enumerate(layers) for m in re.split(r"[|:]", layer)}


def top_module(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def measure_route(root: Path) -> dict:
    lib = Library(load_library(root))
    stops = Walk(lib).run()
    layers = layer_index(root)
    figures = _figures([s.callee[0] for s in stops], layers)
    # the head: the pipeline's own part, before the route enters a stage (or the streaming step)
    first_run = next(
        (i for i, s in enumerate(stops) if s.callee[0] not in HEAD_MODULES), len(stops)
    )
    head = _figures([s.callee[0] for s in stops[:first_run]], layers)
    return {
        "root": str(root),
        "start": ".".join(START),
        **{k: v for k, v in figures.items() if k != "climbs"},
        "head": {k: v for k, v in head.items() if k != "climbs"},
        "route": [
            {
                "from": s.caller,
                "to": f"{s.callee[0]}:{s.callee[1]}",
                "climb": i in figures["climbs"],
                "again": not s.walked,
            }
            for i, s in enumerate(stops)
        ],
    }


def _figures(route: list[str], layers: dict[str, int]) -> dict:
    """Stops, modules, visits and climbs of a sequence of the stops' modules."""
    visits: dict[str, int] = {}
    climbs = []
    for i, module in enumerate(route):
        if i == 0 or module != route[i - 1]:
            visits[module] = visits.get(module, 0) + 1
        if i and module != route[i - 1]:
            here, before = layers.get(top_module(module)), layers.get(top_module(route[i - 1]))
            if here is not None and before is not None and here < before:
                climbs.append(i)
    return {
        "num_stops": len(route),
        "num_modules": len(visits),
        "num_visits": sum(visits.values()),
        "num_climbs": len(climbs),
        "visits": dict(sorted(visits.items(), key=lambda kv: (-kv[1], kv[0]))),
        "climbs": climbs,
    }


def render_route(m: dict, full: bool = True) -> str:
    h = m["head"]
    out = [
        f"the pipeline route from {m['start']}: {m['num_stops']} stops in {m['num_modules']} "
        f"modules, {m['num_visits']} visits, {m['num_climbs']} climbs",
        f"its head (the pipeline, the config and the stage registry): {h['num_stops']} stops in "
        f"{h['num_modules']} modules, {h['num_visits']} visits, {h['num_climbs']} climbs",
        "modules visited more than once: "
        + (", ".join(f"{k} {v}" for k, v in m["visits"].items() if v > 1) or "none"),
    ]
    if full:
        for i, s in enumerate(m["route"]):
            mark = "^" if s["climb"] else " "
            again = " (again)" if s["again"] else ""
            out.append(f"  {i:>3} {mark} {s['to']}{again}  <- {s['from']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    m = measure_route(args.root.resolve())
    print(json.dumps(m, indent=1) if args.json else render_route(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
