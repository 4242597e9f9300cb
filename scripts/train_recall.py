"""Train the associative-recall models of the page "Recall: what a fixed state forgets".

    python3 scripts/train_recall.py                       # all four mixers, attention_ref/data/recall_<mixer>.pt
    python3 scripts/train_recall.py --mixers softmax      # one of them
    python3 scripts/train_recall.py --out-dir /tmp/recall --steps 200

One `attention_ref.recall.RecallModel` per sequence mixer (softmax attention, linear
attention, the delta rule, the gated delta rule): the same width, heads, layers and
convolution, trained the same way (`attention_ref.recall.RecallTraining`: AdamW, warm-up
then cosine decay) on batches of `attention_ref.recall.mqar_batch` whose sequences each hold
2 to 16 key-value pairs, drawn anew every step. The runs are seeded: the same command on the
same torch build and thread count gives the same losses (tests/test_recall.py reruns the
first steps and compares them with the record). Progress (step, loss, seconds) is printed as
it trains. The weights ship in float16; the recorded accuracy per pair count is measured on
the rounded weights, on the fixed test batches of `attention_ref.recall.eval_batch`.
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

from attention_ref import recall  # noqa: E402

OUT_DIR = ROOT / "attention_ref" / "data"


def main(argv: list[str] | None = None) -> int:
    defaults = recall.RecallTraining()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", nargs="+", choices=recall.MIXERS, default=list(recall.MIXERS))
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help=f"default {OUT_DIR.relative_to(ROOT)}")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--min-lr", type=float, default=defaults.min_lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the losses' last digits depend on it; default 1)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "threads", "d", "heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    config = dataclasses.replace(defaults, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                 min_lr=args.min_lr, seed=args.seed)
    pair_counts = range(config.min_pairs, config.max_pairs + 1)
    print(f"{config}; torch {torch.__version__}, {args.threads} thread(s)", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = []
    for mixer in args.mixers:
        model = recall.RecallModel(mixer, vocab=config.vocab, d=args.d, heads=args.heads)
        log = recall.train(model, config, progress=_progress(mixer, config.steps))
        recall.round_to_half(model)
        record = recall.training_record(model, config, log, pair_counts)
        record.update(python=platform.python_version(), machine=platform.machine(), date=time.strftime("%Y-%m-%d"))
        out = args.out_dir / recall.WEIGHTS_FILE.format(mixer=mixer)
        recall.save_recall(str(out), model, record)
        accuracies = record["accuracy"]
        print(f"{mixer:>11}  {log['seconds']:.0f} s; accuracy (float16 weights) by pairs: "
              + ", ".join(f"{p}: {a:.3f}" for p, a in accuracies.items()), flush=True)
        print(f"wrote {out} ({out.stat().st_size:,} bytes)", flush=True)
        summary.append((mixer, log["seconds"], accuracies))
    shown = [p for p in (str(config.min_pairs), "8", str(config.max_pairs)) if p in summary[0][2]]
    print("\nmixer        seconds  " + "  ".join(f"{p + ' pairs':>8}" for p in dict.fromkeys(shown)))
    for mixer, seconds, accuracies in summary:
        print(f"{mixer:<12} {seconds:7.0f}  " + "  ".join(f"{accuracies[p]:8.3f}" for p in dict.fromkeys(shown)))
    return 0


def _progress(mixer: str, steps: int):
    """``progress(step, loss)`` for `attention_ref.recall.train`: prints every 100 steps."""
    began = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if (step + 1) % 100 == 0 or step == 0:
            print(f"{mixer:>11}  step {step + 1:5d}/{steps}  loss {loss:.4f}  "
                  f"{time.perf_counter() - began:6.1f} s", flush=True)

    return progress


if __name__ == "__main__":
    raise SystemExit(main())
