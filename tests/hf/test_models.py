"""Real ``transformers`` models from tiny configs (no downloads), trained by vfsdp.

For GPT-2 (tied embeddings), LLaMA and Mixtral (MoE): 2 and 4 gloo ranks train 5 AdamW steps
with the decoder blocks under ``run_layers`` and match one plain-torch process; the Hugging Face
export loads with ``from_pretrained`` and gives the same logits. One spawn per world size
trains all three models.
"""

import pytest

pytest.importorskip("transformers")

import torch

from tests.hf import bodies
from vfsdp.testing import spawn

KINDS = ["gpt2", "llama", "mixtral"]


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as each rank: the same kernels' summation order
    try:
        return {kind: bodies.train_one_process(kind) for kind in KINDS}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 4])
def test_hf_models_train_as_one_process_and_export_to_from_pretrained(world, reference,
                                                                       tmp_path):
    import transformers as tf

    got = spawn(bodies.train_ranks, world, KINDS, str(tmp_path))[0]
    for kind in KINDS:
        sd, logits, ties, blocks, reloaded = got[kind]
        want, want_logits = reference[kind]
        assert blocks == 2                                     # each decoder block a unit
        if kind == "gpt2":
            assert ties == {"lm_head.weight": "transformer.wte.weight"}
            assert "lm_head.weight" not in sd                  # the tie once, as HF saves it
        worst = max((sd[k] - want[k]).abs().max().item() for k in sd)
        assert worst < 1e-6, (kind, world, worst)
        assert set(want) - set(sd) <= {"lm_head.weight"}
        assert reloaded, kind          # the sharded export read back into meta-planned shards
        files = sorted(p.name for p in (tmp_path / f"{kind}-sharded").iterdir())
        assert "model.safetensors.index.json" in files and "model-00002-of-" in " ".join(files)
        sharded = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{kind}-sharded"))
        assert all(torch.equal(v, sd[k]) for k, v in sharded.state_dict().items() if k in sd)
        loaded = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / kind))
        assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items()
                   if k in sd), kind
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the ranks computed theirs
        try:
            with torch.no_grad():
                again = loaded(input_ids=bodies.probe()).logits
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(again, logits), kind                # the export round trip: exact
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
