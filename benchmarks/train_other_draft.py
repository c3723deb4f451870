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
     (no distillation: the vocabularies differ); batch, sequence length, learning rate and its
     schedule, bf16 autocast and checkpointing are ``train_pair``'s (its ``train``).
  3. the export (bf16 safetensors + tokenizer) to ``--out/stdlib-draft-sp`` and
     ``report.json`` beside it: held-out bits per byte of UTF-8 text (comparable across
     tokenizers) of this draft, of the bundled draft and of the bundled target on the same text;
     characters per token of both tokenizers; the vocabulary map against the target's tokenizer
     (``spec_ext.vocab``: shared tokens, the target's tokens covered by frequency); one-token
     decode cost; parameters, steps, training minutes.

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

    python benchmarks/train_other_draft.py                     # models/stdlib-draft-sp
    python benchmarks/train_other_draft.py --steps 20 --work /tmp/sp-work --out /tmp/sp-out  # smoke run
"""
from __future__ import annotations

import argparse
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
from train_pair import (DRAFT, STREAM_SEEDS, add_training_arguments, encode_split, export, make_model,  # noqa: E402
                        train)

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

    out = args.out / NAME
    export(draft, tokenizer, out)
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    result = report(draft, tokenizer, args.target, args.draft, args, seconds, round_trip)
    (out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
