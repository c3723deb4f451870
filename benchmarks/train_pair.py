"""Train the bundled draft/target pair on the Python standard library.

Stages (each checkpointed; rerunning resumes where it stopped):
  1. a byte-level BPE tokenizer on the training split;
  2. the target, a Llama of about 10M parameters, trained with next-token loss;
  3. the draft, a Llama of about 1.7M parameters, distilled from the target's logits;
  4. both exported as HF folders (bf16 safetensors + tokenizer) under --out, and
     evaluated on the held-out test modules (perplexity, draft/target top-1
     agreement, forward-cost ratio).

    python benchmarks/train_pair.py            # defaults reproduce the bundled pair's step counts
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
from stdlib_data import EOS, read_text, split_files  # noqa: E402

VOCAB_SIZE = 4096
TARGET = dict(hidden_size=320, intermediate_size=864, num_hidden_layers=8,
              num_attention_heads=10, num_key_value_heads=5)
STREAM_SEEDS = {"target": 0, "draft": 1000}  # data order per model; fixed so a resumed run replays it
DRAFT = dict(hidden_size=192, intermediate_size=576, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=6)


def train_tokenizer(work: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = work / "tokenizer"
    if not (path / "tokenizer.json").exists():
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=True)
        tokenizer.train_from_iterator((read_text(f) for f in split_files("train")), trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS,
                                       eos_token=EOS, pad_token=EOS)
        fast.save_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def encode_split(tokenizer, split: str, work: Path) -> torch.Tensor:
    path = work / f"tokens_{split}.pt"
    if not path.exists():
        ids: list[int] = []
        for f in tqdm(split_files(split), desc=f"encode {split}"):
            ids += tokenizer(read_text(f), add_special_tokens=False)["input_ids"]
            ids.append(tokenizer.eos_token_id)
        torch.save(torch.tensor(ids, dtype=torch.int16), path)
    return torch.load(path).long()


def make_model(shape: dict, tokenizer, vocab_size: int = VOCAB_SIZE):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id, **shape)
    return LlamaForCausalLM(config)


def batches(tokens: torch.Tensor, batch: int, seq: int, seed: int, start_step: int):
    generator = torch.Generator().manual_seed(seed)
    step = 0
    while True:
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=generator)
        if step >= start_step:
            yield torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
        step += 1


def lr_at(step: int, steps: int, peak: float, warmup: int = 200) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def resume(ckpt: Path, model, optimizer) -> int:
    """The step a checkpoint was written at, its model and optimizer state loaded (0: no checkpoint)."""
    if not ckpt.exists():
        return 0
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def train(name: str, model, tokens, steps: int, args, work: Path, teacher=None, stream_seed: int | None = None):
    """Next-token training (teacher=None) or distillation from the teacher's logits.
    ``stream_seed``: the data order's seed (default ``STREAM_SEEDS[name]``), plus ``args.seed``."""
    ckpt = work / f"{name}.ckpt"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    step = resume(ckpt, model, optimizer)
    if step >= steps:
        return model
    log = open(work / f"{name}.log", "a")
    model.train()
    stream_seed = STREAM_SEEDS[name] if stream_seed is None else stream_seed
    data = batches(tokens, args.batch, args.seq, seed=stream_seed + args.seed, start_step=step)
    bar = tqdm(total=steps, initial=step, desc=f"train {name}", mininterval=10)
    started, ema = time.time(), None
    while step < steps:
        chunk = next(data)
        inputs, labels = chunk[:, :-1], chunk[:, 1:]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, args.lr)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=inputs).logits.float()
            hard = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            if teacher is None:
                loss = hard
            else:
                with torch.no_grad():
                    teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), -1)
                soft = F.kl_div(F.log_softmax(logits, -1), teacher_logp, log_target=True,
                                reduction="batchmean") / args.seq
                loss = soft + 0.1 * hard
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        ema = hard.item() if ema is None else 0.98 * ema + 0.02 * hard.item()
        bar.update(1)
        bar.set_postfix(ce=f"{ema:.3f}")
        if step % 50 == 0 or step == steps:
            rate = (step - bar.initial) * args.batch * args.seq / (time.time() - started)
            print(json.dumps(dict(step=step, ce=round(ema, 4), loss=round(loss.item(), 4),
                                  tokens_per_s=round(rate))), file=log, flush=True)
        if step % args.checkpoint_every == 0 or step == steps:
            torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                            step=step), ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
    bar.close()
    return model


@torch.no_grad()
def evaluate(target, draft, tokens: torch.Tensor, seq: int = 256, windows: int = 64) -> dict:
    target.eval(), draft.eval()
    generator = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, len(tokens) - seq - 1, (windows,), generator=generator)
    chunk = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
    inputs, labels = chunk[:, :-1], chunk[:, 1:]
    target_logits = target(input_ids=inputs).logits.float()
    draft_logits = draft(input_ids=inputs).logits.float()
    agree = (target_logits.argmax(-1) == draft_logits.argmax(-1)).float().mean().item()
    result = dict(
        target_ppl=math.exp(F.cross_entropy(target_logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1)).item()),
        draft_ppl=math.exp(F.cross_entropy(draft_logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1)).item()),
        top1_agreement=agree,
        # expected accepted drafts per round at K=5 if agreement were independent per token
        iid_expected_accepted_k5=sum(agree ** i for i in range(1, 6)),
    )
    # one-token decode forward with a 200-token cache, the cost that matters for SD
    import inspect
    cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    for name, model in (("target", target), ("draft", draft)):
        times = []
        for _ in range(30):
            out = model(input_ids=inputs[:1, :200], use_cache=True)
            t = time.perf_counter()
            model(input_ids=inputs[:1, 200:201], use_cache=True,
                  **{cache_arg: getattr(out, cache_arg, None) or out.past_key_values})
            times.append(time.perf_counter() - t)
        result[f"{name}_decode_ms"] = sorted(times)[len(times) // 2] * 1e3
    result["draft_target_cost_ratio"] = result["draft_decode_ms"] / result["target_decode_ms"]
    return result


def export(model, tokenizer, path: Path):
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    model.float()


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The optimisation settings ``train`` reads (shared with train_other_draft.py)."""
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="bf16 autocast for the matmuls (weights and optimizer stay fp32)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parent / ".train_work")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "models")
    parser.add_argument("--target-steps", type=int, default=2000)
    parser.add_argument("--draft-steps", type=int, default=2000)
    add_training_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(args.work)
    train_tokens = encode_split(tokenizer, "train", args.work)
    test_tokens = encode_split(tokenizer, "test", args.work)
    print(f"train tokens {len(train_tokens):,}, test tokens {len(test_tokens):,}", flush=True)

    target = make_model(TARGET, tokenizer)
    print(f"target params {sum(p.numel() for p in target.parameters()):,}", flush=True)
    target = train("target", target, train_tokens, args.target_steps, args, args.work)
    target.eval().requires_grad_(False)

    torch.manual_seed(args.seed + 1)
    draft = make_model(DRAFT, tokenizer)
    print(f"draft params {sum(p.numel() for p in draft.parameters()):,}", flush=True)
    draft = train("draft", draft, train_tokens, args.draft_steps, args, args.work, teacher=target)

    export(target, tokenizer, args.out / "stdlib-target")
    export(draft, tokenizer, args.out / "stdlib-draft")
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(args.out / "stdlib-target", dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(args.out / "stdlib-draft", dtype=torch.float32)
    report = evaluate(target, draft, test_tokens)
    report.update(target_params=sum(p.numel() for p in target.parameters()),
                  draft_params=sum(p.numel() for p in draft.parameters()),
                  target_steps=args.target_steps, draft_steps=args.draft_steps,
                  train_tokens_seen_target=args.target_steps * args.batch * args.seq)
    (args.out / "pair_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
