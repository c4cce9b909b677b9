"""The published chat templates of thinking models under tests/fixtures/chat_templates (their
sources: SOURCES.md there), by the thinking family of eagle3.testing.tiny whose tiny target carries
each: `build_tiny_thinking_target(out, family, template_path(family))`."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"

#: family (eagle3.testing.tiny.THINKING_FAMILIES) -> its template's file under CHAT_TEMPLATES
TEMPLATE_FILES = {
    "kimi-k2-thinking": "moonshotai-Kimi-K2-Thinking.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "deepseek-r1-distill": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "deepseek-v3.1": "deepseek-ai-DeepSeek-V3.1.jinja",
    "deepseek-r1-split-think": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "kimi-k3": "Kimi-K3.jinja",
    "glm-4.6": "GLM-4.6.jinja",
    "minimax-m2": "MiniMax-M2.jinja",
    "seed-oss": "ByteDance-Seed-OSS.jinja",
}


def template_path(family: str) -> Path:
    """The published chat template file of `family`."""
    if family not in TEMPLATE_FILES:
        raise KeyError(
            f"no chat template fixture for {family!r}: one of {', '.join(TEMPLATE_FILES)}"
        )
    return CHAT_TEMPLATES / TEMPLATE_FILES[family]
