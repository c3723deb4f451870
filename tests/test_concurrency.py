"""Calls from several threads at once, as a web server makes them: one accelerated model, four
threads, each call's output equal to the same call made alone (greedy: the target's; sampled
with a seed: the same tokens), no exception; what the policy learns across calls (the
memory) holds every call's contribution; a plain ``target.generate`` on another thread beside
accelerated calls runs as it would alone."""
import threading

import pytest
import torch

import spec_ext
from spec_ext.drafters import ModelDrafter
from spec_ext.policies import Adaptive, DynamicTree, Fixed, SuffixCache, Tree
from helpers import hf_greedy, llama, perturbed

PROMPTS = [[5, 17, 33, 8, 5, 17, 33], [40, 2], [9, 9, 9, 9, 12], [70, 71, 60, 70, 71, 60, 70], [3, 1, 4, 1, 5],
           [11, 12, 13, 11, 12]]
BATCHES = [PROMPTS[:2], PROMPTS[2:5], [PROMPTS[5]], PROMPTS[1:4], PROMPTS[3:], PROMPTS[:1], PROMPTS[4:], PROMPTS[::2]]


@pytest.fixture(scope="module")
def target():
    return llama(97, 64, 2, seed=0, sharpen=4.0)


def drafts(target):
    """The draft of every kind the concurrency tests run: a draft model, an EAGLE-3 head, a
    DFlash block drafter, none (the text), and a drafter the caller made (one instance every
    call is given)."""
    from test_dflash import random_dflash
    from test_heads import echo_head
    return {"model": perturbed(target, 0.01, seed=1), "head": echo_head(target, noise=0.01),
            "dflash": random_dflash(target, block=4), "text": None,
            "drafter": ModelDrafter(perturbed(target, 0.01, seed=1))}


def left_padded(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of the ragged ``batch``, left-padded with 0."""
    width = max(map(len, batch))
    return (torch.tensor([[0] * (width - len(p)) + p for p in batch]),
            torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch]))


def run_at_once(calls):
    """Run ``calls`` (functions) on one thread each, all started together; their results, or the
    first exception raised."""
    results, errors = [None] * len(calls), []
    barrier = threading.Barrier(len(calls))

    def work(i):
        try:
            barrier.wait()
            results[i] = calls[i]()
        except Exception as error:  # raised again below, on the main thread
            errors.append(error)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


CASES = [("model", "auto"), ("model", Fixed(3)), ("model", Tree((2, 1))), ("model", Adaptive()), ("head", "auto"),
         ("head", DynamicTree(depth=3, top_k=2, nodes=6)), ("dflash", "auto"), ("dflash", Adaptive()),
         ("text", "ngram"), ("model", "suffix"), ("head", "suffix"), ("drafter", "auto"), ("drafter", Fixed(3))]


@pytest.mark.parametrize("kind,policy", CASES, ids=[f"{k}-{p if isinstance(p, str) else type(p).__name__}"
                                                    for k, p in CASES])
def test_four_threads_calling_one_accelerated_model_each_get_their_own_output(target, kind, policy):
    """Eight ragged greedy calls, two per thread on four threads at once, through one accelerated
    model (its memory, and for suffix decoding one cache, shared): every output equals the same
    call made alone (the target's greedy output), none raises, and the memory holds what the
    calls measured."""
    draft = drafts(target)[kind]
    cache = SuffixCache() if policy in ("suffix", "ngram") else None
    fast = spec_ext.accelerate(target, draft, policy=policy, suffix_cache=cache if cache is not None else False)
    expected = {tuple(map(tuple, b)): [hf_greedy(target, p, 16, eos=[]) for p in b] for b in BATCHES}

    def call(batch):
        ids, mask = left_padded(batch)
        out = fast.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=[],
                            pad_token_id=0)
        return [row[-16:].tolist() for row in out]

    results = run_at_once([lambda b=(BATCHES[2 * i], BATCHES[2 * i + 1]): [call(b[0]), call(b[1])]
                           for i in range(4)])
    for i, (first, second) in enumerate(results):
        for batch, got in ((BATCHES[2 * i], first), (BATCHES[2 * i + 1], second)):
            assert got == expected[tuple(map(tuple, batch))], (i, batch)
    if isinstance(policy, Adaptive) or policy in ("auto", "suffix"):
        assert fast.memory.keys(), "the calls' measurements went into the memory"
    if cache is not None:
        assert len(cache.texts()) == sum(map(len, BATCHES))


def test_a_call_from_inside_a_call_on_the_same_drafter_is_refused(target):
    """A streamer that calls generate again with the caller's drafter (whose state is the outer
    call's) gets a ValueError naming ``draft``; the drafter serves the next call as before."""
    drafter = ModelDrafter(perturbed(target, 0.01, seed=1))

    class Streamer:
        def put(self, value):
            spec_ext.generate(target, drafter, [[5, 17]], max_new_tokens=2, eos_token_id=[])

        def end(self):
            pass
    with pytest.raises(ValueError, match="draft: this Drafter is in a call on this thread"):
        spec_ext.generate(target, drafter, [[5, 17, 33]], max_new_tokens=4, eos_token_id=[], streamer=Streamer())
    out = spec_ext.generate(target, drafter, [PROMPTS[0]], max_new_tokens=8, eos_token_id=[])
    assert out.sequences[0, -8:].tolist() == hf_greedy(target, PROMPTS[0], 8, eos=[])


@pytest.mark.parametrize("kind,policy", [("model", "auto"), ("head", "auto"), ("dflash", Adaptive()),
                                         ("drafter", "auto")])
def test_seeded_sampled_calls_on_four_threads_reproduce(target, kind, policy):
    """Seeded sampled calls at once on four threads give the tokens each gives alone, whatever
    the other calls and the greedy calls before them measured."""
    draft = drafts(target)[kind]
    fast = spec_ext.accelerate(target, draft, policy=policy)
    fast.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=16, do_sample=False)  # a greedy call first: memory

    def call(seed, batch):
        return spec_ext.generate(target, draft, batch, max_new_tokens=12, temperature=1.0, seed=seed, policy=policy,
                                 memory=fast.memory).sequences

    alone = [call(seed, BATCHES[seed]) for seed in range(4)]
    together = run_at_once([lambda s=seed: call(s, BATCHES[s]) for seed in range(4)])
    for seed in range(4):
        assert torch.equal(together[seed], alone[seed]), seed


def test_a_plain_generate_beside_accelerated_calls_runs_as_it_would_alone(target):
    """While accelerated calls run on one thread (their attention routed through spec_ext), a
    plain ``target.generate`` on another thread and an HF-modules model's plain calls give
    the same tokens as alone: the routing is the accelerated thread's own."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=128)).eval()
    models = {"lean": (target, perturbed(target, 0.01, seed=1)), "hf modules": (gpt2, perturbed(gpt2, 0.01, seed=2))}
    for name, (model, draft) in models.items():
        ids, config_class = torch.tensor([PROMPTS[0]]), type(model.config)
        plain_alone = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
        fast = spec_ext.accelerate(model, draft, fast_linear=True)
        stop = threading.Event()

        def accelerated():
            count = 0
            while not stop.is_set() or count < 2:
                out = fast.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
                assert torch.equal(out, plain_alone) or name == "hf modules"  # (skinny_linear's rounding)
                count += 1
            return count

        def plain():
            try:
                return [model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0) for _ in range(4)]
            finally:
                stop.set()

        count, outs = run_at_once([accelerated, plain])
        assert count >= 2
        for out in outs:
            assert torch.equal(out, plain_alone), name
        assert type(model.config) is config_class and model.config._attn_implementation != "spec_ext"
