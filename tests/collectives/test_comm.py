"""comm: the per-thread caches of groups and of the ranks' agreement on a spec."""

import weakref

import torch
import torch.distributed as dist

import vfsdp


def test_a_spec_sharded_under_new_default_groups_keeps_one_agreement_finalizer(tmp_path):
    """Each new default group checks the spec again; the record of the check is forgotten
    when the spec goes, by one finalizer, not one per check."""
    params = {"w": torch.arange(8.0)}
    spec = vfsdp.plan(params, 1)
    for i in range(3):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s{i}", rank=0, world_size=1)
        try:
            vfsdp.shard(params, spec)
        finally:
            dist.destroy_process_group()
    on_spec = [f for f in weakref.finalize._registry if f.peek() and f.peek()[0] is spec]
    assert len(on_spec) == 1
