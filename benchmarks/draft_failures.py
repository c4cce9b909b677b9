"""Where a draft's first guess (TTT step 0) disagrees with the target, on captured held-out prompts.

For every supervised row: the draft's top-5 at step 0 against the target's argmax for that position,
bucketed by the target's own top-1 probability (how close to a tie the target is) and by the kind of
token the target wants (digit, word, punctuation/operator), plus the most frequent (wanted, guessed)
pairs. Step 0 is what the engine's first draft position accepts, and τ is bounded by it.

    python benchmarks/draft_failures.py --draft DIR --captured DIR --target DIR [--name NAME]

Writes benchmarks/results/<name>.{json,md} when --name is given.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3.artifacts import CaptureManifest
from eagle3.model.draft import text_config
from eagle3.train.attention import make_ttt_attention
from eagle3.train.data import SelectedLayers, eval_batches, load_samples
from eagle3.train.estimate import load_draft_dir
from eagle3.train.loss import TargetHead, compute_targets
from eagle3.weights import load_target_tensors, read_target_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS,
    command_line,
    describe_machine,
    machine_line,
    utc_now,
    write_result,
)

BUCKETS = [(0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.01)]


def token_kind(text: str) -> str:
    if text.strip().isdigit():
        return "digit"
    return "word" if any(c.isalpha() for c in text) else "punct/op"


@torch.no_grad()
def analyse(draft: str, captured: str, target: str, top_pairs: int = 20) -> dict:
    from transformers import AutoTokenizer

    model, meta = load_draft_dir(draft, target)
    model.eval()
    tc = text_config(read_target_config(target))
    tensors = load_target_tensors(target)
    captured_ids = CaptureManifest.load_combined(captured).aux_layer_ids
    samples = SelectedLayers(
        load_samples(captured), captured_ids, meta.aux_layer_ids, tc["num_hidden_layers"]
    )
    head = TargetHead(
        tensors["norm"],
        tc.get("rms_norm_eps", 1e-6),
        tensors["lm_head"],
        torch.arange(model.cfg.draft_vocab_size) + model.d2t,
    )
    tok = AutoTokenizer.from_pretrained(target)
    n, topk = 0, [0] * 5
    buckets = {b: [0, 0] for b in BUCKETS}
    kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    pairs: collections.Counter = collections.Counter()
    for b in eval_batches(samples, list(range(len(samples))), 2048, 4):
        b = b.to("cpu", torch.float32)
        ids, doc = b.input_ids, b.doc_ids
        T = ids.shape[1]
        tg = compute_targets(head, b.last_hidden, 4)  # logits (B, T+4, Vd), argmax (B, T+4)
        ids_p = F.pad(ids, (0, 4))  # (B, T+4)
        doc_p = F.pad(doc, (0, 4), value=-2)  # (B, T+4)
        mask_p = F.pad(b.loss_mask.bool(), (0, 4))  # (B, T+4)
        out, _ = model.step(
            ids_p[:, 1 : 1 + T],
            model.combine(b.aux),
            b.positions,
            model.new_cache(),
            make_ttt_attention("auto", doc, 1),
        )  # (B, T, H)
        guess = model.lm_head(out).topk(5, -1).indices  # (B, T, 5) draft ids
        guess = guess + model.d2t[guess]  # (B, T, 5) target ids
        want = tg.argmax[:, 1 : 1 + T]  # (B, T) target argmax for the row's next-next token
        valid = (
            (doc_p[:, 1 : 1 + T] == doc)
            & (doc_p[:, 2 : 2 + T] == doc)
            & (doc >= 0)
            & mask_p[:, 2 : 2 + T]
        )  # (B, T)
        p1 = (
            tg.logits[:, 1 : 1 + T].float().softmax(-1).max(-1).values
        )  # (B, T) target's own top-1 probability
        hit = guess[..., 0] == want  # (B, T)
        n += int(valid.sum())
        for k in range(5):
            topk[k] += int(((guess[..., : k + 1] == want[..., None]).any(-1) & valid).sum())
        for lo, hi in BUCKETS:
            m = valid & (p1 >= lo) & (p1 < hi)
            buckets[(lo, hi)][0] += int(m.sum())
            buckets[(lo, hi)][1] += int((m & hit).sum())
        for bi, ti in valid.nonzero().tolist():
            w = tok.decode([int(want[bi, ti])])
            kinds[token_kind(w)][0] += 1
            kinds[token_kind(w)][1] += int(hit[bi, ti])
            if not hit[bi, ti]:
                pairs[(w, tok.decode([int(guess[bi, ti, 0])]))] += 1
    return {
        "draft": draft,
        "captured": captured,
        "num_rows": n,
        "top_k_agreement": [round(t / n, 4) for t in topk],
        "by_target_top1_prob": [
            {
                "range": list(b),
                "share": round(v[0] / n, 4),
                "agreement": round(v[1] / max(v[0], 1), 4),
            }
            for b, v in buckets.items()
        ],
        "by_token_kind": {
            k: {"share": round(v[0] / n, 4), "agreement": round(v[1] / max(v[0], 1), 4)}
            for k, v in kinds.items()
        },
        "top_misses": [
            {"wanted": w, "guessed": g, "count": c} for (w, g), c in pairs.most_common(top_pairs)
        ],
    }


def markdown(res: dict) -> str:
    L = [
        f"# {res['name']}: where the draft's first guess misses",
        "",
        f"`{res['command']}`"
        + (f" ({res['date']}; {machine_line(res['machine'])})" if "date" in res else ""),
        "",
        f"{res['num_rows']:,} supervised rows; step-0 top-1..5 agreement with the target's argmax: "
        f"{' / '.join(f'{a:.3f}' for a in res['top_k_agreement'])}",
        "",
        "| target's own top-1 probability | share of rows | draft top-1 agreement |",
        "|---|---|---|",
    ]
    L += [
        f"| {b['range'][0]:.1f}–{min(b['range'][1], 1.0):.1f} | {b['share']:.3f} | "
        f"{b['agreement']:.3f} |"
        for b in res["by_target_top1_prob"]
    ]
    L += ["", "| wanted token | share | agreement |", "|---|---|---|"]
    L += [
        f"| {k} | {v['share']:.3f} | {v['agreement']:.3f} |"
        for k, v in res["by_token_kind"].items()
    ]
    L += [
        "",
        "Most frequent misses (wanted → guessed): "
        + ", ".join(
            f"{m['wanted']!r}→{m['guessed']!r} {m['count']}" for m in res["top_misses"][:12]
        ),
    ]
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True, help="exported draft dir or a training best/ dir")
    ap.add_argument(
        "--captured", required=True, help="capture dir(s) of held-out prompts, comma-separated"
    )
    ap.add_argument("--target", required=True)
    ap.add_argument("--name", help="write benchmarks/results/<name>.{json,md}")
    a = ap.parse_args()
    res = analyse(a.draft, a.captured, a.target)
    if a.name:
        res = {
            "name": a.name,
            "date": utc_now(),
            "machine": describe_machine(),
            "command": command_line(__file__),
            **res,
        }
        write_result(RESULTS / a.name, res, markdown(res))
        print(markdown(res))
    else:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
