"""tools/hf_model_tests/fastbert_plugin.py: the check of a fastbert forward against the transformers encoder it
replaced finds a difference where there is one, and leaves what a test observes (its hooks) as it was."""
import importlib.util
import inspect
import os

import pytest
import torch
from helpers import make_inputs, random_hf_bert

import fastbert

PLUGIN = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "hf_model_tests", "fastbert_plugin.py")


@pytest.fixture(scope="module")
def plugin():
    spec = importlib.util.spec_from_file_location("fastbert_plugin_under_test", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _optimized(padding_free):
    model = random_hf_bert(attn="eager")  # sdpa returns no attention maps to compare with
    return fastbert.optimize(model, kernels="torch", padding_free=padding_free, cuda_graphs=False).eval()


def _check(plugin, fb, out, padding_free, **kwargs):
    plugin._settings["padding_free"] = padding_free
    signature = inspect.signature(type(fb).forward)
    return plugin.check_forward(fb, signature, (), kwargs, out)


@pytest.mark.parametrize("padding_free", [False, True])
def test_check_passes_fastbert_and_reports_a_planted_difference(plugin, padding_free):
    fb = _optimized(padding_free)
    ids, tt, mask = make_inputs("right")
    with torch.no_grad():
        out = fb(input_ids=ids, token_type_ids=tt, attention_mask=mask, output_hidden_states=True,
                 output_attentions=True)
    args = dict(input_ids=ids, token_type_ids=tt, attention_mask=mask, output_hidden_states=True,
                output_attentions=True)
    result = _check(plugin, fb, out, padding_free, **args)
    assert result["ok"] and result["max_diff"] < 1e-5, result
    # one element of one real position moved by 1e-3: the check must see it, and say where
    out.hidden_states[1][0, 0, 0] += 1e-3
    result = _check(plugin, fb, out, padding_free, **args)
    assert not result["ok"] and result["worst"] == "hidden_states[1]" and abs(result["max_diff"] - 1e-3) < 1e-5


def test_check_does_not_fire_the_tests_hooks_again(plugin):
    fb = _optimized(False)
    calls = []
    hf = fb.__dict__["_hf_encoder"]  # its linears are fastbert's: a hook there is the test's, seen by both
    hf.encoder.layer[0].output.dense.register_forward_hook(lambda *a: calls.append(1))
    ids, tt, mask = make_inputs("left")
    with torch.no_grad():
        out = fb(input_ids=ids, token_type_ids=tt, attention_mask=mask)
    before = len(calls)
    result = _check(plugin, fb, out, False, input_ids=ids, token_type_ids=tt, attention_mask=mask)
    assert result["ok"], result
    assert len(calls) == before
    assert hf.encoder.layer[0].output.dense._forward_hooks  # put back


def test_train_mode_and_other_dtypes_are_not_checked(plugin):
    fb = _optimized(False)
    ids, tt, mask = make_inputs("none")
    out = fb.train()(input_ids=ids, attention_mask=mask)
    assert _check(plugin, fb, out, False, input_ids=ids, attention_mask=mask) == {"unchecked": "train mode"}
    fb.eval().double()
    out = fb(input_ids=ids, attention_mask=mask)
    assert _check(plugin, fb, out, False, input_ids=ids, attention_mask=mask) == {"unchecked": "not fp32"}


_PROBE_UNDER_THE_PLUGIN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("fastbert_plugin_under_test", sys.argv[1])
plugin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plugin)
plugin.patch_families()
plugin.keep_transformers_probes_stock()
import transformers
from fastbert import packing
from fastbert import installed
swapped = transformers.BertModel(transformers.BertConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                                                         intermediate_size=32, vocab_size=32))
assert type(swapped).__module__.startswith("fastbert"), type(swapped)  # the plugin's swap is on
print(packing.packs_by_position_ids("bert"), installed.tuple_keeps_absent_pooler("bert"))
"""


def test_fastberts_probes_ask_stock_transformers_under_the_plugin():
    """With every family's classes swapped, fastbert's probes of the installed transformers (fastbert/installed.py)
    still build transformers' own encoders: the answers are the ones a process without the plugin gets, and a probe
    does not wait on itself. (A subprocess: the plugin patches transformers' classes for the whole process.)"""
    import subprocess
    import sys

    from fastbert import installed, packing

    run = subprocess.run([sys.executable, "-c", _PROBE_UNDER_THE_PLUGIN, PLUGIN], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [str(packing.packs_by_position_ids("bert")),
                                  str(installed.tuple_keeps_absent_pooler("bert"))]
