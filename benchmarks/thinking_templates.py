"""Thinking targets' published chat templates: what training on the generated ids, one row per turn
where the template needs it, costs and gains, per template and thinking switch.

For each published template (Kimi-K2-Thinking, Qwen3, DeepSeek-R1-distill, DeepSeek-V3.1,
GLM-4.6, MiniMax-M2, Seed-OSS; thinking on, and off where it has a switch) on its tiny thinking
target
(eagle3.testing.tiny.build_tiny_thinking_target + make_thinking_emitter): `--num-chats` chats of
two and three user turns are regenerated with the hf backend (transformers, no vLLM), prepared, and
measured:

- turns regenerated; training rows per conversation (1.0: every turn's prompt extends the row
  before it, the prefix-stable fast path; more: one row per turn); prompt (context) tokens per
  supervised token (what per-turn rows cost in capture and training); the reasoning share of the
  supervised tokens (think markers included); the share of turns cut at `--max-new-tokens`;
  prepare's wall time; whether the trained ids are exactly the generated ids (they must be);
- the same chats as text only (`reasoning_content` + content, no ids, as a user's own dataset holds
  them), supervised as the template renders each turn: identical ids, other ids (a template that
  writes whitespace of its own around the reasoning, which these targets do not), or refused (the
  error's first line, and how many turns `prepare.misaligned_turns: drop` would keep), and how
  many turns' reasoning the template gave nothing to check against;
- before / after: the generated reasoning tokens (the trace between the think markers) that a
  single rendering of each whole conversation holds (`apply_chat_template(messages,
  tokenize=True)` with `reasoning_content` on the assistant turns: what rendering each
  conversation once could supervise at most), against those trained now (all of them). A turn's
  trace counts when it occurs in the rendering as one contiguous run of the generated ids.

    .venv/bin/python benchmarks/thinking_templates.py --num-chats 48 --max-new-tokens 96

writes benchmarks/results/thinking_templates.{json,md} (date, machine, command inside). The
tiny targets are random models steered to write `<think>` reasoning `</think>` answer turns, so
the figures are about the templates' rendering rules and the pipeline, not about a real model's
lengths. The template files are read from `--templates-dir` (default: the published templates
stored as test data, tests/fixtures/chat_templates, named as tests/thinking_templates.py maps
them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, code_commit, command_line, describe_machine, utc_now, write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = RESULTS / "thinking_templates"
#: families whose reasoning markers are several tokens: make_thinking_emitter writes one per state
NO_EMITTER = ("kimi-k3", "deepseek-r1-split-think")


def template_files() -> tuple[Path, dict[str, str]]:
    """(the stored templates' directory, family -> file name), from tests/thinking_templates.py
    (loaded by path: the mapping lives with the fixtures, not in the library)."""
    path = REPO / "tests" / "thinking_templates.py"
    spec = importlib.util.spec_from_file_location("thinking_templates_fixtures", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CHAT_TEMPLATES, dict(mod.TEMPLATE_FILES)


def cases(families: list[str]) -> list[tuple[str, bool]]:
    """(family, thinking) per family: on, and off where its template has a switch."""
    from eagle3.testing.tiny import thinking_family

    out = []
    for f in families:
        out.append((f, True))
        if thinking_family(f).thinking_kwarg:
            out.append((f, False))
    return out


def make_chats(num_chats: int, seed: int) -> list[dict[str, Any]]:
    """`num_chats` chats alternately of two and three user turns, each but the last followed by a
    placeholder answer (regenerate replaces every answer and answers the last user turn); a system
    prompt on every third."""
    from eagle3.testing.tiny import synthetic_corpus

    rng = random.Random(seed)
    lines = synthetic_corpus(num_lines=8 * num_chats + 8, seed=seed + 1)
    chats = []
    for i in range(num_chats):
        messages: list[dict[str, str]] = []
        if i % 3 == 2:
            messages.append({"role": "system", "content": "You are a helpful assistant."})
        for turn in range(2 + i % 2):
            if turn:
                messages.append({"role": "assistant", "content": "a placeholder answer"})
            messages.append({"role": "user", "content": rng.choice(lines)})
        chats.append({"id": f"chat-{i}", "messages": messages})
    return chats


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def generated_ids(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    """chat id -> the ids of its assistant turns, in order, as the target generated them."""
    out: dict[str, list[int]] = {}
    for row in rows:
        for m in row["messages"]:
            if m["role"] == "assistant":
                out.setdefault(row["id"], []).extend(m["token_ids"])
    return out


def as_text_only(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The regenerated chats as a user's own dataset holds them: reasoning_content + content."""
    out = []
    for row in rows:
        messages = []
        for m in row["messages"]:
            m = {k: v for k, v in m.items() if k in ("role", "content", "reasoning")}
            if "reasoning" in m:
                m["reasoning_content"] = m.pop("reasoning")
            messages.append(m)
        out.append({**row, "messages": messages})
    return out


def think_blocks(renderer: Any, ids: list[int]) -> list[list[int]]:
    """The id runs between each `<think>` and the next `</think>` of a rendering."""
    blocks, opened = [], None
    for i, t in enumerate(ids):
        if t == renderer.think_start_id:
            opened = i + 1
        elif t == renderer.think_end_id and opened is not None:
            blocks.append(ids[opened:i])
            opened = None
    return blocks


def contains_run(haystack: list[int], needle: list[int]) -> bool:
    """`needle` occurs in `haystack` as a contiguous run."""
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def single_rendering_reasoning(renderer: Any, rows: list[dict[str, Any]]) -> dict[str, int]:
    """Before per-turn rows: each conversation rendered once, whole, with `reasoning_content` on
    its assistant turns; per generated turn with reasoning, whether its trace (the generated ids
    between the think markers) occurs whole inside one of the rendering's think blocks (taken in
    order, each block holding at most one turn's trace)."""
    tok = renderer.tokenizer
    markers = {renderer.think_start_id, renderer.think_end_id}
    counts: Counter[str] = Counter()
    for row in rows:
        messages = []
        for m in row["messages"]:
            t = {"role": m["role"], "content": m["content"]}
            if m.get("reasoning") is not None:
                t["reasoning_content"] = m["reasoning"]
            messages.append(t)
        kwargs = renderer.kwargs_for(row.get("chat_template_kwargs"))
        rendered = tok.apply_chat_template(messages, tokenize=True, **kwargs)
        if not isinstance(rendered, list):  # transformers 5: a BatchEncoding
            rendered = rendered["input_ids"]
        blocks = think_blocks(renderer, list(rendered))
        for m in row["messages"]:
            if m["role"] != "assistant":
                continue
            n = renderer.num_reasoning_ids(m["prompt_token_ids"], m["token_ids"])
            trace = [i for i in m["token_ids"][:n] if i not in markers]
            if not trace:
                continue
            counts["turns"] += 1
            counts["trace_tokens"] += len(trace)
            found = next((j for j, b in enumerate(blocks) if contains_run(b, trace)), None)
            if found is not None:
                counts["turns_rendered"] += 1
                counts["trace_tokens_rendered"] += len(trace)
                blocks = blocks[found + 1 :]
    return dict(counts)


def run_case(
    target: Path, family: str, thinking: bool, chats: Path, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Regenerate, prepare and measure one (template, thinking) case; see the module docstring."""
    from eagle3.chat_template import ChatRenderer, MisalignedTurnError
    from eagle3.config import PrepareConfig, RegenerateConfig
    from eagle3.data.prepare import run_prepare
    from eagle3.data.regenerate import run_regenerate
    from eagle3.prepared import supervised_ids_by_conversation
    from eagle3.testing.tiny import thinking_kwargs

    kwargs = thinking_kwargs(family, thinking)
    regen = run_regenerate(
        RegenerateConfig(
            target=str(target),
            data=str(chats),
            out=work / "regenerated",
            backend="hf",
            device="cpu",
            dtype="float32",
            max_new_tokens=args.max_new_tokens,
            max_model_len=args.max_model_len,
            batch_size=args.batch_size,
            temperature=args.temperature,
            seed=args.seed,
            chat_template_kwargs=kwargs,
        )
    )
    rows = read_jsonl(regen.conversations_path)

    def prepare(data: Path, out: Path, misaligned: str = "error") -> Any:
        return run_prepare(
            PrepareConfig(
                target=str(target),
                data=str(data),
                out=out,
                max_seq_len=args.max_model_len,
                chat_template_kwargs=kwargs,
                misaligned_turns=misaligned,
            )
        )

    prep = prepare(regen.conversations_path, work / "prepared")
    renderer = ChatRenderer(target, chat_template_kwargs=kwargs)

    def ends(m: dict[str, Any]) -> str | None:
        """How a generated turn ended: "cut" (at max_new_tokens), "in think" (the end-of-turn
        token inside the think block), else None."""
        if m["role"] != "assistant":
            return None
        if m["finish_reason"] == "length":
            return "cut"
        ids = m["token_ids"]
        n = renderer.num_reasoning_ids(m["prompt_token_ids"], ids)
        return "in think" if n == len(ids) and renderer.think_end_id not in ids else None

    num_conv = regen.num_written
    supervised = prep.num_supervised_tokens
    generated = generated_ids(rows)
    case: dict[str, Any] = {
        "template": family,
        "thinking": thinking,
        "chat_template_kwargs": kwargs,
        "conversations": num_conv,
        "turns_regenerated": regen.num_turns,
        "regenerate_s": regen.elapsed_s,
        "rows": prep.num_samples,
        "rows_per_conversation": round(prep.num_samples / num_conv, 3),
        "tokens": prep.num_tokens,
        "supervised_tokens": supervised,
        "context_tokens_per_supervised_token": round(
            (prep.num_tokens - supervised) / supervised, 3
        ),
        "reasoning_tokens": prep.turns.get("reasoning_tokens", 0),
        "reasoning_share_of_supervised": round(
            prep.turns.get("reasoning_tokens", 0) / supervised, 3
        ),
        "turns_cut_at_max_new_tokens": prep.turns.get("hit_max_new_tokens", 0),
        "cut_share": round(prep.turns.get("hit_max_new_tokens", 0) / regen.num_turns, 3),
        "rows_truncated_at_max_seq_len": prep.num_truncated,
        "prepare_s": prep.wall_s,
        "trained_equal_generated": supervised_ids_by_conversation(work / "prepared") == generated,
        "prepare_turns": prep.turns,
    }

    text = write_jsonl(work / "text-only.jsonl", as_text_only(rows))
    try:
        from_text = prepare(text, work / "prepared-text")
    except MisalignedTurnError as e:
        try:  # with `misaligned_turns: drop`, a conversation ends before its misaligned turn
            kept = prepare(text, work / "prepared-text-drop", misaligned="drop").turns
        except ValueError:  # no conversation kept a turn
            kept = {}
        case["text_only"] = {
            "outcome": "refused",
            "message": str(e).splitlines()[0].replace(str(text), text.name),
            "turns_kept_with_drop": kept.get("from_text", 0),
        }
    else:
        from_ids = supervised_ids_by_conversation(work / "prepared-text")
        differ = {cid for cid in generated if from_ids.get(cid) != generated[cid]}
        # what text cannot say: a turn cut at max_new_tokens is trained as if the target had
        # ended it; a turn that ended inside its think block, as if it had closed the block
        cut = {r["id"] for r in rows if any(ends(m) == "cut" for m in r["messages"])}
        unclosed = {r["id"] for r in rows if any(ends(m) == "in think" for m in r["messages"])}
        case["text_only"] = {
            "outcome": "identical ids" if not differ else "other ids",
            "conversations_other_ids": len(differ),
            "conversations_other_ids_with_a_cut_turn": len(differ & cut),
            "conversations_other_ids_with_a_turn_ended_in_think": len(differ & unclosed),
            "reasoning_unchecked": from_text.turns.get("reasoning_unchecked", 0),
            "turns_with_reasoning": from_text.turns.get("with_reasoning", 0),
        }

    before = single_rendering_reasoning(renderer, rows)
    total = before.get("trace_tokens", 0)
    case["reasoning_trace"] = {
        "turns_with_reasoning": before.get("turns", 0),
        "generated_tokens": total,
        "single_rendering_tokens": before.get("trace_tokens_rendered", 0),
        "single_rendering_turns": before.get("turns_rendered", 0),
        "trained_tokens": total if case["trained_equal_generated"] else None,
    }
    return case


def share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "–"


def render_md(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# Thinking templates: per-turn rows on the generated ids",
        "",
        f"- date: {result['date']} (code: commit {result['code_commit']})",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine']['cpu_count']} CPU cores, {result['machine']['platform']}; "
        f"load average at start {tuple(result['machine']['load_avg'])}, at end "
        f"{tuple(result['load_avg_at_end'])} (shared cores); wall time {result['wall_s']:.0f} s",
        f"- per case: {s['num_chats']} chats (two and three user turns, alternately) regenerated "
        f"by the template's tiny thinking target (hf backend, float32, temperature "
        f"{s['temperature']}, seed {s['seed']}, at most {s['max_new_tokens']} new tokens a turn), "
        "then prepared",
        "",
        "| template | thinking | turns | rows / conv | context tok / supervised tok "
        "| reasoning share | cut at max | prepare s | trained = generated | text only "
        "| reasoning unchecked | reasoning trace: single rendering → per-turn rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        t, r = c["text_only"], c["reasoning_trace"]
        if t["outcome"] == "refused":
            kept = t["turns_kept_with_drop"]
            text = f"refused; `drop` keeps {kept} of {c['turns_regenerated']} turns"
            unchecked = "–"
        else:
            text = t["outcome"]
            if t["conversations_other_ids"]:
                text = (
                    f"other ids in {t['conversations_other_ids']} of {c['conversations']} conv "
                    f"({t['conversations_other_ids_with_a_cut_turn']} with a turn cut at max, "
                    f"{t['conversations_other_ids_with_a_turn_ended_in_think']} with one that "
                    "ended inside its think block)"
                )
            unchecked = f"{t['reasoning_unchecked']} of {t['turns_with_reasoning']}"
        if r["generated_tokens"]:
            before = (
                f"{r['single_rendering_tokens']} of {r['generated_tokens']} "
                f"({share(r['single_rendering_tokens'], r['generated_tokens'])}) → "
                f"{r['trained_tokens']} ({share(r['trained_tokens'] or 0, r['generated_tokens'])})"
            )
        else:
            before = "no reasoning"
        lines.append(
            f"| {c['template']} | {'on' if c['thinking'] else 'off'} | {c['turns_regenerated']} "
            f"| {c['rows_per_conversation']:.2f} | {c['context_tokens_per_supervised_token']:.2f} "
            f"| {c['reasoning_share_of_supervised']:.0%} | {c['cut_share']:.0%} "
            f"| {c['prepare_s']:.2f} | {'yes' if c['trained_equal_generated'] else '**no**'} "
            f"| {text} | {unchecked} | {before} |"
        )
    refused = [c for c in result["cases"] if c["text_only"]["outcome"] == "refused"]
    if refused:
        lines += ["", "Text only, refused (the error's first line):", ""]
        for c in refused:
            state = "on" if c["thinking"] else "off"
            lines.append(f"- {c['template']}, thinking {state}: {c['text_only']['message']}")
    lines += [
        "",
        "rows / conv: training rows per conversation (1.00: the prefix-stable fast path). "
        "context tok / supervised tok: unsupervised prompt tokens per supervised token. "
        "reasoning share: supervised tokens inside the think block, markers included. "
        "reasoning trace: the generated tokens between the think markers that one rendering of "
        "the whole conversation holds (what the former single-rendering prepare could supervise "
        "at most) and those trained on per-turn rows. Tool: `benchmarks/thinking_templates.py`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    stored_dir, files = template_files()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-chats", type=int, default=48, help="chats per case (two, three turns)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="longest regenerated turn")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=1024,
        help="regenerate's prompt + answer limit, and prepare's max_seq_len",
    )
    ap.add_argument("--batch-size", type=int, default=16, help="regenerate's conversations a batch")
    ap.add_argument(
        "--temperature", type=float, default=1.0, help="regenerate's sampling temperature"
    )
    ap.add_argument("--seed", type=int, default=0, help="chats and sampling seed")
    emitted = [f for f in files if f not in NO_EMITTER]
    ap.add_argument(
        "--families",
        default=",".join(emitted),
        help=f"comma-separated templates to measure (default: {','.join(emitted)}; not "
        f"{','.join(NO_EMITTER)}, whose markers are several tokens, which the tiny thinking "
        "emitter cannot write)",
    )
    ap.add_argument(
        "--templates-dir",
        type=Path,
        default=stored_dir,
        help="directory holding the published template files (default: the stored test data)",
    )
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where targets, chats and prepared data go (default: a temporary directory, removed)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="output path without suffix: writes OUT.json and OUT.md",
    )
    args = ap.parse_args(argv)
    args.command = command_line(__file__, argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in files]
    if unknown:
        ap.error(f"--families: unknown {unknown}; use some of {','.join(files)}")
    if args.num_chats < 1:
        ap.error(f"--num-chats must be at least 1, got {args.num_chats}")
    missing = [str(args.templates_dir / files[f]) for f in families]
    missing = [p for p in missing if not Path(p).is_file()]
    if missing:
        ap.error(f"--templates-dir {args.templates_dir}: missing {', '.join(missing)}")

    if args.work_dir is None:
        with tempfile.TemporaryDirectory(prefix="thinking-templates-") as tmp:
            return measure(args, families, files, Path(tmp))
    return measure(args, families, files, args.work_dir)


def measure(
    args: argparse.Namespace, families: list[str], files: dict[str, str], work: Path
) -> int:
    from eagle3.testing.tiny import build_tiny_thinking_target, make_thinking_emitter

    t0, load_at_start = time.time(), describe_machine()
    chats = write_jsonl(work / "chats.jsonl", make_chats(args.num_chats, args.seed))
    targets: dict[str, Path] = {}
    results = []
    for family, thinking in cases(families):
        if family not in targets:
            built = build_tiny_thinking_target(
                work / "targets" / family, family, args.templates_dir / files[family]
            )
            targets[family] = make_thinking_emitter(built)
        name = f"{family}-{'on' if thinking else 'off'}"
        case_dir = work / "cases" / name
        if case_dir.exists():  # a rerun in the same --work-dir measures afresh
            import shutil

            shutil.rmtree(case_dir)
        case = run_case(targets[family], family, thinking, chats, case_dir, args)
        results.append(case)
        print(
            f"{name}: {case['turns_regenerated']} turns, {case['rows_per_conversation']:.2f} rows "
            f"/ conv, trained = generated: {case['trained_equal_generated']}, text only: "
            f"{case['text_only']['outcome']}",
            flush=True,
        )
    result = {
        "date": utc_now(),
        "command": args.command,
        "code_commit": code_commit(),
        "machine": load_at_start,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.time() - t0, 1),
        "settings": {
            "num_chats": args.num_chats,
            "max_new_tokens": args.max_new_tokens,
            "max_model_len": args.max_model_len,
            "batch_size": args.batch_size,
            "temperature": args.temperature,
            "seed": args.seed,
            "templates": {f: files[f] for f in families},
        },
        "cases": results,
    }
    write_result(Path(args.out), result, render_md(result))
    bad = [c for c in results if not c["trained_equal_generated"]]
    for c in bad:
        print(
            f"trained ids differ from the generated ids: {c['template']} thinking {c['thinking']}",
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
