"""Grammar-constrained output under speculation: the law over a small finite language
enumerated by the test's own token-level oracle (no grammar library in it), greedy output
equal to ``target.generate`` with the grammar engine's masks as an HF processor, per-row
grammars on a ragged batch, every drafter shape, and the refusals."""
import copy
import json
import re

import numpy as np
import pytest
import torch
from transformers.generation import LogitsProcessor

import spec_ext
from helpers import assert_follows, byte_tokenizer, llama, perturbed
from spec_ext import Grammar

WORDS = ["ab", "abc", "b", "ca", "cab"]
EOS = 0


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def models_(tokenizer):
    target = llama(len(tokenizer) + 4, 32, 2, seed=3, sharpen=3.0)  # 4 padded logits columns
    return target, perturbed(target, 0.01, seed=4)


def text_of(tokenizer, ids):
    return tokenizer.decode([t for t in ids if t != EOS])


def oracle_allowed(tokenizer, prefix: list[int], vocab: int) -> list[int]:
    """The tokens that keep the text a prefix of a word (EOS when it is one), by string tests."""
    text = text_of(tokenizer, prefix)
    allowed = [t for t in range(1, len(tokenizer))
               if any(w.startswith(text + text_of(tokenizer, [t])) for w in WORDS) and text_of(tokenizer, [t])]
    return allowed + [EOS] * (text in WORDS)


def oracle_law(target, tokenizer, temperature: float) -> dict:
    """P(token sequence up to EOS) for the target renormalised over the oracle's legal tokens."""
    law, frontier = {}, {(): 1.0}
    while frontier:
        prefixes = list(frontier)
        ids = torch.tensor([[1] + list(p) for p in prefixes])
        with torch.no_grad():
            logits = target(ids).logits[:, -1].double() / temperature
        grown = {}
        for i, p in enumerate(prefixes):
            allowed = oracle_allowed(tokenizer, list(p), logits.shape[-1])
            probs = torch.softmax(logits[i, allowed], -1)
            for t, q in zip(allowed, probs.tolist()):
                (law if t == EOS else grown)[p + (t,)] = frontier[p] * q
        frontier = grown
    return law


def unpack(bits, V):
    """[B,T,W] int32 bitmask -> [B,T,V] bool."""
    return ((bits[..., None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(-2)[..., :V]


def test_grammar_masks_match_the_oracle(tokenizer, models_):
    """The matcher's masks at every reachable prefix, walked as a tree, are the oracle's sets."""
    from spec_ext.processing import Matchers
    target, _ = models_
    V = target.config.vocab_size
    matchers = Matchers([Grammar.regex("|".join(WORDS))], tokenizer, V, [EOS])
    matchers.start(1)
    prefixes, frontier = [[]], [[]]
    while frontier:
        frontier = [p + [t] for p in frontier for t in oracle_allowed(tokenizer, p, V) if t != EOS]
        prefixes += frontier
    allowed = unpack(matchers.bitmask([prefixes]), V)[0]
    for prefix, row in zip(prefixes, allowed):
        assert sorted(row.nonzero().flatten().tolist()) == sorted(oracle_allowed(tokenizer, prefix, V)), prefix
    # a path that leaves the grammar allows everything (the target rejects before it), and the walk rolled back
    bad = unpack(matchers.bitmask([[[tokenizer.convert_tokens_to_ids("c"), tokenizer.convert_tokens_to_ids("c")]]]), V)
    assert bool(bad.all())
    assert torch.equal(unpack(matchers.bitmask([prefixes]), V)[0], allowed)


@pytest.mark.parametrize("policy,temperature", [("fixed", 1.0), ("tree", 1.0), ("dynamictree", 0.7),
                                                ("auto", 1.0)])
def test_grammar_law_is_the_renormalised_target(tokenizer, models_, policy, temperature, monkeypatch):
    target, draft = models_
    n = 6000
    # (at 6,000 rows a plain step beats drafts accepted 9 in 10: Auto drafts here until measured)
    monkeypatch.setattr(spec_ext.policies.Auto, "OPTIMISTIC", None)
    out = spec_ext.generate(target, draft, [[1]] * n, max_new_tokens=4, temperature=temperature, eos_token_id=EOS,
                            pad_token_id=EOS, tokenizer=tokenizer, grammar=Grammar.regex("|".join(WORDS)),
                            policy=policy, seed=7)
    samples = []
    for row in out.sequences[:, 1:].tolist():
        assert EOS in row, "every row ends with EOS (the grammar forces it once complete)"
        kept = tuple(row[:row.index(EOS) + 1])
        assert text_of(tokenizer, kept) in WORDS
        samples.append(kept)
    law = oracle_law(target, tokenizer, temperature)
    width = max(map(len, law))
    pad = lambda s: list(s) + [-1] * (width - len(s))  # noqa: E731
    assert_follows(np.array([pad(s) for s in samples]), {tuple(pad(k)): v for k, v in law.items()})
    assert out.stats.accepted > 0


class LLGuidanceProcessor(LogitsProcessor):
    """The grammar engine's masks as a stateless HF processor (each call re-reads the row's new
    tokens): the oracle of greedy equality."""

    def __init__(self, grammars, tokenizer, vocab, prompt_width):
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=EOS)
        self.grammars, self.width = grammars, prompt_width

    def __call__(self, input_ids, scores):
        from llguidance.torch import fill_next_token_bitmask
        scores = scores.clone()
        for b, row in enumerate(input_ids.tolist()):
            if self.grammars[b] is None:
                continue
            matcher = self.llg.LLMatcher(self.tok, self.grammars[b].definition, log_level=0)
            if not matcher.consume_tokens(row[self.width:]):
                continue  # a finished row (HF pads it)
            bits = torch.zeros(1, (scores.shape[-1] + 31) // 32, dtype=torch.int32)
            fill_next_token_bitmask(matcher, bits)
            allowed = ((bits[0][:, None] >> torch.arange(32)) & 1).bool().flatten()[:scores.shape[-1]]
            scores[b, ~allowed] = float("-inf")
        return scores


SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["abc", "ca"]}},
          "required": ["a", "b"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.mark.parametrize("policy", ["fixed", "tree", "dynamictree", "ngram", "svip", "heuristic", "confidence"])
def test_grammar_greedy_equals_hf(tokenizer, models_, policy):
    target, draft = models_
    prompts = [[1, 70, 71], [1], [1, 80, 81, 82, 83]]
    grammars = [Grammar.regex("(ab|c)+b"), Grammar.json_schema(SCHEMA), None]
    L = max(map(len, prompts))
    ids = torch.tensor([[EOS] * (L - len(p)) + p for p in prompts])
    mask = (ids != EOS).long()
    hf_processor = LLGuidanceProcessor(grammars, tokenizer, target.config.vocab_size, L)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=EOS,
                               pad_token_id=EOS, logits_processor=[hf_processor])
    fast = spec_ext.accelerate(target, draft, policy=policy)
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=EOS,
                        pad_token_id=EOS, tokenizer=tokenizer, grammar=grammars)
    assert torch.equal(got, expected)
    texts = [text_of(tokenizer, r[L:]) for r in got.tolist()]
    assert re.fullmatch("(ab|c)+b", texts[0]) or EOS not in got[0, L:].tolist()
    assert EOS in got[1, L:].tolist(), "the JSON object completes within max_new_tokens"
    parsed = json.loads(texts[1])
    assert set(parsed) == {"a", "b"} and parsed["b"] in ("abc", "ca")
    assert fast.last_stats.accepted > 0


def test_grammar_drafts_are_masked(tokenizer, models_):
    """A draft equal to the target, masked like it, is accepted whole under a grammar."""
    target, _ = models_
    out = spec_ext.generate(target, copy.deepcopy(target), [[1, 70]] * 3, max_new_tokens=16, eos_token_id=EOS,
                            pad_token_id=EOS, tokenizer=tokenizer, grammar=Grammar.json_schema(SCHEMA),
                            policy="fixed")
    assert out.stats.acceptance_rate > 0.97


def test_grammar_refusals(tokenizer, models_):
    target, draft = models_
    with pytest.raises(ValueError, match="grammar: needs the target's tokenizer"):
        spec_ext.generate(target, draft, [[1]], grammar=Grammar.regex("ab"), eos_token_id=EOS)
    with pytest.raises(ValueError, match="grammar: .* does not compile"):
        spec_ext.generate(target, draft, [[1]], grammar=Grammar.regex("(ab"), tokenizer=tokenizer, eos_token_id=EOS)
    with pytest.raises(ValueError, match="grammar: the JSON schema is not valid JSON"):
        Grammar.json_schema("{not json")
    with pytest.raises(ValueError, match="grammar: got 2 grammars for 1 rows"):
        spec_ext.generate(target, draft, [[1]], grammar=[Grammar.regex("a")] * 2, tokenizer=tokenizer,
                          eos_token_id=EOS)
    with pytest.raises(ValueError, match="grammar: expected a spec_ext.Grammar"):
        spec_ext.generate(target, draft, [[1]], grammar="ab|c", tokenizer=tokenizer, eos_token_id=EOS)
    small = llama(100, 32, 2, seed=3)
    with pytest.raises(ValueError, match="tokenizer: has 260 tokens but the target.s vocabulary has 100"):
        spec_ext.generate(small, None, [[1, 2, 1, 2]], policy="ngram", grammar=Grammar.regex("a"),
                          tokenizer=tokenizer, eos_token_id=EOS)
    with pytest.raises(ValueError, match="grammar: not supported with PEARL"):
        spec_ext.generate(target, draft, [[1]], grammar=Grammar.regex("a"), tokenizer=tokenizer, eos_token_id=EOS,
                          policy="pearl")


def test_ebnf_grammar(tokenizer, models_):
    target, draft = models_
    grammar = Grammar.ebnf('start: item ("," item)*\nitem: "ab" | "c"')
    out = spec_ext.generate(target, draft, [[1]] * 4, max_new_tokens=12, temperature=1.0, eos_token_id=EOS,
                            pad_token_id=EOS, tokenizer=tokenizer, grammar=grammar, seed=3)
    for row in out.sequences[:, 1:].tolist():
        text = text_of(tokenizer, row)
        assert re.fullmatch(r"(ab|c)(,(ab|c))*", text) or (EOS not in row and re.fullmatch(r"(ab|c)(,(ab|c))*,?a?",
                                                                                           text)), text


@pytest.mark.parametrize("policy", ["fixed", "dynamictree"])
def test_grammar_with_a_feature_head(tokenizer, models_, policy):
    """A head's drafts are masked like a draft model's (chains, trees): greedy equals HF's."""
    from test_heads import echo_head
    target, _ = models_
    head = echo_head(target, "eagle3", noise=0.01)
    grammar = Grammar.regex("(ab|c)+b")
    ids = torch.tensor([[1, 70, 71]])
    hf_processor = LLGuidanceProcessor([grammar], tokenizer, target.config.vocab_size, ids.shape[1])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=EOS,
                               logits_processor=[hf_processor])
    out = spec_ext.generate(target, head, ids, max_new_tokens=24, eos_token_id=EOS, pad_token_id=EOS,
                            tokenizer=tokenizer, grammar=grammar, policy=policy)
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 0
