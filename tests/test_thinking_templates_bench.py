"""benchmarks/thinking_templates.py at a tiny size: every published thinking template, thinking on
and off, regenerated (hf backend) and prepared; the trained ids are the generated ids, and the
figures follow each template's rules for a conversation's history."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CASES = [
    ("kimi-k2-thinking", True),
    ("qwen3", True),
    ("qwen3", False),
    ("deepseek-r1-distill", True),
    ("deepseek-v3.1", True),
    ("deepseek-v3.1", False),
    ("glm-4.6", True),
    ("glm-4.6", False),
    ("minimax-m2", True),
    ("seed-oss", True),
    ("seed-oss", False),
]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "thinking_templates_bench", REPO / "benchmarks" / "thinking_templates.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_template_on_two_chats(tmp_path):
    tool = _tool()
    out = tmp_path / "results" / "thinking_templates"
    argv = ["--num-chats", "2", "--max-new-tokens", "32", "--temperature", "0"]
    argv += ["--work-dir", str(tmp_path / "work"), "--out", str(out)]
    assert tool.main(argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    cases = {(c["template"], c["thinking"]): c for c in result["cases"]}
    assert list(cases) == CASES
    for (family, thinking), c in cases.items():
        assert c["trained_equal_generated"], (family, thinking)
        assert c["conversations"] == 2 and 0 < c["turns_regenerated"] <= 5
        assert c["rows_per_conversation"] >= 1.0 and c["context_tokens_per_supervised_token"] > 0
        trace = c["reasoning_trace"]
        if not thinking:
            assert c["reasoning_share_of_supervised"] == 0 and trace["generated_tokens"] == 0
            continue
        assert 0 < c["reasoning_share_of_supervised"] < 1
        assert trace["trained_tokens"] == trace["generated_tokens"] > 0
        if family in ("glm-4.6", "minimax-m2", "seed-oss"):  # rendered with its whitespace
            assert trace["single_rendering_tokens"] < trace["generated_tokens"]
        elif family == "qwen3":  # the last turn's reasoning only
            assert 0 < trace["single_rendering_turns"] <= c["conversations"]
            assert 0 < trace["single_rendering_tokens"] < trace["generated_tokens"]
        else:  # history as `<think></think>`, reasoning dropped, or never rendered
            assert trace["single_rendering_tokens"] == 0
    # one row per conversation where every turn's prompt extends the row before it, else per turn
    assert cases[("deepseek-v3.1", False)]["rows_per_conversation"] == 1.0
    assert cases[("kimi-k2-thinking", True)]["rows_per_conversation"] > 1.0
    # Qwen3 writes its reasoning between newlines of its own, trained as the template renders
    # them; this target's text has none
    assert cases[("qwen3", True)]["text_only"]["outcome"] == "other ids"
    assert cases[("qwen3", False)]["text_only"]["outcome"] == "identical ids"
    assert cases[("deepseek-r1-distill", True)]["text_only"]["reasoning_unchecked"] > 0

    md = out.with_suffix(".md").read_text()
    assert "- command: `" in md and "- machine: " in md and "- date: " in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(CASES) and "| kimi-k2-thinking | on |" in table[1]


def test_an_unknown_template_is_refused(capsys):
    with pytest.raises(SystemExit):
        _tool().main(["--families", "qwen3,llama"])
    assert "--families: unknown ['llama']" in capsys.readouterr().err
