from tests.functional import bodies
from vfsdp.testing import simulate


def test_bad_input_errors_name_path_and_fix():
    msgs = simulate(2, bodies.error_messages)[0]
    assert "tree structure differs" in msgs["structure"] and "missing root" in msgs["structure"]
    assert "root.r0 has shape (6,)" in msgs["shape"] and "(5,)" in msgs["shape"]
    assert "root.r0 is torch.float64" in msgs["dtype"] and "cast it" in msgs["dtype"]
    assert "another plan" in msgs["other_spec"] and "spec they were sharded with" in msgs["other_spec"]
    assert "root.r0 should be this rank's shard" in msgs["local_shape"]
    assert "grad_reduce must be one of" in msgs["op"]
    assert "is not in this mesh" in msgs["src"]
    assert "root.r0 should be a tensor" in msgs["not_tensor"]
