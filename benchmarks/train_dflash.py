"""Train the bundled DFlash block drafter (models/stdlib-dflash) for the bundled target, with
spec_ext.training.dflash on the target's own continuations of prompts from the standard
library's training split (held-out agreement on the validation split). Data, features and
checkpoints live under --work: a rerun resumes (a killed run too).

The bundled drafter came in four runs (docs/block_drafters.md, Training):

    python benchmarks/train_dflash.py --out D600                  # 600 steps on 1024 continuations
    (a warm restart of that run to 2400 steps by an edited checkpoint: D2400; --init-from is that now)
    python benchmarks/train_dflash.py --out D4K --init-from D2400 --sequences 4096 --steps 1200 --lr 1e-3
    python benchmarks/train_dflash.py --out D --init-from D4K --sequences 8192 --steps 2000 --lr 6e-4
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_data import split_files  # noqa: E402

from spec_ext.training.dflash import DFlashTraining, train_dflash  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# sized for a 2-core machine shared with other jobs (about an hour of training): see docs/block_drafters.md
BUNDLED = DFlashTraining(sequences=1024, validation_sequences=32, prompt_tokens=128, new_tokens=96, steps=600,
                         batch=8, anchors=48, block_size=16, layers=1, loss="kl", lr=1.5e-3, warmup=50,
                         draft_vocab=2048, layer_ids=(2, 4, 6, 7), init="focused", validate_every=100,
                         checkpoint_every=50)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--out", type=Path, required=True,
                        help="where the drafter is saved (the bundled one, models/stdlib-dflash, came in four runs)")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".train_work" / "dflash")
    parser.add_argument("--steps", type=int, default=BUNDLED.steps)
    parser.add_argument("--layers", type=int, default=BUNDLED.layers)
    parser.add_argument("--init-from", default=None, help="a drafter trained before to go on from (see --layers)")
    parser.add_argument("--lr", type=float, default=BUNDLED.lr)
    parser.add_argument("--sequences", type=int, default=BUNDLED.sequences, help="the target's continuations")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--stop-at", default=None, help="HH:MM (UTC, today): stop after the first step past it")
    parser.add_argument("--validate-every", type=int, default=BUNDLED.validate_every)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target.config._name_or_path = args.target.name  # the drafter's speculators_config.verifier, not this path
    settings = DFlashTraining(**(vars(BUNDLED) | dict(steps=args.steps, layers=args.layers, lr=args.lr,
                                                      sequences=args.sequences,
                                                      validate_every=args.validate_every,
                                                      init_from=args.init_from)))
    deadline = None
    if args.stop_at is not None:
        hours, minutes = (int(x) for x in args.stop_at.split(":"))
        now = datetime.datetime.now(datetime.timezone.utc)
        deadline = now.replace(hour=hours, minute=minutes, second=0, microsecond=0).timestamp()
    started = time.perf_counter()
    train_dflash(target, tokenizer, split_files("train"), args.out, args.work, settings, split_files("validation"),
                 deadline=deadline)
    print(f"{time.perf_counter() - started:.0f} s; the drafter is at {args.out}")


if __name__ == "__main__":
    main()
