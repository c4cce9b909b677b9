"""Summarise one `benchmarks/refbench_sweep.sh` call from what it brings back (logs.tgz, ranking.json, times.txt):
per variant the best checkpoint's replayed τ estimate on the perturbed validation prompts, the same on the
held-out GSM8K-train split, top-1 agreement on train / held-out / validation rows (the overfitting gap), and
the call's stage times. Writes benchmarks/results/<name>.{json,md}.

    python benchmarks/refbench_sweep_report.py --call-dir /work/.device/1 --name refbench_sweep \
        --command "TRAIN_S=370 EPOCHS=14 ... bash benchmarks/refbench_sweep.sh"
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path

from eagle3.io import write_text

RESULTS = Path(__file__).resolve().parent / "results"
#: what a report keeps of `eagle3 evaluate`'s results.json (the eval dir itself is git-ignored)
VLLM_KEYS = ("acceptance_length", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
             "acceptance_rate_per_position", "outputs_match_baseline", "spec_tokens_per_s", "baseline_tokens_per_s")


def last_by_split(metrics: Path) -> tuple[dict[str, dict], float | None]:
    """The last metrics row of each split, and the peak learning rate logged."""
    out: dict[str, dict] = {}
    peak_lr = None
    for line in metrics.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out[row.get("split", "train")] = row
            if "lr" in row:
                peak_lr = max(peak_lr or 0.0, row["lr"])
    return out, peak_lr


#: (train_config key, label, value meaning "off"), in the order the levers column lists them
LEVERS = (("hidden_noise", "noise", 0), ("weight_decay", "wd", 0), ("feature_loss_weight", "feature loss", 0),
          ("midlayer_feature_loss_weight", "midlayer feature loss", 0), ("distill_temperature", "temperature", 1.0),
          ("dropout", "dropout", 0), ("ema_decay", "EMA", 0), ("freeze", "freeze", []), ("loss_decay", "loss decay", 0.8))


def levers(train_config: dict) -> str:
    """The training options a variant changed from the defaults that matter here, in a few words."""
    bits = []
    if train_config.get("supervise") == "all":
        bits.append("supervise all")
    if train_config.get("init_layers_from_target"):
        bits.append("init layers")
    for key, label, off in LEVERS:
        v = train_config.get(key, off)
        if v is not None and v != off:
            bits.append(f"{label} {'+'.join(v) if isinstance(v, list) else format(v, 'g')}")
    if train_config.get("epochs"):
        bits.append(f"{train_config['epochs']:g} epochs")
    return ", ".join(bits) or "–"


def config_from_flags(flags: str) -> dict:
    """What `levers` reads, from a variant's flags (drafts trained before the metadata recorded train_config)."""
    cfg: dict = {}
    for tok in flags.split():
        key, _, val = tok.lstrip("-").partition("=")
        key = key.replace("-", "_")
        if key in ("supervise",):
            cfg[key] = val
        elif key in ("hidden_noise", "weight_decay"):
            cfg[key] = float(val)
        elif key == "init_layers_from_target":
            cfg[key] = True
    return cfg


def summarise(call_dir: Path, tmp: Path, flags: dict[str, str] | None = None) -> dict:
    with tarfile.open(call_dir / "logs.tgz") as tar:
        tar.extractall(tmp, filter="data")
    runs = next(tmp.rglob("runs/sweep"), None) or next(p for p in tmp.rglob("*") if (p / "vocab").is_dir())
    logs = next(tmp.rglob("sweep-logs"))
    rows = []
    for meta in sorted(runs.glob("*/best/eagle3_draft.json")):
        name = meta.parent.parent.name
        if name == "warmup":
            continue
        m = json.loads(meta.read_text())
        splits, peak_lr = last_by_split(runs / name / "logs" / "metrics.jsonl")
        best = m["metrics"]
        tcfg = m.get("train_config") or config_from_flags((flags or {}).get(name, ""))
        protocol_only = "captured-protocol" in str(m.get("captured", ""))
        rows.append({
            "variant": name, "aux_layer_ids": m["aux_layer_ids"], "ttt_steps": m["ttt_steps"],
            "intermediate_size": m["draft_config"]["intermediate_size"],
            "num_hidden_layers": m["draft_config"].get("num_hidden_layers") or 1, "peak_lr": peak_lr,
            "best_step": m["step"],
            "last_step": splits.get("train", {}).get("step"),
            "tau_estimate_val": best.get("tau_estimate"),
            "accepted_per_position_val": [best.get(f"accepted_{j}") for j in range(3)],
            "rounds_val": best.get("num_rounds"),
            "tau_estimate_heldout_last": splits.get("heldout", {}).get("tau_estimate"),
            "acc0_train_last": splits.get("train", {}).get("acc_0"),
            "acc0_heldout_last": splits.get("heldout", {}).get("acc_0"),
            "acc0_val_last": splits.get("val", {}).get("acc_0"),
            "levers": levers(tcfg), "training_set": "protocol" if protocol_only else "full",
            "train_config": m.get("train_config"), "draft_config": m["draft_config"],
        })
    rows.sort(key=lambda r: -(r["tau_estimate_val"] or 0))
    times = (call_dir / "times.txt").read_text().splitlines() if (call_dir / "times.txt").exists() else []
    gpu = (logs / "gpu.txt").read_text().strip() if (logs / "gpu.txt").exists() else None
    def counts(name: str) -> dict | None:
        found = next(runs.glob(f"{name}/manifest.json"), None)
        m = json.loads(found.read_text()) if found else {}
        return {k: m.get(k) for k in ("num_samples", "num_tokens", "num_supervised_tokens")} if m else None

    return {"gpu": gpu, "times": times, "variants": rows, "data": counts("prepared"),
            "data_protocol": counts("prepared-protocol")}


def markdown(res: dict) -> str:
    L = [f"# {res['name']}: refbench draft variants ranked by the replayed τ estimate", "",
         f"{res['date']} · `{res['command']}`", "", f"GPU: {' / '.join(res['gpu'].splitlines()) if res['gpu'] else '?'}", "",
         f"Training data (full): {res['data']}"
         + (f"; protocol (the first 7,473 conversations alone): {res['data_protocol']}" if res.get("data_protocol") else "")
         + ". τ estimate = `eagle3 estimate`'s replay of vLLM's drafting rounds at k = 3 "
         "(tracks vLLM within 0.02, benchmarks/results/refbench_estimator.md) on the 300 perturbed validation prompts "
         "(val) and on the 2 % held-out GSM8K-train split (heldout).", "",
         "| variant | training convs | levers | aux ids | K | layers | inter | peak lr | best step | τ est (val) "
         "| accepted/pos (val) | τ est (heldout) | acc₀ train / heldout / val |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["variants"]:
        acc = " / ".join(f"{r[k]:.3f}" if r[k] is not None else "–" for k in ("acc0_train_last", "acc0_heldout_last",
                                                                             "acc0_val_last"))
        lr = f"{r['peak_lr']:.0e}" if r.get("peak_lr") else "–"
        n = (res.get("data_protocol") if r.get("training_set") == "protocol" else res["data"])["num_samples"]
        convs = f"{n:,}" + (" (the protocol's)" if n == 7473 else "")
        L.append(f"| {r['variant']} | {convs} | {r.get('levers', '–')} | {tuple(r['aux_layer_ids'])} | {r['ttt_steps']} | {r.get('num_hidden_layers', 1)} | "
                 f"{r['intermediate_size']} | {lr} | "
                 f"{r['best_step']}/{r['last_step']} | **{r['tau_estimate_val']:.3f}** | "
                 f"{' / '.join(str(int(a)) for a in r['accepted_per_position_val'] if a is not None)} of "
                 f"{int(r['rounds_val'] or 0)} | {r['tau_estimate_heldout_last'] or 0:.3f} | {acc} |")
    if res.get("vllm"):
        L += ["", "Measured in vLLM (protocol evaluation, this 2-core CPU):", ""]
        L += [f"- {k}: τ {v['tau']:.3f} ({v['accepted_per_position']})" for k, v in res["vllm"].items()]
    if res["times"]:
        L += ["", "Stage times (s since the call's start): " + "; ".join(t for t in res["times"] if "heartbeat" not in t)]
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call-dir", type=Path, required=True, help="the device call's files (logs.tgz, times.txt, ...)")
    ap.add_argument("--name", default="refbench_sweep")
    ap.add_argument("--command", required=True, help="the command the call ran (recorded)")
    ap.add_argument("--date", required=True, help="when the call ran (UTC)")
    ap.add_argument("--gpus-per-draft", type=int, default=1, help="GPUs each variant trained on (DDP=1: all of them)")
    ap.add_argument("--vllm", nargs="*", default=[], metavar="VARIANT=DIR",
                    help="`eagle3 evaluate` output dirs (results.json) of drafts from this call, to add")
    ap.add_argument("--variant", action="append", default=[], metavar="VARIANT=FLAGS",
                    help="a variant's flags, for drafts whose metadata predates train_config (levers column)")
    a = ap.parse_args()
    flags = dict(v.split("=", 1) for v in a.variant)
    with tempfile.TemporaryDirectory() as tmp:
        res = {"name": a.name, "date": a.date, "command": a.command, "gpus_per_draft": a.gpus_per_draft,
               **summarise(a.call_dir, Path(tmp), flags)}
    vllm = {}
    for spec in a.vllm:
        name, d = spec.split("=", 1)
        m = json.loads((Path(d) / "results.json").read_text())
        vllm[name] = {"tau": m["acceptance_length"], "accepted_per_position": m.get("accepted_per_position"),
                      "num_drafts": m.get("num_drafts"), "eval_dir": d,
                      "results": {k: m[k] for k in VLLM_KEYS if k in m}}
    res["vllm"] = vllm
    write_text(RESULTS / f"{a.name}.json", json.dumps(res, indent=1) + "\n")
    write_text(RESULTS / f"{a.name}.md", markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
