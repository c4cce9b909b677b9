"""benchmarks/realbench/sources.py join-synth: synthesize shards made side by side become one prompt
set."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = REPO / "benchmarks" / "realbench" / "sources.py"


def _shard(d: Path, prompts: list[tuple[str, str]], generated: int, truncated: int) -> Path:
    d.mkdir(parents=True)
    rows = [
        {"id": f"synth-{cat}-{i}", "messages": [{"role": "user", "content": text}], "category": cat}
        for i, (text, cat) in enumerate(prompts)
    ]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "manifest.json").write_text(
        json.dumps(
            {
                "counts": {
                    "generated": generated,
                    "generated_tokens": 10 * generated,
                    "surplus": 1,
                    "dropped": {"truncated": truncated},
                }
            }
        )
    )
    return d


def _join(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(SOURCES), "join-synth", *args], capture_output=True, text=True, env=env
    )


def test_join_synth_drops_cross_shard_duplicates_and_makes_ids_unique(tmp_path: Path) -> None:
    poem = (
        "Write a short poem about the sea, its waves and the gulls that circle over the harbour at "
        "dawn."
    )
    a = _shard(
        tmp_path / "a",
        [(poem, "writing"), ("Explain recursion in Python with a small example.", "coding")],
        generated=5,
        truncated=1,
    )
    b = _shard(
        tmp_path / "b",
        [
            (poem.upper(), "writing"),  # the same text once normalised
            (poem.replace("dawn", "dusk"), "writing"),  # a near-duplicate (5-gram Jaccard > 0.7)
            ("What makes the sky blue during the day but red at sunset?", "stem"),
        ],
        generated=7,
        truncated=2,
    )
    r = _join("--shards", f"{a},{b}", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "prompts.jsonl").read_text().splitlines()
    ]
    assert [row["category"] for row in rows] == ["writing", "coding", "stem"]
    assert len({row["id"] for row in rows}) == 3 and rows[2]["id"] == "synth-s1-stem-0"
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (
        m["counts"]["kept"] == 3 and m["counts"]["generated"] == 12 and m["counts"]["surplus"] == 2
    )
    assert m["counts"]["dropped"] == {
        "truncated": 3,
        "cross_shard_duplicate": 1,
        "cross_shard_near_duplicate": 1,
    }
    assert m["per_domain"] == {"coding": 1, "stem": 1, "writing": 1}


def test_join_synth_names_a_missing_shard(tmp_path: Path) -> None:
    a = _shard(
        tmp_path / "a", [("Explain recursion in Python with a small example.", "coding")], 1, 0
    )
    r = _join("--shards", f"{a},{tmp_path / 'gone'}", "--out", str(tmp_path / "out"))
    assert r.returncode != 0 and "gone/manifest.json is missing" in r.stderr
    assert not (tmp_path / "out" / "prompts.jsonl").exists()


def test_join_synth_refuses_no_shards(tmp_path: Path) -> None:
    r = _join("--shards", "", "--out", str(tmp_path / "out"))
    assert r.returncode != 0 and "names no directory" in r.stderr


def test_eval_drops_every_category_prompt_the_target_also_wrote_for_training(
    tmp_path: Path,
) -> None:
    data = tmp_path / "refbench"
    data.mkdir()
    puzzle = (
        "A snail is at the bottom of a 20-foot well. Each day it climbs 3 feet and slips back 2 "
        "feet at night."
    )
    (data / "gsm8k_eval200.jsonl").write_text(
        json.dumps({"question": puzzle})
        + "\n"
        + json.dumps({"question": "What is 12 times 13?"})
        + "\n"
    )
    turns = [
        "What is your name?",
        "Tell me about the history of tea in England.",
        "How do rockets work in space?",
        "Recommend three novels set in Paris.",
        "Why is the ocean salty?",
        "How do I fix a flat bike tyre?",
    ]
    (data / "sharegpt_sample.json").write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok"}]}
                for t in turns
            ]
        )
    )
    train = _shard(
        tmp_path / "train",
        [
            ("what is your name", "chat"),  # exact once normalised
            (puzzle.replace("3 feet", "three feet"), "math"),
        ],  # near-duplicate
        generated=2,
        truncated=0,
    )
    held = _shard(
        tmp_path / "held",
        [
            ("Write a haiku about autumn leaves falling in the rain.", "writing"),
            (puzzle, "reasoning"),
        ],
        generated=2,
        truncated=0,
    )
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [
            sys.executable,
            str(SOURCES),
            "eval",
            "--refbench-data",
            str(data),
            "--synth-eval",
            str(held / "prompts.jsonl"),
            "--synth-train",
            str(train / "prompts.jsonl"),
            "--out",
            str(tmp_path / "eval.jsonl"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    texts = [row["prompt"] for row in rows]
    assert puzzle not in texts and "What is your name?" not in texts
    assert (
        "What is 12 times 13?" in texts
        and "Write a haiku about autumn leaves falling in the rain." in texts
    )
    m = json.loads((tmp_path / "eval.manifest.json").read_text())
    # the puzzle is dropped twice (GSM8K test and the held-out synthesis); "What is your name?" (its
    # hash bit is 1, so it is a held-out chat prompt) once; "Why is the ocean salty?" (bit 0) is a
    # training chat, never held out
    assert m["dropped"] == {
        "near_duplicate_of_training_synthesis": 2,
        "also_in_training_synthesis": 1,
    }
    assert m["per_category"] == {"math": 1, "chat": 4, "writing": 1}
    assert m["num_prompts"] == len(rows)
