"""How far vfsdp's training of Hugging Face models is from one plain-torch process.

For GPT-2 (tied), LLaMA and Mixtral (MoE) from the tiny configs of ``tests/hf``: 5 AdamW steps
on W gloo ranks (decoder blocks under ``run_layers``) against one process with
``torch.optim.AdamW``, one thread on both sides. Prints the largest parameter difference,
how many tensors are bitwise equal, the export's ``from_pretrained`` logits against vfsdp's,
and whether the sharded export reads back bitwise into meta-planned shards::

    python benchmarks/hf_exactness.py --world-sizes 2 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

from tests.hf import bodies
from vfsdp.testing import spawn

KINDS = ["gpt2", "llama", "mixtral"]


def main(argv=None) -> int:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", nargs="*", type=int, default=[2, 4])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ref = {k: bodies.train_one_process(k) for k in KINDS}
    for world in args.world_sizes:
        out = tempfile.mkdtemp(prefix="vfsdp-hf-")
        got = spawn(bodies.train_ranks, world, KINDS, out)[0]
        for k in KINDS:
            sd, logits, _, _, reloaded = got[k]
            worst = max((sd[n] - ref[k][0][n]).abs().max().item() for n in sd)
            bitwise = sum(torch.equal(sd[n], ref[k][0][n]) for n in sd)
            loaded = tf.AutoModelForCausalLM.from_pretrained(os.path.join(out, k))
            with torch.no_grad():
                again = loaded(input_ids=bodies.probe()).logits
            print(f"W={world} {k:8s} max |param - one process| {worst:.2e} "
                  f"({bitwise}/{len(sd)} tensors bitwise); from_pretrained logits - vfsdp's "
                  f"{(again - logits).abs().max().item():.1e}; sharded export read back "
                  f"bitwise: {reloaded}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
