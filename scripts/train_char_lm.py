"""Train the character-level language model of tutorial page 11 and write its weights.

    python3 scripts/train_char_lm.py                      # writes attention_ref/data/char_lm.pt
    python3 scripts/train_char_lm.py --out /tmp/lm.pt --steps 200
    python3 scripts/train_char_lm.py --copy               # writes attention_ref/data/copy_lm.pt
    python3 scripts/train_char_lm.py --sinks              # writes attention_ref/data/char_lm_sinks.pt

``--copy`` trains the page's second model instead: two attention-only layers of two heads on
`attention_ref.lm.copy_task` (spans of 20-31 random characters, repeated once), where
induction heads form; its settings are `attention_ref.lm.COPY_MODEL` and `COPY_TRAINING`.

The run is seeded: the same command on the same torch build and thread count gives the same
losses (tests/test_lm.py reruns its first steps and compares them with the record). Progress
(step, loss, held-out loss, seconds) is printed as it trains. The weights ship in float16; the
record's final held-out loss is measured on those rounded weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_ref import lm  # noqa: E402

OUT = ROOT / "attention_ref" / "data" / lm.WEIGHTS_FILE
COPY_OUT = ROOT / "attention_ref" / "data" / lm.COPY_WEIGHTS_FILE
SINKS_OUT = ROOT / "attention_ref" / "data" / lm.SINKS_WEIGHTS_FILE


def main(argv: list[str] | None = None) -> int:
    defaults = lm.TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=f"default {OUT.relative_to(ROOT)} "
                        f"({COPY_OUT.relative_to(ROOT)} with --copy)")
    parser.add_argument("--copy", action="store_true", help="train the copy-task model instead")
    parser.add_argument("--sinks", action="store_true",
                        help="give every head a learned sink (the model of page 11's sink experiment)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--min-lr", type=float, default=defaults.min_lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the losses' last digits depend on it; default 1)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "eval_every", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    if args.copy:
        return train_copy(args.out or COPY_OUT, args.threads)
    args.out = args.out or (SINKS_OUT if args.sinks else OUT)

    text = lm.load_corpus()
    tokenizer = lm.CharTokenizer.from_text(text)
    train_text, held_out = lm.split_corpus(text)
    train_ids, eval_ids = tokenizer.encode(train_text), tokenizer.encode(held_out)
    model_config = lm.LMConfig(vocab_size=len(tokenizer), context=args.context, layers=args.layers,
                               heads=args.heads, width=args.width, sinks=args.sinks)
    config = lm.TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.min_lr,
                            seed=args.seed, eval_every=args.eval_every)
    model = lm.CharLM(model_config)
    print(f"{model.num_parameters():,} parameters; {len(train_ids):,} training and "
          f"{len(eval_ids):,} held-out characters; {config}", flush=True)
    began = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if (step + 1) % 50 == 0 or step == 0:
            print(f"step {step + 1:5d}/{config.steps}  loss {loss:.4f}  "
                  f"{time.perf_counter() - began:7.1f} s", flush=True)

    log = lm.train(model, train_ids, config, eval_ids=eval_ids, progress=progress)
    for s, e in zip(log.eval_steps, log.eval_loss):
        print(f"held-out loss at step {s}: {e:.4f}")
    lm.round_to_half(model)
    shipped = lm.evaluate(model, eval_ids)
    print(f"held-out loss of the float16 weights: {shipped:.4f}; {log.seconds:.0f} s")
    record = {
        "train_config": dataclasses.asdict(config),
        "log": log.as_dict(),
        "held_out_loss_float16": shipped,
        "threads": args.threads,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lm.save_char_lm(str(args.out), model, tokenizer, record)
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)")
    return 0


def train_copy(out: Path, threads: int) -> int:
    text = lm.load_corpus()
    tokenizer = lm.CharTokenizer.from_text(text)  # the same 73 characters, drawn at random
    model = lm.CharLM(lm.COPY_MODEL)
    config = lm.COPY_TRAINING
    began = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if (step + 1) % 100 == 0 or step == 0:
            print(f"step {step + 1:5d}/{config.steps}  loss {loss:.4f}  "
                  f"{time.perf_counter() - began:7.1f} s", flush=True)

    log = lm.train(model, None, config, make_batch=lm.copy_batches, progress=progress)
    lm.round_to_half(model)
    inputs, targets, copied, _ = lm.copy_batches(torch.Generator().manual_seed(1), 256)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(inputs).transpose(1, 2), targets, reduction="none")
    on_copies = loss[copied].mean().item()
    print(f"loss on the copies of a fresh batch (float16 weights): {on_copies:.4f}; {log.seconds:.0f} s")
    record = {"train_config": dataclasses.asdict(config), "log": log.as_dict(), "copy_loss_float16": on_copies,
              "threads": threads, "torch": str(torch.__version__), "python": platform.python_version(),
              "machine": platform.machine(), "date": time.strftime("%Y-%m-%d")}
    out.parent.mkdir(parents=True, exist_ok=True)
    lm.save_char_lm(str(out), model, tokenizer, record)
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
