""""auto" that measures: the choice logic, its disk cache and its use by the model and the graph runner, on CPU with a
fake timer (on a GPU the timer is Triton's do_bench on the device).

The fake timer answers in the order the model asks: for each "auto" op in OPS order, the kernel's time, then the
twin's. Here attention's twin is made the faster one.
"""
import json

import pytest
import torch

import fastbert
from conftest import random_hf_bert
from fastbert import auto, ops
from fastbert.graphs import EagerGraph, GraphRunner
from fastbert.kernels import utils as kernel_utils

IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


class FakeTimer:
    """Milliseconds from a script; each call also runs the function once, so both contenders are exercised."""

    def __init__(self, script):
        self.script, self.calls = list(script), 0

    def __call__(self, fn):
        fn()
        self.calls += 1
        return self.script.pop(0)


@pytest.fixture
def measured_here(monkeypatch, tmp_path):
    """CPU counts as a measured device (Triton runs through the interpreter); a fresh cache directory."""
    monkeypatch.setattr(ops, "MEASURED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(kernel_utils, "INTERPRET", True)
    monkeypatch.setattr(auto, "_CHOICES", {})
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def hf():
    return random_hf_bert(hidden=32, heads=2, layers=1, intermediate=40, vocab=50, max_pos=16)


KERNEL_WINS_BUT_ATTENTION = [1.0, 2.0, 5.0, 3.0, 1.0, 2.0, 1.0, 2.0]  # qkv, attention, bias_gelu, residual_layernorm


def test_choices_measure_once_and_persist(tmp_path):
    timer = FakeTimer([2.0, 1.0, 1.0, 1.0])
    path = str(tmp_path / "t.json")
    choices = auto.Choices(torch.device("cpu"), timer, path)
    calls = []
    assert choices.choose("a", lambda: calls.append("kernel"), lambda: calls.append("twin")) is False  # twin faster
    assert choices.choose("b", lambda: None, lambda: None) is True  # a tie goes to the kernel
    assert choices.choose("a", lambda: None, lambda: None) is False and timer.calls == 4  # not measured again
    assert calls == ["kernel", "twin"]
    saved = json.loads(open(path).read())
    assert saved["a"] == {"triton_ms": 2.0, "torch_ms": 1.0, "choice": "torch"}
    reloaded = auto.Choices(torch.device("cpu"), FakeTimer([]), path)  # a new process reads the table
    assert reloaded.choose("a", None, None) is False and reloaded.choose("b", None, None) is True
    open(path, "w").write("{not json")
    assert auto.Choices(torch.device("cpu"), FakeTimer([]), path).table == {}  # corrupt: measured again


def test_token_buckets_and_keys():
    assert [auto.token_bucket(t) for t in (1, 16, 17, 128, 129, 4096)] == [16, 16, 32, 128, 256, 4096]
    shapes = auto.Shapes(128, 384, 1536, 12, 32, 128, "gelu")
    keys = {auto.op_key(op, torch.float16, shapes) for op in fastbert.OPS}
    assert len(keys) == 4 and auto.op_key("attention", torch.float16, shapes) == \
        "attention|float16|T128|nh12|hd32|S128"
    assert auto.op_key("bias_gelu", torch.bfloat16, shapes) != auto.op_key("bias_gelu", torch.float16, shapes)


def test_the_model_runs_what_was_measured_faster(hf, measured_here):
    timer = FakeTimer(KERNEL_WINS_BUT_ATTENTION)
    auto.choices_for(torch.device("cpu"), timer)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto")
    assert fb.resolved_kernels(tokens=8, max_seqlen=5) == {
        "qkv_projection": "triton", "attention": "torch", "bias_gelu": "triton", "residual_layernorm": "triton"}
    assert timer.calls == 8
    with torch.no_grad():
        got = fb(IDS, attention_mask=MASK).last_hidden_state
        want = fastbert.BertModel.from_hf(hf, kernels="torch")(IDS, attention_mask=MASK).last_hidden_state
    assert (got - want).abs().max() <= 1e-5
    assert timer.calls == 8  # 8 tokens, longest 5: the same buckets as asked above, nothing measured again
    table = json.loads(open(auto.choices_for(torch.device("cpu")).path).read())
    assert sorted(entry["choice"] for entry in table.values()) == ["torch", "triton", "triton", "triton"]


def test_explicit_backends_are_never_measured(hf, measured_here):
    timer = FakeTimer([1.0, 2.0, 1.0, 2.0, 1.0, 2.0])  # three auto ops
    auto.choices_for(torch.device("cpu"), timer)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").set_kernels(attention="triton")
    assert fb.resolved_kernels(tokens=8, max_seqlen=5)["attention"] == "triton" and timer.calls == 6
    fb.set_kernels(attention="torch")
    assert fb.resolved_kernels(tokens=8, max_seqlen=5)["attention"] == "torch" and timer.calls == 6


def test_graph_runner_measures_before_capture(hf, measured_here):
    """Every bucket is resolved (and measured) when the runner is built; replays measure nothing."""
    timer = FakeTimer([1.0, 2.0] * 8)  # 2 buckets x 4 ops, the kernel faster everywhere
    auto.choices_for(torch.device("cpu"), timer)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    runner = GraphRunner(fb, token_buckets=(16, 32), max_seqs=4, graph_class=EagerGraph)
    assert timer.calls == 16
    out = runner(IDS, attention_mask=MASK)
    with torch.no_grad():
        want = fb(IDS, attention_mask=MASK).last_hidden_state
    assert (out.last_hidden_state - want).abs().max() <= 1e-6 and timer.calls == 16 and runner.stats.replays == 1
