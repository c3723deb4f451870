"""Predictor training data: teacher-forced features and labels from text the target wrote."""
from __future__ import annotations

import torch
from torch import Tensor
from tqdm import tqdm

from spec_ext.models.eagle import EagleHead
from spec_ext.policies import BranchHint, draft_features, history_features
from spec_ext.policies.learned import HISTORY_FEATURES


@torch.inference_mode()
def features_and_labels(target, draft, sequences: Tensor, start: int, max_length: int = 12,
                        generator: torch.Generator | None = None, step_grid: bool = False) -> dict:
    """Teacher-forced predictor data from text the target wrote (its greedy or sampled
    continuations), with the labels of both decoding modes.

    ``draft``: a causal LM, or an EAGLE-3 :class:`EagleHead` (it reads the target layers
    :class:`~spec_ext.drafters.HeadDrafter` taps, from the target forward made here).
    sequences [N,L] int64: prompts of ``start`` tokens and their continuations.

    The grid: a round rooted at token r (the last committed one) drafts step s = 0, 1, ...
    A draft model's step s is its teacher-forced q at position r+s (drafts after the first
    are proposed once the ones before were accepted, i.e. are the text's); a head's is the
    head unrolled (:func:`spec_ext.training.head.unroll`, pair index t = r-1): its own hidden
    state after the first step, with the text's tokens. The step's acceptance compares that
    q with the target's p at r+s: greedy 1[argmax q == argmax p], sampling sum_x min(p, q)
    (the chance a token drawn from q is accepted). Its run from r: sum_m prod_{s<=m}.

    For every context end i with start-1 <= i <= L-2-max_length (P of them; row-major, so any
    [N*P] entry reshapes to [N,P]):
      * ``specdecpp_x`` [N*P,Hd+3]: :func:`draft_features` of the draft's hidden state and q of
        step 0 at root i (a draft model: its q_i), or of a head's step ``specdecpp_step`` [N*P]
        (drawn uniformly from 0..max_length-1 with ``generator``: one step per end keeps the
        data as large as a draft model's; all steps would take max_length times the memory,
        7 GB instead of 0.6 for the bundled target's training text); ``specdecpp_y_greedy`` /
        ``_sampling`` [N*P]: that step's acceptance. Both hold on any context, so any text
        serves for both;
      * ``specdecpp_x_grid`` [N*P,max_length,Hd+3] (a head with ``step_grid``): every step's,
        to predict SpecDecPP's acceptance per (root, step) when replaying (a draft model's
        depends on the position alone: predict on ``specdecpp_x``);
      * ``adalength_x`` [N*P,2Ht]: [target embedding of token i+1; target hidden at i]
        (the branch predictor's input; AdaLength's is that and the history);
        ``adalength_history_greedy`` / ``_sampling`` [N*P,2]: :func:`history_features` of
        the step-0 drafts accepted in a row at the roots up to i (at most ``max_length``;
        greedy: argmax agreements; sampling: one draw of each acceptance with
        ``generator``, default seed 0); ``accepted_greedy`` / ``_sampling`` [N*P]: those
        acceptances (1/0) at root i;
        ``adalength_y_greedy`` [N*P]: drafts accepted in a round rooted at token i+1 with up
        to ``max_length`` drafts, the run of argmax agreements from i+1 (exact on greedy
        continuations, where accepted drafts are the text's own tokens);
        ``adalength_y_sampling`` [N*P]: the expected count sum_j prod_{m<=j} of the chances
        (acceptances taken as independent);
      * for the replay, with root i: ``runs_greedy`` / ``_sampling`` [N*P]: the drafts a round
        of up to ``max_length`` accepts (sampling: from draws of every step, the draft
        model's the same as the history's, a head's one per (root, step));
        ``chances_greedy`` / ``_sampling`` [N*P,max_length]: each step's acceptance;
      * ``sequence`` [N*P] int64: the row of ``sequences`` each entry comes from.
    """
    L = sequences.shape[1]
    if L - 1 - max_length <= start - 1:
        raise ValueError(f"sequences: need more than start + max_length = {start + max_length} tokens, got {L}")
    is_head = isinstance(draft, EagleHead)
    if is_head and draft.config.kind != "eagle3":
        raise ValueError("draft: an EAGLE-1 head; the training-time unroll (spec_ext.training.head.unroll) that "
                         "gives a head's chains is EAGLE-3's")
    if is_head and start < 2:
        raise ValueError(f"start: a head's round rooted at token r reads the target's feature at r-1, so the "
                         f"first root (start-1) must be >= 1; got start={start}")
    if step_grid and not is_head:
        raise ValueError("step_grid: a draft model's acceptance depends on the position alone (predict on "
                         "specdecpp_x); the step grid is for a head's chains")
    t_out = target(input_ids=sequences, output_hidden_states=True)
    p = torch.softmax(t_out.logits.float(), -1)
    ends = torch.arange(start - 1, L - 1 - max_length)
    out = dict(sequence=torch.arange(len(sequences)).repeat_interleave(len(ends)))
    generator = generator or torch.Generator().manual_seed(0)
    if is_head:
        chances, drawn, samples = _head_grids(target, draft, sequences, t_out.hidden_states, p, ends, max_length,
                                              generator, step_grid)
    else:
        chances, drawn, samples = _draft_model_grids(draft, sequences, p, ends, max_length, generator)
    out.update(samples)
    for mode in ("greedy", "sampling"):
        c, d = chances[mode], drawn[mode]  # [N,L,max_length]
        out[f"adalength_y_{mode}"] = c[:, ends + 1].cumprod(-1).sum(-1).reshape(-1)
        before = accepted_runs(d[..., 0].flip(1), max_length).flip(1)  # accepted in a row, ending at each i
        out[f"adalength_history_{mode}"] = history_features(before[:, ends]).reshape(-1, HISTORY_FEATURES)
        out[f"accepted_{mode}"] = d[:, ends, 0].reshape(-1)
        out[f"runs_{mode}"] = d[:, ends].cumprod(-1).sum(-1).reshape(-1)
        out[f"chances_{mode}"] = c[:, ends].reshape(-1, max_length)
    embed = target.get_input_embeddings()(sequences[:, ends + 1]).float()
    out["adalength_x"] = torch.cat([embed, t_out.hidden_states[-1][:, ends].float()], -1).reshape(
        -1, 2 * target.config.hidden_size)
    return out


def _draft_model_grids(draft, sequences: Tensor, p: Tensor, ends: Tensor, max_length: int,
                       generator: torch.Generator) -> tuple[dict, dict, dict]:
    """A draft causal LM's acceptance grids [N,L,max_length] per mode (step s at root r: its q
    at position r+s against p [N,L,V]; 0 past the end), the drawn ones (sampling: one draw per
    position, so rounds from different roots share them), and SpecDecPP's samples at ``ends``."""
    d_out = draft(input_ids=sequences, output_hidden_states=True)
    q = torch.softmax(d_out.logits.float(), -1)
    accept = dict(greedy=(p.argmax(-1) == q.argmax(-1)).float(), sampling=torch.minimum(p, q).sum(-1))  # [N,L]
    drawn = dict(greedy=accept["greedy"],
                 sampling=(torch.rand(accept["sampling"].shape, generator=generator) < accept["sampling"]).float())
    hidden = d_out.hidden_states[-1][:, ends]
    samples = {f"specdecpp_y_{mode}": a[:, ends].reshape(-1) for mode, a in accept.items()}
    samples["specdecpp_x"] = draft_features(hidden.reshape(-1, hidden.shape[-1]), q[:, ends].reshape(-1, q.shape[-1]))
    return ({mode: steps_ahead(a, max_length) for mode, a in accept.items()},
            {mode: steps_ahead(d, max_length) for mode, d in drawn.items()}, samples)


def _head_grids(target, head: EagleHead, sequences: Tensor, hidden_states, p: Tensor, ends: Tensor,
                max_length: int, generator: torch.Generator, step_grid: bool) -> tuple[dict, dict, dict]:
    """A head's acceptance grids [N,L,max_length] per mode (step s at root r >= 1: the head
    unrolled at pair index r-1 against p [N,L,V] at r+s; 0 at root 0, which has no feature
    before it, and past the end), the drawn ones (sampling: one draw per (root, step): each
    root's chain is its own), and SpecDecPP's samples at ``ends`` (see
    :func:`features_and_labels`). ``hidden_states``: the target's, HF's output_hidden_states."""
    from spec_ext.drafters import HeadDrafter
    from spec_ext.training.head import unroll
    drafter = HeadDrafter(head)
    drafter.bind(target)  # the checks, layers and embedding of inference
    features = torch.cat([hidden_states[k] for k in drafter.target_layers], -1)
    N, L = sequences.shape
    outputs = unroll(head, drafter.embed, sequences, features, max_length)  # per step [N,L-1,H]: root t+1
    draft_ids = torch.arange(head.config.draft_vocab_size, device=p.device) + head.d2t
    best = p.argmax(-1)
    chances = {mode: torch.zeros(N, L, max_length, device=p.device) for mode in ("greedy", "sampling")}
    for s, normed in enumerate(outputs):
        roots = L - 1 - s  # roots 1 .. L-1-s: p at r+s <= L-1
        q = torch.softmax(head.lm_head(normed[:, :roots]).float(), -1)
        chances["greedy"][:, 1:L - s, s] = (draft_ids[q.argmax(-1)] == best[:, 1 + s:]).float()
        chances["sampling"][:, 1:L - s, s] = torch.minimum(p[:, 1 + s:, draft_ids], q).sum(-1)
    drawn = dict(greedy=chances["greedy"],
                 sampling=(torch.rand(chances["sampling"].shape, generator=generator) < chances["sampling"]).float())
    rows = torch.arange(N)[:, None]
    step = torch.randint(max_length, (N, len(ends)), generator=generator)
    hidden = torch.stack(outputs)[step, rows, ends - 1]  # [N,P,H]
    q = torch.softmax(head.lm_head(hidden).float(), -1)
    samples = {f"specdecpp_y_{mode}": c[rows, ends, step].reshape(-1) for mode, c in chances.items()}
    samples["specdecpp_x"] = draft_features(hidden.reshape(-1, hidden.shape[-1]), q.reshape(-1, q.shape[-1]))
    samples["specdecpp_step"] = step.reshape(-1)
    if step_grid:
        grid = [draft_features(h.reshape(-1, h.shape[-1]), torch.softmax(head.lm_head(h).float(), -1).reshape(
            -1, len(draft_ids))) for h in (normed[:, ends - 1] for normed in outputs)]
        samples["specdecpp_x_grid"] = torch.stack(grid, 1)
    return chances, drawn, samples


def steps_ahead(values: Tensor, steps: int, past_end: float = 0.0) -> Tensor:
    """values [N,L] per position -> [N,L,steps]: at [n, j, s] values[n, j+s] (``past_end``
    beyond L): a round's steps rooted at j, where a step's value depends on its position alone."""
    padded = torch.nn.functional.pad(values, (0, steps), value=past_end)
    return padded.unfold(1, steps, 1)[:, :values.shape[1]]


def accepted_runs(accept: Tensor, max_length: int) -> Tensor:
    """accept [N,L] float (1/0, or acceptance chances) -> [N,L]: at j, the drafts a round
    of up to ``max_length`` accepts from j on, sum_{m<max_length} prod_{i<=m} accept[:, j+i]
    (the expected count for chances taken as independent; past the end counts as rejected)."""
    return steps_ahead(accept, max_length).cumprod(-1).sum(-1)


def branch_classes(lengths: Tensor, accept_all_length: int = 4) -> Tensor:
    """Branch-point labels (:class:`BranchHint` values) from accepted lengths: REJECT_ALL
    when none was accepted, ACCEPT_ALL from ``accept_all_length`` on, else DEFER."""
    classes = torch.full_like(lengths, int(BranchHint.DEFER), dtype=torch.int64)
    classes[lengths < 0.5] = int(BranchHint.REJECT_ALL)
    classes[lengths >= accept_all_length] = int(BranchHint.ACCEPT_ALL)
    return classes


def dataset(target, draft, sequences, start, max_length, batch=32, step_grid=False) -> dict:
    """:func:`features_and_labels` of ``sequences`` in batches, plus AdaLength's inputs per mode."""
    generator = torch.Generator().manual_seed(0)
    parts = [features_and_labels(target, draft, sequences[i:i + batch], start, max_length, generator, step_grid)
             for i in tqdm(range(0, len(sequences), batch), desc="features and labels", leave=False)]
    data = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "sequence"}
    for mode in ("greedy", "sampling"):  # AdaLength's input in each mode
        data[f"adalength_in_{mode}"] = torch.cat([data["adalength_x"], data[f"adalength_history_{mode}"]], -1)
    data["sequence"] = torch.cat([p["sequence"] + i for i, p in zip(range(0, len(sequences), batch), parts)])
    data["positions"] = len(data["sequence"]) // len(sequences)
    return data


def by_sequence(data: dict, x: str, y: str, held: Tensor) -> tuple[tuple, tuple]:
    """(train, held-out) pairs of ``data[x], data[y]``; held [N] bool marks held-out sequences."""
    mask = held[data["sequence"]]
    return (data[x][~mask], data[y][~mask]), (data[x][mask], data[y][mask])
