

def test_simulate_puts_back_torch_nn_init_a_library_left_swapped():
    """transformers' no_init_weights, entered and left by two rank threads out of order, can
    leave its no-op in torch.nn.init for the whole process; simulate restores torch's."""
    import torch

    from vfsdp.testing import simulate

    real = torch.nn.init.normal_
    torch.nn.init.normal_ = lambda t, *a, **k: t          # what such a leak leaves behind
    try:
        def body():
            w = torch.zeros(4)
            torch.nn.init.normal_(w)
            return bool(w.abs().sum() > 0)
        assert simulate(2, body) == [True, True]
        assert torch.nn.init.normal_ is real
    finally:
        torch.nn.init.normal_ = real
