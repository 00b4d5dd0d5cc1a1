"""The transforms' refusals: out-of-order chains, a transform used alone, bad hyperparameters."""

import pytest
import torch

from vfsdp.optim import (
    adamw,
    add_decayed_weights,
    chain,
    clip_by_global_norm,
    scale_by_adam,
    scale_by_learning_rate,
    transform,
)
from vfsdp.optim.transforms import run


def test_a_transform_after_scale_by_learning_rate_is_refused():
    with pytest.raises(ValueError, match="scale_by_adam comes after scale_by_learning_rate"):
        chain(scale_by_learning_rate(0.1), scale_by_adam())
    with pytest.raises(ValueError, match="scale_by_learning_rate comes after scale_by_learning_rate"):
        chain(scale_by_adam(), scale_by_learning_rate(0.1), adamw(), scale_by_learning_rate(0.1))


def test_transforms_that_never_reach_the_parameters_are_refused():
    with pytest.raises(ValueError, match=r"\['scale_by_adam'\] do not end with scale_by_learning"):
        chain(clip_by_global_norm(1.0), scale_by_adam())
    with pytest.raises(ValueError, match="member 1 sits between transforms"):
        chain(scale_by_adam(), clip_by_global_norm(1.0), scale_by_learning_rate(0.1))
    with pytest.raises(TypeError, match="run takes transforms"):
        run(clip_by_global_norm(1.0), scale_by_learning_rate(0.1))


def test_a_transform_alone_is_not_an_optimizer():
    opt = add_decayed_weights(0.1)
    for call in (lambda: opt.init(None, None), lambda: opt.update(None, None, None, None)):
        with pytest.raises(TypeError, match="add_decayed_weights is a transform of the updates"):
            call()


def test_bad_hyperparameters_and_transforms_are_refused():
    with pytest.raises(ValueError, match=r"scale_by_adam: betas must be in \[0, 1\)"):
        scale_by_adam(b2=1.0)
    with pytest.raises(ValueError, match="scale_by_adam: eps must be >= 0"):
        scale_by_adam(eps=-1.0)
    with pytest.raises(ValueError, match="add_decayed_weights: weight_decay must be >= 0"):
        add_decayed_weights(-0.1)
    with pytest.raises(ValueError, match="scale_by_learning_rate: lr must be >= 0"):
        scale_by_learning_rate(float("nan"))
    with pytest.raises(TypeError, match=r"transform\('mine'\): takes apply"):
        transform(torch.zeros(1), name="mine")


def test_a_matrix_preconditioner_outside_its_one_chain_is_refused():
    from vfsdp.optim import scale_by_muon, scale_by_shampoo, scale_by_soap

    sign = transform(lambda u, s: None, name="sign")
    for members in ((sign, scale_by_soap(), scale_by_learning_rate(0.1)),
                    (scale_by_shampoo(), sign, scale_by_learning_rate(0.1)),
                    (scale_by_muon(), add_decayed_weights(0.1, lambda p: True),
                     scale_by_learning_rate(0.1))):
        name = next(m for m in members if m is not sign).init.__self__.name
        with pytest.raises(ValueError, match=f"chain: {name} preconditions whole matrices"):
            chain(*members)
    with pytest.raises(ValueError, match="scale_by_soap: weight_decay= belongs to "
                                         "add_decayed_weights"):
        scale_by_soap(weight_decay=0.1)
    with pytest.raises(ValueError, match="soap: precondition_frequency must be >= 1"):
        scale_by_soap(precondition_frequency=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'block'"):
        scale_by_shampoo(block=4)
