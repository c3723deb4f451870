"""``generate`` and ``accelerate``: check the arguments, pick the engine the policy needs,
run it with the models' attention routed through spec_ext, and return what HF returns."""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from spec_ext import ops

from spec_ext.drafters import Drafter, MixedDrafter, OtherTokenizerDrafter, Sampler, build, kind_of, load, pad_rows
from spec_ext.engine.common import Output, Stats, prompt_rows
from spec_ext.engine.parallel import ParallelEngine
from spec_ext.engine.serial import SerialEngine
from spec_ext.engine.settings import SETTINGS, make_processors, resolve_settings, sampling_temperature, stop_strings
from spec_ext.engine.tensor_parallel import channel
from spec_ext.models import attention_implementation, split_size, vocabulary_size
from spec_ext.models.lean import why_not_lean
from spec_ext.policies import Call, Memory, Policy, Suffix, SuffixCache, resolve
from spec_ext.policies.learned import input_embedding
from spec_ext.vocab import fingerprint


def _invariant(invariant, target) -> bool:
    """generate's ``invariant`` for ``target`` (None: where it was measured no slower)."""
    if invariant is None:
        return target.device.type == "cpu" and target.dtype == torch.float16 and split_size(target) == 1 \
            and ops.registered("skinny_linear", "CPU") and ops.registered("tree_attention_invariant", "CPU") \
            and why_not_lean(target) is None
    if not isinstance(invariant, bool):
        raise ValueError(f"invariant: expected True, False or None, got {invariant!r}")
    if invariant and split_size(target) > 1:
        raise ValueError("invariant: a tensor-parallel target's shards sum their linear layers across ranks in "
                         "no fixed order; run it unsplit")
    return invariant


def _check_fast_linear(fast_linear) -> None:
    if not (isinstance(fast_linear, bool) or (isinstance(fast_linear, str) and fast_linear == "auto")):
        raise ValueError(f"fast_linear: expected 'auto', True or False, got {fast_linear!r}")


# generation_config fields that change what HF's generate computes and that spec_ext does
# not implement, with the values that change nothing: any other value is refused by name
NEUTRAL = {"encoder_repetition_penalty": (1.0,), "encoder_no_repeat_ngram_size": (0,), "num_beams": (1,),
           "num_beam_groups": (1,), "diversity_penalty": (0.0,), "force_words_ids": (), "constraints": (),
           "forced_bos_token_id": (), "forced_eos_token_id": (), "top_h": (), "penalty_alpha": (),
           "guidance_scale": (1.0,), "exponential_decay_length_penalty": (), "max_time": (),
           "watermarking_config": (), "prompt_lookup_num_tokens": (), "dola_layers": (),
           "return_dict_in_generate": (False,), "output_scores": (False,), "output_logits": (False,)}


def check_generation_config(model) -> None:
    """Refuse, by name, a ``generation_config`` setting that HF's generate would apply and
    spec_ext does not (it would otherwise be dropped silently)."""
    config = getattr(model, "generation_config", None)
    for name, neutral in NEUTRAL.items():
        value = getattr(config, name, None)
        if value is not None and value not in neutral:
            raise ValueError(f"generation_config.{name}={value!r}: not supported by spec_ext (HF's generate would "
                             f"apply it); set target.generation_config.{name} = None to decode without it")


def _check_tokenizer(tokenizer, target) -> None:
    """The tokenizer must be the target's: no more tokens than its logits have columns."""
    if tokenizer is None:
        return
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise ValueError(f"tokenizer: expected a transformers tokenizer, got {type(tokenizer).__name__}")
    if len(tokenizer) > vocabulary_size(target):
        raise ValueError(f"tokenizer: has {len(tokenizer)} tokens but the target's vocabulary has "
                         f"{vocabulary_size(target)}: pass the target's own tokenizer")


def _healed(target, tokenizer, input_ids, attention_mask):
    """HF's token healing of the prompts (``target.heal_tokens``): unpadded tensor prompts only."""
    if tokenizer is None:
        raise ValueError("token_healing: needs the target's tokenizer (pass tokenizer=)")
    if not isinstance(input_ids, Tensor):
        raise ValueError("token_healing: needs input_ids as a [B, L] tensor")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("token_healing: supported for prompts without padding (HF re-tokenises the healed "
                         "prompts and keeps the old attention mask)")
    healed = target.heal_tokens(input_ids, tokenizer)
    return healed, None


def token_ids(value, name: str) -> list[int]:
    """``value`` (an id, a list of ids, a 0-d or 1-d tensor, numpy integers) as a list of ints."""
    if value is None:
        return []
    if hasattr(value, "tolist"):  # tensors and numpy values
        value = value.tolist()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name}: expected a token id or a list of ids, got {value!r}")
    return list(values)


def _with_cache(policy: str | Policy, suffix_cache) -> str | Policy:
    """The call's policy with ``suffix_cache``: the names "auto", "ngram" and "suffix" become
    ``Suffix(suffix_cache)``; a :class:`Suffix` must hold that very cache."""
    if suffix_cache is None:
        return policy
    if not isinstance(suffix_cache, SuffixCache):
        raise ValueError(f"suffix_cache: expected a spec_ext.SuffixCache, got {type(suffix_cache).__name__}")
    if isinstance(policy, str) and policy.lower() in ("auto", "ngram", "suffix"):
        return Suffix(cache=suffix_cache)
    if isinstance(policy, Suffix) and policy.cache is suffix_cache:
        return policy
    raise ValueError(f"suffix_cache: drafts with policy 'auto', 'ngram' or 'suffix' (or a Suffix holding this "
                     f"cache), not {policy!r}")


# vocabulary sizes this far apart count as one tokenizer's embedding table padded (Qwen2.5-0.5B's 151936 beside
# Qwen2.5-7B's 152064); further apart, a pair without tokenizers is refused
PADDING = 512


def _across_tokenizers(draft, tokenizer, draft_tokenizer, mode: str, policy: Policy):
    """``draft`` as an :class:`OtherTokenizerDrafter` when it is a causal LM with a tokenizer of
    its own (``draft_tokenizer``, not the target's ``tokenizer``); else ``draft`` as it is. A
    kind that cannot have a tokenizer of its own is refused with ``draft_tokenizer``."""
    if draft_tokenizer is None:
        return draft
    if draft is None or not kind_of(draft).own_tokenizer:
        what = "None" if draft is None else kind_of(draft).describe
        raise ValueError(f"assistant_tokenizer: applies to a draft causal LM, not {what}: a head, a block drafter or "
                         f"MTP layers read the target's own hidden states and draft ids of the target's vocabulary "
                         f"(a reduced one maps to it by d2t); leave assistant_tokenizer unset")
    if tokenizer is None:
        raise ValueError("assistant_tokenizer: needs the target's tokenizer too (pass tokenizer=)")
    if fingerprint(draft_tokenizer, "assistant_tokenizer") == fingerprint(tokenizer, "tokenizer"):
        return draft  # one tokenizer: the plain drafter
    if policy.parallel:
        raise ValueError(f"policy: {type(policy).__name__} drafts beside the verification, from a draft that shares "
                         f"the target's tokens; a draft with another tokenizer runs with serial policies")
    return OtherTokenizerDrafter(draft, draft_tokenizer, tokenizer, mode, hidden=policy.reads_draft_hidden)


def _drafter(target, draft, policy: Policy) -> tuple[MixedDrafter, Policy]:
    """Check the models and make the call's drafting for ``draft``; the policy fitted to it
    (:meth:`Policy.fitted`)."""
    drafter = build(draft, policy)
    model = drafter.model_drafter
    if policy.drafts_elsewhere and split_size(target) > 1:
        raise ValueError("policy: PEARL(mode='distributed') with a tensor-parallel target: transformers' tensor "
                         "parallelism takes the whole default process group (WORLD_SIZE == tp_size), so no rank "
                         "is left for the draft; use PEARL(mode='threads'), whose draft runs on the leading rank")
    drafter.bind(target)
    if model is None:
        return drafter, policy
    policy = policy.fitted(model.max_depth, model.chain_length, kind_of(draft).describe)
    if model.model is not None and not isinstance(model, OtherTokenizerDrafter):
        vt, vd = vocabulary_size(target), vocabulary_size(model.model)
        if abs(vt - vd) > PADDING:
            raise ValueError(f"draft: its vocabulary has {vd} tokens and the target's {vt}, further apart than "
                             f"padding ({PADDING}): most likely another tokenizer. Pass the target's tokenizer "
                             f"and the draft's (tokenizer=..., assistant_tokenizer=...) to draft across "
                             f"tokenizers")
    return drafter, policy


@dataclass(frozen=True)
class RoundTiming:
    """A sampled call's timing of rounds (:class:`spec_ext.policies.base.TimesRounds`): the
    serial engine on random prompts of ``PROMPT`` ids below ``vocab``, with ``target``, a
    drafter built from ``draft`` for ``policy``, and the call's ``sampling`` (the Sampler's
    arguments, its processors aside). Its ``key``: the sampling's settings that are set (the
    warpers past temperature cost time; their values hardly do)."""
    target: object
    draft: object
    policy: Policy
    vocab: int
    sampling: dict

    PROMPT: ClassVar[int] = 32

    @property
    def key(self) -> tuple:
        return tuple(sorted(name for name, value in self.sampling.items()
                            if value is not None and name != "temperature"))

    def __call__(self, controller, rows: int) -> None:
        drafter, policy = _drafter(self.target, self.draft, self.policy)
        device = self.target.device
        generator = torch.Generator(device=device).manual_seed(0)
        prompts = torch.randint(0, self.vocab, (rows, self.PROMPT), device=device, generator=generator).tolist()
        loop = SerialEngine(self.target, drafter, policy, controller, prompts, controller.tokens,
                            Sampler(**self.sampling), set(), generator, None)
        loop.stop = _AfterLastRound(controller)
        loop.run()


@dataclass
class _AfterLastRound:
    """Stops every row once the controller's last round was observed (an engine's ``stop``)."""
    controller: object

    def cut(self, row: int, new: list[int], emitted: list[int]) -> int | None:
        return len(emitted) if self.controller.done else None


def inferred_mask(input_ids, pad_token_id, config_pad_token_id, eos_ids: list[int]) -> Tensor | None:
    """The attention mask HF's generate infers where none is given (``input_ids`` a [B, L]
    integer tensor): every position holding the pad id (the argument, else the generation
    config's, else the first EOS id) is masked where it occurs in the prompts and is not an EOS
    id; else none (None), with HF's warnings for a batch."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return None
    pad = pad_token_id if pad_token_id is not None else config_pad_token_id
    batched = input_ids.shape[0] > 1
    if pad is None and eos_ids:
        if batched:
            warnings.warn("The attention mask and the pad token id were not set, with a batched input. As a "
                          "consequence, you may observe unexpected behavior. Please pass your input's "
                          "`attention_mask` to obtain reliable results.", stacklevel=3)
        pad = eos_ids[0]
    if pad is None:
        return None
    pad = token_ids(pad, "pad_token_id")[0]
    if pad in eos_ids:
        if batched:
            warnings.warn("The attention mask is not set with a batched input, and cannot be inferred from input "
                          "because pad token is same as eos token. As a consequence, you may observe unexpected "
                          "behavior. Please pass your input's `attention_mask` to obtain reliable results.",
                          stacklevel=3)
        return None
    mask = input_ids.ne(pad)
    return None if bool(mask.all()) else mask.long()


# a draft that agrees this rarely over this many drafts is most likely not a draft of this target
UNRELATED_RATE, UNRELATED_DRAFTS = 0.02, 64


def warn_if_unrelated(target, draft, stats: Stats) -> None:
    """Warn (once, at the end of the call) when the draft model's proposals (not the text's)
    were almost never accepted: exact still, but slower than the target alone, and the likely cause, another
    tokenizer, cannot be seen in the configs (vocabularies may differ by padding)."""
    model = stats.by_source.get("model")
    drafted, accepted = (0, 0) if model is None else (model.drafted, model.accepted)
    if draft is None or drafted < UNRELATED_DRAFTS or accepted >= UNRELATED_RATE * drafted:
        return
    vt, vd = vocabulary_size(target), vocabulary_size(draft)
    sizes = f"vocabulary sizes {vd} and {vt}" if vd != vt else f"the same vocabulary size ({vt})"
    warnings.warn(f"draft: {accepted} of {drafted} drafts accepted; the output is exact but slower "
                  f"than the target alone. The likely cause: the draft uses another tokenizer than the target "
                  f"({sizes}); use a draft from the target's family", stacklevel=3)


_DRAFTER_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _drafter_turn(draft):
    """A :class:`~spec_ext.drafters.Drafter` the caller made holds one call's state (its caches,
    what its last call measured): calls given the same instance take turns, on any thread (a
    call on the thread that holds it, from a streamer or a processor, is refused). A loaded
    draft gets a drafter of its own per call, so those calls run at once."""
    if not isinstance(draft, Drafter):
        yield
        return
    with _DRAFTER_LOCKS_GUARD:  # (on the instance: a drafter need not be hashable)
        turn = draft.__dict__.setdefault("_spec_ext_turn", [threading.Lock(), None])
    if turn[1] == threading.get_ident():
        raise ValueError("draft: this Drafter is in a call on this thread already (a streamer or a processor "
                         "called generate again); give the inner call a drafter of its own")
    with turn[0]:
        turn[1] = threading.get_ident()
        try:
            yield
        finally:
            turn[1] = None


def _one_call_per_drafter(generate):
    @functools.wraps(generate)
    def call(target, draft, *args, **kwargs):
        with _drafter_turn(draft):
            return generate(target, draft, *args, **kwargs)
    return call


@_one_call_per_drafter
@torch.inference_mode()
def generate(target, draft, input_ids, attention_mask: Tensor | None = None, max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | Tensor | None = None, pad_token_id: int | None = None,
             policy: str | Policy = "auto", seed: int | None = None, streamer=None,
             fast_linear: bool | str = "auto", tokenizer=None, grammar=None, logits_processor=None,
             prefix_allowed_tokens_fn=None, assistant_tokenizer=None, tokenizer_mode: str = "auto",
             suffix_cache: SuffixCache | None = None, memory: Memory | None = None, invariant: bool | None = None,
             **settings) -> Output:
    """Speculative decoding of ``target`` with ``draft``: greedy output equals the
    target's own greedy output; sampled output follows the target's distribution.

    Args:
        target, draft: transformers decoder-only causal LMs (any that
            :func:`spec_ext.models.unsupported_reason` accepts) with one tokenizer; their
            vocabulary sizes may differ by padding (draft None with ``policy="ngram"``, or when
            the policy's draft runs on another rank). ``draft`` may also be a
            :class:`spec_ext.drafters.Drafter`, which brings its own policy; it holds one call's
            state, so calls given the same instance run one at a time.
        input_ids: [B, L] LongTensor (left-padded, with ``attention_mask``) or a list of
            token-id lists (ragged). Without ``attention_mask``, the mask is inferred as HF's
            generate infers it: the positions holding the pad id (``pad_token_id``, else the
            generation config's, else the first EOS id) are masked, unless it is an EOS id.
            Right padding (a row ending in masked positions): spec_ext continues each row's own
            text, where HF's generate continues after the pads (warned once).
        temperature: 0 for greedy; top_k / top_p as in HF, applied to target and draft alike.
        policy: a :class:`spec_ext.policies.Policy` or its lower-case name (default ``Auto``:
            no tuning, see the table in :mod:`spec_ext.policies`).
        memory: what the policy learned in earlier calls (:class:`spec_ext.policies.Memory`;
            ``accelerate`` keeps one per wrapped model): read at the start, added to at the end;
            None: the call starts afresh.
        seed: seeds a private generator; None uses torch's global generator.
        streamer: an HF streamer (batch size 1).
        fast_linear: ``"auto"`` (the default) or True: the target's linear layers (in the
            lean forward, or its float32 ``nn.Linear`` modules on the HF-modules path) take
            :func:`spec_ext.ops.skinny_linear` where its measured rule
            (``spec_ext.ops.linear.uses_kernel``: CPU float32, AVX2 + FMA
            or AVX-512, up to 16 token rows, 32 for large weights with short rows) says it is
            faster than F.linear, per layer and call (True also warns where it cannot apply);
            False: HF's own arithmetic (F.linear) for the target. Output is exact with
            respect to the forward used; skinny_linear's logits differ from HF's by float32
            rounding (a dot product summed in another order: a few units in the last place),
            so greedy text can differ from ``target.generate`` only where two tokens tie to
            within that rounding (not seen on the bundled pair's held-out prompts). The draft
            takes skinny_linear wherever it applies, whatever this says: its rounding
            changes only which tokens are proposed, never the output.
        invariant: the target's forward width-invariant (docs/invariance.md): a position's
            logits the same bits verified among others or decoded alone, so greedy output is
            bit-identical to ``policy=Plain()``'s (the same forward, no drafts) in every
            precision. True: the invariant linear and attention kernels (the lean forward, or
            the HF modules with their activations and rotary applied a position at a time);
            ValueError where there is no invariant kernel for its device and dtype. None (the
            default): True where it was measured no slower (a float16 target on the CPU on the
            lean forward), else False.
        tokenizer: the target's tokenizer (for ``grammar``, ``stop_strings`` and ``assistant_tokenizer``).
        assistant_tokenizer, tokenizer_mode: the draft's tokenizer, when it is not the target's
            (HF's name): the draft proposes across tokenizers (:class:`spec_ext.drafters.OtherTokenizerDrafter`),
            ``"tli"`` (its law on the shared tokens), ``"slem"`` (its text re-tokenised) or
            ``"auto"`` (TLI when the shared tokens cover 20% of the prompts'); exact either way;
            ``stats.tokenizer_mode`` says which ran.
        suffix_cache: a :class:`spec_ext.SuffixCache` kept across calls (and threads): suffix
            decoding (:class:`spec_ext.policies.Suffix`), each row drafting the most frequent
            continuations of its longest suffix found in earlier requests, or its own text;
            every finished row is added to it at the end of the call. With the policy
            "auto", "ngram" or "suffix" (or a Suffix holding this cache); stats count the
            cache's rounds apart (``cache_matched``, ``cache_drafted``, ``cache_accepted``).
        grammar: a :class:`spec_ext.Grammar`, or one per prompt (None for a free row): the new
            text follows it; EOS is forced when it completes.
        logits_processor, prefix_allowed_tokens_fn: HF's contract; called at every verified
            and drafted position with that position's own ``input_ids`` (the padded prompt,
            the committed tokens, the drafts before it), grouped by length: a processor must
            read a row's state from its ``input_ids`` alone (no state kept between calls).
        **settings: HF's generation settings by name (else the target's generation_config):
            repetition_penalty, no_repeat_ngram_size, bad_words_ids, min_length,
            min_new_tokens, sequence_bias, suppress_tokens, begin_suppress_tokens; when
            sampling min_p, typical_p, epsilon_cutoff, eta_cutoff and num_return_sequences;
            stop_strings and token_healing (with ``tokenizer``). Each applies to every
            verified position and to the drafts, so the output is HF's with the same settings.
    Returns:
        Output(sequences [B, L + new] as HF generate returns them, padded with
        ``pad_token_id`` after EOS; stats). A target split by transformers' tensor
        parallelism: call it on every rank with the same arguments; rank 0 runs the loop
        and every rank returns the same Output (see ``docs/distributed.md``).

    Example:
        >>> out = generate(target, draft, tokenizer("def f(", return_tensors="pt").input_ids,
        ...                max_new_tokens=32, policy="fixed")           # doctest: +SKIP
    """
    started = time.perf_counter()
    if isinstance(draft, (str, Path)):
        draft = load(draft, target)
    policy = resolve(_with_cache(policy, suffix_cache))
    drafting = _across_tokenizers(draft, tokenizer, assistant_tokenizer, tokenizer_mode, policy)
    drafter, policy = _drafter(target, drafting, policy)
    model = drafter.model_drafter
    draft = None if model is None else model.model
    across = model if isinstance(model, OtherTokenizerDrafter) else None
    _check_fast_linear(fast_linear)
    invariant = _invariant(invariant, target)
    check_generation_config(target)
    eos_ids = token_ids(eos_token_id if eos_token_id is not None else target.generation_config.eos_token_id,
                        "eos_token_id")
    call = resolve_settings(target, settings, eos_ids, logits_processor, prefix_allowed_tokens_fn,
                            sampling=(temperature or 0) > 0)
    _check_tokenizer(tokenizer, target)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed: expected an int or None, got {seed!r}")
    if call.token_healing:
        input_ids, attention_mask = _healed(target, tokenizer, input_ids, attention_mask)
    if attention_mask is None:
        attention_mask = inferred_mask(input_ids, pad_token_id, target.generation_config.pad_token_id, eos_ids)
    prompts = prompt_rows(input_ids, attention_mask, vocabulary_size(target))
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be a positive int, got {max_new_tokens!r}")
    limit = getattr(target.config, "max_position_embeddings", None)
    longest = max(map(len, prompts))
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"input_ids: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds "
                         f"the target's max_position_embeddings ({limit})")
    if streamer is not None and len(prompts) * call.num_return_sequences != 1:
        raise ValueError(f"streamer: supported for batch size 1 only (like HF streamers), got "
                         f"{len(prompts) * call.num_return_sequences} rows")
    if target.training and getattr(target.config, "attention_dropout", 0.0):
        raise ValueError(f"target: in train mode with attention_dropout={target.config.attention_dropout}; "
                         "spec_ext decodes without dropout (HF's generate would apply it): call target.eval()")
    eos = set(eos_ids)
    if pad_token_id is None:
        pad_token_id = target.generation_config.pad_token_id
        if pad_token_id is None:  # as HF: the first EOS id
            pad_token_id = eos_ids[0] if eos_ids else 0
    pad_token_id = token_ids(pad_token_id, "pad_token_id")[0]
    head = input_ids.to(target.device) if isinstance(input_ids, Tensor) else \
        pad_rows(prompts, pad_token_id, target.device, left=True)
    n = call.num_return_sequences
    if n > 1:  # as HF: row b's copies are rows b*n .. b*n+n-1
        prompts, head = [p for p in prompts for _ in range(n)], head.repeat_interleave(n, 0)
        call.processor.batch_ids = [b // n for b in range(len(prompts))]
    generator = None
    if seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(seed)
    # a draft of another tokenizer keeps its own vocabulary (its drafter maps it to the target's)
    fitted = [m for m in (target, None if across is not None else draft) if m is not None]
    processors = make_processors(call, prompts, max(map(vocabulary_size, fitted)), tokenizer, grammar,
                                 vocabulary_size(target))
    if processors is not None:
        if policy.parallel:
            raise ValueError(f"{', '.join(processors.names)}: not supported with {type(policy).__name__}, whose "
                             f"drafts run ahead of the verification whose tokens these settings read")
        processors.start(head.tolist(), prompts, head.shape[1] + max_new_tokens + policy.lookahead + 2,
                         target.device)
    sampler = Sampler(temperature, top_k, top_p, **call.warpers, processors=processors)
    split = channel(target)  # a tensor-parallel target: the leading rank runs the loop, the others follow
    if split is not None and policy.reads_target:  # (AdaLength embeds the roots on the leader alone)
        input_embedding(target)
    if split is not None and not split.leading:
        return split.follow(target)
    # the draft's rounding changes only which tokens are proposed, never the output; a draft
    # of another tokenizer keeps its own vocabulary
    own = contextlib.nullcontext() if across is None else \
        attention_implementation(across.model, fast_linear=fast_linear or "auto")
    with split.leading_run(target) if split is not None else contextlib.nullcontext(), \
            attention_implementation(*fitted, fast_linear=[fast_linear, fast_linear or "auto"][:len(fitted)],
                                     vocab_size=vocabulary_size(target), invariant=[invariant, False][:len(fitted)]), \
            own:
        if policy.parallel:
            loop = ParallelEngine(policy, target, draft, prompts, max_new_tokens, sampler, eos, generator, streamer,
                                  fast_linear)
        else:  # (a controller may time the target's forward when it starts: inside the block)
            timing = None if sampler.greedy else \
                RoundTiming(target, drafting, policy, min(map(vocabulary_size, fitted)),
                            dict(temperature=temperature, top_k=top_k, top_p=top_p, **call.warpers))
            controller = policy.start(Call(len(prompts), sampler.greedy, target, drafter.proposer,
                                           1 if model is None else model.drafts_per_forward,
                                           int(model is not None and model.drafts_every_round), memory, timing))
            loop = SerialEngine(target, drafter, policy, controller, prompts, max_new_tokens, sampler, eos, generator,
                                streamer)
        loop.stop = stop_strings(call, tokenizer, head.tolist())
        if streamer is not None:
            streamer.put(torch.tensor([prompts[0]]))
        stats = loop.run()
    if across is not None:
        stats.tokenizer_mode = across.mode_used or ""
    else:
        warn_if_unrelated(target, draft, stats)
    if streamer is not None:
        streamer.end()
    tail = pad_rows(loop.new, pad_token_id, target.device)
    cache = None if drafter.text is None else drafter.text.settings.cache
    if cache is not None:  # suffix decoding: the finished rows for the next calls
        for prompt, output in zip(prompts, loop.new):
            cache.add(prompt, output)
    stats.wall_time = time.perf_counter() - started
    stats.processing_time = 0.0 if processors is None else processors.seconds
    output = Output(torch.cat([head, tail], 1), stats)
    if split is not None:
        split.finish(output)
    return output


_HF_ARGS = {"input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
            "eos_token_id", "pad_token_id", "streamer", "seed", "tokenizer", "grammar", "logits_processor",
            "prefix_allowed_tokens_fn", "assistant_tokenizer", *SETTINGS}


class Accelerated:
    """The target model with a speculative ``generate``; every other attribute is the
    target's. ``last_stats`` holds the stats of the latest call to finish. Calls may come from
    several threads at once: the policy is a value, each call has its own controller, and
    what the policy learns across calls is one :class:`~spec_ext.policies.Memory` (``memory``)
    that every call reads at its start and adds to at its end, under its lock (a
    :class:`~spec_ext.drafters.Drafter` the caller made is one call's state: its calls take
    turns)."""

    def __init__(self, target, draft, policy: str | Policy = "auto", fast_linear: bool | str = "auto", tokenizer=None,
                 draft_tokenizer=None, tokenizer_mode: str = "auto", suffix_cache: SuffixCache | bool = True,
                 invariant: bool | None = None):
        if isinstance(draft, (str, Path)):
            draft = load(draft, target)
        if suffix_cache is True:  # a cache of its own, for the text-drafting policies named
            suffix_cache = SuffixCache() if isinstance(policy, str) and policy.lower() in ("ngram", "suffix") else None
        elif suffix_cache is False:
            suffix_cache = None
        self._target, self._draft = target, draft
        self._policy = resolve(_with_cache(policy, suffix_cache))
        self._fast_linear = fast_linear
        self._tokenizers = dict(tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer, tokenizer_mode=tokenizer_mode)
        with _drafter_turn(draft):
            _drafter(target, _across_tokenizers(draft, tokenizer, draft_tokenizer, tokenizer_mode, self._policy),
                     self._policy)
        _check_fast_linear(fast_linear)
        self._invariant = _invariant(invariant, target)
        self.memory = Memory()
        self.last_stats: Stats | None = None

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, *args, **kwargs):
        return self._target(*args, **kwargs)

    def generate(self, input_ids=None, attention_mask=None, max_new_tokens: int | None = None, do_sample=None,
                 temperature=None, top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, streamer=None,
                 seed=None, tokenizer=None, grammar=None, logits_processor=None, prefix_allowed_tokens_fn=None,
                 assistant_tokenizer=None, **settings) -> Tensor:
        """HF-style generate (see :func:`generate`); returns the sequences tensor.
        ``tokenizer`` / ``assistant_tokenizer`` default to those given to :func:`accelerate`.
        Unknown arguments raise ``ValueError`` rather than being ignored."""
        unsupported = {k: v for k, v in settings.items() if k not in SETTINGS}
        if unsupported:
            raise ValueError(f"{', '.join(sorted(unsupported))}: not supported by spec_ext's generate "
                             f"(supported: {', '.join(sorted(_HF_ARGS))})")
        if input_ids is None:
            raise ValueError("input_ids: required")
        config = self._target.generation_config
        temperature = sampling_temperature(do_sample, temperature, config)
        if max_new_tokens is None:  # as HF: max_new_tokens, else max_length counts the prompt, else 20 new
            max_new_tokens = config.max_new_tokens
            if max_new_tokens is None and config.max_length is not None:
                width = input_ids.shape[1] if isinstance(input_ids, Tensor) else max(map(len, input_ids))
                max_new_tokens = config.max_length - width
                if max_new_tokens < 1:
                    raise ValueError(f"generation_config.max_length={config.max_length}: leaves no new token after "
                                     f"a prompt of {width}; set max_new_tokens")
            max_new_tokens = 20 if max_new_tokens is None else max_new_tokens
        if temperature == 0:
            top_k, top_p = None, None
        else:
            top_k = config.top_k if top_k is None else top_k
            top_p = config.top_p if top_p is None else top_p
        out = generate(self._target, self._draft, input_ids, attention_mask, max_new_tokens, temperature, top_k,
                       top_p, eos_token_id, pad_token_id, self._policy, seed, streamer, self._fast_linear,
                       tokenizer=tokenizer or self._tokenizers["tokenizer"], grammar=grammar,
                       logits_processor=logits_processor, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                       assistant_tokenizer=assistant_tokenizer or self._tokenizers["assistant_tokenizer"],
                       tokenizer_mode=self._tokenizers["tokenizer_mode"], memory=self.memory,
                       invariant=self._invariant, **settings)
        self.last_stats = out.stats
        return out.sequences


def accelerate(target, draft, policy: str | Policy = "auto", fast_linear: bool | str = "auto", tokenizer=None,
               draft_tokenizer=None, tokenizer_mode: str = "auto", suffix_cache: SuffixCache | bool = True,
               invariant: bool | None = None) -> Accelerated:
    """Wrap ``target`` so that ``.generate(...)`` runs speculative decoding with ``draft``
    (``fast_linear`` and ``invariant``: see :func:`generate`; ``tokenizer`` and ``draft_tokenizer``: the
    target's and the draft's, for a draft of another tokenizer, set once for every call;
    ``tokenizer_mode``: see :func:`generate`).

    ``suffix_cache``: True (the default): with ``policy="ngram"`` or ``"suffix"`` the wrapper
    keeps a :class:`spec_ext.SuffixCache` (default budget, outputs only) for its own calls,
    so each call drafts from the earlier calls' outputs too (suffix decoding); a
    SuffixCache: that one (shared with other callers); False: no cache (plain ``NGram``).
    Other policies, and a Policy object given as it is, keep no cache of their own.

    Example:
        >>> fast = accelerate(target, draft, policy="fixed")            # doctest: +SKIP
        >>> fast.generate(input_ids, max_new_tokens=64)                 # doctest: +SKIP
    """
    return Accelerated(target, draft, policy, fast_linear, tokenizer, draft_tokenizer, tokenizer_mode, suffix_cache,
                       invariant)
