""""auto" that measures: the choice logic, its disk cache and its use by the model and the graph runner, on CPU with a
fake timer (on a GPU the timer is Triton's do_bench on the device).

The fake timer answers in the order the model asks: for each "auto" op in OPS order, the kernel's time, then the
twin's. Here attention's twin is made the faster one.
"""
import inspect
import json

import pytest
import torch
from helpers import AUTO_IDS as IDS
from helpers import AUTO_MASK as MASK
from helpers import Breaks, FakeTimer, failure_warnings, kernel_module, random_hf_bert, twin_for

import fastbert
from fastbert import dispatch, fallback, measure, ops, units
from fastbert.graphs import EagerGraph, GraphRunner
from fastbert.kernels import utils as kernel_utils


@pytest.fixture
def measured_here(monkeypatch, tmp_path):
    """CPU counts as a measured device (Triton runs through the interpreter); a fresh cache directory."""
    monkeypatch.setattr(dispatch, "MEASURED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(kernel_utils, "INTERPRET", True)
    monkeypatch.setattr(measure, "_CHOICES", {})
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def hf():
    return random_hf_bert(hidden=32, heads=2, layers=1, intermediate=40, vocab=50, max_pos=16)


KERNEL_WINS_BUT_ATTENTION = [1.0, 2.0, 5.0, 3.0, 1.0, 2.0, 1.0, 2.0]  # qkv, attention, bias_gelu, residual_layernorm


def test_choices_measure_once_and_persist(tmp_path):
    timer = FakeTimer([2.0, 1.0, 1.0, 1.0])
    path = str(tmp_path / "t.json")
    choices = measure.Choices(torch.device("cpu"), timer, path)
    calls = []
    assert choices.choose("a", lambda: calls.append("kernel"), lambda: calls.append("twin")) is False  # twin faster
    assert choices.choose("b", lambda: None, lambda: None) is True  # a tie goes to the kernel
    assert choices.choose("a", lambda: None, lambda: None) is False and timer.calls == 4  # not measured again
    assert calls == ["kernel", "twin"]
    saved = json.loads(open(path).read())
    assert saved["a"] == {"triton_ms": 2.0, "torch_ms": 1.0, "choice": "torch"}
    reloaded = measure.Choices(torch.device("cpu"), FakeTimer([]), path)  # a new process reads the table
    assert reloaded.choose("a", None, None) is False and reloaded.choose("b", None, None) is True
    open(path, "w").write("{not json")
    assert measure.Choices(torch.device("cpu"), FakeTimer([]), path).table == {}  # corrupt: measured again


def test_token_buckets_and_keys():
    assert [measure.token_bucket(t) for t in (1, 16, 17, 128, 129, 4096)] == [16, 16, 32, 128, 256, 4096]
    shapes = measure.Shapes(128, 384, 1536, 12, 32, 128, "gelu")
    keys = {measure.op_key(op, torch.float16, shapes) for op in fastbert.OPS}
    assert len(keys) == 4 and measure.op_key("attention", torch.float16, shapes) == \
        "attention|float16|T128|nh12|hd32|S128|ragged"
    dense = measure.Shapes(128, 384, 1536, 12, 32, 128, "gelu", ragged=False)
    assert measure.op_key("attention", torch.float16, dense) == "attention|float16|T128|nh12|hd32|S128|dense"
    assert measure.op_key("bias_gelu", torch.bfloat16, shapes) != measure.op_key("bias_gelu", torch.float16, shapes)


def test_gated_and_pre_norm_are_keyed_as_their_own_variants():
    """The gated MLP and the pre-norm form are timed apart from the BERT forms of the same shapes (key suffix)."""
    bert = measure.Shapes(128, 768, 1152, 12, 64, 128, "gelu")
    modern = measure.Shapes(128, 768, 1152, 12, 64, 128, "gelu", bias_gelu=units.bias_gelu.Variant(gated=True),
                            residual_layernorm=units.residual_layernorm.Variant(pre_norm=True))
    assert measure.op_key("bias_gelu", torch.bfloat16, bert) == "bias_gelu|bfloat16|T128|H768|I1152|gelu"
    assert measure.op_key("bias_gelu", torch.bfloat16, modern) == "bias_gelu|bfloat16|T128|H768|I1152|gelu|gated"
    assert measure.op_key("residual_layernorm", torch.bfloat16, bert) == "residual_layernorm|bfloat16|T128|H768|I1152"
    assert measure.op_key("residual_layernorm", torch.bfloat16, modern) == \
        "residual_layernorm|bfloat16|T128|H768|I1152|prenorm"
    for op in ("qkv_projection", "attention"):  # the other ops do not depend on these axes
        assert measure.op_key(op, torch.bfloat16, bert) == measure.op_key(op, torch.bfloat16, modern)


def test_gated_and_pre_norm_are_measured_as_they_run(measured_here):
    """The contenders "auto" times for the gated MLP take HF's Wi [2I, H] with gated=True, and for the pre-norm form
    pre_norm=True (and no LN bias, as ModernBERT): kernel and twin then answer the same, and the choice is filed
    under the variant's own key."""
    shapes = measure.Shapes(16, 32, 40, 2, 16, 16, "gelu", bias_gelu=units.bias_gelu.Variant(gated=True),
                            residual_layernorm=units.residual_layernorm.Variant(pre_norm=True))
    device = torch.device("cpu")
    seen = []

    def recording(op, fn):
        def run(*args, **kwargs):
            seen.append((op, args, kwargs))
            return fn(*args, **kwargs)
        return run

    choices = measure.choices_for(device, FakeTimer([1.0, 2.0, 1.0, 2.0]))
    results = {}
    for op in ("bias_gelu", "residual_layernorm"):
        unit = units.UNITS[op]
        kernel_fn, twin_fn = measure.contenders(op, torch.float32, shapes, device, recording(op, unit.kernel),
                                                recording(op, unit.twin))
        results[op] = kernel_fn(), twin_fn()
        assert choices.choose(measure.op_key(op, torch.float32, shapes), kernel_fn, twin_fn) is True
    (k_out, t_out) = results["bias_gelu"]
    assert k_out.shape == t_out.shape == (16, 40) and (k_out - t_out).abs().max() <= 1e-5
    for k_pair, t_pair in zip(*results["residual_layernorm"]):  # (after attention, after the MLP)
        assert len(k_pair) == len(t_pair) == 2  # (s, LN(s))
        assert all((k - t).abs().max() <= 1e-5 for k, t in zip(k_pair, t_pair))
    signature = inspect.signature(units.bias_gelu.twin)
    gelu_calls = [signature.bind(*args, **kw).arguments for op, args, kw in seen if op == "bias_gelu"]
    assert gelu_calls and all(a["weight"].shape == (80, 32) and a["gated"] is True for a in gelu_calls)
    signature = inspect.signature(units.residual_layernorm.twin)
    norm_calls = [signature.bind(*args, **kw).arguments for op, args, kw in seen if op == "residual_layernorm"]
    assert norm_calls and all(a["pre_norm"] is True and a["ln_bias"] is None for a in norm_calls)
    assert sorted(choices.table) == ["bias_gelu|float32|T16|H32|I40|gelu|gated",
                                     "residual_layernorm|float32|T16|H32|I40|prenorm"]


def test_the_model_runs_what_was_measured_faster(hf, measured_here):
    timer = FakeTimer(KERNEL_WINS_BUT_ATTENTION)
    measure.choices_for(torch.device("cpu"), timer)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto")
    assert fb.resolved_kernels(tokens=8, max_seqlen=5) == {
        "qkv_projection": "triton", "attention": "torch", "bias_gelu": "triton", "residual_layernorm": "triton"}
    assert timer.calls == 8
    with torch.no_grad():
        got = fb(IDS, attention_mask=MASK).last_hidden_state
        want = fastbert.BertModel.from_hf(hf, kernels="torch")(IDS, attention_mask=MASK).last_hidden_state
    assert (got - want).abs().max() <= 1e-5
    assert timer.calls == 8  # 8 tokens, longest 5: the same buckets as asked above, nothing measured again
    table = json.loads(open(measure.choices_for(torch.device("cpu")).path).read())
    assert sorted(entry["choice"] for entry in table.values()) == ["torch", "triton", "triton", "triton"]


def test_explicit_backends_are_never_measured(hf, measured_here):
    timer = FakeTimer([1.0, 2.0, 1.0, 2.0, 1.0, 2.0])  # three auto ops
    measure.choices_for(torch.device("cpu"), timer)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").set_kernels(attention="triton")
    assert fb.resolved_kernels(tokens=8, max_seqlen=5)["attention"] == "triton" and timer.calls == 6
    fb.set_kernels(attention="torch")
    assert fb.resolved_kernels(tokens=8, max_seqlen=5)["attention"] == "torch" and timer.calls == 6


def test_graph_runner_measures_before_capture(hf, measured_here):
    """Every bucket is resolved (and measured) when the runner is built; replays measure nothing."""
    timer = FakeTimer([1.0, 2.0] * 8)  # 2 buckets x 4 ops, the kernel faster everywhere
    measure.choices_for(torch.device("cpu"), timer)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    runner = GraphRunner(fb, token_buckets=(16, 32), max_seqs=4, graph_class=EagerGraph)
    assert timer.calls == 16
    out = runner(IDS, attention_mask=MASK)
    with torch.no_grad():
        want = fb(IDS, attention_mask=MASK).last_hidden_state
    assert (out.last_hidden_state - want).abs().max() <= 1e-6 and timer.calls == 16 and runner.stats.replays == 1


# ---- the safety net: a kernel that raises never breaks an "auto" forward --------------------------------------------
def _compile_error():
    import ast

    from triton.compiler.errors import CompilationError
    return CompilationError("x = tl.load(p)", ast.parse("x = 1").body[0], "an MLIR pass failed")


def _out_of_resources():
    from triton.runtime.errors import OutOfResources
    return OutOfResources(262144, 232448, "shared memory")


ERRORS = {"compile": _compile_error, "resources": _out_of_resources,
          "launch": lambda: RuntimeError("CUDA driver: invalid argument at launch")}


@pytest.fixture
def no_failures_yet(monkeypatch):
    monkeypatch.setattr(fallback, "_FAILED", {})


@pytest.mark.parametrize("error", sorted(ERRORS))
@pytest.mark.parametrize("op", fastbert.OPS)
def test_a_failing_kernel_leaves_auto_on_the_twin(hf, op, error, monkeypatch, no_failures_yet):
    want = twin_for(hf, op)
    broken = Breaks(ERRORS[error])
    monkeypatch.setattr(kernel_module(op), "launch", broken)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    assert fb.resolved_kernels(tokens=8, max_seqlen=5)[op] == "triton"
    with pytest.warns(RuntimeWarning) as record, torch.no_grad():
        first = fb(IDS, attention_mask=MASK).last_hidden_state  # the forward that met the error
        second = fb(IDS, attention_mask=MASK).last_hidden_state
    assert len(failure_warnings(record)) == 1, [str(w.message) for w in record]
    message = str(failure_warnings(record)[0].message)
    assert repr(op) in message and "16-token bucket" in message and type(ERRORS[error]()).__name__ in message
    assert broken.calls == 1  # not retried
    assert torch.equal(first, want) and torch.equal(second, want)
    assert fb.resolved_kernels(tokens=8, max_seqlen=5)[op] == "torch"  # the plans say what runs now


@pytest.mark.parametrize("op", fastbert.OPS)
def test_a_failing_kernel_raises_its_own_error_under_triton(hf, op, monkeypatch, no_failures_yet):
    monkeypatch.setattr(kernel_module(op), "launch", Breaks(ERRORS["launch"]))
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").set_kernels(**{op: "triton"}).eval()
    with pytest.raises(RuntimeError, match="invalid argument at launch"), torch.no_grad():
        fb(IDS, attention_mask=MASK)
    assert fallback._FAILED == {}


def test_the_net_records_nothing_when_the_input_is_at_fault(no_failures_yet):
    x = torch.randn(4, 8)

    def twin():
        raise ValueError("the twin rejects this input too")

    with pytest.raises(RuntimeError, match="kernel says no"):
        fallback.with_net("bias_gelu", x, x.device, Breaks(lambda: RuntimeError("kernel says no")), twin)
    assert fallback._FAILED == {}


@pytest.mark.parametrize("op", fastbert.OPS)
def test_a_failing_kernel_inside_cuda_graphs_replays_the_twin(hf, op, monkeypatch, no_failures_yet):
    want = twin_for(hf, op)
    monkeypatch.setattr(kernel_module(op), "launch", Breaks(ERRORS["launch"]))
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    with pytest.warns(RuntimeWarning) as record:
        runner = GraphRunner(fb, token_buckets=(16, 32), max_seqs=4, graph_class=EagerGraph)
        out = runner(IDS, attention_mask=MASK).last_hidden_state
    buckets = [str(w.message).split("-token bucket")[0].rsplit(" ", 1)[1] for w in failure_warnings(record)]
    assert buckets and len(buckets) == len(set(buckets))  # said once per bucket the runner ran
    assert (out - want).abs().max() <= 1e-6


def test_the_per_op_functions_and_the_traced_ops_have_the_net(monkeypatch, no_failures_yet):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(12, generator=g)
    want = ops.bias_gelu_torch(x, w, b)
    monkeypatch.setattr(kernel_module("bias_gelu"), "bias_gelu", Breaks(ERRORS["launch"]))
    monkeypatch.setattr(kernel_module("bias_gelu"), "launch", Breaks(ERRORS["launch"]))
    with pytest.warns(RuntimeWarning, match="bias_gelu"):
        assert torch.equal(ops.bias_gelu(x, w, b, backend="auto"), want)
    with pytest.raises(RuntimeError, match="invalid argument"):
        ops.bias_gelu(x, w, b, backend="triton")
    monkeypatch.setattr(fallback, "_FAILED", {})
    with pytest.warns(RuntimeWarning, match="bias_gelu"):
        assert torch.equal(torch.ops.fastbert.bias_gelu(x, w, b, "gelu", "auto"), want)
    with pytest.raises(RuntimeError, match="invalid argument"):
        torch.ops.fastbert.bias_gelu(x, w, b, "gelu", "triton")


def test_a_kernel_failing_while_measured_is_recorded_for_the_next_process(hf, measured_here, monkeypatch,
                                                                            no_failures_yet):
    monkeypatch.setattr(kernel_module("bias_gelu"), "launch", Breaks(ERRORS["compile"]))
    # qkv, attention, residual_layernorm are timed (kernel then twin); bias_gelu's kernel raises in the timer
    measure.choices_for(torch.device("cpu"), FakeTimer([1.0, 2.0, 1.0, 2.0, 1.0, 2.0]))
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    with pytest.warns(RuntimeWarning, match="an MLIR pass failed"):
        assert fb.resolved_kernels(tokens=8, max_seqlen=5)["bias_gelu"] == "torch"
    table = json.loads(open(measure.choices_for(torch.device("cpu")).path).read())
    (key,) = [k for k in table if k.startswith("bias_gelu|")]
    assert table[key]["choice"] == "torch" and "CompilationError" in table[key]["error"]

    # a new process: the table is read from disk, the kernel is neither timed nor launched again, and it is said once
    monkeypatch.setattr(measure, "_CHOICES", {})
    monkeypatch.setattr(fallback, "_FAILED", {})
    timer = measure.choices_for(torch.device("cpu"), FakeTimer([]))
    again = Breaks(ERRORS["compile"])
    monkeypatch.setattr(kernel_module("bias_gelu"), "launch", again)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    with pytest.warns(RuntimeWarning, match="in an earlier process") as record, torch.no_grad():
        got = fb(IDS, attention_mask=MASK).last_hidden_state
        fb(IDS, attention_mask=MASK)
    assert len(failure_warnings(record)) == 1 and again.calls == 0 and timer.timer.calls == 0
    assert torch.equal(got, twin_for(hf, "bias_gelu"))


# ---- attention is measured on the layout it will run on ------------------------------------------------------------
def test_attention_is_measured_on_ragged_and_dense_layouts_apart(hf, measured_here):
    seen = []

    class Timer(FakeTimer):
        def __call__(self, fn):
            return super().__call__(fn)

    timer = Timer([1.0, 2.0, 5.0, 3.0, 1.0, 2.0, 1.0, 2.0,   # the ragged batch: attention's twin faster
                   9.0, 3.0])                                # the dense batch: only attention is new
    measure.choices_for(torch.device("cpu"), timer)
    original = units.attention.twin

    def twin(qkv, attn, *args, **kwargs):
        seen.append(attn)
        return original(qkv, attn, *args, **kwargs)

    ops_twin = pytest.MonkeyPatch()
    ops_twin.setattr(units.attention, "twin", twin)
    try:
        fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
        with torch.no_grad():
            fb(IDS, attention_mask=MASK)                  # 8 real tokens, lengths 5 and 3
            fb(IDS[:, :4], attention_mask=MASK[:, :4])    # lengths 4 and 3: the same buckets, nothing new
            fb(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]))  # dense: 8 tokens, rows of 4
    finally:
        ops_twin.undo()
    assert timer.calls == 10
    table = measure.choices_for(torch.device("cpu")).table
    attention_keys = sorted(k for k in table if k.startswith("attention|"))
    assert [k.rsplit("|", 1)[1] for k in attention_keys] == ["dense", "ragged"]
    timed = [a for a in seen if isinstance(a, fastbert.layout.TokenLayout)][:2]
    assert not timed[0].uniform  # the twin was timed on a ragged batch, with its per-sequence loop


def test_the_measured_ragged_layout_spreads_lengths():
    layout = units.attention.measured_layout(1024, 128, True, "cpu")
    assert layout.num_tokens == 1024 and layout.max_seqlen == 128 and not layout.uniform
    assert min(layout.lengths) <= 32 and len(set(layout.lengths)) >= 6
    assert int(layout.cu_seqlens[-1]) == 1024
    dense = units.attention.measured_layout(1024, 128, False, "cpu")
    assert dense.uniform and dense.lengths == (128,) * 8


def test_attention_with_a_relative_bias_is_measured_with_one(measured_here):
    """MPNet's attention carries a per-distance bias table: "auto" times both contenders with such a table and keys
    the result apart from the same shapes without one."""
    from helpers import random_arch_model
    hf = random_arch_model("mpnet", hidden=32, heads=2, layers=1, intermediate=40)
    timer = FakeTimer([1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 1.0, 2.0])  # attention: the twin measured faster
    measure.choices_for(torch.device("cpu"), timer)
    biases = []
    original = units.attention.twin

    def twin(qkv, attn, scale, dropout_p=0.0, return_probs=False, extras=units.attention.NONE, workspace=None):
        biases.append(None if extras.bias is None else tuple(extras.bias.shape))
        return original(qkv, attn, scale, dropout_p, return_probs, extras, workspace)

    patch = pytest.MonkeyPatch()
    patch.setattr(units.attention, "twin", twin)
    try:
        fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
        with torch.no_grad():
            out = fb(IDS, attention_mask=MASK)
            ref = hf(IDS, attention_mask=MASK)
    finally:
        patch.undo()
    assert timer.calls == 8
    keys = [k for k in measure.choices_for(torch.device("cpu")).table if k.startswith("attention|")]
    assert len(keys) == 1 and keys[0].endswith("|ragged|bias129"), keys
    assert biases and all(b == (2, 2 * 129 - 1) for b in biases), biases  # timed and run with the model's table
    real = MASK.bool()
    assert (out.last_hidden_state - ref.last_hidden_state)[real].abs().max() <= 1e-5


def test_windowed_rotary_attention_is_measured_as_that_variant(measured_here, monkeypatch):
    """ModernBERT's local layers: "auto" times kernel and twin with the window and rotary tables of the layout it
    measures on, and keys the result apart from the same shapes without them (and from each alone)."""
    timer = FakeTimer([1.0, 2.0])  # kernel, then twin
    measure.choices_for(torch.device("cpu"), timer)
    seen = {"kernel": [], "twin": []}

    def spy(name, original):
        def run(qkv, attn, scale, dropout_p=0.0, return_probs=False, extras=units.attention.NONE, workspace=None):
            rotary = extras.rotary
            seen[name].append((extras.window, None if rotary is None else (tuple(rotary.cos.shape), rotary.cos.dtype,
                                                                           rotary, attn)))
            return original(qkv, attn, scale, dropout_p, return_probs, extras, workspace)
        return run

    monkeypatch.setattr(units.attention, "kernel", spy("kernel", units.attention.kernel))
    monkeypatch.setattr(units.attention, "twin", spy("twin", units.attention.twin))
    shapes = measure.Shapes(16, 32, 40, 2, 16, 16, "gelu", True, units.attention.Variant(window=3, rotary=True))
    situation = dispatch.Situation(("auto",) * 4, torch.device("cpu"), torch.float32, 16, False, 0.0, 0.0, None,
                                   shapes)
    assert dispatch._measured("attention", situation) is True
    assert timer.calls == 2
    (key,) = [k for k in measure.choices_for(torch.device("cpu")).table if k.startswith("attention|")]
    assert key.endswith("|ragged|window3|rotary"), key
    for name in ("kernel", "twin"):
        ((window, (shape, dtype, rotary, layout)),) = seen[name]
        assert window == 3 and shape == (layout.num_tokens, 8) and dtype == torch.float32
        starts = layout.cu_seqlens[:-1].long()
        # each sequence's tables start at position 0: cos 1, sin 0 in its first row
        assert torch.equal(rotary.cos[starts], torch.ones(len(starts), 8))
        assert torch.equal(rotary.sin[starts], torch.zeros(len(starts), 8))
    plain = measure.Shapes(16, 32, 40, 2, 16, 16, "gelu", True)
    keys = {measure.op_key("attention", torch.float32, s) for s in
            (plain, shapes, measure.Shapes(16, 32, 40, 2, 16, 16, "gelu", True, units.attention.Variant(window=3)),
             measure.Shapes(16, 32, 40, 2, 16, 16, "gelu", True, units.attention.Variant(rotary=True)))}
    assert len(keys) == 4


# ---- what "auto" times, and what it blames on the kernel ------------------------------------------------------------
def test_a_failing_twin_is_not_recorded_against_the_kernel(measured_here, monkeypatch, no_failures_yet):
    """The twin raises while it is timed: its own error reaches the caller, nothing is recorded against the kernel
    (in this process or on disk), and the key is measured again next time."""
    def twin(*args, **kwargs):
        raise ValueError("the twin cannot run this")

    monkeypatch.setattr(units.bias_gelu, "twin", twin)
    timer = FakeTimer([1.0, 2.0, 1.0])
    choices = measure.choices_for(torch.device("cpu"), timer)
    shapes = measure.Shapes(16, 32, 40, 2, 16, 16, "gelu")
    situation = dispatch.Situation(("auto",) * 4, torch.device("cpu"), torch.float32, 16, False, 0.0, 0.0, None,
                                   shapes)
    with pytest.raises(ValueError, match="the twin cannot run this"):
        dispatch._measured("bias_gelu", situation)
    key = measure.op_key("bias_gelu", torch.float32, shapes)
    assert fallback._FAILED == {} and choices.failure(key) is None
    assert json.loads(open(choices.path).read())[key] == {"triton_ms": 1.0}  # the kernel's time, no choice
    monkeypatch.setattr(units.bias_gelu, "twin", lambda *args, **kwargs: None)
    # measured again, both: the kernel 2 ms, the twin 1 ms (the timer counts the calls that returned)
    assert dispatch._measured("bias_gelu", situation) is False and timer.calls == 3 and timer.script == []
    assert measure.Choices(torch.device("cpu"), FakeTimer([]), choices.path).table[key]["choice"] == "torch"


def test_auto_times_the_median(monkeypatch):
    """default_timer asks do_bench for the median: here nine runs of 1 ms and one stall of 100 ms (mean 10.9 ms).
    The stand-in has do_bench's signature and summarises with Triton's own function."""
    import inspect

    import triton.testing

    times = [1.0] * 9 + [100.0]
    asked = []

    def do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
        fn()
        asked.append(return_mode)
        return triton.testing._summarize_statistics(times, quantiles, return_mode)

    assert inspect.signature(do_bench) == inspect.signature(triton.testing.do_bench)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    ran = []
    assert measure.default_timer(lambda: ran.append(1)) == 1.0 and ran == [1] and asked == ["median"]


# ---- "auto" under autograd: forward + backward are what is timed --------------------------------------------------
def _grads(fb):
    out = fb(IDS, attention_mask=MASK).last_hidden_state
    out.pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in fb.named_parameters() if p.grad is not None}
    fb.zero_grad(set_to_none=True)
    return out.detach(), grads


def test_auto_under_autograd_times_the_training_kernels_forward_and_backward(hf, measured_here, monkeypatch):
    """An eval-mode forward with autograd on trains every op: each is timed as forward + backward under its own
    "|train" key (the backward inside the timed call: it is what the timer sees), the kernels win here, and the
    forward then runs the units' train_kernels, whose gradients are the twins'."""
    backward_calls = []
    for op in ("bias_gelu", "residual_layernorm"):
        module = kernel_module(op)
        original = module.backward if op == "bias_gelu" else module.layernorm_backward
        name = "backward" if op == "bias_gelu" else "layernorm_backward"

        def counting(*args, _original=original, _op=op, **kwargs):
            backward_calls.append(_op)
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, name, counting)
    timer = FakeTimer([1.0, 2.0] * 8)
    measure.choices_for(torch.device("cpu"), timer)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    got, got_grads = _grads(fb)
    # eval mode with autograd on: the inference plan is resolved too (the warning when its kernels would differ)
    assert timer.calls == 16
    assert {"bias_gelu", "residual_layernorm"} <= set(backward_calls)
    table = json.loads(open(measure.choices_for(torch.device("cpu")).path).read())
    assert len(table) == 8
    train_keys = [k for k in table if k.endswith("|train")]
    assert sorted(k.split("|")[0] for k in train_keys) == sorted(fastbert.OPS)
    assert all(v["choice"] == "triton" for v in table.values()), table
    assert backward_calls.count("bias_gelu") == 2  # timed once, then the step's own backward

    twin, twin_grads = _grads(fastbert.BertModel.from_hf(hf, kernels="torch").eval())
    assert (got - twin).abs().max() <= 1e-5
    assert sorted(got_grads) == sorted(twin_grads)
    for name in twin_grads:
        scale = twin_grads[name].abs().max().clamp_min(1.0)
        assert (got_grads[name] - twin_grads[name]).abs().max() <= 1e-4 * scale, name

    # inference's entries stand apart, without "|train": a no_grad forward's plan is the one already measured
    assert fb.resolved_kernels(tokens=8, max_seqlen=5) == dict.fromkeys(fastbert.OPS, "triton")
    assert timer.calls == 16


@pytest.mark.parametrize("op", ["bias_gelu", "residual_layernorm"])
def test_a_backward_failing_while_measured_leaves_auto_training_on_the_twin(hf, op, measured_here, monkeypatch,
                                                                            no_failures_yet):
    """A kernel whose backward raises while "auto" times forward + backward: that op trains on its twin (said once,
    recorded under its "|train" key), the others on their kernels, and the gradients are the twins'."""
    name = "backward" if op == "bias_gelu" else "layernorm_backward"
    broken = Breaks(ERRORS["compile"])
    monkeypatch.setattr(kernel_module(op), name, broken)
    measure.choices_for(torch.device("cpu"), FakeTimer([1.0, 2.0] * 6))  # the other three ops, trained and not
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    with pytest.warns(RuntimeWarning, match="an MLIR pass failed") as record:
        got, got_grads = _grads(fb)
        _grads(fb)
    assert len(failure_warnings(record)) == 1 and repr(op) in str(failure_warnings(record)[0].message)
    assert broken.calls == 1
    table = json.loads(open(measure.choices_for(torch.device("cpu")).path).read())
    (key,) = [k for k in table if k.startswith(op + "|")]
    assert key.endswith("|train") and table[key]["choice"] == "torch" and "CompilationError" in table[key]["error"]
    # the failure sets the op aside for this process's inference forwards of that bucket too (not timed)
    assert len(table) == 7 and all(v["choice"] == "triton" for k, v in table.items() if k != key)
    assert fb.resolved_kernels(tokens=8, max_seqlen=5)[op] == "torch"

    twin, twin_grads = _grads(fastbert.BertModel.from_hf(hf, kernels="torch").eval())
    assert (got - twin).abs().max() <= 1e-5
    for name in twin_grads:
        scale = twin_grads[name].abs().max().clamp_min(1.0)
        assert (got_grads[name] - twin_grads[name]).abs().max() <= 1e-4 * scale, name
