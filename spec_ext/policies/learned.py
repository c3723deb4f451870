"""Learned policies: predictors that choose draft lengths and branch points.

:class:`SpecDecPP` (SpecDec++: stop drafting by a predicted acceptance), :class:`AdaLength`
(AdaEAGLE: a predicted length per round), :class:`BranchPredictor` and
:class:`LearnedSpecBranch` (SpecBranch's branch points). Each predictor is a
:class:`ResidualMLP` with two outputs (or sets of outputs), one per decoding mode: greedy
(exact greedy labels) and sampling (soft labels sum_x min(p, q)), each with its own threshold
or offset, tuned at batch 1 and for batches. The policies only choose lengths, so outputs stay
exact whatever the predictors say. Predictors are safetensors files with their config in the
metadata; :mod:`spec_ext.training` makes them for any pair (``benchmarks/train_policies.py``),
and the policies by name load the bundled pair's (``policies/*.safetensors`` of
:mod:`spec_ext.bundled`).
"""
from __future__ import annotations

import functools
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_ext import ops
from spec_ext.bundled import bundled_path
from spec_ext.models.eagle import EagleHead
from spec_ext.policies.base import Call, Controller, Policy, Report, RoundPlan, RoundState, check, register
from spec_ext.policies.parallel import BranchHint, SpecBranch

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


_GATHERED: "weakref.WeakKeyDictionary[nn.Module, tuple[Tensor, Tensor]]" = weakref.WeakKeyDictionary()


def input_embedding(target):
    """``target``'s input embedding as a function of token ids that runs on this rank alone.
    A tensor-parallel target's table (its own module would need every rank) is gathered by a
    collective, so the first call for a table must come on every rank (generate makes it
    before the leader starts); the whole table is kept beside the shard from then on."""
    module = target.get_input_embeddings()
    weight = module.weight
    if hasattr(weight, "full_tensor"):  # a DTensor shard
        shard, table = _GATHERED.get(module, (None, None))
        if shard is not weight:
            _GATHERED[module] = weight, weight.full_tensor()
        weight = _GATHERED[module][1]
    return functools.partial(F.embedding, weight=weight)


def _predictor(source, name: str) -> tuple[ResidualMLP, dict]:
    if isinstance(source, ResidualMLP):
        return source.eval(), {}
    if source is None:
        try:
            path = bundled_path("policies", f"{name}.safetensors")
        except FileNotFoundError as error:
            raise ValueError(f"predictor: {error}, or pass predictor=<path to a .safetensors file | "
                             f"ResidualMLP> (benchmarks/train_policies.py trains one)") from None
    else:
        path = Path(source)
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
    longest draft), as that count / 4 and whether it is > 0 (acceptance comes in bursts)."""
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


def _loaded(policy, name: str, key: str, default: float) -> dict:
    """Load ``policy.predictor`` (see :func:`_predictor`) onto ``policy`` (a frozen value: the
    loaded model and its settings are kept beside its fields): ``{key}s``, the field ``key``
    per mode (:func:`_per_mode`), and ``max_draft`` as tuned where None. Returns the settings."""
    model, settings = _predictor(policy.predictor, name)
    object.__setattr__(policy, "_model", model)
    object.__setattr__(policy, f"{key}s", _per_mode(getattr(policy, key), settings, key, default))
    if policy.max_draft is None:
        object.__setattr__(policy, "max_draft", settings.get("max_draft", 12))
    check(policy.max_draft >= 1, "max_draft", f"must be >= 1, got {policy.max_draft}")
    return settings


@register
@dataclass(frozen=True)
class SpecDecPP(Policy):
    """SpecDec++: stop drafting once 1 - prod(predicted acceptance) > ``threshold``.

    A batch drafts as one: the batch goes on while 1 - mean over rows of prod(predicted
    acceptance) <= ``threshold`` (at batch 1, the rule above): the batch pays each draft
    forward and the verification's width for its longest row.

    Args:
        predictor: path of a safetensors predictor, a :class:`ResidualMLP` or None for
            the bundled pair's (``policies/specdecpp.safetensors``).
        threshold: one value for every case, or None for the values tuned with the
            predictor (for greedy and for sampling, at batch 1 and for batches).
        max_draft: None takes the value tuned with the predictor.
    """
    reads_draft_hidden: ClassVar[bool] = True
    predictor: object = None
    threshold: float | None = None
    max_draft: int | None = None

    def __post_init__(self):
        _loaded(self, "specdecpp", "threshold", 0.5)
        for value in self.thresholds.values():
            check(0 < value < 1, "threshold", f"must be in (0, 1), got {value}")

    def start(self, call: Call) -> Controller:
        return _SpecDecPP(self, call)


class _SpecDecPP(Controller):
    def __init__(self, policy: SpecDecPP, call: Call):
        super().__init__(policy, call)
        draft = call.draft
        if isinstance(draft, EagleHead):
            width, device = draft.hidden_size, draft.fc.weight.device
            what = "the head's hidden state and draft_features"
        elif hasattr(getattr(draft, "config", None), "hidden_size"):
            width, what, device = draft.config.hidden_size, "the draft's hidden state and draft_features", draft.device
        else:
            raise ValueError(f"policy: SpecDecPP reads a draft model's or a feature head's hidden state; this "
                             f"drafter ({type(draft).__name__}) has neither")
        self.model = policy._model
        _check_width(self.model, width + DRAFT_EXTRA_FEATURES, what, "SpecDecPP")
        self.model.to(device)
        self.weights = self.model.weights()
        # one fused call per draft step where the kernel runs (float32 on CPU), else torch ops
        self.fused = (device.type == "cpu" and ops.registered("acceptance_head", "CPU")
                      and all(t.dtype == torch.float32 for t in self.weights))
        self.column = GREEDY if call.greedy else SAMPLING
        self.verdicts = None

    def plan(self, state: RoundState) -> RoundPlan:
        threshold = self.policy.thresholds[self.call.greedy, state.rows > 1]
        survival: list[float] = []

        def goes_on(step: int, probs: Tensor, tokens: Tensor, hidden: Tensor | None = None) -> Tensor:
            accept = self._accept(probs, hidden).tolist()
            # the survival products and the verdict in Python floats: the loop syncs on the
            # verdict anyway, and each tensor op here costs ~10 us after a draft forward; the two
            # verdict tensors are made once per batch size and shared: callers read them only
            survival[:] = accept if step == 1 else [s * a for s, a in zip(survival, accept)]
            if self.verdicts is None or len(self.verdicts[0]) != len(accept):
                self.verdicts = [torch.full((len(accept),), go, dtype=torch.bool, device=probs.device)
                                 for go in (False, True)]
            return self.verdicts[int(1 - sum(survival) / len(survival) <= threshold)]
        return RoundPlan([self.policy.max_draft] * state.rows, stop=goes_on)

    def _accept(self, probs: Tensor, hidden: Tensor) -> Tensor:
        if self.fused and hidden.dtype == torch.float32:
            return ops.acceptance_head(hidden, probs, self.weights, self.column, LAYER_NORM_EPS, validate=False)
        return torch.sigmoid(self.model(draft_features(hidden, probs))[:, self.column])


@register
@dataclass(frozen=True)
class AdaLength(Policy):
    """AdaEAGLE's lightweight draft-length predictor: each round drafts
    ceil(predicted accepted length + ``offset``) tokens, between 1 and ``max_draft``.

    A batch drafts as one, to the mean of its rows' predicted lengths: each draft forward
    and the verification's width are paid for the longest row.

    Args:
        predictor: path of a safetensors predictor, a :class:`ResidualMLP` or None for
            the bundled pair's (``policies/adalength.safetensors``).
        offset: one value for every case, or None for the values tuned with the predictor
            (for greedy and for sampling, at batch 1 and for batches).
        max_draft: None takes the value tuned with the predictor.
    """
    reads_target: ClassVar[bool] = True
    reads_agreement: ClassVar[bool] = True
    predictor: object = None
    offset: float | None = None
    max_draft: int | None = None

    def __post_init__(self):
        settings = _loaded(self, "adalength", "offset", 0.0)
        object.__setattr__(self, "first_round", settings.get("first_round", 3))

    def start(self, call: Call) -> Controller:
        return _AdaLength(self, call)


class _AdaLength(Controller):
    per_row = ("k", "before")

    def __init__(self, policy: AdaLength, call: Call):
        super().__init__(policy, call)
        target = call.target
        self.model = policy._model
        _check_width(self.model, 2 * target.config.hidden_size + HISTORY_FEATURES,
                     "[target input embedding; target hidden state; history_features]", "AdaLength")
        self.embed = input_embedding(target)
        self.model.to(target.device)
        self.k = [min(policy.first_round, policy.max_draft)] * call.batch_size
        self.before = [0] * call.batch_size  # positions the draft agreed on in a row before the next root

    def plan(self, state: RoundState) -> RoundPlan:
        features = None if state.target_hidden is None else \
            torch.cat([self.embed(state.roots).float(), state.target_hidden.float()], -1)

        def length(agreed: Tensor | None) -> list[int]:
            # the run goes on through the bonus token only if the draft agrees with it too, as the
            # training data counts it
            if agreed is not None:
                self.before = [before if ok else 0 for before, ok in zip(self.before, agreed.tolist())]
            if features is not None:
                history = history_features(torch.tensor(self.before, device=features.device))
                greedy = self.call.greedy
                offset = self.policy.offsets[greedy, len(self.before) > 1]
                column = GREEDY if greedy else SAMPLING
                predicted = self.model(torch.cat([features, history], -1))[:, column].mean() + offset
                self.k = [int(predicted.ceil().clamp(1, self.policy.max_draft))] * len(self.before)
            return list(self.k)
        return RoundPlan(list(self.k), after_catch_up=length)

    def observe(self, report: Report) -> None:
        self.before = [min(self.policy.max_draft, before + a + 1) if a >= n else 0
                       for before, n, a in zip(self.before, report.drafted, report.accepted)]


class BranchPredictor:
    """SpecBranch's branch-point predictor: a 3-class residual MLP on [target input
    embedding of a row's new root; target hidden state that produced it] -> a
    :class:`BranchHint`: REJECT_ALL (the next draft is likely rejected: branch at once),
    DEFER (branch by the draft's confidence) or ACCEPT_ALL (the next drafts likely all pass:
    draft a plain chain). Six outputs: three for greedy decoding, three for sampling.

    Example:
        >>> policy = SpecBranch(predictor=BranchPredictor())   # the bundled pair's  # doctest: +SKIP
    """

    def __init__(self, predictor=None):
        self._model, _ = _predictor(predictor, "branch")
        if self._model.config["out_features"] != 6:
            raise ValueError(f"predictor: a branch predictor has 6 outputs, got {self._model.config['out_features']}")

    def bound(self, target):
        """Per call: (hidden [B,H], roots [B], greedy) -> a hint per row, for ``target``."""
        _check_width(self._model, 2 * target.config.hidden_size,
                     "[target input embedding; target hidden state]", "branch")
        embed = input_embedding(target)
        self._model.to(target.device)

        def classify(hidden: Tensor, roots: Tensor, greedy: bool) -> list[BranchHint]:
            features = torch.cat([embed(roots).float(), hidden.float()], -1)
            logits = self._model(features)[:, :3] if greedy else self._model(features)[:, 3:]
            return [BranchHint(c) for c in logits.argmax(-1).tolist()]
        return classify


@register
@dataclass(frozen=True)
class LearnedSpecBranch(SpecBranch):
    """:class:`spec_ext.policies.SpecBranch` with the bundled pair's branch-point
    predictor (``policies/branch.safetensors`` of :mod:`spec_ext.bundled`) or ``predictor`` (a path, a
    :class:`ResidualMLP` or a :class:`BranchPredictor`)."""

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.predictor, BranchPredictor):
            object.__setattr__(self, "predictor", BranchPredictor(self.predictor))
