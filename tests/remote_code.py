"""A tiny target whose tokenizer is Python code shipped in its directory (tokenizer_config.json
`auto_map`), as Kimi-K2.5 ships a tiktoken tokenizer: what `trust_remote_code` is for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def remote_code_target(target: Path, tmp_path: Path) -> Path:
    """A copy of `target` whose tokenizer class is defined in the directory's own code."""
    out = tmp_path / "remote-tok"
    shutil.copytree(target, out)
    (out / "tokenization_tiny.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class TinyRemoteTokenizer(PreTrainedTokenizerFast):\n"
        "    remote_code_ran = True\n"
    )
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": [None, "tokenization_tiny.TinyRemoteTokenizer"]}
    tc["tokenizer_class"] = "TinyRemoteTokenizer"
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    return out
