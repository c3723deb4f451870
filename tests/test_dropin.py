"""A drop-in for HF generate: the attention mask HF infers when none is given, right padding,
and bad input refused with an error naming the argument."""
import warnings

import pytest
import torch

import spec_ext
from helpers import hf_greedy, llama, perturbed


@pytest.fixture(scope="module")
def pair():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.02, seed=1)


def hf(target, ids, **kwargs):
    return target.generate(ids, max_new_tokens=12, do_sample=False, **kwargs)


@pytest.mark.parametrize("source", ["argument", "generation_config"])
def test_no_attention_mask_is_inferred_as_hf_infers_it(pair, source):
    """Prompts holding the pad id (left padding, and a pad id inside a prompt's text) with no
    attention_mask: the pad id from the argument or from generation_config; spec_ext's output
    equals HF's bit for bit, batch 1 and a ragged batch; with the pad id an EOS id, nothing is
    masked, as HF (which warns for a batch)."""
    target, draft = pair
    pad = 7
    batch = torch.tensor([[pad, pad, 5, 17, 33, 8], [9, 4, pad, 21, 3, 40], [pad, 11, 12, 13, 14, 15]])
    fast = spec_ext.accelerate(target, draft)
    config = target.generation_config
    old = (config.pad_token_id, config.eos_token_id)
    try:
        if source == "generation_config":
            config.pad_token_id, kwargs = pad, {}
        else:
            kwargs = dict(pad_token_id=pad)
        for ids in (batch[:1], batch[1:2], batch):
            expected = hf(target, ids, **kwargs)
            got = fast.generate(ids, max_new_tokens=12, do_sample=False, **kwargs)
            assert torch.equal(got, expected), (source, ids)
            unmasked = hf(target, ids, attention_mask=torch.ones_like(ids), **kwargs)
            assert not torch.equal(unmasked, expected) or ids.shape[0] == 1, "the mask must matter here"
        config.eos_token_id = pad  # the pad id is an EOS id: nothing is inferred
        with pytest.warns(UserWarning, match="cannot be inferred from input because pad token is same as eos"):
            got = fast.generate(batch, max_new_tokens=12, do_sample=False, **kwargs)
        assert torch.equal(got, hf(target, batch, attention_mask=torch.ones_like(batch), **kwargs))
    finally:
        config.pad_token_id, config.eos_token_id = old


def test_right_padding_continues_each_rows_text_and_warns_once(pair):
    """A right-padded batch: spec_ext continues each row's own text (what the row left-padded
    gives), unlike HF, and says so once per process."""
    import spec_ext.engine.common as common
    target, draft = pair
    right = torch.tensor([[5, 17, 33, 8], [9, 4, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    left = torch.tensor([[5, 17, 33, 8], [0, 0, 9, 4]])
    common._WARNED.discard("right padding")
    with pytest.warns(UserWarning, match="attention_mask: right padding"):
        got = spec_ext.generate(target, draft, right, attention_mask=mask, max_new_tokens=8).sequences
    expected = spec_ext.generate(target, draft, left, attention_mask=mask.flip(1), max_new_tokens=8).sequences
    assert torch.equal(got[:, 4:], expected[:, 4:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec_ext.generate(target, draft, right, attention_mask=mask, max_new_tokens=2)


def test_bad_input_is_refused_naming_the_argument(pair, tmp_path):
    target, draft = pair
    with pytest.raises(TypeError, match="input_ids: prompt 0 holds 'a' \\(str\\)"):
        spec_ext.generate(target, draft, [["a", "b"]], max_new_tokens=2)
    with pytest.raises(TypeError, match="input_ids: expected integer token ids, got a tensor of torch.float32"):
        spec_ext.generate(target, draft, torch.tensor([[1.0, 2.0]]), max_new_tokens=2)
    with pytest.raises(TypeError, match="seed: expected an int or None, got 'abc'"):
        spec_ext.generate(target, draft, [[1, 2]], max_new_tokens=2, seed="abc")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="draft: .*config.json is not valid JSON"):
        spec_ext.accelerate(target, tmp_path)
    assert spec_ext.generate(target, draft, [[1, 2]], max_new_tokens=2, seed=3).sequences.shape == (1, 4)


def counted(model):
    """A list that grows by one at each forward of ``model`` (the handle removes the count)."""
    calls = []
    return calls, model.register_forward_pre_hook(lambda module, args: calls.append(1))


@pytest.mark.parametrize("new", [24, 25])
def test_with_a_draft_model_every_draft_accepted_target_forwards_equal_hf_assisted_generation(new):
    """A draft equal to the target (every draft accepted), k = 3: HF's assisted generation
    verifies its first drafts in the prompt's own forward, and so does spec_ext's first round:
    the same number of target forwards for odd and even lengths (one fewer than a separate
    prefill); greedy outputs equal."""
    import copy
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    draft = copy.deepcopy(target)
    ids = torch.tensor([[5, 17, 33, 8, 40, 2]])
    config = draft.generation_config  # k = 3 every round, no stop by the draft's confidence
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = 3, "constant"
    config.assistant_confidence_threshold = 0.0
    calls, handle = counted(target)
    expected = target.generate(ids, assistant_model=draft, max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    handle.remove()
    out = spec_ext.generate(target, draft, ids, max_new_tokens=new, eos_token_id=[], policy=spec_ext.policies.Fixed(3))
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted == out.stats.drafted > 0
    assert out.stats.target_calls == len(calls), (out.stats.target_calls, len(calls))


@pytest.mark.parametrize("new", [24, 25])
def test_with_mtp_target_forwards_equal_transformers_use_mtp(new, tmp_path_factory):
    """The checkpoint's own MTP layer, Fixed(1): spec_ext's prefill emits the first token and
    the MTP layer drafts from the prefill's hidden state, as transformers' ``use_mtp`` does:
    the same target forwards on every prompt, odd and even lengths, accepted or not (before, one
    more where the first draft, drafted before the prompt's forward, was rejected)."""
    import random
    import test_mtp
    from test_mtp import PROMPTS, target_with_mtp
    test_mtp._TMP[:] = [tmp_path_factory]  # (its checkpoints' folder, as test_mtp's own fixture sets it)
    target, _ = target_with_mtp("glm4_moe", 1)
    rng = random.Random(0)
    rejected = 0
    for prompt in PROMPTS + [[rng.randrange(3, 61) for _ in range(rng.randrange(2, 8))] for _ in range(3)]:
        ids = torch.tensor([prompt])
        calls, handle = counted(target)
        expected = target.generate(ids, max_new_tokens=new, do_sample=False, use_mtp=True, eos_token_id=None,
                                   pad_token_id=0)
        handle.remove()
        out = spec_ext.generate(target, "mtp", ids, max_new_tokens=new, eos_token_id=[],
                                policy=spec_ext.policies.Fixed(1))
        assert torch.equal(out.sequences, expected)
        assert out.stats.target_calls == len(calls), (prompt, out.stats.target_calls, len(calls))
        rejected += out.stats.accepted < out.stats.drafted
    assert rejected, "prompts with rejected drafts too"


@pytest.mark.parametrize("kind", ["model", "head", "block", "text"])
@pytest.mark.parametrize("new", [1, 2])
def test_calls_that_end_in_the_first_round_equal_hf(kind, new):
    """One or two new tokens, row 0 ending at its first token (its EOS): the first round, which
    emits the first token with or without drafts, ends rows as HF does for every kind of drafter
    (a drafter reading the target's features starts on the rows left, here none or one)."""
    from helpers import ragged_greedy_equals_target
    from test_dflash import random_dflash
    from test_heads import echo_head
    from spec_ext.policies import NGram
    target = llama(12, 32, 4, seed=3, sharpen=3.0)
    draft = {"model": perturbed(target, 0.01, seed=1), "head": echo_head(target, noise=0.05),
             "block": random_dflash(target), "text": None}[kind]
    policy = NGram() if kind == "text" else "fixed"
    prompts = [[5, 7, 3, 8, 11, 4], [9, 4, 10]]
    if new == 1:
        out = spec_ext.generate(target, draft, prompts, max_new_tokens=1, eos_token_id=[], policy=policy)
        assert [out.sequences[b, -1].item() for b in range(2)] == [hf_greedy(target, p, 1, [])[0] for p in prompts]
    else:
        out = ragged_greedy_equals_target(target, draft, prompts, policy, max_new=new, eos_steps=[0])
    assert out.stats.target_calls == new


def test_policy_defaults_fit_the_drafter_and_numbers_beyond_it_are_refused(tmp_path_factory):
    """A block of 4 slots drafts 3 in a line: Fixed(), Tree(), DynamicTree() and an Adaptive
    tree without numbers fit it and stay exact (ragged, EOS); numbers set beyond it are refused
    naming the policy. Two MTP layers: Fixed() drafts 2, one per layer, as transformers' use_mtp."""
    import test_mtp
    from helpers import ragged_greedy_equals_target
    from test_dflash import random_dflash
    from spec_ext.policies import Adaptive, DynamicTree, Fixed, Tree
    target = llama(12, 32, 4, seed=3, sharpen=3.0)
    block = random_dflash(target, block=4, scale=0.3)
    prompts = [[5, 7, 3, 8, 11, 4], [9, 4, 10]]
    for policy, fitted in [(Fixed(), Fixed(3)), (Tree(), Tree((3, 2, 1))), (DynamicTree(), DynamicTree(depth=3)),
                           (Adaptive(tree=DynamicTree(top_k=4)), Adaptive(tree=DynamicTree(depth=3, top_k=4)))]:
        assert policy.fitted(3, 3) == fitted
        out = ragged_greedy_equals_target(target, block, prompts, policy, max_new=16)
        assert 0 < max(out.stats.draft_lengths) <= fitted.lookahead, policy
    for policy, said in [(Fixed(4), r"Fixed\(k=4\) drafts 4 in a line"), (Tree((2, 1, 1, 1)), "grows trees 4 deep"),
                         (DynamicTree(depth=5), "grows trees 5 deep")]:
        with pytest.raises(ValueError, match=rf"policy: .*{said}.*a block drafter drafts at most 3"):
            spec_ext.generate(target, block, prompts[:1], max_new_tokens=4, policy=policy)
    test_mtp._TMP[:] = [tmp_path_factory]
    with_mtp, _ = test_mtp.target_with_mtp("glm4_moe", 2)
    out = spec_ext.generate(with_mtp, "mtp", [[5, 17, 33, 8]], max_new_tokens=12, eos_token_id=[], policy=Fixed())
    assert set(out.stats.draft_lengths[1:]) == {2}  # (the first round: the prompt's forward, no drafts)


@pytest.mark.parametrize("kind", ["model", "head", "tree", "pearl", "gpt2", "gemma2"])
def test_a_long_prompts_head_is_fed_in_bounded_forwards_before_the_first_round(kind, monkeypatch):
    """Prompts longer than PROMPT_CHUNK (here 4 tokens) feed all but their last 4 tokens in
    forwards of at most 4 tokens a row before the first round's forward (ragged rows: one
    shorter than the chunk, fed nothing before it): greedy output equals HF's, ending rows at EOS,
    and the rounds after it draft and accept as they do with the whole prompt in one forward
    (a head's features of every prompt token assembled from both); the extra forwards counted.
    Llama on the lean forward; gpt2 and gemma2 (sliding windows of 6, a soft-cap) on the HF
    modules."""
    from helpers import ragged_greedy_equals_target
    from spec_ext.engine import common
    from test_architectures import sharpened_model
    from test_heads import echo_head
    target = sharpened_model(kind) if kind in ("gpt2", "gemma2") else llama(61, 32, 4, seed=3, sharpen=3.0)
    draft, policy = {"model": (perturbed(target, 0.01, seed=1), "fixed"), "head": (echo_head(target, noise=0.05),
                                                                                  "fixed"),
                     "tree": (perturbed(target, 0.01, seed=1), "tree"),
                     "pearl": (perturbed(target, 0.01, seed=1), spec_ext.policies.PEARL(gamma=2))}.get(
                         kind, (perturbed(target, 0.01, seed=1), "fixed"))
    prompts = [[5, 7, 3, 8, 11, 4, 9, 30, 12, 40, 6], [9, 4, 10], [17, 2, 33, 8, 21, 5, 50]]
    whole = ragged_greedy_equals_target(target, draft, prompts, policy, max_new=16, eos_steps=[5])
    fed = []

    def recording(*args, **kwargs):
        fed.append(common.lead_in(*args, **kwargs))
        return fed[-1]

    monkeypatch.setattr(common, "PROMPT_CHUNK", 4)
    for module in ("spec_ext.engine.serial", "spec_ext.engine.parallel.target_side"):
        monkeypatch.setattr(f"{module}.lead_in", recording)
    chunked = ragged_greedy_equals_target(target, draft, prompts, policy, max_new=16, eos_steps=[5])
    assert [f[0] for f in fed] == [[7, 0, 3]] and fed[0][2] == 2  # 7 tokens in forwards of 4 and 3
    assert torch.equal(chunked.sequences, whole.sequences)
    if kind != "pearl":  # (PEARL's rounds depend on the threads' timing)
        assert chunked.stats.target_calls == whole.stats.target_calls + 2
        assert (chunked.stats.drafted, chunked.stats.accepted) == (whole.stats.drafted, whole.stats.accepted) != (0, 0)
