"""The config's route through the library, recorded while a real pipeline runs.

    python scripts/config_route.py            # figures, then the route's call edges
    python scripts/config_route.py --json     # the same as JSON
    python scripts/config_route.py --root DIR # the library of another checkout (DIR/src)

No maintained tool follows one parameter through the calls that pass it on (call-graph tools
draw every call; import tools see modules), so this one records it with Python's own profiler
hook (sys.setprofile, threading.setprofile): two tiny pipelines run on the CPU, a random
5-layer target, transformers backends (regenerate, capture, refine) and a few training steps;
the second in streaming mode. Evaluate is left out: it needs a vLLM engine.

A stop is an eagle3 function called with a config object among its arguments, or in a field of
a dataclass argument (an instance of a class defined in eagle3.config or one of its modules: the
PipelineConfig, a stage's section, one of train's groups). An edge is (the eagle3 function that
called it, the stop), counted once however often it runs. Figures: stops (distinct functions),
modules, visits (edges that enter a module from another one: how often the route comes into
it) and climbs (edges from a module in a lower import layer to one in a higher layer: the config
handed back up against pyproject.toml's library-layers contract). The config package counts as
one module.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import tomllib
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def layer_ranks(pyproject: Path) -> dict[str, int]:
    """eagle3 sub-package or module name -> its rank in the library-layers contract (0 = top)."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "library-layers")["layers"]
    ranks: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for name in layer.replace("|", ":").split(":"):
            ranks[name.strip()] = i
    return ranks


def rank_of(module: str, ranks: dict[str, int]) -> int:
    parts = module.split(".")
    return ranks.get(parts[1], len(ranks)) if len(parts) > 1 else -1


def tiny_pipelines(target: Path, work: Path) -> list[Any]:
    """The two pipelines the route is recorded on (the cheapest that run every stage but
    evaluate; the second streams capture into training)."""
    from eagle3.config import PipelineConfig

    assets = ROOT / "src" / "eagle3" / "assets"
    cpu32 = {"device": "cpu", "dtype": "float32"}
    capture = {"backend": "hf", **cpu32, "storage_dtype": "float32", "batch_tokens": 512}
    train = {
        "loss": {"ttt_steps": 2},
        "loader": {"max_seq_len": 128, "val_fraction": 0.25},
        "checkpoint": {"eval_every": 2, "save_every": 2, "log_every": 1},
        "max_steps": 2,
        "device": "cpu",
        "runtime": {"dtype": "float32"},
    }
    common = {
        "target": str(target),
        "data": str(assets / "demo_chats.jsonl"),
        "prepare": {"max_seq_len": 128, "limit": 8},
        "vocab": {"draft_vocab_size": 64},
    }
    offline = {
        **common,
        "name": "route-offline",
        "work_dir": str(work / "offline"),
        "mix": {"sources": [{"path": str(assets / "smol_chats.jsonl"), "weight": 0.2}]},
        "regenerate": {"backend": "hf", **cpu32, "max_new_tokens": 4, "limit": 8},
        "capture": {**capture, "shard_tokens": 256},
        "train": train,
        "refine": {
            "enabled": True,
            "rounds": 1,
            "num_prompts": 2,
            "num_val_prompts": 2,
            "max_new_tokens": 4,
            "steps_per_round": 1,
            "storage_dtype": "float32",
            **cpu32,
        },
    }
    streaming = {
        **common,
        "name": "route-stream",
        "work_dir": str(work / "stream"),
        "regenerate": {"enabled": False},
        "capture": {**capture, "shard_tokens": 128},
        "train": {**train, "epochs": 1},
        "stream": {"enabled": True, "spool_cap_gb": 0.01, "poll_interval_s": 0.02},
    }
    return [PipelineConfig.model_validate(c) for c in (offline, streaming)]


class RouteRecorder:
    """The profiler hook: every call of an eagle3 function whose arguments hold a config."""

    def __init__(self) -> None:
        from pydantic import BaseModel

        self.base = BaseModel
        self.edges: dict[tuple[str, str], int] = {}  # (caller, stop) -> order of first sight
        self.lock = threading.Lock()

    def is_config(self, value: Any) -> bool:
        return isinstance(value, self.base) and type(value).__module__.startswith("eagle3.config")

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not _ours(frame) or frame.f_code.co_name in INNER_SCOPES:
            return
        code = frame.f_code
        num_args = code.co_argcount + code.co_kwonlyargcount
        values = [frame.f_locals.get(n) for n in code.co_varnames[:num_args]]
        # a config carried inside a record (a dataclass argument's field) is passed on too
        values += [
            getattr(v, f.name, None)
            for v in values
            if dataclasses.is_dataclass(v) and not isinstance(v, type)
            for f in dataclasses.fields(v)
        ]
        if not any(self.is_config(v) for v in values):
            return
        caller = frame.f_back
        while caller is not None and (not _ours(caller) or caller.f_code.co_name in INNER_SCOPES):
            caller = caller.f_back
        edge = (_name(caller) if caller else "(outside)", _name(frame))
        with self.lock:
            self.edges.setdefault(edge, len(self.edges))


#: code objects that are part of the function around them (a comprehension's own frame)
INNER_SCOPES = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _ours(frame: FrameType) -> bool:
    return frame.f_globals.get("__name__", "").startswith("eagle3")


def _name(frame: FrameType) -> str:
    return f"{frame.f_globals['__name__']}:{frame.f_code.co_qualname}"


def record_route(work: Path) -> list[tuple[str, str]]:
    from eagle3.pipeline import run_pipeline
    from eagle3.testing.tiny import TinySpec, build_tiny_target

    target = build_tiny_target(work / "target", TinySpec(arch="llama", num_layers=5))
    configs = tiny_pipelines(target, work)
    rec = RouteRecorder()
    threading.setprofile(rec)
    sys.setprofile(rec)
    try:
        for cfg in configs:
            run_pipeline(cfg)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return sorted(rec.edges, key=rec.edges.__getitem__)


def figures(edges: list[tuple[str, str]], ranks: dict[str, int]) -> dict[str, Any]:
    def module(name: str) -> str:  # the config package counts as one module
        m = name.split(":")[0]
        return "eagle3.config" if m.startswith("eagle3.config.") else m

    stops = {callee for _, callee in edges}
    entering = [(a, b) for a, b in edges if module(a) != module(b)]
    climbs = [(a, b) for a, b in entering if rank_of(module(b), ranks) < rank_of(module(a), ranks)]
    visits = Counter(module(b) for _, b in entering)
    return {
        "stops": len(stops),
        "modules": len({module(s) for s in stops}),
        "edges": len(edges),
        "visits": sum(visits.values()),
        "climbs": len(climbs),
        "visits_per_module": dict(visits.most_common()),
        "climb_edges": [f"{a} -> {b}" for a, b in climbs],
        "route": [f"{a} -> {b}" for a, b in edges],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--root", type=Path, default=ROOT, help="checkout whose library is traced")
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.root / "src"))
    with tempfile.TemporaryDirectory(prefix="config-route-") as tmp:
        edges = record_route(Path(tmp))
    out = figures(edges, layer_ranks(args.root / "pyproject.toml"))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(
        f"config route (recorded run): {out['stops']} stops in {out['modules']} modules, "
        f"{out['visits']} visits, {out['climbs']} climbs ({out['edges']} call edges)"
    )
    capture = {m: n for m, n in out["visits_per_module"].items() if m.startswith("eagle3.capture")}
    print("visits per capture module: " + ", ".join(f"{m} {n}" for m, n in capture.items()))
    print(
        "modules entered more than twice: "
        + ", ".join(f"{m} {n}" for m, n in out["visits_per_module"].items() if n > 2)
    )
    for line in out["climb_edges"]:
        print(f"  climb: {line}")


if __name__ == "__main__":
    main()
