"""Hugging Face MoE checkpoints both ways: ``transformers`` 5's ``save_pretrained`` writes one
tensor per expert (Qwen3-MoE: ``experts.N.gate_proj.weight``; Mixtral:
``block_sparse_moe.experts.N.w1.weight``) for the model's fused ``experts.gate_up_proj``;
``load_safetensors`` reads them into the fused shards, and ``save_safetensors(hf_layout=...)``
writes the same file ``save_pretrained`` does."""

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import safetensors.torch as st
import torch

from tests.hf import checkpoint_bodies as cb
from vfsdp.testing import simulate

LAYOUT = {"mixtral": "mixtral", "qwen3_moe": "per_expert"}


@pytest.fixture(scope="module", params=list(LAYOUT))
def saved(request, tmp_path_factory):
    """``(kind, the model's state dict, the directory save_pretrained wrote)``."""
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    net = cb.model(kind)
    net.save_pretrained(str(path))
    return kind, {k: v.detach().clone() for k, v in net.state_dict().items()}, path


def test_load_safetensors_reads_save_pretrained_per_expert_files(saved):
    kind, want, path = saved
    stored = st.load_file(str(path / "model.safetensors"))
    assert not any(k.endswith("gate_up_proj") for k in stored)   # per expert, as HF writes it
    assert any(".experts.3." in k for k in stored)
    for world in (2, 3):
        got = simulate(world, cb.load, kind, str(path))[0]
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want), kind


def test_an_expert_parallel_plan_reads_its_experts_from_per_expert_files(saved):
    kind, want, path = saved
    for index, got in simulate(4, cb.load_ep, kind, str(path)):
        for name, piece in got.items():
            full = want[name]
            if name.endswith(("gate_up_proj", "down_proj")):   # this ep index's 2 experts
                full = full[2 * index:2 * index + 2]
            assert torch.equal(piece, full), (kind, name, index)


@pytest.mark.parametrize("sharded", [None, 4096])
def test_save_safetensors_writes_what_save_pretrained_writes(saved, tmp_path, sharded):
    import transformers as tf

    kind, want, path = saved
    simulate(2, cb.export, kind, want, str(tmp_path), LAYOUT[kind], sharded)
    hf = st.load_file(str(path / "model.safetensors"))
    names = sorted(os.listdir(tmp_path))
    ours = {}
    for name in names:
        if name.endswith(".safetensors"):
            ours.update(st.load_file(str(tmp_path / name)))
    assert set(ours) == set(hf)                       # a per-expert reader finds every name
    assert all(torch.equal(ours[k], hf[k]) for k in hf)
    assert ("model.safetensors.index.json" in names) == bool(sharded)
    back = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    assert all(torch.equal(back[k], want[k]) for k in want), kind
    got = simulate(2, cb.load, kind, str(tmp_path))[0]  # and vfsdp reads it back
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_fused_default_loads_with_from_pretrained(saved, tmp_path):
    import transformers as tf

    kind, want, _ = saved
    simulate(2, cb.export, kind, want, str(tmp_path), None)
    assert any(k.endswith("experts.gate_up_proj")
               for k in st.load_file(str(tmp_path / "model.safetensors")))
    back = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    assert all(torch.equal(back[k], want[k]) for k in want), kind
