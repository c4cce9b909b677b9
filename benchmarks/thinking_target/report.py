"""A run's results, here: the thinking target's pipeline, serving and the golden check.

    .venv/bin/python benchmarks/thinking_target/report.py --files DIR [DIR ...] \
        [--machine "NVIDIA H200"] [--command "..."] [--out benchmarks/results] \
        [--thinking-name thinking_target] [--serving-name vllm_gpu_serving]

Each DIR holds the out.tar.xz.partNN pieces one GPU run's `host.sh collect` brought back (or that
run's out/ folder itself, as a run on this CPU leaves it): the thinking target's (out/build: the
build's build.json, check.json; out/results: the pipeline's stage results, evaluations, serving,
timings) and the golden check's (out/golden). Writes, each as JSON + a short markdown table with
date, machine and command:

- `{thinking-name}.{json,md}`: the target's build and check, the pipeline's figures (turns,
  reasoning share, capture throughput through vLLM and through transformers), and tokens per
  target step on the reasoning span and the answer span per draft, n-gram and temperature, with
  the goals (draft >= 2x n-gram on reasoning; >= the peer on both spans);
- `{serving-name}.{json,md}`: benchmarks/vllm_gpu/serving.py's record;
- `vllm_gpu_golden.{json,md}`: the golden capture check per runner, dtype and target.
Parts that did not come back are said, not invented.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: recipe.sh's draft names: reasoning kept, answers only, the peer
DRAFTS = ("thinking", "answers", "peer")


def unpack(dirs: list[Path], work: Path) -> dict[str, Path | None]:
    """The runs' out/ folders (their collected pieces joined and unpacked under `work`): where
    results/, build/ and golden/ are, None for those that did not come back."""
    outs = []
    for i, d in enumerate(dirs):
        parts = sorted(d.glob("out.tar.xz.part*"))
        if parts:
            joined = work / f"run{i}.tar.xz"
            joined.write_bytes(b"".join(p.read_bytes() for p in parts))
            with tarfile.open(joined) as tar:
                tar.extractall(work / f"run{i}", filter="data")
            outs.append(work / f"run{i}" / "out")
        else:
            outs.append(d)
    return {
        name: next((o / name for o in outs if (o / name).is_dir()), None)
        for name in ("results", "build", "golden")
    }


def read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def span_table(results: Path) -> list[dict[str, Any]]:
    """Tokens per target step per (temperature, span, category), one column per method."""
    rows: dict[tuple, dict[str, Any]] = {}
    for draft in DRAFTS:
        res = read(results / f"eval_{draft}.results.json")
        if not res:
            continue
        for r in res.get("span_rows") or []:
            method = draft if r["method"] != "ngram" else "ngram"
            key = (r["temperature"], r["span"], r["category"])
            row = rows.setdefault(key, {"temperature": key[0], "span": key[1], "category": key[2]})
            row[method] = r["tokens_per_step"]
            row[f"{method}_tokens"] = r["generated_tokens"]
    return [rows[k] for k in sorted(rows)]


def goals(table: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in table:
        if r["category"] != "all" or "thinking" not in r:
            continue
        t, span, ours = r["temperature"], r["span"], r["thinking"]
        if span == "reasoning" and r.get("ngram"):
            ratio = ours / r["ngram"]
            out.append(
                f"T {t}, reasoning: draft {ours:.2f} vs n-gram {r['ngram']:.2f} = {ratio:.2f}x "
                f"({'meets' if ratio >= 2 else 'short of'} the 2x goal)"
            )
        if r.get("peer"):
            out.append(
                f"T {t}, {span}: draft {ours:.2f} vs the peer {r['peer']:.2f} "
                f"({'meets' if ours >= r['peer'] else 'short of'} the >= peer goal)"
            )
    return out


def pipeline_figures(results: Path) -> dict[str, Any]:
    regen = read(results / "regenerate.json") or {}
    counts = (regen.get("manifest") or {}).get("counts") or {}
    cap, cap_hf = read(results / "cap.json") or {}, read(results / "cap_hf.json") or {}
    timings = (results / "timings.txt").read_text() if (results / "timings.txt").is_file() else ""
    return {
        "regenerate": {
            k: counts.get(k)
            for k in (
                "written_conversations",
                "regenerated_turns",
                "generated_tokens",
                "turns_with_reasoning",
                "reasoning_tokens",
                "answer_tokens",
            )
        }
        | {"finish_reasons": regen.get("finish_reasons"), "elapsed_s": regen.get("elapsed_s")},
        "prepare": read(results / "prepare.json"),
        "prepare_answers_only": read(results / "prepare_answers.json"),
        "capture_throughput": {
            name: {k: c.get(k) for k in ("num_tokens", "wall_s", "tokens_per_s")}
            for name, c in (("vllm", cap), ("hf", cap_hf))
            if c
        },
        "timings": timings.splitlines(),
    }


def thinking_markdown(record: dict[str, Any]) -> str:
    lines = [
        f"# The thinking target on {record['machine']} ({record['date']})",
        "",
        f"- machine: {record['machine']}; command: {record['command']}",
        "- target: SmolLM2-135M-Instruct + LoRA in Qwen3's thinking format "
        "(benchmarks/thinking_target), thinking on",
    ]
    check = (record.get("check") or {}).get("per_set") or {}
    if check:
        lines += ["", "Held-out check of the target (greedy):", ""]
        lines += ["| set | prompts | open `<think>` | close it | answer | end the turn | agrees |"]
        lines += ["|---|---:|---:|---:|---:|---:|---:|"]
        for name, c in {**check, "all": record["check"].get("total", {})}.items():
            lines.append(
                f"| {name} | {c.get('prompts')} | {c.get('opens')} | {c.get('closes')} | "
                f"{c.get('answers')} | {c.get('ends')} | {c.get('correct')} |"
            )
    pipe = record["pipeline"]
    regen, prep = pipe["regenerate"], pipe["prepare"] or {}
    prep_a = pipe["prepare_answers_only"] or {}
    if regen.get("regenerated_turns"):
        lines += [
            "",
            f"Pipeline data: the target regenerated {regen['written_conversations']} training "
            f"conversations ({regen['regenerated_turns']} turns, finish reasons "
            f"{regen['finish_reasons']}; {regen['reasoning_tokens']} reasoning and "
            f"{regen['answer_tokens']} answer tokens); prepared with the reasoning kept "
            f"{prep.get('num_rows')} rows, {prep.get('num_tokens')} tokens, "
            f"{prep.get('num_supervised_tokens')} supervised; answers only "
            f"{prep_a.get('num_rows')} rows, {prep_a.get('num_tokens')} tokens, "
            f"{prep_a.get('num_supervised_tokens')} supervised.",
        ]
    tp = pipe["capture_throughput"]
    if tp:
        lines += ["", "Capture throughput on the same machine and rows:", ""]
        lines += ["| backend | tokens | wall s | tokens/s |", "|---|---:|---:|---:|"]
        for name, c in tp.items():
            lines.append(f"| {name} | {c['num_tokens']} | {c['wall_s']} | {c['tokens_per_s']} |")
    lines += ["", "Tokens per target step (k = 3), held-out GSM8K test and MATH-500:", ""]
    lines += [
        "| T | span | category | draft (reasoning kept) | draft (answers only) | peer | n-gram |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in record["spans"]:
        cells = [r.get(m) for m in ("thinking", "answers", "peer", "ngram")]
        lines.append(
            f"| {r['temperature']} | {r['span']} | {r['category']} | "
            + " | ".join("–" if c is None else f"{c:.3f}" for c in cells)
            + " |"
        )
    if record["goals"]:
        lines += ["", "Goals:", ""] + [f"- {g}" for g in record["goals"]]
    if record["missing"]:
        lines += ["", "Not measured: " + "; ".join(record["missing"])]
    for note in record.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def golden_markdown(record: dict[str, Any]) -> str:
    lines = [
        f"# Golden capture on a GPU vLLM ({record['date']})",
        "",
        f"- machine: {record['machine']}; command: {record['command']}",
        "",
        "| runner | dtype | target | status | max rel. error | nearest neighbour's |",
        "|---|---|---|---|---:|---:|",
    ]
    for name, g in sorted(record["runs"].items()):
        _, runner, dtype = name.split("_")  # golden_v2_float32
        for t in g.get("targets", []):
            err, nb = t.get("max_rel_err"), t.get("min_neighbour_rel_err")
            status = t["status"]
            if "message" in t:  # the engine's one-line reason, without the log prefix
                status += ": " + t["message"].split("] ", 1)[-1].splitlines()[0][:160]
            lines.append(
                f"| {runner.upper()} | {dtype} | {t['target']} | {status} | "
                f"{'' if err is None else f'{err:.2e}'} | {'' if nb is None else f'{nb:.3f}'} |"
            )
    if record.get("touchpoints"):
        lines += ["", f"Touchpoints on the installed vLLM: {record['touchpoints'][-1].strip()}"]
    for finding in record.get("findings", []):
        lines += ["", finding]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=Path, nargs="+", required=True, help="the runs' pieces")
    ap.add_argument("--machine", default="NVIDIA H200", help="the card, or the CPU, it ran on")
    ap.add_argument("--thinking-name", default="thinking_target", help="file name, no suffix")
    ap.add_argument("--serving-name", default="vllm_gpu_serving", help="file name, no suffix")
    ap.add_argument("--command", default="benchmarks/thinking_target/README.md, 'On the H200'")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument(
        "--notes",
        type=Path,
        help="markdown paragraphs on the pipeline's run (findings), kept in its record",
    )
    ap.add_argument(
        "--golden-notes",
        type=Path,
        help="markdown paragraphs on the golden run (what failed and why), kept in its record",
    )
    args = ap.parse_args()
    date = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        found = unpack(args.files, Path(tmp))
        results = found["results"]
        if results:
            build = read(found["build"] / "build.json") if found["build"] else None
            check = read(found["build"] / "check.json") if found["build"] else None
            spans = span_table(results)
            missing = [
                f"{d} draft's evaluation"
                for d in DRAFTS
                if not (results / f"eval_{d}.results.json").is_file()
            ]
            record = {
                "date": date,
                "machine": args.machine,
                "command": args.command,
                "build": build,
                "check": check,
                "pipeline": pipeline_figures(results),
                "spans": spans,
                "goals": goals(spans),
                "missing": missing,
            }
            if args.notes:
                record["notes"] = args.notes.read_text().strip().split("\n\n")
            name = args.thinking_name
            (args.out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
            (args.out / f"{name}.md").write_text(thinking_markdown(record))
            serving = read(results / "serving.json")
            if serving:
                name = args.serving_name
                (args.out / f"{name}.json").write_text(json.dumps(serving, indent=1))
                (args.out / f"{name}.md").write_text((results / "serving.md").read_text())
        if found["golden"]:
            runs = {p.stem: read(p) for p in sorted(found["golden"].glob("*.json"))}
            record = {
                "date": date,
                "machine": args.machine,
                "command": args.command,
                "runs": {k: v for k, v in runs.items() if v},
            }
            touch = found["golden"] / "touchpoints.log"
            if touch.is_file():
                record["touchpoints"] = [
                    line for line in touch.read_text().splitlines() if "rows found" in line
                ]
            if args.golden_notes:
                record["findings"] = args.golden_notes.read_text().strip().split("\n\n")
            (args.out / "vllm_gpu_golden.json").write_text(json.dumps(record, indent=1) + "\n")
            (args.out / "vllm_gpu_golden.md").write_text(golden_markdown(record))
    print({k: bool(v) for k, v in found.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
