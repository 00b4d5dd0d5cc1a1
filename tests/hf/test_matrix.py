"""Sixteen Hugging Face architectures from tiny configs (tests/hf/matrix_bodies.py): 2 ranks
train 3 AdamW steps under ``apply(vfsdp.gather(...))`` and ``apply.run_layers``, with and
without Hugging Face's activation checkpointing (reentrant asked for), and match one plain-torch
process within 1e-5; the export loads with ``from_pretrained``; ``save_pretrained``'s
checkpoint and vfsdp's sharded export read back at 3 ranks."""

import pytest

pytest.importorskip("transformers")

import torch

from tests.hf import matrix_bodies as mb
from vfsdp.testing import simulate


@pytest.mark.slow
@pytest.mark.parametrize("kind", mb.KINDS)
def test_architecture_trains_as_one_process_exports_and_reads_back(kind, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as each rank: the same kernels' summation order
    try:
        want = mb.train_one_process(kind)
    finally:
        torch.set_num_threads(threads)
    got = simulate(2, mb.train_ranks, kind, str(tmp_path), timeout=600)[0]
    assert set(got) == set(mb.MODES)
    for mode, sd in got.items():
        assert set(sd) <= set(want) and set(want) - set(sd) <= mb.TIED[kind], (kind, mode)
        worst = max((sd[k] - want[k]).abs().max().item() for k in sd)
        assert worst < 1e-5, (kind, mode, worst)
    sd = got[mb.MODES[-1]]
    cls, _ = mb._configs()[kind]
    loaded = cls.from_pretrained(str(tmp_path / kind)).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in sd.items()), kind
    back = simulate(3, mb.read_back, [kind], str(tmp_path), "-sharded")[0][kind]
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd), kind


@pytest.mark.parametrize("kind", mb.KINDS)
def test_load_safetensors_reads_save_pretrained_at_3_ranks(kind, tmp_path):
    """With ``rename=apply.saved_names()``: transformers renames some tensors on the way out
    (GPT-NeoX's lm_head as embed_out, ViT's attention under its older names)."""
    net = mb.model(kind)
    net.save_pretrained(str(tmp_path / kind))
    want = net.state_dict()
    got = simulate(3, mb.read_back, [kind], str(tmp_path), "")[0][kind]
    assert set(got) <= set(want) and set(want) - set(got) <= mb.TIED[kind]
    assert all(torch.equal(got[k], want[k]) for k in got), kind


def _captured(kind):
    """apply.run_layers as the module's first call, with output_hidden_states and
    output_attentions (transformers installs its capture hooks on that call)."""
    import torch.distributed as dist

    import vfsdp

    net = mb.model(kind)
    net.set_attn_implementation("eager")  # sdpa returns no attention weights
    net.eval()
    params, apply = vfsdp.functionalize(net)
    spec = vfsdp.plan(params, dist.get_world_size())
    shards = vfsdp.shard(params, spec)
    ids = mb.batch(kind)["input_ids"]
    with torch.no_grad():
        out = apply.run_layers(shards, spec, input_ids=ids, output_hidden_states=True,
                               output_attentions=True, output_router_logits=True)
    return out.hidden_states, out.attentions, out.router_logits


@pytest.mark.parametrize("kind", ["qwen3_moe"])
def test_output_capture_works_when_run_layers_is_the_first_call(kind):
    net = mb.model(kind)
    net.set_attn_implementation("eager")
    net.eval()
    with torch.no_grad():
        want = net(input_ids=mb.batch(kind)["input_ids"], output_hidden_states=True,
                   output_attentions=True, output_router_logits=True)
    for hidden, attentions, routers in simulate(2, _captured, kind):
        for got, ref in ((hidden, want.hidden_states), (attentions, want.attentions),
                         (routers, want.router_logits)):
            assert got is not None and len(got) == len(ref) > 0
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
