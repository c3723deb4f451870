"""HF's logits settings and user processors under speculation: greedy output equal to
``target.generate`` with the same settings on a ragged batch with EOS, for every drafter
shape; sampled output following the law HF's own processor classes give (the oracle);
the drafts processed like the target (a draft equal to the target is always accepted)."""
import copy

import numpy as np
import pytest
import torch
from transformers import generation as g

import spec_ext
from spec_ext.policies import Fixed
from helpers import PROMPT, VOCAB, assert_follows, byte_tokenizer, llama, make_policy, perturbed

PROMPTS = [[1, 5, 9, 11, 3, 7, 12], [1, 4, 4], [1, 2, 8, 9, 30, 31, 32, 33, 5, 6]]
MAX_NEW = 24
POLICIES = ["fixed", "auto", "tree", "dynamictree", "ngram", "heuristic", "confidence", "plain"]


@pytest.fixture(scope="module")
def pair():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.003, seed=1)


def padded(prompts):
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf(target, eos, **settings):
    ids, mask = padded(PROMPTS)
    return target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                           pad_token_id=0, **settings)


def free_run(target):
    return hf(target, eos=[])[:, padded(PROMPTS)[0].shape[1]:].tolist()


def settings_cases(target):
    """Each setting, with values that change what this target writes (checked by the test)."""
    free = free_run(target)
    row0, row1 = free[0], free[1]
    return {
        "repetition_penalty": dict(repetition_penalty=1.3),
        "repetition_reward": dict(repetition_penalty=0.7),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[row1[2]], row0[3:5]]),
        "sequence_bias": dict(sequence_bias={(row0[4],): -4.0, tuple(row0[1:3]): -9.0, (17,): 2.5}),
        "min_length": dict(min_length=20, eos_token_id=row0[2]),
        "min_new_tokens": dict(min_new_tokens=14, eos_token_id=row0[2]),
        "min_new_tokens_over_min_length": dict(min_new_tokens=4, min_length=40, eos_token_id=row0[2]),
        "suppress_tokens": dict(suppress_tokens=[row0[1], row1[3]]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[row0[0], row1[0]]),
        "all": dict(repetition_penalty=1.2, no_repeat_ngram_size=3, bad_words_ids=[row0[3:5]],
                    sequence_bias={(row0[4],): -2.0}, min_new_tokens=5, suppress_tokens=[row1[3]],
                    begin_suppress_tokens=[row0[0]], eos_token_id=row0[6]),
    }


def eos_of(settings, free):
    """The setting's own EOS, else a token row 0 writes at step 6 (so rows end early)."""
    return settings.pop("eos_token_id", free[0][6])


@pytest.mark.parametrize("name", ["repetition_penalty", "repetition_reward", "no_repeat_ngram_size", "bad_words_ids",
                                  "sequence_bias", "min_length", "min_new_tokens", "min_new_tokens_over_min_length",
                                  "suppress_tokens", "begin_suppress_tokens", "all"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_hf_with_setting(pair, name, policy):
    target, draft = pair
    settings = dict(settings_cases(target)[name])
    eos = eos_of(settings, free_run(target))
    expected = hf(target, eos, **settings)
    assert not torch.equal(expected, hf(target, eos)), f"{name} changes nothing here"
    ids, mask = padded(PROMPTS)
    out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                            pad_token_id=0, policy=make_policy(policy, target, draft), **settings)
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 0 if policy != "plain" else out.stats.drafted == 0
    assert out.stats.processing_time > 0


@pytest.mark.parametrize("name", ["repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias",
                                  "min_new_tokens", "all"])
@pytest.mark.parametrize("policy", ["fixed", "tree"])
def test_drafts_are_processed_like_the_target(pair, name, policy):
    """A draft equal to the target, processed with each draft's own prefix, proposes what the
    target keeps: a chain is accepted whole, a tree's first path always."""
    target, _ = pair
    settings = dict(settings_cases(target)[name])
    eos = eos_of(settings, free_run(target))
    ids, mask = padded(PROMPTS)
    out = spec_ext.generate(target, copy.deepcopy(target), ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                            eos_token_id=eos, pad_token_id=0, policy=policy, **settings)
    assert torch.equal(out.sequences, hf(target, eos, **settings))
    # the draft's own rounding (skinny_linear) may split a near tie, rarely
    if policy == "fixed":
        assert out.stats.acceptance_rate > 0.97
    else:  # the tree's top-1 path, its depth (4), is accepted each round: as many forwards as a chain of 4
        # accepted whole, and one more (a tree's first round emits a token and drafts none)
        chain = spec_ext.generate(target, copy.deepcopy(target), ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                  eos_token_id=eos, pad_token_id=0, policy=Fixed(4), **settings)
        assert chain.stats.acceptance_rate > 0.97 and out.stats.target_calls <= chain.stats.target_calls + 1


@pytest.mark.parametrize("policy", ["fixed", "dynamictree"])
def test_settings_with_a_feature_head(policy):
    from test_heads import echo_head
    target = llama(61, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", draft_vocab=40, noise=0.01)
    ids, mask = padded(PROMPTS)
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=[[7, 8]], min_new_tokens=3)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[],
                               pad_token_id=0, **settings)
    out = spec_ext.generate(target, head, ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=[],
                            pad_token_id=0, policy=policy, **settings)
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 0


def test_accelerate_reads_the_generation_config(pair):
    """Settings in the target's generation_config apply as in HF's generate; an argument wins."""
    target, draft = pair
    target = copy.deepcopy(target)
    target.generation_config.repetition_penalty = 1.3
    target.generation_config.no_repeat_ngram_size = 3
    ids, mask = padded(PROMPTS)
    fast = spec_ext.accelerate(target, draft, policy="fixed")
    for kw in ({}, dict(repetition_penalty=1.1)):
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                                   eos_token_id=[], pad_token_id=0, **kw)
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[],
                            pad_token_id=0, **kw)
        assert torch.equal(got, expected)


# ------------------------------------------------------------------ user processors
class BanSuccessor(g.LogitsProcessor):
    """Bans (last token * 7 + 3) mod V: reads only input_ids, as the contract asks."""

    def __call__(self, input_ids, scores):
        banned = (input_ids[:, -1] * 7 + 3) % scores.shape[-1]
        return scores.scatter(1, banned[:, None], float("-inf"))


def allow_even_after_odd(batch_id, input_ids):
    last = int(input_ids[-1])
    return list(range(0, 97, 2)) if last % 2 else list(range(batch_id % 2, 97, 2 - batch_id % 2))


@pytest.mark.parametrize("policy", ["fixed", "tree", "ngram", "confidence"])
def test_user_processors_and_prefix_fn_equal_hf(pair, policy):
    target, draft = pair
    eos = free_run(target)[0][6]
    processors = g.LogitsProcessorList([BanSuccessor(), g.RepetitionPenaltyLogitsProcessor(1.5)])
    for kw in (dict(logits_processor=processors), dict(prefix_allowed_tokens_fn=allow_even_after_odd),
               dict(logits_processor=processors, prefix_allowed_tokens_fn=allow_even_after_odd,
                    repetition_penalty=1.1)):
        expected = hf(target, eos, **kw)
        assert not torch.equal(expected, hf(target, eos))
        ids, mask = padded(PROMPTS)
        out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                pad_token_id=0, policy=policy, **kw)
        assert torch.equal(out.sequences, expected), kw


@pytest.mark.parametrize("policy", ["fixed", "tree", "ngram", "heuristic"])
def test_prefix_fn_that_allows_nothing_off_its_constraint(pair, policy):
    """GENRE's pattern: the function walks a trie of allowed continuations and returns [] off it.
    Drafts off the trie are processed (and rejected) without an error; HF's output results."""
    target, draft = pair
    ids, mask = padded(PROMPTS)
    width = ids.shape[1]
    free = free_run(target)
    eos = 96
    allowed_texts = [free[0][:5] + [eos], free[0][:2] + [40, 41, eos], [44, 45, eos]]

    def trie(batch_id, input_ids):
        done = input_ids[width:].tolist()
        return sorted({t[len(done)] for t in allowed_texts if t[:len(done)] == done and len(t) > len(done)})

    expected = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                               pad_token_id=0, prefix_allowed_tokens_fn=trie)
    out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                            pad_token_id=0, policy=policy, prefix_allowed_tokens_fn=trie)
    assert torch.equal(out.sequences, expected)
    assert (expected[:, width:] == eos).any(1).all()


def test_user_processor_sees_each_position_prefix(pair):
    """Every call gets whole prefixes: the padded prompt, the committed tokens, the drafts before it."""
    target, draft = pair
    seen = []

    def record(input_ids, scores):
        seen.extend(map(tuple, input_ids.tolist()))
        return scores

    ids, mask = padded(PROMPTS)
    out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=[],
                            pad_token_id=0, policy="fixed", logits_processor=[record])
    final = [tuple(r) for r in out.sequences.tolist()]
    for row in final:  # every prefix HF would have passed is among the calls
        for end in range(ids.shape[1], len(row)):
            assert row[:end] in seen
    assert all(len(s) >= ids.shape[1] and s[:ids.shape[1]] in map(tuple, ids.tolist()) for s in seen)
    assert all(t >= 0 for s in seen for t in s), "no call sees a padded draft"


# ------------------------------------------------------------------ sampling laws
@pytest.fixture(scope="module")
def sampling_pair():
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    return target, perturbed(target, 0.01, seed=11)


def hf_joint(target, processors, steps=3, prompt=PROMPT):
    """P(x1..x_steps | prompt) with HF's processor classes on the target's logits, by enumeration."""
    joint = {(): 1.0}
    for _ in range(steps):
        prefixes = list(joint)
        ids = torch.tensor([list(prompt) + list(p) for p in prefixes])
        with torch.no_grad():
            scores = target(ids).logits[:, -1].float()
        for processor in processors:
            scores = processor(ids, scores)
        probs = torch.softmax(scores, -1).double()
        joint = {p + (x,): joint[p] * float(probs[i, x]) for i, p in enumerate(prefixes) for x in range(VOCAB)}
    return joint


SAMPLING = {
    "repetition_penalty": (dict(repetition_penalty=1.6), [g.RepetitionPenaltyLogitsProcessor(1.6)]),
    "no_repeat_ngram": (dict(no_repeat_ngram_size=2), [g.NoRepeatNGramLogitsProcessor(2)]),
    "bad_words": (dict(bad_words_ids=[[3], [5, 2]]), [g.NoBadWordsLogitsProcessor([[3], [5, 2]])]),
    "min_p": (dict(min_p=0.5), [g.MinPLogitsWarper(0.5)]),
    "typical_p": (dict(typical_p=0.6), [g.TypicalLogitsWarper(0.6)]),
    "epsilon": (dict(epsilon_cutoff=0.15), [g.EpsilonLogitsWarper(0.15)]),
    "eta": (dict(eta_cutoff=0.5), [g.EtaLogitsWarper(0.5)]),
    "penalty_top_k_min_p": (dict(repetition_penalty=1.4, top_k=5, min_p=0.05, temperature=0.8),
                            [g.RepetitionPenaltyLogitsProcessor(1.4), g.TemperatureLogitsWarper(0.8),
                             g.TopKLogitsWarper(5), g.MinPLogitsWarper(0.05)]),
}


SAMPLING_CASES = [(name, "fixed") for name in SAMPLING]
SAMPLING_CASES += [("repetition_penalty", "tree"), ("no_repeat_ngram", "tree"), ("penalty_top_k_min_p", "tree"),
                   ("bad_words", "dynamictree"), ("typical_p", "dynamictree"),
                   ("penalty_top_k_min_p", "plain"), ("no_repeat_ngram", "plain")]


@pytest.mark.parametrize("name,policy", SAMPLING_CASES)
def test_sampling_follows_hf_processors(sampling_pair, name, policy):
    target, draft = sampling_pair
    settings, oracle = SAMPLING[name]
    settings = dict(settings)
    temperature = settings.pop("temperature", 1.0)
    n = 20_000
    out = spec_ext.generate(target, draft, [PROMPT] * n, max_new_tokens=3, temperature=temperature,
                            eos_token_id=[], policy=policy, seed=len(name) + len(policy), **settings)
    joint = hf_joint(target, oracle)
    plain = hf_joint(target, [g.TemperatureLogitsWarper(temperature)])
    distance = sum(abs(joint[k] - plain[k]) for k in joint) / 2
    assert distance > 0.05, f"{name} changes the law too little to test (total variation {distance:.3f})"
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), joint)
    assert out.stats.accepted > 0 if policy != "plain" else out.stats.drafted == 0


def test_sampling_with_user_processor_and_repeated_rows(sampling_pair):
    """A user processor under sampling, and num_return_sequences: rows b*n .. b*n+n-1 are the
    copies of prompt b, each following the processed law."""
    target, draft = sampling_pair

    class BanTwiceLast(g.LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.scatter(1, (2 * input_ids[:, -1:]) % VOCAB, float("-inf"))

    n = 6000
    out = spec_ext.generate(target, draft, [PROMPT, [2, 4]] * (n // 2), max_new_tokens=3, temperature=1.0,
                            eos_token_id=[], policy="fixed", seed=5, logits_processor=[BanTwiceLast()],
                            num_return_sequences=2)
    assert out.sequences.shape[0] == 2 * n
    rows = out.sequences[:, -3:].numpy()
    assert_follows(rows[np.arange(2 * n) % 4 < 2], hf_joint(target, [BanTwiceLast()]))  # the copies of PROMPT
    assert not np.array_equal(rows[0::4], rows[1::4]), "the copies of a prompt are drawn independently"


# ------------------------------------------------------------------ refusals
def test_refusals(pair):
    target, draft = pair
    ids, mask = padded(PROMPTS)
    with pytest.raises(ValueError, match="num_return_sequences=2: greedy"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, num_return_sequences=2)
    with pytest.raises(ValueError, match="repetition_penalty: must be a positive number"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, repetition_penalty=0)
    with pytest.raises(ValueError, match="no_repeat_ngram_sizes: not a generation setting"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, no_repeat_ngram_sizes=2)
    with pytest.raises(ValueError, match="repetition_penalty: not supported with PEARL"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, policy="pearl", repetition_penalty=1.1)
    with pytest.raises(ValueError, match="bad_words_ids: leave no legal next token"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, bad_words_ids=[[t] for t in range(97)],
                          eos_token_id=[])
    with pytest.raises(ValueError, match="sequence_bias / bad_words_ids: token ids \\[500\\] are past the target"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, sequence_bias={(500,): 1.0})
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn: returned an empty list"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, prefix_allowed_tokens_fn=lambda b, x: [])

    class Stateful:
        __module__ = "xgrammar.contrib.hf"

        def __call__(self, input_ids, scores):
            return scores

    with pytest.raises(ValueError, match="xgrammar's HF LogitsProcessor keeps state"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, logits_processor=[Stateful()])
    with pytest.raises(ValueError, match="PrefixConstrainedLogitsProcessor is not supported .* prefix_allowed_tokens_fn"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, logits_processor=[
            g.PrefixConstrainedLogitsProcessor(allow_even_after_odd, 1)])
    with pytest.raises(ValueError, match="stop_strings: needs the target's tokenizer"):
        spec_ext.generate(target, draft, ids, attention_mask=mask, stop_strings=["ab"])


# ------------------------------------------------------------------ stop strings, token healing
@pytest.fixture(scope="module")
def text_pair():
    tokenizer = byte_tokenizer()
    target = llama(len(tokenizer), 32, 2, seed=3, sharpen=3.0)
    return tokenizer, target, perturbed(target, 0.01, seed=4)


def test_stop_strings_equal_hf(text_pair):
    """A row ends at the token that completes a stop string (which may span tokens), as HF's."""
    tokenizer, target, draft = text_pair
    prompts = [[1, 70, 71], [1, 72], [1, 80, 81, 82, 83]]
    ids, mask = padded(prompts)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=[],
                           pad_token_id=0)
    texts = [tokenizer.decode(r) for r in free[:, ids.shape[1]:].tolist()]
    stops = [texts[0][8:10], texts[2][14:17]]  # strings these rows write, across tokens or not
    for policy in ("fixed", "tree", "ngram"):
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=[],
                                   pad_token_id=0, stop_strings=stops, tokenizer=tokenizer)
        assert expected.shape[1] < free.shape[1] or not torch.equal(expected, free)
        out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[],
                                pad_token_id=0, stop_strings=stops, tokenizer=tokenizer, policy=policy)
        width = expected.shape[1]
        assert torch.equal(out.sequences[:, :width], expected)
        assert not out.sequences[:, width:].any()


def test_token_healing_equals_hf():
    tokenizer = byte_tokenizer()
    tokenizer.bos_token = "<eos>"  # HF's healing replaces the BOS id by the pad id
    target = llama(len(tokenizer), 32, 2, seed=3, sharpen=12.0)  # sharp enough to outweigh HF's +1 for the tail
    draft = perturbed(target, 0.01, seed=4)
    ids = torch.tensor([tokenizer("xab").input_ids])
    assert not torch.equal(target.heal_tokens(ids, tokenizer), ids), "healing changes the prompt here"
    expected = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=0,
                               token_healing=True, tokenizer=tokenizer)
    fast = spec_ext.accelerate(target, draft, policy="fixed")
    got = fast.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=0,
                        token_healing=True, tokenizer=tokenizer)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="token_healing: needs the target's tokenizer"):
        fast.generate(ids, token_healing=True)


@pytest.mark.parametrize("kind", ["gpt2", "gemma2", "qwen3"])
def test_settings_on_other_architectures(kind):
    """The HF-modules path (gpt2, gemma2) and the lean one (qwen3) under the settings: HF's output."""
    from test_architectures import sharpened_model
    target = sharpened_model(kind)
    draft = perturbed(target, 0.01, seed=1)
    ids, mask = padded(PROMPTS)
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, suppress_tokens=[5], min_new_tokens=4)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[],
                               pad_token_id=0, **settings)
    out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=[],
                            pad_token_id=0, policy="fixed", **settings)
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 0
