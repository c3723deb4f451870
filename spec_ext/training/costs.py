"""Measured costs that the replay weighs lengths by: a round with k drafts, and the learned
policies' own decisions."""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from spec_ext.engine import generate
from spec_ext.models import SpecCache
from spec_ext.models.eagle import EagleHead
from spec_ext.policies import AdaLength, Call, Fixed, Report, RoundPlan, RoundState, Source, SpecDecPP
from spec_ext.training.replay import MAX_LENGTH

COST_KS = (1, 2, 3, 4, 6, 8, 12)  # draft lengths whose round cost is measured


def round_costs(target, draft, prompts, new_tokens, repeats, fast_linear, batch=1) -> dict:
    """ms per round of Fixed(k), k in COST_KS, with ``batch`` prompts per generate call, over
    all prompts and repeats (every k runs on a group before the next group, so the box's
    drift hits all alike), and the least-squares line through them for every k in
    0..MAX_LENGTH (one noisy point would bend an interpolation and with it the choices)."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    elapsed, rounds = dict.fromkeys(COST_KS, 0.0), dict.fromkeys(COST_KS, 0)
    for _ in tqdm(range(repeats), desc=f"round costs, batch {batch}"):
        for group in groups:
            for k in COST_KS:
                out = generate(target, draft, group, max_new_tokens=new_tokens, eos_token_id=[],
                                        policy=Fixed(k), fast_linear=fast_linear)
                elapsed[k] += out.stats.wall_time
                rounds[k] += out.stats.target_calls - 1  # the first call is the prefill
    measured = {k: 1e3 * elapsed[k] / rounds[k] for k in COST_KS}
    per_draft, base = np.polyfit(list(measured), list(measured.values()), 1)
    round_ms = base + per_draft * np.arange(MAX_LENGTH + 1)
    return dict(measured_ms={k: round(v, 3) for k, v in measured.items()}, base_ms=round(float(base), 3),
                per_draft_ms=round(float(per_draft), 3), round_ms=round_ms.round(3).tolist())


def decision_ms(predictors, target, draft, batch=1, repeats=300) -> dict:
    """Median ms of the learned policies' own work for ``batch`` rows: SpecDecPP's per draft
    step (features and head), AdaLength's per round (embedding, history and predictor). Each
    call follows a draft forward (``draft``: a causal LM or an :class:`EagleHead`), as in the
    loop: after one, small ops run 2-3x slower than back to back."""
    call = Call(batch, True, target, draft)
    specdecpp = SpecDecPP(predictors["specdecpp"]).start(call)
    adalength = AdaLength(predictors["adalength"]).start(call)
    vocab, width, draft_step = _draft_step(target, draft, batch)
    probs = torch.softmax(torch.randn(batch, vocab) * 4, -1)
    token, draft_hidden = probs.argmax(-1), torch.randn(batch, width)
    state = RoundState(batch, target_hidden=torch.randn(batch, target.config.hidden_size), roots=token)
    agreed = torch.ones(batch, dtype=torch.bool)
    drafted = RoundPlan([3] * batch)
    report = Report(drafted, [Source.MODEL] * batch, [3] * batch, [3] * batch, [[0]] * batch, 4)
    specdecpp_plan = specdecpp.plan(state)
    calls = dict(specdecpp_per_draft=lambda: specdecpp_plan.keep_drafting(1, probs, token, draft_hidden),
                 adalength_per_round=lambda: (adalength.observe(report), adalength.plan(state).budget(agreed)))
    costs = {}
    with torch.inference_mode():
        for name, call in calls.items():
            times = []
            for _ in range(repeats):
                draft_step(token)
                started = time.perf_counter()
                call()
                times.append(time.perf_counter() - started)
            costs[name] = round(1e3 * statistics.median(times[repeats // 10:]), 4)
    return costs


def _draft_step(target, draft, batch: int):
    """(vocabulary size, hidden width, step): ``step(token [batch])`` runs one draft forward of
    a token per row, as the loop does between decisions: a causal LM's, or a head's over a
    cache of its own (one token at position 0, the pair's feature random; nothing kept)."""
    if not isinstance(draft, EagleHead):
        return draft.config.vocab_size, draft.config.hidden_size, lambda token: draft(token[:, None])
    weight = draft.fc.weight
    cache = SpecCache(draft.num_layers, None, None, batch, 1, weight.dtype, weight.device)
    embed = draft.embed_tokens if draft.embed_tokens is not None else target.get_input_embeddings()
    hidden = torch.randn(batch, 1, draft.hidden_size, dtype=weight.dtype, device=weight.device)
    positions = torch.zeros(batch, 1, dtype=torch.int64, device=weight.device)
    target_head = target.get_output_embeddings()
    return draft.layer_config.vocab_size, draft.hidden_size, lambda token: draft(
        embed(token[:, None]), hidden, positions, cache, target_head=target_head)
