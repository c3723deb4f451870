"""A draft model with another tokenizer than the target's (issue 41): the vocabulary map by
bytes, and OtherTokenizerDrafter's two modes (TLI, SLEM) exact in greedy and sampled
decoding. Every tokenizer is made here (the tokenizers library, no downloads); the models
are tiny Llamas, trained for a few seconds on the same small text where a test needs drafts
that are accepted."""
import copy
import functools
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import spec_ext
from spec_ext.drafters.other_tokenizer import OtherTokenizerDrafter
from spec_ext.engine import Sampler
from spec_ext.models import attention_implementation, forward_path
from spec_ext.policies import SVIP, Auto, DynamicTree, Fixed, NGram, Tree, resolve
from spec_ext.vocab import prefix_index, token_keys, vocab_map
from helpers import assert_follows, exact_joint, llama, make_policy, plan_of, ragged_greedy_equals_target

TEXT = ("the cat sat on the mat. the dog sat on the log. a cat and a dog ran to the mat, and the cat sat. "
        "then the dog ran to the log and sat on it. café au lait, naïve cat. ") * 8
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 (the tiny Llamas' pad, bos, eos)


def wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def byte_level(vocab_size: int) -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE trained on TEXT (256 byte tokens, 3 specials, the rest merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return wrap(tok)


def sentencepiece(merges: int, legacy: bool = False) -> PreTrainedTokenizerFast:
    """SentencePiece style: Metaspace (``▁``) pre-tokenizer and BPE with byte fallback
    (``<0x00>``..``<0xFF>`` after the specials), trained on TEXT. ``legacy``: Llama-2's layout
    instead (no pre-tokenizer; a normalizer that writes a dummy ``▁`` before every text it
    is given and spaces as ``▁``)."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trained.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=40 + merges, special_tokens=SPECIALS))
    learned = trained.get_vocab()
    ordered = SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    ordered += [t for t, _ in sorted(learned.items(), key=lambda item: item[1]) if t not in SPECIALS]
    merge_list = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                  for m in json.loads(trained.to_str())["model"]["merges"]]
    vocab = {t: i for i, t in enumerate(ordered)}
    tok = Tokenizer(models.BPE(vocab, merge_list, unk_token="<pad>", byte_fallback=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # Llama-2's
    tok.add_special_tokens(SPECIALS)
    return wrap(tok)


def word_level(words: list[str]) -> PreTrainedTokenizerFast:
    """Word-level: ``words`` in this order after the specials (unknown words: ``<pad>``)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIALS + words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    return wrap(tok)


@functools.lru_cache(maxsize=None)
def tokenizer(name: str) -> PreTrainedTokenizerFast:
    return {"bytes300": lambda: byte_level(300), "bytes280": lambda: byte_level(280),
            "chars": lambda: byte_level(262),  # nearly characters: the draft's boundaries move as text comes
            "sp": lambda: sentencepiece(60), "sp-legacy": lambda: sentencepiece(60, legacy=True)}[name]()


@functools.lru_cache(maxsize=None)
def trained(name: str, seed: int, kind: str = "llama"):
    """A 2-layer model over ``tokenizer(name)`` trained on TEXT for a few seconds: it continues
    the text, so a draft and a target trained so agree often. ``kind``: a Llama, or another
    architecture in test_architectures' tiny configuration."""
    tok = tokenizer(name)
    if kind == "llama":
        model = llama(len(tok), 64, 2, seed=seed, max_positions=512)
    else:
        from test_architectures import sharpened_model
        model = sharpened_model(kind, vocab=len(tok), seed=seed, window=512)
    model.train()
    ids = torch.tensor(tok(TEXT).input_ids)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(120):
        starts = torch.randint(0, len(ids) - 49, (16,), generator=generator)
        batch = torch.stack([ids[s:s + 48] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model.eval()


PROMPTS = ["the cat sat on", "a dog ran to the", "then the", "café au lait, na"]


def ragged(tok, prompts):
    """Left-padded ids and attention mask of ``prompts`` under ``tok`` (no special tokens)."""
    rows = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return rows, ids, mask


def greedy_equal(target, drafter, policy, prompts, target_tok, max_new=24, eos_steps=None):
    """spec_ext with ``drafter`` under ``policy`` on the left-padded batch equals target.generate
    row by row, with an EOS that ends row 0 early (the other rows go on: rows drop out of the
    drafter; ``eos_steps``: see ``ragged_greedy_equals_target``)."""
    rows = [target_tok(p, add_special_tokens=False).input_ids for p in prompts]
    return ragged_greedy_equals_target(target, drafter, rows, policy=policy, max_new=max_new, eos_steps=eos_steps)


# ------------------------------------------------------------------ the map
def hand_byte_level():
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "Ġ": 4, "Ġa": 5, "ab": 6, "Ã": 7, "©": 8, "Ã©": 9}
    tok = Tokenizer(models.BPE(vocab, [("Ġ", "a"), ("a", "b"), ("Ã", "©")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def hand_sentencepiece():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x61>": 3, "a": 4, "b": 5, "▁": 6, "▁a": 7, "ba": 8, "<0xC3>": 9,
             "<0xA9>": 10, "é": 11, "<0x20>": 12}
    tok = Tokenizer(models.BPE(vocab, [("▁", "a"), ("b", "a")], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_the_map_by_bytes_matches_a_hand_written_expectation():
    target, draft = hand_byte_level(), hand_sentencepiece()
    assert token_keys(target)[5] == ("bytes", b" a", False) and token_keys(target)[9] == ("bytes", "é".encode(), False)
    assert token_keys(draft)[3] == ("bytes", b"a", True) and token_keys(draft)[0] == ("added", "<unk>", False)
    m = vocab_map(draft, target)
    # draft: <unk> (no such target token), <s>, </s> (by content), <0x61> (the same bytes as "a": "a" is kept),
    # a, b, ▁ (a space: Ġ), ▁a (Ġa), ba (none), <0xC3> (Ã: byte 0xC3), <0xA9> (©: byte 0xA9),
    # é (Ã©: its 2 bytes),
    # <0x20> (a space like ▁, which is kept over the byte-fallback token)
    assert m.draft_to_target.tolist() == [-1, 0, 1, -1, 2, 3, 4, 5, -1, 7, 8, 9, -1]
    assert m.target_to_draft.tolist() == [1, 2, 4, 5, 6, 7, -1, 9, 10, 11]
    assert m.shared == 9
    assert m.share_by_frequency([[2, 2, 6, 5]]) == 0.75 and m.share_by_frequency([]) == 0.0
    assert vocab_map(draft, target) is m  # cached
    padded = m.padded(16, 8)  # a draft model of 16 rows, a target model of 8 (ids 8, 9 dropped)
    assert padded.draft_to_target.tolist()[9:] == [7, -1, -1, -1, -1, -1, -1]
    assert padded.target_to_draft.tolist() == [1, 2, 4, 5, 6, 7, -1, 9]


def test_word_level_and_real_shaped_pairs_share_what_they_should():
    words = word_level(["the", "cat", "sat", "dog"])
    other = word_level(["dog", "sat", "mat"])
    m = vocab_map(other, words)
    assert m.draft_to_target.tolist() == [0, 1, 2, 6, 5, -1]
    big, small, sp = tokenizer("bytes300"), tokenizer("bytes280"), tokenizer("sp")
    assert vocab_map(small, big).shared == len(small)  # fewer merges of the same training: a subset
    ids = big(TEXT).input_ids
    assert vocab_map(sp, big).share_by_frequency(ids) > 0.5


def test_a_slow_tokenizer_or_a_bad_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="target_tokenizer"):
        vocab_map(tokenizer("sp"), object())
    with pytest.raises(ValueError, match="mode"):
        OtherTokenizerDrafter(trained("sp", 1), tokenizer("sp"), tokenizer("bytes300"), mode="x")
    with pytest.raises(ValueError, match="policy: PEARL drafts beside the verification"):
        spec_ext.generate(trained("bytes300", 0), trained("sp", 1), [[5, 6]], max_new_tokens=4,
                          policy=spec_ext.policies.PEARL(), tokenizer=tokenizer("bytes300"),
                          assistant_tokenizer=tokenizer("sp"))


def test_a_draft_that_covers_little_of_the_prompts_warns_and_auto_picks_slem():
    target_tok, draft_tok = word_level(["the", "cat", "sat", "dog"]), word_level(["dog", "mat"])
    target, draft = llama(len(target_tok), 32, 1, seed=0), llama(len(draft_tok), 32, 1, seed=1)
    ids = [target_tok("the cat sat the cat dog", add_special_tokens=False).input_ids]
    drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode="tli")
    with pytest.warns(UserWarning, match="covers 17% of the prompts' target tokens"):
        spec_ext.generate(target, drafter, ids, max_new_tokens=4, policy=Fixed(2))
    drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode="auto")
    spec_ext.generate(target, drafter, ids, max_new_tokens=4, policy=Fixed(2))
    assert drafter.mode_used == "slem"


# ------------------------------------------------------------------ greedy equality
@pytest.mark.parametrize("mode", ["tli", "slem"])
@pytest.mark.parametrize("draft_name,policy", [("sp", Fixed(4)), ("bytes280", Auto()), ("sp", SVIP()),
                                               ("sp", "specdecpp"), ("bytes280", "adalength"),
                                               ("sp", Tree((3, 2, 1))), ("bytes280", DynamicTree(4, 4, 16))])
def test_greedy_equals_the_target_on_a_ragged_batch(mode, draft_name, policy):
    """Every kind of length policy: fixed, adaptive on the host (Auto), on the draft's
    distribution (SVIP), on the draft's hidden state (SpecDecPP), on the target's (AdaLength);
    and trees, static and EAGLE-2's (TLI: target ids grown from the shared tokens' logits;
    SLEM: each path's text re-tokenised, the paths merged)."""
    target, draft = trained("bytes300", 0), trained(draft_name, 1)
    policy = resolve(make_policy(policy, target, draft))
    drafter = OtherTokenizerDrafter(draft, tokenizer(draft_name), tokenizer("bytes300"), mode=mode,
                                    hidden=policy.reads_draft_hidden)
    out = greedy_equal(target, drafter, policy, PROMPTS, tokenizer("bytes300"))
    assert drafter.mode_used == mode
    assert out.stats.accepted > 0 and out.stats.draft_calls > 0


def test_boundaries_that_move_roll_the_draft_cache_back_and_stay_exact():
    """The target writes nearly a character per token; the draft's word-sized tokens merge as
    each arrives ("Ġc" then "Ġca" then "Ġcat"): its cache is rolled back where they do."""
    target, draft = trained("chars", 0), trained("bytes300", 1)
    for mode in ("tli", "slem"):
        drafter = OtherTokenizerDrafter(draft, tokenizer("bytes300"), tokenizer("chars"), mode=mode)
        out = greedy_equal(target, drafter, Fixed(3), PROMPTS, tokenizer("chars"), max_new=30)
        assert drafter.moved > 0 and out.stats.accepted > 0, (mode, drafter.moved, out.stats)
    # the other way: a draft of nearly characters for a target of words
    target, draft = trained("bytes300", 0), trained("chars", 1)
    for mode in ("tli", "slem"):
        drafter = OtherTokenizerDrafter(draft, tokenizer("chars"), tokenizer("bytes300"), mode=mode)
        out = greedy_equal(target, drafter, Fixed(6), PROMPTS, tokenizer("bytes300"), max_new=20)
        assert out.stats.accepted > 0, (mode, out.stats)


@pytest.mark.parametrize("name", ["bytes300", "sp"])
def test_the_retokenised_window_starts_at_the_last_word_start_however_far_back(name):
    """The window re-tokenised before a round begins at the last draft token, at least
    ``BACK`` before the last aligned one, that starts at or right after whitespace (any
    Unicode whitespace), the first of the tokens that start there (a character's bytes may be
    several tokens): against a scan of every token, on texts with runs of up to 200
    characters without whitespace (a long run is not the whole text re-tokenised)."""
    from spec_ext.drafters.other_tokenizer import BACK
    tok = tokenizer(name)
    drafter = OtherTokenizerDrafter(None, tok, tokenizer("chars"), mode="slem")
    lead = len(drafter.lead)
    generator, far = torch.Generator().manual_seed(0), 0
    for case in range(60):
        words = TEXT.split(" ") + ["été", "ébène"]  # bytes of a character in tokens of their own
        pieces = [words[int(i)] for i in torch.randint(len(words), (12,), generator=generator)]
        separators = [" ", "\u3000", "\u00a0", "\n", "\u2028", " é"]
        joins = [separators[int(i)] for i in torch.randint(len(separators), (12,), generator=generator)]
        run = int(torch.randint(0, 200, (1,), generator=generator)) if case % 3 else 0
        text = "".join(p + j for p, j in zip(pieces, joins)) + ("catdog" * 40)[:run] + "\n" * (case % 2)
        encoding = tok.backend_tokenizer.encode(text, add_special_tokens=False)
        starts = [o[0] for o in encoding.offsets]
        aligned = lead + len(starts) - int(torch.randint(0, 4, (1,), generator=generator))
        drafter.text, drafter.starts, drafter.aligned = [text], [starts], [aligned]
        expected = (lead, 0)
        for i in range(aligned - 1 - BACK - lead, -1, -1):
            s = starts[i]
            if s < len(text) and (s == 0 or text[s].isspace() or text[s - 1].isspace()):
                expected = (starts.index(s) + lead, s)  # the first token that starts there
                break
        assert drafter._window(0) == expected, (case, text[-60:])
        far += expected[1] > 0 and aligned - 1 - BACK - expected[0] > 16
    assert far > 0  # windows that begin more than 16 tokens back, none of them at the text's start


@pytest.mark.parametrize("target_name,draft_name", [("chars", "bytes300"), ("bytes300", "sp"),
                                                    ("bytes300", "sp-legacy"), ("bytes300", "chars")])
def test_the_drafts_context_is_its_tokenizers_tokens_of_the_committed_text(target_name, draft_name):
    """After every sync each row's draft context (past the lead) is what the draft's
    tokenizer makes of the whole committed text (less the last token where healing took a
    longer one), though only a tail window is re-tokenised: byte-level BPE, SentencePiece
    with a Metaspace pre-tokenizer, and Llama-2's layout, whose dummy ``▁`` before every
    text it encodes would otherwise land inside the context at each window."""
    target, draft = trained(target_name, 0), trained(draft_name, 1)
    tok = tokenizer(draft_name)
    drafter = OtherTokenizerDrafter(draft, tok, tokenizer(target_name), mode="slem")
    sync, checked = drafter._sync, []

    def synced(heal=False):
        out = sync(heal)
        lead = len(drafter.lead)
        for b, left_out in enumerate(out[2]):
            whole = tok.backend_tokenizer.encode(drafter.text[b], add_special_tokens=False).ids
            if not whole:
                continue
            expected = whole[:-1] if left_out is not None else whole
            assert drafter.dids[b][lead:drafter.aligned[b]] == expected, (b, repr(drafter.text[b][-40:]))
            checked.append(drafter.aligned[b])
        return out

    drafter._sync = synced
    prompts = PROMPTS + ["the cat sat on the mat.\n\n  a été ébène"]
    _, ids, mask = ragged(tokenizer(target_name), prompts)
    out = spec_ext.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=40, policy=Fixed(4))
    assert out.stats.accepted > 0 and len(checked) >= 3 * len(prompts), len(checked)  # windows, not only the first sync


# ------------------------------------------------------------------ the permuted-vocabulary guard
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"]


def permuted_pair(seed: int):
    """A word-level target and the same model under a shuffled vocabulary: draft id d is
    target id perm[d], its embedding and lm_head rows moved along."""
    target_tok = word_level(WORDS)
    order = torch.randperm(len(WORDS), generator=torch.Generator().manual_seed(seed))
    draft_words = [WORDS[i] for i in order.tolist()]
    draft_tok = word_level(draft_words)
    target = llama(len(target_tok), 32, 2, seed=seed, sharpen=2.0)
    perm = torch.tensor([target_tok.convert_tokens_to_ids(t) for t in draft_tok.convert_ids_to_tokens(
        list(range(len(draft_tok))))])
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[perm])
        draft.lm_head.weight.copy_(target.lm_head.weight[perm])
    return target, target_tok, draft, draft_tok, perm


def test_a_permuted_vocabulary_is_accepted_always_greedy_and_sampled():
    target, target_tok, draft, draft_tok, perm = permuted_pair(3)
    m = vocab_map(draft_tok, target_tok)
    assert torch.equal(m.draft_to_target, perm)
    prompts = ["a b c", "d e f g h", "l"]
    drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode="tli")
    out = greedy_equal(target, drafter, Fixed(4), prompts, target_tok, max_new=20)
    assert out.stats.accepted == out.stats.drafted > 0
    _, ids, mask = ragged(target_tok, prompts * 20)
    drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode="tli")
    out = spec_ext.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=16, temperature=1.0,
                            eos_token_id=[], seed=0, policy=Fixed(4))
    # p and q agree up to the draft's rounding (its linear layers may take another kernel); the
    # special tokens the target samples are in the draft's text too (shared by content)
    assert out.stats.acceptance_rate > 0.99, out.stats.as_dict()


# ------------------------------------------------------------------ the sampling law
LAW_WORDS = ["a", "b", "c", "d", "e"]  # with the 3 specials: a target vocabulary of 8 (helpers.VOCAB)


@pytest.mark.parametrize("mode,draft_kind,temperature,top_k,policy", [
    ("tli", "permuted", 1.0, None, "fixed"), ("tli", "other", 1.0, None, "fixed"), ("tli", "other", 0.7, 5, "fixed"),
    ("slem", "other", 1.0, None, "fixed"), ("tli", "other", 1.0, None, "tree"), ("slem", "other", 1.0, None, "tree"),
    ("tli", "other", 1.0, None, "dynamictree"), ("tli", "other", 1.0, None, "ngram"),
    ("slem", "other", 1.0, None, "ngram"), ("tli", "other", 1.0, None, "ngramtree"),
    ("slem", "other", 1.0, None, "ngramtree")])
def test_sampling_follows_the_targets_law_by_enumeration(mode, draft_kind, temperature, top_k, policy):
    """Chains, trees (deterministic: the policy's top-k or EAGLE-2's tree of either mode) and
    the text's drafts beside the draft (NGram: chains with the draft's q on the rows without
    a match, one-hot on the others; trees)."""
    target_tok = word_level(LAW_WORDS)
    target = llama(len(target_tok), 32, 2, seed=10, sharpen=3.0)
    if draft_kind == "permuted":
        draft_tok = word_level(LAW_WORDS[::-1])
        perm = torch.tensor(target_tok.convert_tokens_to_ids(draft_tok.convert_ids_to_tokens(list(range(8)))))
        draft = copy.deepcopy(target)
        with torch.no_grad():
            draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[perm])
            draft.lm_head.weight.copy_(target.lm_head.weight[perm])
    else:  # shares a, c, e and the specials; lacks b, d; has words of its own
        draft_tok = word_level(["e", "x", "a", "y", "c", "z"])
        draft = llama(len(draft_tok), 32, 1, seed=12, sharpen=3.0)
    prompt = [3, 4, 5]  # "a b c"
    n = 4000
    policy = {"fixed": Fixed(3), "tree": Tree((2, 2)), "dynamictree": DynamicTree(3, 2, 6),
              "ngram": NGram(n_min=1, tree=False), "ngramtree": NGram(n_min=1, tree=True)}[policy]
    drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode=mode)
    beside_text = isinstance(policy, NGram)  # the rows' text drafts beside the drafter
    if beside_text:  # "a b c" + 3: a row whose last token occurred before has a match
        prompt = [3, 4, 3]
    out = spec_ext.generate(target, drafter, [prompt] * n, max_new_tokens=3, temperature=temperature, top_k=top_k,
                            eos_token_id=[], seed=7, policy=policy)
    assert_follows(out.sequences[:, len(prompt):].numpy(), exact_joint(target, Sampler(temperature, top_k, None),
                                                                       prompt=prompt))
    assert out.stats.accepted > 0
    if beside_text:  # both kinds of row, both accepted
        assert 0 < out.stats.text_accepted < out.stats.accepted, out.stats.as_dict()
    if draft_kind == "permuted":
        assert out.stats.acceptance_rate > 0.99, out.stats.as_dict()


# ------------------------------------------------------------------ through generate and accelerate
def test_generate_and_accelerate_take_the_tokenizers():
    """HF's spelling per call (tokenizer=, assistant_tokenizer=) and accelerate's once per model:
    greedy equal to target.generate, drafts accepted, the stats naming the mode that ran."""
    target_tok, draft_tok = tokenizer("bytes300"), tokenizer("sp")
    target, draft = trained("bytes300", 0), trained("sp", 1)
    _, ids, mask = ragged(target_tok, PROMPTS)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=[],
                               pad_token_id=0)
    for mode in ("auto", "tli", "slem"):
        fast = spec_ext.accelerate(target, draft, policy="fixed", tokenizer=target_tok, draft_tokenizer=draft_tok,
                                   tokenizer_mode=mode)
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=[],
                            pad_token_id=0)
        assert torch.equal(got, expected), mode
        assert fast.last_stats.tokenizer_mode == ("slem" if mode == "auto" else mode)  # auto: see test_auto_...
        assert fast.last_stats.accepted > 0
    out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[],
                            pad_token_id=0, policy="fixed", tokenizer=target_tok, assistant_tokenizer=draft_tok)
    assert torch.equal(out.sequences, expected) and out.stats.tokenizer_mode == "slem"
    # the same tokenizer on both sides: the plain drafter
    same = spec_ext.generate(target, target, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[],
                             pad_token_id=0, tokenizer=target_tok, assistant_tokenizer=target_tok)
    assert same.stats.tokenizer_mode == ""


def test_four_threads_calling_one_accelerated_model_across_tokenizers_each_get_their_own_output():
    """One accelerated model with a draft of another tokenizer (a drafter made per call), ragged
    greedy calls on four threads at once: each equals ``target.generate`` of its batch."""
    from test_concurrency import run_at_once
    target_tok, draft_tok = tokenizer("bytes300"), tokenizer("sp")
    target, draft = trained("bytes300", 0), trained("sp", 1)
    fast = spec_ext.accelerate(target, draft, policy="fixed", tokenizer=target_tok, draft_tokenizer=draft_tok)
    batches = [PROMPTS, PROMPTS[1:], PROMPTS[:1], PROMPTS[::2]]
    inputs = [ragged(target_tok, batch)[1:] for batch in batches]
    expected = [target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=[],
                                pad_token_id=0) for ids, mask in inputs]
    got = run_at_once([lambda ids=ids, mask=mask: fast.generate(ids, attention_mask=mask, max_new_tokens=16,
                                                                do_sample=False, eos_token_id=[], pad_token_id=0)
                       for ids, mask in inputs])
    for i, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), i
    assert fast.last_stats.accepted > 0


def test_pairs_without_tokenizers_are_refused_by_name():
    target, draft = trained("bytes300", 0), llama(300 + 600, 32, 2, seed=1)
    with pytest.raises(ValueError, match="draft: its vocabulary has 900 tokens and the target's 300, further apart "
                                         "than padding .*assistant_tokenizer"):
        spec_ext.generate(target, draft, [[5, 6]], max_new_tokens=4)
    with pytest.raises(ValueError, match="assistant_tokenizer: needs the target's tokenizer too"):
        spec_ext.generate(target, draft, [[5, 6]], max_new_tokens=4, assistant_tokenizer=tokenizer("sp"))


def test_a_draft_of_another_tokenizer_under_hf_settings():
    """TLI drafts are target ids processed like the target's, SLEM's are checked by the
    target's processed logits: exact under the settings either way."""
    target_tok, draft_tok = tokenizer("bytes300"), tokenizer("sp")
    target, draft = trained("bytes300", 0), trained("sp", 1)
    _, ids, mask = ragged(target_tok, PROMPTS)
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=[],
                               pad_token_id=0, **settings)
    for mode in ("tli", "slem"):
        fast = spec_ext.accelerate(target, draft, policy="fixed", tokenizer=target_tok, draft_tokenizer=draft_tok,
                                   tokenizer_mode=mode)
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=[],
                            pad_token_id=0, **settings)
        assert torch.equal(got, expected), mode
        assert fast.last_stats.accepted > 0 and fast.last_stats.tokenizer_mode == mode


# ------------------------------------------------------------------ token healing and auto
@pytest.mark.parametrize("name", ["bytes300", "sp", "chars"])
def test_the_prefix_index_finds_every_token_that_begins_with_given_bytes(name):
    tok = tokenizer(name)
    index = prefix_index(tok)
    keys = token_keys(tok)
    assert index.spelled
    for prefix in [b"", b" ", b" c", b"ca", b"\xc3", "é".encode(), b"the", b"\xff", b"a\xff", b"\xfe\xff", b"zzz"]:
        lo, hi = index.bounds(prefix)
        found = {i for i in range(len(tok)) if lo <= int(index.rank[i]) < hi}
        expected = {i for i, k in enumerate(keys) if k is not None and k[0] == "bytes" and k[1].startswith(prefix)}
        assert found == expected, prefix
    assert not prefix_index(word_level(["a", "b"])).spelled  # the decoder writes its spaces


def test_token_healing_drafts_across_the_committed_texts_end():
    """A target of nearly characters cuts words anywhere; the draft's word-sized tokens then
    end its context mid-word ("Ġc" of "Ġcat"). Healed (the last token left out, the first
    draft token beginning with its bytes) its drafts are accepted more, and stay exact."""
    target, draft = trained("chars", 0), trained("bytes300", 1)
    accepted = {}
    for heal in (True, False):
        drafter = OtherTokenizerDrafter(draft, tokenizer("bytes300"), tokenizer("chars"), mode="slem")
        if not heal:
            drafter._left_out = lambda *args: None
        out = greedy_equal(target, drafter, Fixed(4), PROMPTS * 2, tokenizer("chars"), max_new=30)
        accepted[heal] = out.stats.mean_accepted
    assert accepted[True] > accepted[False] + 0.3, accepted


def test_token_healing_spends_a_forward_only_where_every_row_takes_a_longer_token():
    """Healing decides in the sync's one forward: a row whose draft, at its last token's
    place, chooses that token itself drafts on from it; a row that chooses a longer token
    rolls the last one out of its cache. A round costs k forwards for k drafts, as without
    healing, and one step more only where every row took a longer token. Counted per round
    against the draft's forwards on a ragged batch, rounds of each kind seen, the draft's
    cache holding exactly the row's draft tokens after every sync and chain."""
    target, draft = trained("chars", 0), trained("bytes300", 1)
    k, rounds = 4, []
    drafter = OtherTokenizerDrafter(draft, tokenizer("bytes300"), tokenizer("chars"), mode="slem")
    heal, sync, chain = drafter._heal, drafter._sync, drafter._chain

    def held():
        assert drafter.cache.host_lengths == [len(ids) for ids in drafter.dids]

    def recorded(after, before, healed):
        out = heal(after, before, healed)
        rounds[-1] = [h is not None for h in out[2]]  # the rows that took a longer token
        return out

    def synced(heal=False):
        rounds.append([])
        out = sync(heal)
        held()
        return out

    def chained(*args, **kwargs):
        out = chain(*args, **kwargs)
        held()
        return out

    drafter._heal, drafter._sync, drafter._chain = recorded, synced, chained
    out = greedy_equal(target, drafter, Fixed(k), PROMPTS, tokenizer("chars"), max_new=40)
    assert out.stats.accepted > 0
    every = sum(1 for r in rounds if r and all(r))
    some = sum(1 for r in rounds if any(r) and not all(r))
    assert every > 0 and some > 0, rounds
    assert drafter.calls == k * len(rounds) + every, (drafter.calls, len(rounds), every, some)


def test_token_healing_keeps_the_last_token_where_the_draft_chooses_it_or_its_bytes_twin():
    """A row whose context ends in ``h`` (of ``▁t``, ``h``): at h's place the draft chooses
    ``h`` itself, its byte-fallback twin ``<0x68>`` (the same bytes: nothing to heal) or the
    longer ``he``. The first two keep h in the context and propose from the logits after it;
    the third rolls h out of that row's cache and proposes ``he`` from the logits before
    (with the hidden state before, for policies that read it)."""
    target_tok, draft_tok = tokenizer("bytes300"), tokenizer("sp")
    vocab = draft_tok.get_vocab()
    target, draft = llama(len(target_tok), 32, 1, seed=0), llama(len(draft_tok), 32, 1, seed=1)
    drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode="slem")
    drafter.bind(target)
    rows = [target_tok("the cat sat on th", add_special_tokens=False).input_ids] * 3
    with torch.no_grad(), attention_implementation(draft):
        drafter.start(rows, capacity=8, sampler=Sampler())
        drafter._begin(rows)
        after, _, _ = drafter._sync()
        held = [list(ids) for ids in drafter.dids]
        assert [draft_tok.convert_ids_to_tokens(ids[-2:]) for ids in held] == [["▁t", "h"]] * 3
        healed = [drafter._left_out(b, drafter.dids[b], drafter.starts[b]) for b in range(3)]
        assert healed == [b"h"] * 3
        before = torch.randn(3, after.shape[1])
        for b, choice in enumerate(["h", "<0x68>", "he"]):
            before[b, vocab[choice]] = 100.0
        before[:, vocab["▁the"]] = 200.0  # not a token of h's bytes
        lengths = list(drafter.cache.host_lengths)
        hidden_after, hidden_before = torch.randn(3, 32), torch.randn(3, 32)
        logits, hidden, left_out = drafter._heal((after, hidden_after), (before, hidden_before), healed)
    assert left_out == [None, None, b"h"]
    assert drafter.dids[:2] == held[:2] and drafter.dids[2] == held[2][:-1]
    assert drafter.cache.host_lengths == [lengths[0], lengths[1], lengths[2] - 1]
    assert torch.equal(logits[:2], after[:2]) and torch.equal(hidden[:2], hidden_after[:2])
    assert set(torch.isfinite(logits[2]).nonzero()[:, 0].tolist()) == {vocab[t] for t in ("h", "he", "<0x68>")}
    assert logits[2].argmax().item() == vocab["he"] and torch.equal(hidden[2], hidden_before[2])


@pytest.mark.parametrize("target_name,draft_name,temperature", [("chars", "bytes300", 0.0), ("bytes300", "sp", 0.0),
                                                                ("permuted", "permuted", 1.0)])
def test_auto_runs_the_mode_that_accepts_more(target_name, draft_name, temperature):
    """Each mode alone, then auto: after its probe rounds auto runs the mode whose drafts
    were accepted more (SLEM on greedy pairs of other vocabularies, TLI where one
    vocabulary is the other's permutation, sampled)."""
    if target_name == "permuted":
        target, target_tok, draft, draft_tok, _ = permuted_pair(3)
        prompts = ["a b c", "d e f g h", "l"] * 2
    else:
        target, draft = trained(target_name, 0), trained(draft_name, 1)
        target_tok, draft_tok, prompts = tokenizer(target_name), tokenizer(draft_name), PROMPTS * 2
    _, ids, mask = ragged(target_tok, prompts)
    measured = {}
    for mode in ("tli", "slem", "auto"):
        drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode=mode)
        out = spec_ext.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=60, eos_token_id=[],
                                temperature=temperature, seed=0, policy=Fixed(4))
        measured[mode] = out.stats.mean_accepted
    better = max(("tli", "slem"), key=measured.get)
    assert abs(measured["tli"] - measured["slem"]) > 0.5, measured  # a choice that matters
    rounds = drafter.rounds_by_mode
    assert drafter.mode_used == better and min(rounds.values()) >= 3, (measured, rounds)
    assert rounds[better] >= 3 * rounds["slem" if better == "tli" else "tli"], (measured, rounds)


# ------------------------------------------------------------------ beside the text's drafts
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("mode", ["tli", "slem"])
def test_beside_ngram_drafts_greedy_equals_the_target(mode, tree):
    """NGram with a draft of another tokenizer (generate's policy="ngram" with the two
    tokenizers): rows with a match draft from their text, the others from the draft, in one
    verification; greedy equal to target.generate on a ragged batch, both kinds accepted."""
    target, draft = trained("bytes300", 0), trained("sp", 1)
    target_tok, draft_tok = tokenizer("bytes300"), tokenizer("sp")
    prompts = ["the cat sat on the mat. the dog sat on", "café au lait", "then the dog ran to the log and sat on it. "
               "then the dog ran", "a cat and"]
    _, ids, mask = ragged(target_tok, prompts)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=[],
                               pad_token_id=0)
    out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[],
                            pad_token_id=0, policy=NGram(tree=tree), tokenizer=target_tok,
                            assistant_tokenizer=draft_tok, tokenizer_mode=mode)
    assert torch.equal(out.sequences, expected)
    assert 0 < out.stats.text_accepted < out.stats.accepted and out.stats.draft_calls > 0, out.stats.as_dict()
    assert out.stats.tokenizer_mode == mode


@pytest.mark.parametrize("tree", [False, True])
def test_beside_ngram_slem_retokenises_only_the_drafters_rows(tree):
    """Beside the text's drafts (chains and trees) a SLEM chain stands for the rows without a
    match only: the text's rows are not re-tokenised (their texts handed to the target's
    tokenizer are empty) and the round's accepted drafts are tallied over the drafter's rows."""
    target, draft = trained("bytes300", 0), trained("sp", 1)
    target_tok, draft_tok = tokenizer("bytes300"), tokenizer("sp")
    prompts = ["the cat sat on the mat. the dog sat on", "café au lait", "then the dog ran to the log and sat on it. "
               "then the dog ran", "a cat and"]
    policy = NGram(tree=tree)
    model_drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode="slem")
    propose, retokenise, commit = model_drafter.propose, model_drafter._retokenise, model_drafter.commit
    rounds, tallied = [], []

    def proposing(seqs, roots, plan, forced=None, forced_rows=None):
        rounds.append([[False] * len(seqs) if forced_rows is None else forced_rows.tolist(), None])
        return propose(seqs, roots, plan, forced, forced_rows)

    def retokenised(texts, rows=None):
        rounds[-1][1] = list(texts)
        return retokenise(texts, rows)

    def committed(outcome):
        before = list(model_drafter.tally["slem"])
        commit(outcome)
        if model_drafter.current is not None:  # a round the drafter ran
            tallied.append((model_drafter.tally["slem"][0] - before[0], rounds[-1][0].count(False)))

    model_drafter.propose, model_drafter._retokenise, model_drafter.commit = proposing, retokenised, committed
    # an EOS late in row 0's text (the rows' texts are alike: an early one ends every row before
    # rounds where the text and the drafter both draft rows)
    out = greedy_equal(target, model_drafter, policy, prompts, target_tok, max_new=30, eos_steps=range(15, 30))
    mixed = [(by_text, texts) for by_text, texts in rounds if any(by_text)]
    assert mixed and out.stats.text_accepted > 0, out.stats.as_dict()
    for by_text, texts in mixed:
        assert all(text == "" for text, forced in zip(texts, by_text) if forced), (by_text, texts)
    assert any(text for _, texts in mixed for text, forced in zip(texts, by_text) if not forced)
    assert tallied and all(rows == own for rows, own in tallied), tallied


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beside_ngram_slem_chains_shorter_than_draft_k(seed, tree):
    """Word-level SLEM drafts often re-tokenise to fewer than ``draft_k`` target tokens (a
    special token ends the draft's text): the model's rows carry what it drafted, at batch 1
    (the whole batch short) and on a ragged batch whose rows end at an EOS."""
    target_tok, draft_tok = word_level(LAW_WORDS), word_level(["e", "x", "a", "y", "c", "z"])
    target = llama(len(target_tok), 32, 2, seed=10, sharpen=3.0)
    draft = llama(len(draft_tok), 32, 1, seed=seed, sharpen=3.0)
    for prompts in (["a b c"], ["a b c", "c a", "e e d a b"]):
        policy = NGram(n_min=1, tree=tree)
        drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode="slem")
        out = greedy_equal(target, drafter, policy, prompts, target_tok, max_new=16)
        assert out.stats.drafted - out.stats.text_drafted <= 5 * out.stats.rounds, out.stats.as_dict()


def test_the_draft_cache_grows_where_rows_feed_unequal_tails():
    """A row near the cache's end that feeds one token beside a row that feeds many: the
    padded feed writes every row's width, and the cache grows to hold it."""
    target_tok, draft_tok = word_level(LAW_WORDS), word_level(["e", "x", "a", "y", "c", "z", "b", "d"])
    target, draft = llama(len(target_tok), 32, 2, seed=10), llama(len(draft_tok), 32, 1, seed=1)
    plan = plan_of(Fixed(1), 2)  # one draft per row and round
    drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode="tli")
    drafter.bind(target)
    rows = [[3] * 40, [4] * 2]
    with torch.no_grad(), attention_implementation(draft):
        drafter.start(rows, capacity=0, sampler=Sampler())
        drafter.propose(rows, torch.tensor([3, 4]), plan)
        capacity = drafter.cache.capacity
        drafter.propose([rows[0] + [3], rows[1] + [5] * 20], torch.tensor([3, 5]), plan)
    assert drafter.cache.capacity > capacity
    assert drafter.cache.host_lengths == [len(d) for d in drafter.dids]


def test_the_length_policy_does_not_learn_from_the_rounds_auto_spends_measuring():
    """Auto's rounds of the mode behind are marked ``explores`` in the report the policy's
    controller observes (it learns nothing from them: their acceptance says nothing of the
    mode that runs); every other round is not."""
    observed = []

    class Recording(Fixed):
        def start(self, call):
            controller = super().start(call)
            controller.observe = lambda report: observed.append(report.explores)
            return controller

    target, draft = trained("bytes300", 0), trained("sp", 1)
    _, ids, mask = ragged(tokenizer("bytes300"), PROMPTS)
    drafter = OtherTokenizerDrafter(draft, tokenizer("sp"), tokenizer("bytes300"), mode="auto")
    out = spec_ext.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=60, eos_token_id=[],
                            policy=Recording(4))
    rounds = drafter.rounds_by_mode
    assert drafter.mode_used == "slem" and rounds["tli"] >= 3, rounds
    learned_from = observed.count(False)
    assert learned_from == rounds["slem"] and observed.count(True) == rounds["tli"], (observed, rounds)
    assert out.stats.accepted > 0


@pytest.mark.parametrize("kind", ["gpt2", "gemma2", "qwen3"])
@pytest.mark.parametrize("mode", ["tli", "slem"])
def test_drafts_of_other_architectures(kind, mode):
    """The draft on the HF modules (gpt2; gemma2's soft-caps) and the lean forward (qwen3):
    greedy equal to the target on a ragged batch with EOS, drafts accepted."""
    target, draft = trained("bytes300", 0), trained("sp", 1, kind)
    drafter = OtherTokenizerDrafter(draft, tokenizer("sp"), tokenizer("bytes300"), mode=mode)
    out = greedy_equal(target, drafter, Fixed(4), PROMPTS, tokenizer("bytes300"))
    assert out.stats.accepted > 0, out.stats.as_dict()
    assert forward_path(draft).startswith("lean" if kind == "qwen3" else "hf"), forward_path(draft)
