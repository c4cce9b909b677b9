"""EAGLE-3.1 drafts (fc_norm, norm_output): options, export keys, and parity of OUR draft forward
with VLLM'S draft forward on the same weights and inputs (recorded inside a real vLLM engine), for
EAGLE-3 and EAGLE-3.1."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tests.vllm_layout import expected_export_shapes

from eagle3.config import ExportConfig, TrainConfig
from eagle3.export import run_export
from eagle3.model.draft import DraftConfig, Eagle3Draft


def _cfg(**kw) -> DraftConfig:
    return DraftConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        vocab_size=50,
        draft_vocab_size=50,
        target_hidden_size=32,
        num_aux=3,
        **kw,
    )


def _naive_attn(q, keys, values):
    k = torch.cat(keys, 2).repeat_interleave(q.shape[1] // keys[0].shape[1], 1)  # (B, nh, S, d)
    v = torch.cat(values, 2).repeat_interleave(q.shape[1] // keys[0].shape[1], 1)  # (B, nh, S, d)
    T, S = q.shape[2], k.shape[2]
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # query t sees keys up to S - T + t
    return (
        torch.softmax(
            (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -torch.inf), -1
        )
        @ v
    )


def test_fc_norm_adds_one_norm_per_aux_state_and_norm_output_adds_nothing():
    base = sum(p.numel() for p in Eagle3Draft(_cfg()).parameters())
    fc = sum(p.numel() for p in Eagle3Draft(_cfg(fc_norm=True)).parameters())
    out = sum(p.numel() for p in Eagle3Draft(_cfg(norm_output=True)).parameters())
    assert fc - base == 3 * 32 and out == base
    shapes = expected_export_shapes(_cfg(fc_norm=True))
    assert [k for k in shapes if k.startswith("fc_norm")] == [
        "fc_norm.0.weight",
        "fc_norm.1.weight",
        "fc_norm.2.weight",
    ]
    assert set(Eagle3Draft(_cfg(fc_norm=True)).export_state_dict()) == set(shapes)


def test_norm_output_feeds_the_normed_state_to_the_next_step():
    torch.manual_seed(0)
    a, b = Eagle3Draft(_cfg()), Eagle3Draft(_cfg(norm_output=True))
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        a.norm.weight.uniform_(0.5, 1.5)
        b.norm.weight.copy_(a.norm.weight)
    ids, hid, pos = torch.randint(0, 50, (1, 5)), torch.randn(1, 5, 32), torch.arange(5)[None]
    out_a, next_a = a.step(ids, hid, pos, a.new_cache(), _naive_attn)
    out_b, next_b = b.step(ids, hid, pos, b.new_cache(), _naive_attn)
    torch.testing.assert_close(out_a, out_b)  # the first step's lm_head input is the same ...
    torch.testing.assert_close(next_b, out_b)  # ... 3.1 passes it on, 3 passes the pre-norm state
    assert not torch.allclose(next_a, next_b, atol=1e-2)
    # and so the second TTT step differs
    assert not torch.allclose(
        a(ids, torch.randn(1, 5, 96), pos, _naive_attn, 2)[1],
        b(ids, torch.randn(1, 5, 96), pos, _naive_attn, 2)[1],
    )


def test_init_layers_from_target_with_fc_norm_refused():
    with pytest.raises(ValueError, match="fc_norm"):
        TrainConfig(
            draft={"init_layers_from_target": True, "num_hidden_layers": 2, "family": "eagle3.1"}
        )


def test_cli_flag_chooses_the_family():
    from eagle3.cli import build_parser, stage_config_from_args

    args = build_parser().parse_args(["train", "--draft-family", "eagle3.1"])
    assert stage_config_from_args("train", args).draft.family == "eagle3.1"


def _checkpoint(tiny_llama, root, family: str, num_layers: int = 1):
    """A draft checkpoint of `num_layers` layers with random weights (norm weights away from 1 so
    each norm matters), as run_train saves it."""
    from tests.synthetic_capture import write_vocab

    from eagle3.artifacts import CaptureManifest, DraftVocab
    from eagle3.train.checkpoint import draft_metadata, save_model_dir
    from eagle3.train.trainer import build_draft
    from eagle3.weights import load_target_tensors, read_target_config

    vocab = write_vocab(root / "vocab", 512, torch.arange(0, 512, 2))
    cfg = TrainConfig(
        target=str(tiny_llama),
        captured="none",
        vocab=str(vocab),
        out=root / "train",
        draft={"family": family, "num_hidden_layers": num_layers},
    )
    tcfg = read_target_config(tiny_llama)
    d2t, t2d = DraftVocab.load(vocab).torch_maps()
    torch.manual_seed(0)
    model = build_draft(cfg, tcfg, load_target_tensors(tiny_llama), d2t, t2d, num_aux=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm."):
                p.uniform_(0.5, 1.5)
    manifest = CaptureManifest(aux_layer_ids=[1, 2, 4], hidden_size=128)
    return save_model_dir(
        root / "train" / "final", model, draft_metadata(cfg, model.cfg, manifest, tcfg, step=1)
    )


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_writes_the_keys_vllm_reads(tiny_llama, tmp_path, fmt):
    ck = _checkpoint(tiny_llama, tmp_path, "eagle3.1")
    run_export(ExportConfig(checkpoint=str(ck), out=tmp_path / "draft", format=fmt))
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    w = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert w["fc_norm.2.weight"].shape == (128,)
    if (
        fmt == "speculators"
    ):  # vLLM's speculators reader passes both keys through to the llama_eagle3 config
        from vllm.transformers_utils.configs.speculators.algos import update_eagle3

        pre: dict = {}
        update_eagle3(config, pre)
        assert pre["fc_norm"] is True and pre["norm_output"] is True


def test_eagle3_export_has_no_eagle31_keys(tiny_llama, tmp_path):
    ck = _checkpoint(tiny_llama, tmp_path, "eagle3")
    run_export(ExportConfig(checkpoint=str(ck), out=tmp_path / "draft"))
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert "fc_norm" not in config and "norm_output" not in config


# ------------------------------------------------------------------------- parity with vLLM's draft


def _install_recorder(worker):
    """Runs inside the (in-process) vLLM worker: record every call of the draft's
    combine_hidden_states and forward (inputs and outputs), so the test can replay them through our
    draft."""
    model = worker.model_runner.drafter.model
    model._eagle3_record = record = []

    def forward_hook(mod, args, kwargs, out):
        record.append(
            (
                "forward",
                {
                    k: kwargs[k].detach().clone()
                    for k in ("input_ids", "positions", "hidden_states")
                },
                [o.detach().clone() for o in out],
            )
        )

    model.register_forward_hook(forward_hook, with_kwargs=True)
    combine = model.combine_hidden_states

    def recorded_combine(h):
        out = combine(h)
        record.append(("combine", h.detach().clone(), out.detach().clone()))
        return out

    model.combine_hidden_states = recorded_combine
    return type(model).__name__


def record_vllm_draft_calls(target: str, draft: str) -> list:
    """Runs in a fresh process of its own (eagle3.vllm_engine.run_in_subprocess): a real vLLM engine
    with the engine core in that process, so the draft module is reachable; greedy, 3 tokens;
    returns every recorded draft call. Not in the pytest worker: an engine there rewires kernels
    across everything the worker has imported (it failed once on llvmlite's `_lib_fn_wrapper`,
    imported by an earlier test) and disables torch.set_num_threads for the rest of the worker's
    session."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target,
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3},
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
        seed=0,
    )
    assert llm.collective_rpc(_install_recorder) == ["Eagle3LlamaForCausalLM"]
    llm.generate(
        ["Hello the world is"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    record = llm.collective_rpc(lambda w: w.model_runner.drafter.model._eagle3_record)[0]
    return _map_tensors(
        record, lambda t: t.numpy()
    )  # by value: a torch tensor would cross as a handle to this
    # process's shared memory, gone once it exits


def _map_tensors(x, fn):
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return fn(x) if hasattr(x, "shape") else x


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_our_draft_forward_equals_vllms(tiny_llama, tmp_path, variant):
    """The exported draft runs in a real vLLM engine (k = 3, float32); every draft call's inputs and
    outputs are recorded and replayed through our Eagle3Draft loaded from the same exported weights:
    combine (fc_norm + fc), the lm_head input and the state passed to the next step must match, and
    vLLM must feed that state to its next draft step. The other setting of norm_output / fc_norm
    must NOT match, so the check sees the semantics. The EAGLE-3 draft has two layers: the extra
    layer's wiring (residual, norms, its own KV cache per step) must equal vLLM's too."""
    pytest.importorskip("vllm")
    from eagle3.vllm_engine import run_in_subprocess

    on = variant == "eagle3.1"
    num_layers = 1 if on else 2
    ck = _checkpoint(tiny_llama, tmp_path, "eagle3.1" if on else "eagle3", num_layers)
    run_export(ExportConfig(checkpoint=str(ck), out=tmp_path / "draft"))
    record = _map_tensors(
        run_in_subprocess(record_vllm_draft_calls, str(tiny_llama), str(tmp_path / "draft")),
        torch.from_numpy,
    )

    meta = json.loads((ck / "eagle3_draft.json").read_text())
    exported = {
        k: v.float() for k, v in load_file(str(tmp_path / "draft" / "model.safetensors")).items()
    }
    from eagle3.weights import load_target_tensors

    def ours(**flags) -> Eagle3Draft:
        m = Eagle3Draft(DraftConfig.from_dict({**meta["draft_config"], **flags}))
        state = {k: v for k, v in exported.items() if k in m.state_dict()}
        state["embed_tokens.weight"] = load_target_tensors(tiny_llama)["embed"].float()
        m.load_state_dict(state, strict=False)
        m.d2t.copy_(exported["d2t"].long())
        return m.eval()

    model, flipped = ours(), ours(norm_output=not on)
    assert model.cfg.fc_norm == on and model.cfg.norm_output == on
    assert model.cfg.num_hidden_layers == num_layers
    assert ("layers.1.self_attn.q_proj.weight" in exported) == (num_layers == 2)
    kinds = [r[0] for r in record]
    assert kinds[:4] == ["combine", "forward", "forward", "forward"], (
        kinds
    )  # prefill + 2 single-token steps (k=3)
    _, aux, combined = record[0]
    with torch.no_grad():
        torch.testing.assert_close(model.combine(aux), combined, atol=1e-4, rtol=1e-4)
        if on:  # the same weights without fc_norm give another fc input
            plain = ours(fc_norm=False)
            plain.fc.weight.copy_(model.fc.weight)
            assert not torch.allclose(plain.combine(aux), combined, atol=1e-2)
        cache, flipped_cache, prev_next = model.new_cache(), flipped.new_cache(), None
        for _, inputs, (out_vllm, next_vllm) in record[1:4]:
            ids, pos, hidden = (
                inputs["input_ids"][None],
                inputs["positions"][None],
                inputs["hidden_states"][None],
            )
            if (
                prev_next is not None
            ):  # vLLM feeds the previous call's second output (at the sampled row)
                torch.testing.assert_close(hidden[0, -1], prev_next[-1], atol=0, rtol=0)
            out, nxt = model.step(ids, hidden, pos, cache, _naive_attn)
            torch.testing.assert_close(out[0], out_vllm, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(nxt[0], next_vllm, atol=1e-4, rtol=1e-4)
            _, nxt_flipped = flipped.step(ids, hidden, pos, flipped_cache, _naive_attn)
            assert not torch.allclose(nxt_flipped[0], next_vllm, atol=1e-2)
            prev_next = next_vllm


@pytest.mark.slow
def test_train_eagle31_learns_and_exports(tiny_llama, tmp_path):
    """run_train of family eagle3.1 (both switches): fc_norm weights are trained (moved off 1),
    the loss falls, the checkpoint's draft config carries the switches, and export writes
    them."""
    from tests.synthetic_capture import capture_samples, frequent_ids, write_vocab

    from eagle3.train import run_train

    samples, manifest = capture_samples(
        tiny_llama, num=12, aux_layer_ids=(1, 2, 4), min_len=16, max_len=32
    )
    vocab = write_vocab(tmp_path / "vocab", 512, frequent_ids(samples, 200, 512))
    cfg = TrainConfig(
        target=str(tiny_llama),
        captured="in-memory",
        vocab=str(vocab),
        out=tmp_path / "train",
        max_steps=16,
        optimizer={"lr": 5e-3},
        schedule={"warmup_steps": 2},
        loader={"max_seq_len": 64, "val_fraction": 0.0},
        loss={"ttt_steps": 2},
        checkpoint={"eval_every": 16, "save_every": 16, "log_every": 4},
        device="cpu",
        draft={"family": "eagle3.1"},
    )
    res = run_train(cfg, samples=samples, manifest=manifest)
    train = [
        json.loads(x)
        for x in (tmp_path / "train" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    train = [r for r in train if r["split"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.05
    assert res.metadata["draft_config"]["fc_norm"] and res.metadata["draft_config"]["norm_output"]
    w = load_file(str(res.final_dir / "model.safetensors"))
    assert not torch.equal(w["fc_norm.0.weight"], torch.ones(128))
    run_export(ExportConfig(checkpoint=str(tmp_path / "train"), out=tmp_path / "draft"))
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["norm_output"] is True
