"""apmpo.learner.zero3 without DeepSpeed: on whole weights (ZeRO-0/1/2, or no engine) every read is the module's
own and nothing is announced; a non-finite weight is refused by name before a push begins. The partitioned paths
run on two ranks: tests/test_learner.py (a step and the push's stream) and tests/test_zero3.py (a whole run)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from apmpo.learner.zero3 import WholeWeights, check_finite, full_shape, gathered_parameters, partitioned


def test_whole_weights_are_read_directly(tiny_tied):
    model = AutoModelForCausalLM.from_pretrained(tiny_tied)
    weights = WholeWeights(model)
    assert not partitioned(model) and not weights.collective
    named = list(model.named_parameters())
    assert [(n, id(p)) for n, p in gathered_parameters(model)] == [(n, id(p)) for n, p in named]
    assert [(n, id(p)) for n, p in weights.for_push()] == [(n, id(p)) for n, p in named]  # no copies
    assert weights.specs() == [(n, p.dtype, tuple(p.shape)) for n, p in named]
    assert weights.export_state() is None  # save_pretrained reads the module itself
    assert all(full_shape(p) == tuple(p.shape) for _, p in named)
    weights.settle()  # no other rank to wait for


def test_a_non_finite_weight_is_refused_by_name(tiny_tied):
    model = AutoModelForCausalLM.from_pretrained(tiny_tied)
    check_finite(model)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' holds NaN or infinite values"):
        check_finite(model)
