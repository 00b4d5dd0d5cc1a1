"""Loss curves of the example model under AdamW and 8-bit AdamW, on one plot.

Trains ``examples/train_gpt.py``'s model twice with the same data and seed (simulated ranks),
prints the final losses and their relative gap (target: within 2 %), and saves the plot::

    python benchmarks/optim_quality.py --steps 150 --png runs/optim_quality.png
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import train_gpt

from vfsdp.testing import simulate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--optims", nargs="*", default=["adamw", "adamw8bit"])
    ap.add_argument("--png", default="runs/optim_quality.png")
    args = ap.parse_args(argv)
    curves = {}
    for name in args.optims:
        targs = train_gpt.parse(["--steps", str(args.steps), "--optim", name, "--out", ""])
        curves[name] = simulate(args.world_size, train_gpt.train, targs)[0]["losses"]
    base = curves[args.optims[0]][-1]
    for name, losses in curves.items():
        tail = sum(losses[-10:]) / min(10, len(losses))
        print(f"{name:>10}: loss {losses[0]:.4f} -> {losses[-1]:.4f} (mean of last 10: {tail:.4f}); "
              f"final vs {args.optims[0]}: {100 * (losses[-1] - base) / base:+.2f} %")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, losses in curves.items():
            ax.plot(range(1, len(losses) + 1), losses, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"plot saved to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
