"""Train a second bundled draft with a tokenizer of its own (issue 41): ``models/stdlib-draft-sp``.

The bundled pair (``train_pair.py``) shares one byte-level BPE tokenizer of 4096 tokens. This
draft has the bundled draft's shape (``train_pair.DRAFT``) over another vocabulary, so that the
other-tokenizer drafter (``spec_ext.drafters.other_tokenizer``) can be measured against the
same-tokenizer draft on the same corpus. Stages (each checkpointed; rerunning resumes):

  1. a SentencePiece-style tokenizer trained by ``tokenizers`` on the same training split:
     BPE with byte fallback (``<0x00>``..``<0xFF>`` at ids 1..256), spaces written ``▁`` by a
     ``Metaspace`` pre-tokenizer and decoder, the target's EOS (``<|endoftext|>``, by content)
     at id 0, 3000 tokens in all. Pieces before BPE: a word with its leading space, a run of
     spaces (the last one goes with the next word), tabs, line breaks; BPE merges inside a piece
     (letters, digits and punctuation together, as SentencePiece does: no GPT-2 split between
     ``self`` and ``.``). Rare characters (past the 160 most frequent) are written as bytes.
     ``decode(encode(text)) == text`` is asserted on every held-out file.
  2. the draft, a Llama of ``train_pair.DRAFT``'s shape (about 1.5M parameters with this
     vocabulary), trained with next-token cross-entropy on the training split in its own tokens
     (no logit distillation: the vocabularies differ; see stage 3); batch, sequence length,
     learning rate and its schedule, bf16 autocast and checkpointing are ``train_pair``'s (its ``train``).
  3. distillation, sequence-level (the issue's recipe for a draft of another tokenizer: the
     logits cannot be matched across vocabularies, the target's text can): the bundled target
     (float32) writes greedy continuations (``--distill-new-tokens`` 96) of
     ``--distill-continuations`` (12288) prompts of 96 target tokens cut from the training split
     (``stdlib_data.code_prompts``), HF ``generate`` in batches of 64, cached after each batch
     in the work folder; each prompt + continuation is decoded to text and re-tokenised by the
     draft's tokenizer, and the draft is fine-tuned with cross-entropy on the continuation's
     tokens only (the prompt's masked), each step half a batch of those and half a batch of
     ordinary training windows (against forgetting), the two losses averaged;
     ``--distill-steps`` (3600) at ``--distill-lr`` (5e-4, warmup a tenth, cosine to a tenth),
     checkpointed. ``--distill-continuations 0`` skips the stage (the undistilled draft).
  4. the export (bf16 safetensors + tokenizer) to ``--out/stdlib-draft-sp`` and
     ``report.json`` beside it: held-out bits per byte of UTF-8 text (comparable across
     tokenizers) of this draft, of the bundled draft and of the bundled target on the same text;
     characters per token of both tokenizers; the vocabulary map against the target's tokenizer
     (``spec_ext.vocab``: shared tokens, the target's tokens covered by frequency); one-token
     decode cost; parameters, steps, training minutes; the distillation's settings and minutes;
     greedy agreement with the target (``agreement``: teacher-forced on the target's greedy
     continuations of 64 held-out prompts, per token and per character) of this draft, of it
     before distillation and of the bundled draft.

The prepend scheme: ``--prepend-scheme never`` (the default: Gemma's choice, no dummy-prefix
``▁``) round-trips every text exactly, and a tail re-tokenised from a word start gives the
tokens it has inside the text. ``first`` (Llama-2's dummy prefix) round-trips Python files (the
decoder drops the first space, and a file never starts with one) but not a text that starts
with a space, and a tail that starts at a line break gets an extra ``▁`` token (on the held-out
files, 82 of 406 tails starting at a whitespace-adjacent token, the kind of window the
other-tokenizer drafter re-tokenises, gave other tokens than the text's own; 0 of 394 with
``never``); ``always`` round-trips no file (every piece gets a ``▁``).

Cost on the 2-core machine (measured 2026-12-02 while two test runs held both cores, so the
quiet-machine figures are estimates): tokenizer, round-trip check and encoding ~45 s; a
training step costs 0.34 s of CPU (15 steps at 1 thread got a core to themselves: 0.34 s/step
wall); the smoke runs, niced against the two test runs, saw 0.97-1.35 s/step. The report ~1 min
(the target's held-out pass is most of it). The default 2000 steps (the bundled draft's) so take
~8-11 min of training on a quiet machine, ~13 min in all; on a machine shared as above ~35-45 min.
The distillation at 1 thread, niced beside other work (2026-12-02): the continuations ~2.4-10
prompts/s (96 tokens each, batch 64; the prompts are a prefix-stable stream, so a cache of the
first N serves a larger count: ``continuations_train_<N>x96+96.pt`` copied to the larger name
resumes), ~31 min for 12288 beside a test run; the fine-tuning steps 2.4-3 steps/s (~23 min
for 3600); the held-out continuations for the agreement ~1 min. More distillation data raised
the agreement with the target's text per draft token from 0.68 (768 continuations, 300 steps)
to 0.72 (2048, 800), 0.76 (6144, 2400) and 0.78 (12288, 3600); the bundled draft's is 0.73.

    python benchmarks/train_other_draft.py                     # models/stdlib-draft-sp
    python benchmarks/train_other_draft.py --steps 20 --work /tmp/sp-work --out /tmp/sp-out  # smoke run
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stdlib_data import read_text, split_files  # noqa: E402
from train_pair import (DRAFT, STREAM_SEEDS, add_training_arguments, batches, encode_split, export,  # noqa: E402
                        lr_at, make_model, resume, train)

NAME = "stdlib-draft-sp"
VOCAB_SIZE = 3000
ALPHABET = 160  # the most frequent characters get tokens of their own; the rest are bytes
# before BPE: a word (anything but whitespace) with its leading space, a run of spaces whose
# last space goes with the next word, tabs, line breaks, other whitespace
PIECES = r" ?[^\s]+| +(?=[ ][^\s])| +|\t+|[\r\n]+|[^\S\r\n \t]+"
ROOT = Path(__file__).resolve().parents[1]


def _pre_tokenizer(scheme: str):
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PIECES), "isolated"),
                                    pre_tokenizers.Metaspace(prepend_scheme=scheme, split=False)])


def train_sp_tokenizer(work: Path, eos: str, scheme: str, vocab_size: int = VOCAB_SIZE):
    """The SentencePiece-style tokenizer (see the module docstring), trained once into
    ``work/tokenizer`` and loaded from there."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = work / "tokenizer"
    if not (path / "tokenizer.json").exists():
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        trained = Tokenizer(models.BPE())
        trained.pre_tokenizer = _pre_tokenizer(scheme)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(byte_tokens), special_tokens=[eos],
                                      limit_alphabet=ALPHABET, show_progress=True)
        trained.train_from_iterator((read_text(f) for f in split_files("train")), trainer)
        # the same merges over a vocabulary with the byte tokens after EOS (Llama-2's layout)
        learned = sorted(trained.get_vocab().items(), key=lambda item: item[1])
        ordered = [eos, *byte_tokens, *(t for t, _ in learned if t != eos)]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                  for m in json.loads(trained.to_str())["model"]["merges"]]
        tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(ordered)}, merges, byte_fallback=True))
        tokenizer.pre_tokenizer = _pre_tokenizer(scheme)
        tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(),
                                               decoders.Metaspace(prepend_scheme=scheme, split=False)])
        tokenizer.add_special_tokens([eos])
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=eos, eos_token=eos, pad_token=eos,
                                       clean_up_tokenization_spaces=False)
        fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def round_trip_failures(tokenizer, files) -> list[str]:
    """The files of ``files`` whose text ``tokenizer`` does not give back exactly."""
    return [str(f) for f in files
            if tokenizer.decode(tokenizer(read_text(f), add_special_tokens=False).input_ids) != read_text(f)]


def eval_texts(chars: int) -> list[str]:
    """About ``chars`` characters of the held-out test modules: the first whole lines of each
    test file, the same share of each (deterministic)."""
    files = split_files("test")
    per_file, texts = math.ceil(chars / len(files)), []
    for f in files:
        text = read_text(f)
        cut = text.rfind("\n", 0, per_file) + 1 if len(text) > per_file else len(text)
        if cut > 0:
            texts.append(text[:cut])
    return texts


@torch.no_grad()
def nats_per_byte(model, tokenizer, texts: list[str], seq: int = 256, batch: int = 16) -> tuple[float, int]:
    """(mean negative log-likelihood per UTF-8 byte, tokens) of ``texts`` under ``model``: each
    text after an EOS (as in training), in windows of ``seq`` predicted tokens, each window
    read from its own start (no context carried across windows)."""
    model.eval()
    eos = tokenizer.eos_token_id
    windows, tokens = [], 0
    for text in texts:
        ids = [eos] + tokenizer(text, add_special_tokens=False).input_ids
        tokens += len(ids) - 1
        windows += [ids[s:s + seq + 1] for s in range(0, len(ids) - 1, seq)]
    nll = 0.0
    for i in range(0, len(windows), batch):
        group = windows[i:i + batch]
        width = max(map(len, group))
        chunk = torch.tensor([w + [eos] * (width - len(w)) for w in group])
        labels = torch.tensor([w[1:] + [-100] * (width - len(w)) for w in group])
        logits = model(input_ids=chunk[:, :-1]).logits.float()  # right padding: causal, no effect
        nll += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum").item()
    return nll / sum(len(t.encode()) for t in texts), tokens


@torch.no_grad()
def decode_ms(models: dict, context: int = 200, repeats: int = 30) -> dict[str, float]:
    """Per name of ``models`` (name -> (model, token ids)): the median time of a one-token
    forward after a ``context``-token cache (the cost per draft token). The models take turns
    in each repeat, so that load from elsewhere on the machine falls on them alike."""
    import inspect
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, (model, ids) in models.items():
            model.eval()
            ids = torch.tensor([ids[:context + 1]])
            # transformers renamed past_key_values to cache
            arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            out = model(input_ids=ids[:, :context], use_cache=True)
            t = time.perf_counter()
            model(input_ids=ids[:, context:], use_cache=True, **{arg: getattr(out, arg, None) or out.past_key_values})
            times[name].append(time.perf_counter() - t)
    return {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}


# ------------------------------------------------------------------ stage 3: distillation
@torch.no_grad()
def target_continuations(target, target_tokenizer, split: str, count: int, prompt_tokens: int, new_tokens: int,
                         path: Path, batch: int = 64, seed: int = 0, desc: str = "continuations") -> list[str]:
    """The target's greedy continuations of ``count`` prompts of ``split`` (``code_prompts``,
    ``prompt_tokens`` tokens each ending at a line break), ``new_tokens`` each (EOS does not
    stop them), generated ``batch`` at a time with HF ``generate`` and cached at ``path``
    after each batch (a rerun resumes). Returns [(prompt text, continuation text)] as
    strings: the target's tokens decoded, so that any tokenizer can re-read them."""
    from stdlib_data import code_prompts

    done = torch.load(path) if path.exists() else dict(prompts=[], continuations=[])
    prompts = code_prompts(target_tokenizer, split, count, prompt_tokens, seed=seed)
    eos = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = None  # exactly new_tokens each
    target.eval()
    bar = tqdm(total=count, initial=len(done["continuations"]), desc=desc)
    for start in range(len(done["continuations"]), count, batch):
        ids = torch.tensor(prompts[start:start + batch])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=target_tokenizer.eos_token_id)
        done["prompts"] += ids.tolist()
        done["continuations"] += out[:, ids.shape[1]:].tolist()
        torch.save(done, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
        bar.update(len(ids))
    bar.close()
    target.generation_config.eos_token_id = eos
    pairs = []
    for prompt, continuation in zip(done["prompts"][:count], done["continuations"][:count]):
        text = target_tokenizer.decode(prompt + continuation, clean_up_tokenization_spaces=False)
        head = target_tokenizer.decode(prompt, clean_up_tokenization_spaces=False)
        assert text.startswith(head)
        # a continuation that stops inside a character: drop the partial character
        pairs.append((head, text[len(head):].rstrip("\ufffd")))
    return pairs


def continuation_ids(tokenizer, head: str, tail: str) -> tuple[list[int], int]:
    """(the tokens of ``head + tail``, where the tail's tokens start): the tokens past the
    common prefix of the whole text's and the head's alone (a token across the boundary is
    the tail's)."""
    ids = tokenizer(head + tail, add_special_tokens=False).input_ids
    own = tokenizer(head, add_special_tokens=False).input_ids
    start = next((i for i, (a, b) in enumerate(zip(ids, own)) if a != b), min(len(ids), len(own)))
    return ids, start


def distill(draft, tokenizer, pairs: list[tuple[str, str]], train_tokens: torch.Tensor, args, work: Path):
    """Sequence-level distillation (issue 41's recipe for a draft of another tokenizer): the
    target's greedy text re-tokenised by the draft's tokenizer is what the draft must
    predict. Each step: half a batch of those sequences (cross-entropy on the continuation's
    tokens only, the prompt's masked) and half a batch of ordinary training windows (against
    forgetting), the two losses averaged; ``args.distill_steps`` steps at ``args.distill_lr``
    (warmup, then cosine to a tenth), checkpointed at ``work/draft_sp_distill.ckpt``."""
    eos = tokenizer.eos_token_id
    rows, labels = [], []
    for head, tail in pairs:
        ids, start = continuation_ids(tokenizer, head, tail)
        cut = max(0, len(ids) - (args.seq + 1))  # too long: the prompt's first tokens go
        ids, start = ids[cut:], max(1, start - cut)
        rows.append(ids + [eos] * (args.seq + 1 - len(ids)))
        labels.append([-100] * start + ids[start:] + [-100] * (args.seq + 1 - len(ids)))
    rows, labels = torch.tensor(rows), torch.tensor(labels)
    half = args.batch // 2
    steps = args.distill_steps
    ckpt = work / "draft_sp_distill.ckpt"
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.distill_lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = resume(ckpt, draft, optimizer)
    if step >= steps:
        return draft
    # the data order, replayed from step 0 so that a resumed run sees the same batches
    generator = torch.Generator().manual_seed(args.seed + 41)
    order = torch.cat([torch.randperm(len(rows), generator=generator)
                       for _ in range(math.ceil(steps * half / len(rows)) + 1)])
    corpus = batches(train_tokens, half, args.seq, seed=STREAM_SEEDS["draft"] + args.seed + 41, start_step=step)
    log = open(work / "draft_sp_distill.log", "a")
    draft.train()
    bar = tqdm(total=steps, initial=step, desc="distill draft_sp", mininterval=10)
    ema = None
    while step < steps:
        pick = order[step * half:(step + 1) * half]
        chunk, target_labels = rows[pick], labels[pick]
        plain = next(corpus)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, args.distill_lr, warmup=max(1, steps // 10))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = draft(input_ids=chunk[:, :-1]).logits.float()
            soft = F.cross_entropy(logits.flatten(0, 1), target_labels[:, 1:].flatten(), ignore_index=-100)
            logits = draft(input_ids=plain[:, :-1]).logits.float()
            hard = F.cross_entropy(logits.flatten(0, 1), plain[:, 1:].flatten())
            loss = 0.5 * (soft + hard)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        step += 1
        ema = (soft.item(), hard.item()) if ema is None else \
            (0.95 * ema[0] + 0.05 * soft.item(), 0.95 * ema[1] + 0.05 * hard.item())
        bar.update(1)
        bar.set_postfix(ce_target=f"{ema[0]:.3f}", ce_corpus=f"{ema[1]:.3f}")
        if step % 25 == 0 or step == steps:
            print(json.dumps(dict(step=step, ce_target_text=round(ema[0], 4), ce_corpus=round(ema[1], 4))),
                  file=log, flush=True)
        if step % args.checkpoint_every == 0 or step == steps:
            torch.save(dict(model=draft.state_dict(), optimizer=optimizer.state_dict(), step=step),
                       ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
    bar.close()
    return draft


@torch.no_grad()
def agreement(model, tokenizer, pairs: list[tuple[str, str]], batch: int = 16) -> dict:
    """How often the model's greedy next token is the one the target's greedy text has next,
    teacher-forced on ``pairs`` (held-out prompts and the target's greedy continuations) in
    the model's own tokens, over the continuation's tokens: per token, and per character
    (each token weighs the characters it adds to the decoded text), which compares
    tokenizers. For the target's own tokenizer this is top-1 agreement with the target."""
    model.eval()
    eos = tokenizer.eos_token_id
    hits = tokens = hit_chars = chars = 0
    for i in range(0, len(pairs), batch):
        group = [continuation_ids(tokenizer, head, tail) for head, tail in pairs[i:i + batch]]
        width = max(len(ids) for ids, _ in group)
        chunk = torch.tensor([ids + [eos] * (width - len(ids)) for ids, _ in group])
        predicted = model(input_ids=chunk).logits.argmax(-1)
        for row, ((ids, start), (head, _)) in enumerate(zip(group, pairs[i:i + batch])):
            # a token across the boundary weighs the continuation's characters only
            lengths = [max(len(head), len(tokenizer.decode(ids[:j], clean_up_tokenization_spaces=False)))
                       for j in range(max(1, start), len(ids) + 1)]
            for j, width_chars in zip(range(max(1, start), len(ids)), torch.tensor(lengths).diff().tolist()):
                hit = int(predicted[row, j - 1]) == ids[j]
                hits += hit
                tokens += 1
                hit_chars += hit * width_chars
                chars += width_chars
    return dict(per_token=hits / tokens, per_char=hit_chars / chars, tokens=tokens, chars=chars)


def report(draft, tokenizer, target_dir: Path, draft_dir: Path, args, train_seconds: float,
           round_trip: dict) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_ext.vocab import vocab_map

    target_tokenizer = AutoTokenizer.from_pretrained(target_dir)
    texts = eval_texts(args.eval_chars)
    text = "".join(texts)
    vocab = vocab_map(tokenizer, target_tokenizer)
    draft_ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    target_ids = torch.tensor(target_tokenizer(text, add_special_tokens=False).input_ids)
    result = dict(
        eval_text=f"held-out test modules, the first lines of each file: {len(text):,} characters, "
                  f"{len(text.encode()):,} bytes, windows of {args.seq} tokens",
        tokenizer=dict(
            vocab_size=len(tokenizer), kind=f"BPE, byte fallback, Metaspace prepend_scheme={args.prepend_scheme!r}",
            eos_token=tokenizer.eos_token, eos_token_id=tokenizer.eos_token_id,
            chars_per_token=len(text) / len(draft_ids),
            target_chars_per_token=len(text) / len(target_ids),
            round_trip=round_trip),
        vocab_map=dict(
            target_vocab_size=len(target_tokenizer), shared=vocab.shared,
            shared_of_draft=vocab.shared / len(tokenizer), shared_of_target=vocab.shared / len(target_tokenizer),
            subset_of_target=vocab.shared == len(tokenizer),
            # what the warning measures: the target's tokens of this text the draft has
            target_share_by_frequency=vocab.share_by_frequency(target_ids),
            # the draft's own tokens of this text that map to a target token (what TLI can propose)
            draft_share_by_frequency=float((vocab.draft_to_target[draft_ids] >= 0).float().mean())),
    )
    models = {"draft_sp": (draft, tokenizer)}
    for name, folder in (("draft", draft_dir), ("target", target_dir)):
        if folder.exists():
            models[name] = (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                            AutoTokenizer.from_pretrained(folder))
    held_out = {}
    for name, (model, tok) in tqdm(models.items(), desc="evaluate"):
        nats, tokens = nats_per_byte(model, tok, texts, seq=args.seq)
        held_out[name] = dict(bits_per_byte=nats / math.log(2), perplexity_per_byte=math.exp(nats),
                              perplexity_per_char=math.exp(nats * len(text.encode()) / len(text)),
                              perplexity_per_token=math.exp(nats * len(text.encode()) / tokens),
                              params=sum(p.numel() for p in model.parameters()))
    costs = decode_ms({name: (model, tok(text, add_special_tokens=False).input_ids)
                       for name, (model, tok) in models.items() if name != "target"})
    for name, ms in costs.items():
        held_out[name]["decode_ms_200"] = ms  # one-token forward after 200 tokens, fp32, median
    result["held_out"] = held_out
    log = [json.loads(line) for line in (args.work / "draft_sp.log").read_text().splitlines()] \
        if (args.work / "draft_sp.log").exists() else []
    result["training"] = dict(
        steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, bf16=args.bf16, seed=args.seed,
        tokens_seen=args.steps * args.batch * args.seq,
        minutes=train_seconds / 60,  # the runs of the training stage that finished it
        final_train_ce=log[-1]["ce"] if log else None,
        tokens_per_s=log[-1]["tokens_per_s"] if log else None,
        seconds_per_step=args.batch * args.seq / log[-1]["tokens_per_s"] if log and log[-1]["tokens_per_s"] else None)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parent / ".train_work" / "draft-sp")
    parser.add_argument("--out", type=Path, default=ROOT / "models",
                        help=f"the folder {NAME}/ is written in")
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target",
                        help="the bundled target (its tokenizer's EOS; the vocabulary map; the report)")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft",
                        help="the bundled same-tokenizer draft (compared in the report)")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--prepend-scheme", choices=("never", "first", "always"), default="never",
                        help="Metaspace's dummy-prefix rule (see the module docstring)")
    parser.add_argument("--steps", type=int, default=2000)
    add_training_arguments(parser)
    parser.add_argument("--eval-chars", type=int, default=200_000,
                        help="held-out characters the report's perplexities are measured on")
    parser.add_argument("--distill-continuations", type=int, default=12288,
                        help="the target's greedy continuations of training prompts the draft is then fine-tuned "
                             "on (stage 3; 0: no distillation)")
    parser.add_argument("--distill-prompt-tokens", type=int, default=96, help="target tokens per prompt")
    parser.add_argument("--distill-new-tokens", type=int, default=96, help="target tokens per continuation")
    parser.add_argument("--distill-steps", type=int, default=3600)
    parser.add_argument("--distill-lr", type=float, default=5e-4)
    parser.add_argument("--agreement-prompts", type=int, default=64,
                        help="held-out prompts whose target continuations the report's agreement is measured on")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    eos = AutoTokenizer.from_pretrained(args.target).eos_token
    tokenizer = train_sp_tokenizer(args.work, eos, args.prepend_scheme, args.vocab_size)
    assert len(tokenizer) == args.vocab_size and tokenizer.eos_token == eos, (len(tokenizer), tokenizer.eos_token)
    held_out_files = split_files("validation") + split_files("test")
    failures = round_trip_failures(tokenizer, held_out_files)
    assert not failures, f"decode(encode(text)) != text for {len(failures)} held-out files, e.g. {failures[:3]}"
    round_trip = dict(files=len(held_out_files), exact=len(held_out_files) - len(failures))
    print(f"tokenizer: {len(tokenizer)} tokens, round trip exact on {len(held_out_files)} held-out files",
          flush=True)
    train_tokens = encode_split(tokenizer, "train", args.work)
    print(f"train tokens {len(train_tokens):,}", flush=True)

    torch.manual_seed(args.seed + 1)
    draft = make_model(DRAFT, tokenizer, vocab_size=len(tokenizer))
    print(f"draft params {sum(p.numel() for p in draft.parameters()):,}", flush=True)
    seconds_file = args.work / "draft_sp.seconds"
    seconds = float(seconds_file.read_text()) if seconds_file.exists() else 0.0
    started = time.time()
    done_before = (args.work / "draft_sp.ckpt").exists() and \
        torch.load(args.work / "draft_sp.ckpt")["step"] >= args.steps
    draft = train("draft_sp", draft, train_tokens, args.steps, args, args.work,
                  stream_seed=STREAM_SEEDS["draft"])
    if not done_before:
        seconds += time.time() - started
        seconds_file.write_text(f"{seconds:.1f}\n")

    undistilled = copy.deepcopy(draft)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target_tokenizer = AutoTokenizer.from_pretrained(args.target)
    distillation = None
    if args.distill_continuations > 0:
        timings = args.work / "draft_sp_distill.seconds"
        spent = json.loads(timings.read_text()) if timings.exists() else dict(generation=0.0, finetune=0.0)
        cache = args.work / (f"continuations_train_{args.distill_continuations}x"
                             f"{args.distill_prompt_tokens}+{args.distill_new_tokens}.pt")
        started = time.time()
        complete = cache.exists() and len(torch.load(cache)["continuations"]) >= args.distill_continuations
        pairs = target_continuations(target, target_tokenizer, "train", args.distill_continuations,
                                     args.distill_prompt_tokens, args.distill_new_tokens, cache)
        if not complete:
            spent["generation"] += time.time() - started
            timings.write_text(json.dumps(spent) + "\n")
        started = time.time()
        complete = (args.work / "draft_sp_distill.ckpt").exists() and \
            torch.load(args.work / "draft_sp_distill.ckpt")["step"] >= args.distill_steps
        draft = distill(draft, tokenizer, pairs, train_tokens, args, args.work)
        if not complete:
            spent["finetune"] += time.time() - started
            timings.write_text(json.dumps(spent) + "\n")
        log = [json.loads(line) for line in (args.work / "draft_sp_distill.log").read_text().splitlines()]
        distillation = dict(
            recipe="sequence-level: the target's greedy continuations of training prompts, decoded and re-tokenised "
                   "by the draft's tokenizer; cross-entropy on the continuation's tokens (the prompt's masked), "
                   "each step half such sequences, half ordinary training windows, the two losses averaged",
            continuations=args.distill_continuations, split="train", prompt_tokens=args.distill_prompt_tokens,
            new_tokens=args.distill_new_tokens, generation="HF generate, greedy, float32, batch 64",
            steps=args.distill_steps, lr=args.distill_lr, schedule="warmup a tenth, cosine to a tenth",
            batch=f"{args.batch // 2} continuations + {args.batch // 2} windows of {args.seq}",
            minutes_generation=spent["generation"] / 60, minutes_finetune=spent["finetune"] / 60,
            final_ce_target_text=log[-1]["ce_target_text"], final_ce_corpus=log[-1]["ce_corpus"])

    out = args.out / NAME
    export(draft, tokenizer, out)
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    result = report(draft, tokenizer, args.target, args.draft, args, seconds, round_trip)
    if distillation is not None:
        result["distillation"] = distillation
    if args.agreement_prompts > 0:
        held_out = target_continuations(target, target_tokenizer, "test", args.agreement_prompts,
                                        args.distill_prompt_tokens, args.distill_new_tokens,
                                        args.work / f"continuations_test_{args.agreement_prompts}x"
                                                    f"{args.distill_prompt_tokens}+{args.distill_new_tokens}.pt",
                                        desc="held-out continuations")
        rates = {"draft_sp": agreement(draft, tokenizer, held_out)}
        if distillation is not None:
            rates["draft_sp_undistilled"] = agreement(undistilled.float(), tokenizer, held_out)
        if args.draft.exists():
            rates["draft"] = agreement(AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32),
                                       AutoTokenizer.from_pretrained(args.draft), held_out)
        result["agreement_with_target"] = dict(
            text=f"the target's greedy continuations ({args.distill_new_tokens} target tokens) of "
                 f"{args.agreement_prompts} held-out test prompts of {args.distill_prompt_tokens} tokens, "
                 f"teacher-forced: how often each model's greedy next token is the text's next token in its own "
                 f"tokens (per token, and per character: each token weighs the characters it adds)",
            **rates)
    (out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
