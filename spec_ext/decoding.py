"""The drafter-verifier loop on Hugging Face models, for ragged batches.

Each round, for every unfinished row at once: the draft proposes a chain (or a tree),
the target verifies it in one forward through :class:`SpecCache` and tree attention, a
rejection sampler keeps what the target's distribution allows, and both caches roll back
to what was kept. One host sync per round (the accepted counts), plus one per draft step
for adaptive policies that decide on the host when to stop drafting.

Cache convention: the target cache holds every committed token but the last, which is
the root of the next verification; the draft cache holds a prefix of the committed
tokens and catches up (``pending``) at the start of its next round.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spec_ext import hf, ops
from spec_ext.cache import SpecCache
from spec_ext.policies import Policy, resolve
from spec_ext.tree import build_tree


@dataclass
class Stats:
    """Counters of one generate call. ``rounds`` counts (row, verification) pairs."""
    target_calls: int = 0
    draft_calls: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    discarded: int = 0  # drafts thrown away unverified (parallel methods draft ahead)
    wall_time: float = 0.0
    accepted_lengths: list[int] = field(default_factory=list, repr=False)
    draft_lengths: list[int] = field(default_factory=list, repr=False)

    @property
    def rollback(self) -> int:
        """Drafts thrown away: verified and rejected, plus (parallel methods) unverified ones."""
        return self.drafted - self.accepted + self.discarded

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per row per target call."""
        return self.accepted / max(1, self.rounds)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(1e-9, self.wall_time)

    def as_dict(self) -> dict:
        return dict(target_calls=self.target_calls, draft_calls=self.draft_calls, rounds=self.rounds,
                    drafted=self.drafted, accepted=self.accepted, rollback=self.rollback,
                    mean_accepted=round(self.mean_accepted, 4), acceptance_rate=round(self.acceptance_rate, 4),
                    discarded=self.discarded, new_tokens=self.new_tokens, wall_time=round(self.wall_time, 4),
                    tokens_per_s=round(self.tokens_per_s, 2))


@dataclass
class Output:
    sequences: Tensor  # [B, prompt + new], like HF generate
    stats: Stats


class Sampler:
    """Temperature, top-k and top-p (HF semantics), applied identically to p and q."""

    def __init__(self, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None):
        if temperature is None or temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k: must be >= 1, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        self.greedy = temperature == 0
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def probs(self, logits: Tensor) -> Tensor:
        x = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, index = torch.sort(x, dim=-1)
            tail = torch.softmax(ordered, -1).cumsum(-1) <= 1 - self.top_p
            tail[..., -1] = False
            x = x.masked_fill(tail.scatter(-1, index, tail), float("-inf"))
        return torch.softmax(x, -1)


def _prompts(input_ids, attention_mask) -> list[list[int]]:
    if isinstance(input_ids, Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, L], got shape {tuple(input_ids.shape)}")
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)}, "
                                 f"got {tuple(attention_mask.shape)}")
            rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
        else:
            rows = input_ids.tolist()
    else:
        rows = [list(map(int, r)) for r in input_ids]
    if not rows:
        raise ValueError("input_ids: the batch is empty")
    for b, r in enumerate(rows):
        if not r:
            raise ValueError(f"input_ids: prompt {b} is empty")
    return rows


def _pad(rows: list[list[int]], value: int, device) -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)


def check_finite(logits: Tensor, model: str) -> None:
    """Raise unless ``logits`` (of ``model``, on the prompt) are all finite. The loops check
    each model once per call, on the prompt, and verify the rounds unchecked: NaN or inf
    logits (broken weights, float16 overflow) would otherwise decode into garbage."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"{model}: its logits on the prompt contain NaN or inf (check its weights and dtype)")


class _Rows:
    """Per-row output bookkeeping shared by the serial and the parallel loops; needs
    ``seqs``, ``new``, ``max_new``, ``eos``, ``stats`` and ``streamer``."""

    def _emit(self, r: int, tokens: list[int], num_drafted: int, num_accepted: int) -> bool:
        """Append row ``r``'s tokens of one verification, cut at max_new_tokens and at EOS,
        and count the round; True while the row goes on."""
        emitted = tokens[:self.max_new - len(self.new[r])]
        for n, tok in enumerate(emitted):
            if tok in self.eos:
                emitted = emitted[:n + 1]
                break
        self.seqs[r] += emitted
        self.new[r] += emitted
        self.stats.rounds += 1
        self.stats.drafted += num_drafted
        self.stats.accepted += num_accepted
        self.stats.accepted_lengths.append(num_accepted)
        self.stats.draft_lengths.append(num_drafted)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(emitted))
        return len(self.new[r]) < self.max_new and not (emitted and emitted[-1] in self.eos)


class _Loop(_Rows):
    def __init__(self, target, draft, prompts, max_new_tokens, sampler, eos, policy, generator, streamer):
        self.target, self.draft = target, draft
        self.sampler, self.eos, self.policy = sampler, eos, policy
        self.generator, self.streamer = generator, streamer
        self.device = target.device
        self.max_new = max_new_tokens
        self.seqs = [list(p) for p in prompts]
        self.new: list[list[int]] = [[] for _ in prompts]
        self.active = list(range(len(prompts)))
        capacity = max(len(p) for p in prompts) + max_new_tokens + policy.max_draft + 2
        self.tcache = SpecCache.for_model(target, len(prompts), capacity)
        self.dcache = SpecCache.for_model(draft, len(prompts), capacity)
        self.stats = Stats()
        self.draft_hidden = "draft_hidden" in policy.needs
        self.target_hidden = "target_hidden" in policy.needs
        self.bonus_agreement = "bonus_agreement" in policy.needs
        # per row: did the last round accept every draft, and the distribution p its bonus came from
        self.all_accepted = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        self.bonus_p: Tensor | None = None
        # a policy that never stops a row early needs no host sync per draft step
        self.adaptive = type(policy).keep_drafting is not Policy.keep_drafting
        if policy.kind == "tree":
            self.tree = build_tree(policy.parents)
            self.parents = self.tree.parents.to(self.device)
            self.tree_mask = self.tree.mask.to(self.device)
            self.depth = self.tree.depth[0].to(self.device)

    # ------------------------------------------------------------------ forwards
    def _target(self, ids: Tensor, positions: Tensor, mask=None, hidden=False):
        self.stats.target_calls += 1
        return hf.forward(self.target, ids, self.tcache, positions, mask, hidden)

    def _draft(self, ids: Tensor, positions: Tensor, mask=None, hidden=False):
        self.stats.draft_calls += 1
        return hf.forward(self.draft, ids, self.dcache, positions, mask, hidden)

    def prefill(self) -> None:
        heads = [s[:-1] for s in self.seqs]
        if max(map(len, heads)) == 0:
            return
        ids = _pad(heads, 0, self.device)
        out = self._target(ids, torch.arange(ids.shape[1], device=self.device).expand_as(ids),
                           hidden=self.target_hidden)
        check_finite(out[0] if self.target_hidden else out, "target")
        self.tcache.advance([len(h) for h in heads])
        if self.target_hidden and min(map(len, heads)) > 0:  # one-token prompts: the policy's first guess
            last = torch.tensor([len(h) - 1 for h in heads], device=self.device)
            rows = torch.arange(len(heads), device=self.device)
            roots = torch.tensor([s[-1] for s in self.seqs], device=self.device)
            self.policy.see_target(out[1][rows, last], roots)

    def _catch_up_draft(self) -> tuple[Tensor, Tensor | None]:
        """Feed the draft the committed tokens it has not seen; logits [B,V] after the last
        (and the hidden state [B,H] that produced them, for policies that need it)."""
        pending = [self.seqs[r][n:] for r, n in zip(self.active, self.dcache.host_lengths)]
        ids = _pad(pending, 0, self.device)
        positions = self.dcache.lengths[:, None] + torch.arange(ids.shape[1], device=self.device)
        out = self._draft(ids, positions, hidden=self.draft_hidden)
        if self.stats.draft_calls == 1:  # the prompt
            check_finite(out[0] if self.draft_hidden else out, "draft")
        last = torch.tensor([len(p) - 1 for p in pending], device=self.device)
        rows = torch.arange(len(pending), device=self.device)
        self.dcache.advance([len(p) for p in pending])
        if self.bonus_agreement:
            self.policy.see_bonus_agreement(self._bonus_agreement(out[0] if self.draft_hidden else out, ids, last))
        if self.draft_hidden:
            return out[0][rows, last], out[1][rows, last]
        return out[rows, last], None

    def _bonus_agreement(self, logits: Tensor, ids: Tensor, last: Tensor) -> Tensor:
        """[B] bool: rows whose last round accepted every draft and whose draft, at the last
        draft's position (logits [B,T,V] of the catch-up over ids [B,T]), agrees with the
        bonus token (ids[b, last[b]]); see :mod:`spec_ext.policies`."""
        if not self.all_accepted.any():  # also the first round: no bonus yet
            return self.all_accepted.clone()
        rows = torch.arange(len(ids), device=self.device)
        before = logits[rows, (last - 1).clamp_min(0)]
        if self.sampler.greedy:
            agreed = before.argmax(-1) == ids[rows, last]
        else:
            chance = torch.minimum(self.bonus_p, self.sampler.probs(before)).sum(-1)
            agreed = torch.rand(chance.shape, device=self.device, generator=self.generator) < chance
        # a row that drafted less than the batch fed its last draft while drafting (the
        # catch-up has only its bonus): its agreement is not known and counts as broken
        return agreed & self.all_accepted & (last >= 1)

    def _propose(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.sampler.greedy:
            return logits.argmax(-1), None
        q = self.sampler.probs(logits)
        return torch.multinomial(q, 1, generator=self.generator).squeeze(1), q

    # ------------------------------------------------------------------ rounds
    def chain_round(self) -> tuple[list[list[int]], list[int], list[int]]:
        B = len(self.active)
        logits, hidden = self._catch_up_draft()
        start = list(self.dcache.host_lengths)
        budget = self.policy.plan()
        kmax = max(budget)
        budget_t = torch.tensor(budget, device=self.device)
        drafts = torch.full((B, kmax), -1, dtype=torch.int64, device=self.device)
        q_all = None if self.sampler.greedy else torch.zeros(B, kmax, logits.shape[-1], device=self.device)
        num_draft = torch.zeros(B, dtype=torch.int64, device=self.device)
        going = torch.ones(B, dtype=torch.bool, device=self.device)
        extra_forwards, steps = 0, 0
        for step in range(1, kmax + 1):
            token, q = self._propose(logits)
            drafts[:, step - 1] = torch.where(going, token, -1)
            if q is not None:
                q_all[:, step - 1] = q
            num_draft += going
            steps = step
            going = going & (step < budget_t)
            if self.adaptive:
                going &= self.policy.keep_drafting(step, torch.softmax(logits, -1), token, hidden)
            if step == kmax or (self.adaptive and not bool(going.any())):
                break
            out = self._draft(token[:, None], self.dcache.lengths[:, None], hidden=self.draft_hidden)
            logits, hidden = (out[0][:, 0], out[1][:, 0]) if self.draft_hidden else (out[:, 0], None)
            self.dcache.advance([1] * B)
            extra_forwards += 1
        drafts = drafts[:, :steps]
        roots = torch.tensor([self.seqs[r][-1] for r in self.active], device=self.device)
        ids = torch.cat([roots[:, None], drafts.clamp_min(0)], 1)
        positions = self.tcache.lengths[:, None] + torch.arange(steps + 1, device=self.device)
        target_out = self._target(ids, positions, hidden=self.target_hidden)
        target_logits = target_out[0] if self.target_hidden else target_out
        # the loop builds the verification's inputs itself: no input checks (they cost 2.7% of
        # a greedy call at batch 1 on CPU); the models' logits were checked on the prompt
        if self.sampler.greedy:
            p, result = None, ops.greedy_verify(target_logits, drafts, num_draft, validate=False)
        else:
            p = self.sampler.probs(target_logits)
            result = ops.chain_rejection_sample(p, drafts, q_all[:, :steps], num_draft, generator=self.generator,
                                                validate=False)
        rows = torch.arange(B, device=self.device) if self.bonus_agreement or self.target_hidden else None
        if self.bonus_agreement:
            self.all_accepted = result.num_accepted == num_draft
            self.bonus_p = None if p is None else p[rows, result.num_accepted]
        if self.target_hidden:
            self.policy.see_target(target_out[1][rows, result.num_accepted], result.tokens[rows, result.num_accepted])
        tokens, accepted = result.tokens.tolist(), result.num_accepted.tolist()
        self.tcache.advance([a + 1 for a in accepted])
        self.dcache.rollback([s + min(a, extra_forwards) for s, a in zip(start, accepted)])
        return tokens, accepted, num_draft.tolist()

    def tree_round(self) -> tuple[list[list[int]], list[int], list[int]]:
        B = len(self.active)
        logits, _ = self._catch_up_draft()
        levels, branching = self.policy.levels, self.policy.branching
        T = len(self.policy.parents)
        nodes = torch.zeros(B, T, dtype=torch.int64, device=self.device)
        nodes[:, 0] = torch.tensor([self.seqs[r][-1] for r in self.active], device=self.device)
        nodes[:, levels[0]] = torch.topk(logits, branching[0], dim=-1).indices
        for d in range(1, len(levels)):
            n = levels[d - 1][-1] + 1  # the tree so far: nodes 0..n-1, root re-fed at its own position
            self.dcache.rollback([x - 1 for x in self.dcache.host_lengths])
            tree_logits = self._draft(nodes[:, :n], self.dcache.lengths[:, None] + self.depth[:n],
                                      self.tree_mask[:, :n])
            self.dcache.advance([1] * B)
            children = torch.topk(tree_logits[:, levels[d - 1]], branching[d], dim=-1).indices
            nodes[:, levels[d]] = children.reshape(B, -1)
        target_logits = self._target(nodes, self.tcache.lengths[:, None] + self.depth, self.tree_mask)
        drafts = nodes
        if self.sampler.greedy:
            result = ops.tree_greedy_verify(target_logits, drafts, self.parents, max_depth=self.tree.max_depth,
                                            validate=False)
        else:
            result = ops.tree_rejection_sample(self.sampler.probs(target_logits), drafts, self.parents,
                                               generator=self.generator, max_depth=self.tree.max_depth,
                                               validate=False)
        accepted = result.num_accepted.tolist()
        self.tcache.commit(result.path, accepted)
        return result.tokens.tolist(), accepted, [T - 1] * B

    # ------------------------------------------------------------------ bookkeeping
    def run(self) -> Stats:
        self.policy.start(len(self.active), self.sampler.greedy)
        self.prefill()
        while self.active:
            round_fn = self.tree_round if self.policy.kind == "tree" else self.chain_round
            tokens, accepted, drafted = round_fn()
            self.policy.observe(drafted, accepted)
            keep = []
            for i, r in enumerate(self.active):
                if self._emit(r, tokens[i][:accepted[i] + 1], drafted[i], accepted[i]):
                    keep.append(i)
            if len(keep) < len(self.active):
                self.tcache.keep_rows(keep)
                self.dcache.keep_rows(keep)
                self.policy.keep_rows(keep)
                if self.bonus_agreement:
                    self._keep_round_outcome(keep)
                self.active = [self.active[i] for i in keep]
        self.stats.new_tokens = sum(map(len, self.new))
        return self.stats

    def _keep_round_outcome(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.all_accepted = self.all_accepted[index]
        if self.bonus_p is not None:
            self.bonus_p = self.bonus_p[index]


def _check_fast_linear(fast_linear) -> None:
    if not isinstance(fast_linear, bool):
        raise ValueError(f"fast_linear: expected True or False, got {fast_linear!r}")


def _check_models(target, draft, policy: Policy) -> None:
    if draft is None:
        if getattr(policy, "mode", None) != "distributed":
            raise ValueError("draft: required (None only with a policy whose draft runs on another rank, "
                             "e.g. PEARL(mode='distributed'))")
        hf.check_model(target, "target")
    else:
        hf.check_pair(target, draft)


@torch.inference_mode()
def generate(target, draft, input_ids, attention_mask: Tensor | None = None, max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             policy: str | Policy = "svip", seed: int | None = None, streamer=None,
             fast_linear: bool = False) -> Output:
    """Speculative decoding of ``target`` with ``draft``: greedy output equals the
    target's own greedy output; sampled output follows the target's distribution.

    Args:
        target, draft: transformers Llama/Qwen2/Mistral causal LMs with the same vocabulary
            (draft None when the policy's draft runs on another rank).
        input_ids: [B, L] LongTensor (left-padded, with ``attention_mask``) or a list of
            token-id lists (ragged).
        temperature: 0 for greedy; top_k / top_p as in HF, applied to target and draft alike.
        policy: a :class:`spec_ext.policies.Policy` or its lower-case name.
        seed: seeds a private generator; None uses torch's global generator.
        streamer: an HF streamer (batch size 1).
        fast_linear: run the target's linear layers through :func:`spec_ext.ops.skinny_linear`
            too (CPU float32 Llama-family models; 2-4x faster matmuls at decode and
            verification sizes). Output is then exact with respect to that forward, whose
            logits differ from HF's by float32 rounding: greedy text can differ from
            ``target.generate`` where two tokens tie to within that rounding. The draft
            takes skinny_linear wherever it applies, whatever this says: its rounding
            changes only which tokens are proposed, never the output.
    Returns:
        Output(sequences [B, L + new] as HF generate returns them, padded with
        ``pad_token_id`` after EOS; stats).

    Example:
        >>> out = generate(target, draft, tokenizer("def f(", return_tensors="pt").input_ids,
        ...                max_new_tokens=32, policy="fixed")           # doctest: +SKIP
    """
    started = time.perf_counter()
    policy = resolve(policy)
    _check_models(target, draft, policy)
    _check_fast_linear(fast_linear)
    prompts = _prompts(input_ids, attention_mask)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be a positive int, got {max_new_tokens!r}")
    limit = getattr(target.config, "max_position_embeddings", None)
    longest = max(map(len, prompts))
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"input_ids: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds "
                         f"the target's max_position_embeddings ({limit})")
    if streamer is not None and len(prompts) != 1:
        raise ValueError(f"streamer: supported for batch size 1 only (like HF streamers), got {len(prompts)} rows")
    eos = eos_token_id if eos_token_id is not None else target.generation_config.eos_token_id
    eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    if pad_token_id is None:
        pad_token_id = target.generation_config.pad_token_id
        if pad_token_id is None:
            pad_token_id = min(eos) if eos else 0
    generator = None
    if seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(seed)
    policy.bind(target, draft)
    models = [m for m in (target, draft) if m is not None]
    for model, role in zip(models, ("target", "draft")):
        ahead = policy.lookahead if policy.kind == "parallel" else policy.max_draft
        hf.check_window(model, role, longest + max_new_tokens + ahead + 1)
    sampler = Sampler(temperature, top_k, top_p)
    if policy.kind == "parallel":
        loop = policy.make_loop(target, draft, prompts, max_new_tokens, sampler, eos, generator, streamer,
                                fast_linear)
    else:
        loop = _Loop(target, draft, prompts, max_new_tokens, sampler, eos, policy, generator, streamer)
    if streamer is not None:
        streamer.put(torch.tensor([prompts[0]]))
    # the draft's rounding changes only which tokens are proposed, never the output
    with hf.attention_implementation(*models, fast_linear=[fast_linear, fast_linear or "auto"][:len(models)]):
        stats = loop.run()
    if streamer is not None:
        streamer.end()
    if isinstance(input_ids, Tensor):
        head = input_ids.to(target.device)
    else:
        head = torch.tensor([[pad_token_id] * (longest - len(p)) + p for p in prompts], device=target.device)
    width = max(map(len, loop.new))
    tail = torch.tensor([n + [pad_token_id] * (width - len(n)) for n in loop.new], dtype=torch.int64,
                        device=target.device)
    stats.wall_time = time.perf_counter() - started
    return Output(torch.cat([head, tail], 1), stats)


_HF_ARGS = {"input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
            "eos_token_id", "pad_token_id", "streamer", "seed"}


class Accelerated:
    """The target model with a speculative ``generate``; every other attribute is the
    target's. ``last_stats`` holds the stats of the latest call."""

    def __init__(self, target, draft, policy: str | Policy = "svip", fast_linear: bool = False):
        self._target, self._draft, self._policy = target, draft, resolve(policy)
        self._fast_linear = fast_linear
        _check_models(target, draft, self._policy)
        _check_fast_linear(fast_linear)
        self.last_stats: Stats | None = None

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, *args, **kwargs):
        return self._target(*args, **kwargs)

    def generate(self, input_ids=None, attention_mask=None, max_new_tokens: int | None = None, do_sample=None,
                 temperature=None, top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, streamer=None,
                 seed=None, **unsupported) -> Tensor:
        """HF-style generate (see :func:`generate`); returns the sequences tensor.
        Unknown arguments raise ``ValueError`` rather than being ignored."""
        if unsupported:
            raise ValueError(f"{', '.join(sorted(unsupported))}: not supported by spec_ext's generate "
                             f"(supported: {', '.join(sorted(_HF_ARGS))})")
        if input_ids is None:
            raise ValueError("input_ids: required")
        config = self._target.generation_config
        do_sample = config.do_sample if do_sample is None else do_sample
        temperature = (config.temperature or 1.0) if temperature is None else temperature
        if max_new_tokens is None:
            max_new_tokens = config.max_new_tokens or 20
        if not do_sample:
            temperature, top_k, top_p = 0.0, None, None
        else:
            top_k = config.top_k if top_k is None else top_k
            top_p = config.top_p if top_p is None else top_p
        out = generate(self._target, self._draft, input_ids, attention_mask, max_new_tokens, temperature, top_k,
                       top_p, eos_token_id, pad_token_id, self._policy, seed, streamer, self._fast_linear)
        self.last_stats = out.stats
        return out.sequences


def accelerate(target, draft, policy: str | Policy = "svip", fast_linear: bool = False) -> Accelerated:
    """Wrap ``target`` so that ``.generate(...)`` runs speculative decoding with ``draft``
    (``fast_linear``: see :func:`generate`).

    Example:
        >>> fast = accelerate(target, draft, policy="fixed")            # doctest: +SKIP
        >>> fast.generate(input_ids, max_new_tokens=64)                 # doctest: +SKIP
    """
    return Accelerated(target, draft, policy, fast_linear)
