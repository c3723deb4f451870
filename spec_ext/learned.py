"""Learned draft-length policies and the functions that train them on any pair.

* :class:`SpecDecPP` (SpecDec++): a residual MLP on the draft's last hidden state (plus
  three numbers of the distribution q it produced: log max q, entropy, top-1 minus top-2,
  see :func:`draft_features`) predicts the probability that the token drafted from q is
  accepted; drafting stops once the predicted probability that some draft of the round is
  rejected, 1 - prod(accept), exceeds ``threshold``. Deciding costs no extra draft forward;
  on CPU in float32 each draft step's decision is one call of the fused kernel
  :func:`spec_ext.ops.acceptance_head`.
* :class:`AdaLength` (AdaEAGLE's length predictor): a residual MLP on [target input
  embedding of the round's root token; target last hidden state that produced it; the
  row's recent history (:func:`history_features`)] predicts how many drafts the target
  will accept; the round drafts that many.
* :class:`BranchPredictor` (SpecBranch's branch points): a 3-class residual MLP on the same
  features says whether the next drafts are likely all rejected (branch at once), all
  accepted (no branches) or uncertain (branch by the draft's confidence);
  :class:`LearnedSpecBranch` is SpecBranch driven by it.

Each predictor has two outputs, one per decoding mode: greedy (exact greedy labels) and
sampling (soft labels sum_x min(p, q) = E_{x~q} min(1, p(x)/q(x))), each with its own
threshold or offset, tuned at batch 1 and for batches (where a draft step costs more next
to a verification, so shorter drafts pay). The policies only choose lengths, so outputs
stay exact whatever the predictors say.

Predictors are safetensors files with their config in the metadata;
``benchmarks/train_policies.py`` makes ``models/policies/*.safetensors`` for the bundled
pair, and ``policy="specdecpp"`` / ``"adalength"`` / ``"learnedspecbranch"`` load those.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_ext import ops
from spec_ext.parallel import SpecBranch
from spec_ext.policies import Policy, register

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "models" / "policies"
GREEDY, SAMPLING = 0, 1  # output columns of every predictor
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which ResidualMLP keeps


class ResidualMLP(nn.Module):
    """in_features -> hidden, ``depth`` pre-norm residual blocks, -> out_features."""

    def __init__(self, in_features: int, out_features: int = 2, hidden: int = 256, depth: int = 2):
        super().__init__()
        self.config = dict(in_features=in_features, out_features=out_features, hidden=hidden, depth=depth)
        self.inp = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden, eps=LAYER_NORM_EPS), nn.Linear(hidden, hidden), nn.SiLU(),
                          nn.Linear(hidden, hidden))
            for _ in range(depth))
        self.out = nn.Linear(hidden, out_features)

    def forward(self, x: Tensor) -> Tensor:
        # functional calls: a policy runs this once per draft step at batch 1, where calling
        # each submodule costs more than its arithmetic (18 instead of 56 us per call)
        h = F.linear(x, self.inp.weight, self.inp.bias)
        for norm, up, _, down in self.blocks:
            y = F.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            h = h + F.linear(F.silu(F.linear(y, up.weight, up.bias)), down.weight, down.bias)
        return F.linear(h, self.out.weight, self.out.bias)

    def weights(self) -> list[Tensor]:
        """The parameters in :func:`spec_ext.ops.acceptance_head`'s order."""
        blocks = [t for norm, up, _, down in self.blocks
                  for t in (norm.weight, norm.bias, up.weight, up.bias, down.weight, down.bias)]
        return [t.detach() for t in (self.inp.weight, self.inp.bias, *blocks, self.out.weight, self.out.bias)]

    def save(self, path: str | Path, **settings) -> None:
        """Weights plus config and policy ``settings`` (JSON in the safetensors metadata)."""
        from safetensors.torch import save_file
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path), metadata={"config": json.dumps(self.config), "settings": json.dumps(settings)})

    @classmethod
    def load(cls, path: str | Path) -> tuple["ResidualMLP", dict]:
        from safetensors import safe_open
        from safetensors.torch import load_file
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if "config" not in meta:
            raise ValueError(f"predictor: {path} has no spec_ext predictor config in its metadata")
        model = cls(**json.loads(meta["config"]))
        model.load_state_dict(load_file(str(path)))
        return model.eval(), json.loads(meta.get("settings", "{}"))


def _predictor(source, name: str) -> tuple[ResidualMLP, dict]:
    if isinstance(source, ResidualMLP):
        return source.eval(), {}
    path = Path(source) if source is not None else DEFAULT_DIR / f"{name}.safetensors"
    if not path.exists():
        raise ValueError(f"predictor: {path} not found; train one with benchmarks/train_policies.py or pass "
                         f"predictor=<path to a .safetensors file | ResidualMLP>")
    model, settings = ResidualMLP.load(path)
    if settings.get("kind", name) != name:
        raise ValueError(f"predictor: {path} holds a {settings['kind']!r} predictor, not {name!r}")
    return model, settings


def _check_width(predictor: ResidualMLP, expected: int, what: str, policy: str) -> None:
    if predictor.config["in_features"] != expected:
        raise ValueError(f"predictor: the {policy} predictor takes {predictor.config['in_features']} features but "
                         f"{what} gives {expected}; train one for this pair (benchmarks/train_policies.py)")


def draft_features(hidden: Tensor, probs: Tensor) -> Tensor:
    """SpecDecPP's input [B,H+3] float32: the draft's hidden state [B,H] that produced the
    distribution ``probs`` [B,V] (temperature 1), then log max q, entropy of q and
    max q minus the second largest q. The three numbers carry most of what generalises to
    unseen text; the hidden state alone over-fits the training sequences."""
    probs = probs.float()
    top = probs.topk(2, dim=-1).values
    return torch.cat([hidden.float(), top[:, :1].log(), torch.special.entr(probs).sum(-1, keepdim=True),
                      top[:, :1] - top[:, 1:]], -1)


DRAFT_EXTRA_FEATURES = 3  # the numbers draft_features appends to the hidden state


def history_features(accepted_before: Tensor) -> Tensor:
    """AdaLength's history input [..., 2] float32 from ``accepted_before`` [...]: for how
    many positions in a row just before the round's root the draft agreed with the target
    (0 after a rejected draft; over consecutive rounds that accepted every draft and whose
    draft also agreed with the bonus token, each counting its drafts + 1; at most the
    longest draft), as that count / 4 and whether it is > 0. Acceptance comes in bursts:
    on the validation split the run after a round that accepted all 12 drafts averages 8.7,
    after a rejection 1.9; with these two numbers the replayed AdaLength went from 1.01x to
    1.03x the best fixed k (greedy)."""
    return torch.stack([accepted_before.float() / 4, (accepted_before > 0).float()], -1)


HISTORY_FEATURES = 2  # the numbers history_features gives per row


def _per_mode(value, settings: dict, key: str, default: float) -> dict[tuple[bool, bool], float]:
    """{(greedy, batched): setting}: ``value`` everywhere when given, else as tuned (batched:
    tuned for batches, used at batch > 1; the batch-1 value where none was tuned)."""
    if value is not None:
        return {(g, b): float(value) for g in (True, False) for b in (False, True)}
    greedy = settings.get(key, default)
    sampling = settings.get(f"{key}_sampling", greedy)
    return {(True, False): greedy, (False, False): sampling,
            (True, True): settings.get(f"{key}_batch", greedy),
            (False, True): settings.get(f"{key}_batch_sampling", sampling)}


@register
class SpecDecPP(Policy):
    """SpecDec++: stop drafting once 1 - prod(predicted acceptance) > ``threshold``.

    A batch drafts as one: the batch goes on while 1 - mean over rows of prod(predicted
    acceptance) <= ``threshold`` (at batch 1, the rule above). Stopping a row alone would
    save nothing, as the batch pays each draft forward whether one row goes on or all, and
    the target verifies every row to the longest draft; going on while any row is confident
    drafts near ``max_draft`` for all (batch 8: 9 drafts per round instead of 5, 0.8x).

    Args:
        predictor: path of a safetensors predictor, a :class:`ResidualMLP` or None for
            the bundled pair's (``models/policies/specdecpp.safetensors``).
        threshold: one value for every case, or None for the values tuned with the
            predictor (for greedy and for sampling, at batch 1 and for batches).
        max_draft: None takes the value tuned with the predictor.
    """

    needs = ("draft_hidden",)

    def __init__(self, predictor=None, threshold: float | None = None, max_draft: int | None = None):
        self._predictor, settings = _predictor(predictor, "specdecpp")
        self.thresholds = _per_mode(threshold, settings, "threshold", 0.5)
        self.max_draft = settings.get("max_draft", 12) if max_draft is None else max_draft
        for value in self.thresholds.values():
            if not 0 < value < 1:
                raise ValueError(f"threshold: must be in (0, 1), got {value}")
        if self.max_draft < 1:
            raise ValueError(f"max_draft: must be >= 1, got {self.max_draft}")

    def bind(self, target, draft) -> None:
        _check_width(self._predictor, draft.config.hidden_size + DRAFT_EXTRA_FEATURES,
                     "the draft's hidden state and draft_features", "SpecDecPP")
        self._predictor.to(draft.device)
        self._weights = self._predictor.weights()
        # one fused call per draft step where the kernel runs (float32 on CPU), else torch ops
        self._fused = (draft.device.type == "cpu" and ops.registered("acceptance_head", "CPU")
                       and all(t.dtype == torch.float32 for t in self._weights))

    def _accept(self, probs: Tensor, hidden: Tensor, column: int) -> Tensor:
        if self._fused and hidden.dtype == torch.float32:
            return torch.ops.spec_ext.acceptance_head(hidden, probs, self._weights, column, LAYER_NORM_EPS)
        return torch.sigmoid(self._predictor(draft_features(hidden, probs))[:, column])

    def start(self, batch_size, greedy=True) -> None:
        super().start(batch_size, greedy)
        self._verdicts = None

    def keep_drafting(self, step, probs, tokens, hidden=None) -> Tensor:
        column = GREEDY if self.greedy else SAMPLING
        threshold = self.thresholds[self.greedy, self.batch_size > 1]
        accept = self._accept(probs, hidden, column).tolist()
        # the survival products and the verdict in Python floats: the loop syncs on the
        # verdict anyway, and each tensor op here costs ~10 us after a draft forward; the two
        # verdict tensors are made once per batch size and shared: callers read them only
        self._survival = accept if step == 1 else [s * a for s, a in zip(self._survival, accept)]
        if self._verdicts is None or len(self._verdicts[0]) != len(accept):
            self._verdicts = [torch.full((len(accept),), go, dtype=torch.bool, device=probs.device)
                              for go in (False, True)]
        going_on = 1 - sum(self._survival) / len(self._survival) <= threshold
        return self._verdicts[int(going_on)]


@register
class AdaLength(Policy):
    """AdaEAGLE's lightweight draft-length predictor: each round drafts
    ceil(predicted accepted length + ``offset``) tokens, between 1 and ``max_draft``.

    A batch drafts as one, to the mean of its rows' predicted lengths: each draft forward
    and the verification's width are paid for the longest row whatever the others draft,
    so per-row lengths drafted near the longest prediction for all (batch 8: 0.8x fixed k).

    Args:
        predictor: path of a safetensors predictor, a :class:`ResidualMLP` or None for
            the bundled pair's (``models/policies/adalength.safetensors``).
        offset: one value for every case, or None for the values tuned with the predictor
            (for greedy and for sampling, at batch 1 and for batches).
        max_draft: None takes the value tuned with the predictor.
    """

    needs = ("target_hidden", "bonus_agreement")

    def __init__(self, predictor=None, offset: float | None = None, max_draft: int | None = None):
        self._predictor, settings = _predictor(predictor, "adalength")
        self.offsets = _per_mode(offset, settings, "offset", 0.0)
        self.max_draft = settings.get("max_draft", 12) if max_draft is None else max_draft
        self._first = settings.get("first_round", 3)
        if self.max_draft < 1:
            raise ValueError(f"max_draft: must be >= 1, got {self.max_draft}")

    def bind(self, target, draft) -> None:
        _check_width(self._predictor, 2 * target.config.hidden_size + HISTORY_FEATURES,
                     "[target input embedding; target hidden state; history_features]", "AdaLength")
        self._embed = target.get_input_embeddings()
        self._predictor.to(target.device)

    def start(self, batch_size, greedy=True) -> None:
        super().start(batch_size, greedy)
        self._k = [min(self._first, self.max_draft)] * batch_size
        self._before = [0] * batch_size  # positions the draft agreed on in a row before the next root
        self._features = None

    def see_target(self, hidden: Tensor, next_tokens: Tensor) -> None:
        # the round's outcome (observe) comes after this call: predict in plan()
        self._features = torch.cat([self._embed(next_tokens).float(), hidden.float()], -1)

    def observe(self, num_draft, num_accepted) -> None:
        # the run goes on through the bonus token only if the draft agrees with it too
        # (see_bonus_agreement), as the training data counts it: accepted + 1
        self._before = [min(self.max_draft, before + a + 1) if a >= n else 0
                        for before, n, a in zip(self._before, num_draft, num_accepted)]

    def see_bonus_agreement(self, agreed: Tensor) -> None:
        self._before = [before if ok else 0 for before, ok in zip(self._before, agreed.tolist())]

    def plan(self) -> list[int]:
        if self._features is not None:
            history = history_features(torch.tensor(self._before, device=self._features.device))
            column = GREEDY if self.greedy else SAMPLING
            offset = self.offsets[self.greedy, len(self._before) > 1]
            length = self._predictor(torch.cat([self._features, history], -1))[:, column].mean() + offset
            self._k = [int(length.ceil().clamp(1, self.max_draft))] * len(self._before)
            self._features = None
        return list(self._k)

    def keep_rows(self, rows) -> None:
        super().keep_rows(rows)
        self._k = [self._k[r] for r in rows]
        self._before = [self._before[r] for r in rows]
        if self._features is not None:
            self._features = self._features[torch.tensor(rows, dtype=torch.long, device=self._features.device)]


class BranchPredictor:
    """SpecBranch's branch-point predictor: a 3-class residual MLP on [target input
    embedding of a row's new root; target hidden state that produced it] -> REJECT_ALL
    (the next draft is likely rejected: branch at once), DEFER (branch by the draft's
    confidence) or ACCEPT_ALL (the next ``accept_all_length`` drafts likely all pass:
    draft a plain chain). Six outputs: three for greedy decoding, three for sampling.

    Example:
        >>> policy = SpecBranch(predictor=BranchPredictor())   # the bundled pair's  # doctest: +SKIP
    """

    def __init__(self, predictor=None):
        self._model, settings = _predictor(predictor, "branch")
        self.accept_all_length = settings.get("accept_all_length", 4)
        if self._model.config["out_features"] != 6:
            raise ValueError(f"predictor: a branch predictor has 6 outputs, got {self._model.config['out_features']}")

    def bind(self, target) -> None:
        _check_width(self._model, 2 * target.config.hidden_size,
                     "[target input embedding; target hidden state]", "branch")
        self._embed = target.get_input_embeddings()
        self._model.to(target.device)

    def classify(self, hidden: Tensor, roots: Tensor, greedy: bool) -> list[int]:
        features = torch.cat([self._embed(roots).float(), hidden.float()], -1)
        logits = self._model(features)[:, :3] if greedy else self._model(features)[:, 3:]
        return logits.argmax(-1).tolist()


def branch_classes(lengths: Tensor, accept_all_length: int = 4) -> Tensor:
    """Branch-point labels from accepted lengths: 0 (none accepted: REJECT_ALL),
    2 (at least ``accept_all_length``: ACCEPT_ALL), else 1 (DEFER)."""
    classes = torch.ones_like(lengths, dtype=torch.int64)
    classes[lengths < 0.5] = 0
    classes[lengths >= accept_all_length] = 2
    return classes


@register
class LearnedSpecBranch(SpecBranch):
    """:class:`spec_ext.parallel.SpecBranch` with the bundled pair's branch-point
    predictor (``models/policies/branch.safetensors``) or ``predictor`` (a path, a
    :class:`ResidualMLP` or a :class:`BranchPredictor`)."""

    def __init__(self, branches: int = 4, gamma: int | None = None, mode: str = "threads", draft_rank: int = 1,
                 timeout: float = 60.0, max_gamma: int = 12, predictor=None):
        if not isinstance(predictor, BranchPredictor):
            predictor = BranchPredictor(predictor)
        super().__init__(branches, gamma, mode, draft_rank, timeout, max_gamma, predictor)


# ---------------------------------------------------------------------- training
@torch.inference_mode()
def features_and_labels(target, draft, sequences: Tensor, start: int, max_length: int = 12,
                        generator: torch.Generator | None = None) -> dict:
    """Teacher-forced predictor data from text the target wrote (its greedy or sampled
    continuations), with the labels of both decoding modes.

    sequences [N,L] int64: prompts of ``start`` tokens and their continuations. For every
    context end i with start-1 <= i <= L-2-max_length (P of them; row-major, so any
    [N*P] entry reshapes to [N,P]):
      * ``specdecpp_x`` [N*P,Hd+3]: :func:`draft_features` at i (where the draft makes q_i);
        ``specdecpp_y_greedy`` [N*P]: 1[argmax q_i == argmax p_i];
        ``specdecpp_y_sampling`` [N*P]: sum_x min(p_i, q_i), the chance a token drawn from
        q_i is accepted. Both hold on any context, so any text serves for both.
      * ``adalength_x`` [N*P,2Ht]: [target embedding of token i+1; target hidden at i]
        (the branch predictor's input; AdaLength's is that and the history);
        ``adalength_history_greedy`` / ``_sampling`` [N*P,2]: :func:`history_features` of
        the drafts accepted in a row up to the one that would have proposed token i+1 (at
        most ``max_length``; greedy: argmax agreements; sampling: one draw of each
        acceptance with ``generator``, default seed 0); ``accepted_greedy`` /
        ``_sampling`` [N*P]: those acceptances (1/0) of the draft made at i;
        ``adalength_y_greedy`` [N*P]: drafts accepted in a round rooted at token i+1 with up
        to ``max_length`` drafts, the run of argmax agreements from i+1 (exact on greedy
        continuations, where accepted drafts are the text's own tokens);
        ``adalength_y_sampling`` [N*P]: the expected count sum_j prod_{m<=j} sum_x min(p_m, q_m)
        (acceptances taken as independent).
      * ``sequence`` [N*P] int64: the row of ``sequences`` each entry comes from.
    """
    L = sequences.shape[1]
    if L - 1 - max_length <= start - 1:
        raise ValueError(f"sequences: need more than start + max_length = {start + max_length} tokens, got {L}")
    t_out = target(input_ids=sequences, output_hidden_states=True)
    d_out = draft(input_ids=sequences, output_hidden_states=True)
    p, q = torch.softmax(t_out.logits.float(), -1), torch.softmax(d_out.logits.float(), -1)
    ends = torch.arange(start - 1, L - 1 - max_length)
    out = dict(sequence=torch.arange(len(sequences)).repeat_interleave(len(ends)))
    accept = dict(greedy=(p.argmax(-1) == q.argmax(-1)).float(), sampling=torch.minimum(p, q).sum(-1))  # [N,L]
    generator = generator or torch.Generator().manual_seed(0)
    drawn = dict(greedy=accept["greedy"],
                 sampling=(torch.rand(accept["sampling"].shape, generator=generator) < accept["sampling"]).float())
    for mode, a in accept.items():
        out[f"specdecpp_y_{mode}"] = a[:, ends].reshape(-1)
        out[f"adalength_y_{mode}"] = accepted_runs(a, max_length)[:, ends + 1].reshape(-1)
        before = accepted_runs(drawn[mode].flip(1), max_length).flip(1)  # accepted in a row, ending at each i
        out[f"adalength_history_{mode}"] = history_features(before[:, ends]).reshape(-1, HISTORY_FEATURES)
        out[f"accepted_{mode}"] = drawn[mode][:, ends].reshape(-1)
    hidden = d_out.hidden_states[-1][:, ends]
    out["specdecpp_x"] = draft_features(hidden.reshape(-1, hidden.shape[-1]), q[:, ends].reshape(-1, q.shape[-1]))
    embed = target.get_input_embeddings()(sequences[:, ends + 1]).float()
    out["adalength_x"] = torch.cat([embed, t_out.hidden_states[-1][:, ends].float()], -1).reshape(
        -1, 2 * target.config.hidden_size)
    return out


def accepted_runs(accept: Tensor, max_length: int) -> Tensor:
    """accept [N,L] float (1/0, or acceptance chances) -> [N,L]: at j, the drafts a round
    of up to ``max_length`` accepts from j on, sum_{m<max_length} prod_{i<=m} accept[:, j+i]
    (the expected count for chances taken as independent; past the end counts as rejected)."""
    windows = torch.nn.functional.pad(accept, (0, max_length)).unfold(1, max_length, 1)[:, :accept.shape[1]]
    return windows.cumprod(-1).sum(-1)


def simulated_tokens_per_ms(accept: Tensor, lengths: Tensor, round_ms: Sequence[float],
                            max_length: int) -> tuple[float, float]:
    """Replay chain speculative decoding on teacher-forced acceptances with measured round
    costs, to compare draft-length rules without timing noise.

    accept [N,P] bool: accept[n, j] says whether the draft proposed right after root j of
    row n is accepted, given every earlier draft of the round was. lengths [N,P] int: the
    drafts a rule proposes in a round rooted at j (1..max_length). round_ms[k]: the cost of
    a round with k drafts. A round rooted at j keeps the run of accepted drafts (at most
    ``lengths[n, j]``) plus the target's token; rows stop when a round could reach past the
    data (j + max_length > P).
    Returns (tokens per ms, mean drafts per round).
    """
    return simulated_batch_tokens_per_ms(accept, lambda rows, roots: int(lengths[rows[0], roots[0]]),
                                         lambda k, n: round_ms[k], max_length, batch=1)


def simulated_batch_tokens_per_ms(accept: Tensor, choose, round_ms, max_length: int,
                                  batch: int) -> tuple[float, float]:
    """:func:`simulated_tokens_per_ms` for batches that draft as one: rows
    ``batch*i .. batch*(i+1)-1`` of accept [N,P] decode together, each round proposing
    ``choose(rows, roots)`` drafts (rows [n] int64: the batch's unfinished rows, roots [n]
    int64: where each row's round is rooted) at a cost of ``round_ms(k, n)`` ms for n
    unfinished rows; each row keeps its own run of accepted drafts.
    Returns (tokens per ms, mean drafts per round).
    """
    P = accept.shape[1]
    runs = accepted_runs(accept.float(), max_length).long()
    tokens = cost = rounds = drafted = 0
    for first in range(0, len(accept), batch):
        rows = torch.arange(first, min(first + batch, len(accept)))
        roots = torch.zeros_like(rows)
        while True:
            going = roots + max_length <= P
            rows, roots = rows[going], roots[going]
            if len(rows) == 0:
                break
            k = choose(rows, roots)
            kept = runs[rows, roots].clamp(max=k)
            tokens += int(kept.sum()) + len(rows)
            cost += round_ms(k, len(rows))
            rounds += 1
            drafted += k
            roots = roots + kept + 1
    return tokens / cost, drafted / max(1, rounds)


def asymmetric_l1(prediction: Tensor, target: Tensor, under_weight: float = 2.0) -> Tensor:
    """L1 loss with under-prediction (prediction < target) weighted ``under_weight``."""
    error = target - prediction
    return torch.where(error > 0, under_weight * error, -error).mean()


def train_predictor(model: ResidualMLP, data: dict[int, tuple[Tensor, Tensor]], loss: str, epochs: int = 8,
                    batch: int = 512, lr: float = 2e-3, seed: int = 0, progress: bool = True,
                    held_out: dict[int, tuple[Tensor, Tensor]] | None = None) -> dict:
    """Train ``model``'s output columns on ``data[column] = (x [M,F], y [M])``.

    loss: "bce" (acceptance probabilities, soft labels allowed), "asymmetric_l1"
    (lengths) or "cross_entropy" (class labels y; column c is output group c*3..c*3+2).
    held_out: data of the same form (best from other sequences than ``data``'s, as
    neighbouring positions of one sequence are near copies); the model keeps the weights of
    the epoch with the lowest held-out loss.
    Returns {"train": mean training loss per epoch, "held_out": held-out loss per epoch
    (with ``held_out``), "best_epoch": the epoch kept}.
    """
    from tqdm import tqdm
    if loss not in ("bce", "asymmetric_l1", "cross_entropy"):
        raise ValueError(f"loss: expected 'bce', 'asymmetric_l1' or 'cross_entropy', got {loss!r}")

    def objective(x: Tensor, y: Tensor, column: int) -> Tensor:
        if loss == "cross_entropy":
            return F.cross_entropy(model(x)[:, 3 * column:3 * column + 3], y.long())
        out = model(x)[:, column]
        return F.binary_cross_entropy_with_logits(out, y) if loss == "bce" else asymmetric_l1(out, y)

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps_per_epoch = max(math.ceil(len(y) / batch) for _, y in data.values())
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=epochs * steps_per_epoch)
    history = dict(train=[], held_out=[], best_epoch=epochs - 1)
    best = (math.inf, None)
    for epoch in tqdm(range(epochs), desc=f"train {loss}", disable=not progress):
        model.train()
        orders = {c: torch.randperm(len(y), generator=generator) for c, (_, y) in data.items()}
        total = 0.0
        for step in range(steps_per_epoch):
            value = 0.0
            for column, (x, y) in data.items():
                index = orders[column][(step * batch) % len(y):][:batch]
                value = value + objective(x[index], y[index], column)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            optimizer.step()
            schedule.step()
            total += value.item()
        history["train"].append(total / steps_per_epoch)
        if held_out:
            model.eval()
            with torch.no_grad():
                value = sum(objective(x, y, column).item() for column, (x, y) in held_out.items())
            history["held_out"].append(value)
            if value < best[0]:
                best = (value, {k: v.clone() for k, v in model.state_dict().items()})
                history["best_epoch"] = epoch
    if best[1] is not None:
        model.load_state_dict(best[1])
    model.eval()
    return history
