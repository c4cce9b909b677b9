"""`eagle3 refine`: on-policy refinement of a trained EAGLE-3 draft.

A draft trained on fixed target trajectories is served on rounds it drafts itself. Each round:

1. rollouts: the target continues `num_prompts` prompts of the TRAINING sources (the prepared
   data's prompts, eagle3.data.rollout; never eval prompts) at every temperature of
   `temperatures`, through the regenerate stage's generators (backend vllm, or hf: transformers
   generate). The continuation is the target's, so the text is exactly what serving emits. The
   capture stage (same backend, the checkpoint's captured aux ids) records the target's states.
2. replay: the draft's drafting rounds over the rollouts, k = num_speculative_tokens tokens each,
   replayed as the offline estimator replays vLLM (eagle3.train.onpolicy.find_rejected_blocks):
   every round's start row and first rejected position. A draft token is accepted when it is the
   rollout's next token. Greedy, that is the target's argmax; sampled, it is exact too: vLLM's
   rejection sampler, given EAGLE's greedy draft with one-hot draft probabilities, accepts a draft
   token iff it emits it.
3. training, from the current draft: the TTT loss at those rounds only (each round's steps up to
   and including its first rejected one; the next round starts at the rejected token, as in vLLM:
   `loss_rows: rounds`) or at every row (`loss_rows: all`) on 1 - supervised_share of the
   micro-batches; the others are supervised batches of the training capture (the plain TTT loss),
   so that nothing is forgotten. `steps_per_round` steps of the trainer's own loop at a lower lr.

A VALIDATION split of the same sources (`num_val_prompts` prompts held out of every round, rolled
out once) gives the per-position acceptance α (position j: accepted / reached) and τ before and
after each round, per temperature and pooled. best/ holds the round (0 = the input draft) with the
highest pooled τ, final/ the last round's.

Output (`out`), laid out as a training run, so `eagle3 export --checkpoint OUT` works unchanged (it
exports best/; its eagle3_draft.json records `refine`: the input checkpoint, the rounds, α):
    best/, final/          model.safetensors + eagle3_draft.json
    checkpoints/step-N/    the state at the end of each round (N: optimizer steps of all rounds)
    logs/metrics.jsonl     every round's `train` records (global steps), `refine_val` (α and τ per
                           round, round 0 = the input) and `refine_rollouts` (rounds replayed,
                           rejected blocks, the loss at the rejected positions before/after)
    curves.png, refine.json (the summary `eagle3 refine` prints, with the run's content key)
    validation/            the validation rollouts: rollouts/ (prepared), captured/, rollouts.json
    rounds/round-R/        its rollouts, capture, training dir (logs, final/) and round.json
Caching by content: a round's rollouts are keyed by their prompts and settings (not by the draft:
the target's text does not depend on it), a round by the previous round's key (the first by the
input weights), its rollouts, every replay and training setting, the supervised capture and the
validation set. A rerun reuses what is unchanged: rounds, rollouts, or the whole run.

Its modules, one job each:
    plan       what a run reads and decides: checkpoint, k, training config, prompts, metadata
    keys       the content keys of rollouts, rounds and the run
    rollouts   generation through the regenerate stage's generators, and its capture
    runtime    the device, the target's head, a draft loaded onto them
    scoring    replay, per-position acceptance α and τ, the loss at rejected positions, best round
    training   a round's training through the trainer's loop
    rounds     the rounds in order, each reused by its key
    outputs    best/, final/, logs, curves.png and refine.json
    run        run_refine: the stage, as a sequence of the above
"""

from __future__ import annotations

from eagle3.refine.outputs import SUMMARY, RefineResult
from eagle3.refine.plan import Plan, read_plan, recorded_settings
from eagle3.refine.run import run_refine

__all__ = ["SUMMARY", "Plan", "RefineResult", "read_plan", "recorded_settings", "run_refine"]
