"""The headline usage: `fastbert.optimize(model)` with the default kernels ("auto"), then a forward, as a user runs it.

On CPU the tests run Triton's interpreter (tests/conftest.py), so "auto" takes each kernel there and the optimized
head runs all four Triton kernels; on a GPU it runs what "auto" measured. Either way the head's outputs equal stock
HF's on real tokens at the fp32 bar.
"""
import copy

import pytest
import torch
import transformers

import fastbert
from fastbert.numerics import FP32_TOL, max_error
from test_dropin import HEADS, bert_config, head_inputs, perturbed, real_part


@pytest.mark.parametrize("name", ["BertForSequenceClassification", "BertForTokenClassification"])
def test_optimize_with_default_kernels_then_forward(name):
    config = bert_config(hidden_size=32, num_attention_heads=2, intermediate_size=48, num_hidden_layers=1)
    stock = perturbed(getattr(transformers, name)(config))
    inputs = head_inputs(name)
    with torch.no_grad():
        want = stock(**inputs)
    model = fastbert.optimize(copy.deepcopy(stock))
    encoder = model.bert
    assert isinstance(encoder, fastbert.BertModel) and set(encoder.kernels.values()) == {"auto"}
    on_triton = {op for op, b in encoder.resolved_kernels(tokens=20, max_seqlen=9).items() if b == "triton"}
    from fastbert.kernels import utils
    assert on_triton == (set(fastbert.OPS) if utils.INTERPRET or torch.cuda.is_available() else set())
    with torch.no_grad():
        got = model(**inputs)
    for field, _ in HEADS[name][1]:
        err = max_error(real_part(name, field, got[field]), real_part(name, field, want[field]))
        assert err <= FP32_TOL, f"{field}: max |delta| {err:.3g}"
