"""Padding-free execution: packed input, one host read per forward, traceable forwards, the CUDA-graph runner.

References: HF's BertModel on each sequence alone (what FlashAttention's varlen path computes for packed input), and
HF on the padded batch for real tokens. fp32 bar: 1e-5.
"""
import warnings

import pytest
import torch
from helpers import DEVICE, host_reads, random_hf_bert

import fastbert
from fastbert import dispatch, units
from fastbert.graphs import EagerGraph, GraphRunner

BACKENDS = ["torch", "triton"]  # triton: the interpreter on CPU, compiled on CUDA


@pytest.fixture(scope="module")
def hf():
    return random_hf_bert(hidden=64, heads=2, layers=2, intermediate=100, vocab=60, max_pos=40, types=2).to(DEVICE)


def ragged(lengths, vocab=60, seed=0):
    """Right-padded ids / mask / types for rows of the given lengths, plus the packed form of the same tokens."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    ids = torch.randint(1, vocab, (B, S), generator=g)
    types = torch.randint(0, 2, (B, S), generator=g)
    mask = (torch.arange(S)[None] < torch.tensor(lengths)[:, None]).long()
    flat_ids, flat_types = ids[mask.bool()], types[mask.bool()]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return [t.to(DEVICE) for t in (ids, types, mask, flat_ids, flat_types, cu)]


def per_sequence_hf(hf, flat_ids, flat_types, cu):
    """HF on each packed sequence alone: (last_hidden_state [T, H], pooler_output [n, H])."""
    hidden, pooled = [], []
    with torch.no_grad():
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            out = hf(flat_ids[None, start:end], token_type_ids=flat_types[None, start:end])
            hidden.append(out.last_hidden_state[0])
            pooled.append(out.pooler_output[0])
    return torch.cat(hidden), torch.stack(pooled)


# ---- packed input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_input_matches_hf_per_sequence(hf, backend):
    """model(input_ids=[T], cu_seqlens=[n+1]) returns packed outputs: [T, H] and one pooler row per sequence, positions
    restarting at 0 in every sequence."""
    _, _, _, flat_ids, flat_types, cu = ragged([5, 1, 17, 9])
    fb = fastbert.BertModel.from_hf(hf, kernels=backend)
    with torch.no_grad():
        out = fb(input_ids=flat_ids, token_type_ids=flat_types, cu_seqlens=cu, max_seqlen=17)
        again = fb(input_ids=flat_ids, token_type_ids=flat_types, cu_seqlens=cu)  # max_seqlen read from cu_seqlens
    hidden, pooled = per_sequence_hf(hf, flat_ids, flat_types, cu)
    assert out.last_hidden_state.shape == (32, 64) and out.pooler_output.shape == (4, 64)
    assert (out.last_hidden_state - hidden).abs().max() <= 1e-5
    assert (out.pooler_output - pooled).abs().max() <= 1e-5
    assert torch.equal(again.last_hidden_state, out.last_hidden_state)


def test_hf_packed_keywords_as_transformers_takes_them(hf):
    """transformers' packed form: [1, T] ids, position_ids restarting per sequence, cu_seq_lens_q / max_length_q
    (FlashAttention's varlen keywords): every sequence attends to itself only; HF's shapes, its pooler on token 0."""
    _, _, _, flat_ids, flat_types, cu = ragged([4, 11, 2], seed=1)
    positions = torch.cat([torch.arange(n) for n in (4, 11, 2)]).to(DEVICE)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    with torch.no_grad():
        out = fb(input_ids=flat_ids[None], token_type_ids=flat_types[None], position_ids=positions[None],
                 cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11, max_length_k=11)
    hidden, pooled = per_sequence_hf(hf, flat_ids, flat_types, cu)
    assert out.last_hidden_state.shape == (1, 17, 64) and out.pooler_output.shape == (1, 64)
    assert (out.last_hidden_state[0] - hidden).abs().max() <= 1e-5
    assert (out.pooler_output[0] - pooled[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(cu_seqlens=torch.tensor([0, 3, 9])), ValueError, r"rise from 0 to the number of tokens \(10\)"),
    (dict(cu_seqlens=torch.tensor([1, 3, 10])), ValueError, "first 1"),
    (dict(cu_seqlens=torch.tensor([0, 6, 4, 10])), ValueError, "smallest step -2"),
    (dict(cu_seqlens=torch.tensor([0.0, 10.0])), TypeError, "cu_seqlens must be a 1-D integer tensor"),
    (dict(cu_seqlens=torch.tensor([0])), TypeError, "n >= 1 sequences"),
    (dict(cu_seqlens=torch.tensor([0, 4, 10]), max_seqlen=5), ValueError,
     r"max_seqlen=5 must be an int >= the longest"),
    (dict(cu_seqlens=torch.tensor([0, 10]), attention_mask=torch.ones(10)), ValueError, "takes no attention_mask"),
    (dict(cu_seqlens=torch.tensor([0, 10]), output_attentions=True), NotImplementedError, "output_attentions"),
    (dict(cu_seqlens=torch.tensor([0, 10]), position_ids=torch.zeros(9, dtype=torch.long)), ValueError,
     r"position_ids has shape \(9,\) but the packed input has 10 tokens"),
    (dict(cu_seq_lens_q=torch.tensor([0, 10])), ValueError, r"must be \[1, total_tokens, ...\]"),
    (dict(max_length_q=10), ValueError, "packed input needs cu_seq_lens_q"),
])
def test_packed_input_errors(hf, kwargs, exc, words):
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids = torch.arange(1, 11, device=DEVICE)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(exc, match=words), torch.no_grad():
        fb(input_ids=ids, **kwargs)


# ---- one host read per forward ---------------------------------------------------------------------------------------
def test_one_host_read_per_forward(hf, monkeypatch):
    """A padded batch costs exactly one device-to-host read (validation, lengths and the token count together)."""
    reads = host_reads(monkeypatch)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, types, mask, *_ = ragged([7, 3, 12, 1])
    with torch.no_grad():
        fb(ids, attention_mask=mask, token_type_ids=types)
        reads.clear()
        fb(ids, attention_mask=mask, token_type_ids=types)
    assert reads == ["tolist"]


# ---- traced forwards: built on one batch, right for every other ------------------------------------------------------
def _traced_cases():
    ids, types, mask, *_ = ragged([9, 9, 9], seed=3)
    padded = mask.clone()
    padded[1, 5:] = 0
    padded[2, :3] = 0  # left padding: position 0 is padding
    return ids, types, mask, padded


def _check_traced(traced, hf, fb):
    ids, types, ones, padded = _traced_cases()
    for mask in (ones, padded):
        got = traced(ids, mask, types)
        got = got["last_hidden_state"] if isinstance(got, dict) else got[0] if isinstance(got, tuple) else \
            got.last_hidden_state
        with torch.no_grad():
            want = fb(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
            hf_out = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        assert (got - hf_out)[mask.bool()].abs().max() <= 1e-5  # HF on real tokens
        assert (got - want).abs().max() <= 1e-5  # the eager model everywhere (zeros at padded positions)


def test_torch_compile_fullgraph(hf):
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").eval()
    torch._dynamo.reset()
    compiled = torch.compile(fb, fullgraph=True)
    ids, types, ones, _ = _traced_cases()
    with torch.no_grad():
        compiled(ids, ones, types)  # built on the unpadded batch
        _check_traced(lambda i, m, t: compiled(i, attention_mask=m, token_type_ids=t), hf, fb)
    torch._dynamo.reset()


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_torch_export(hf, kernels):
    """The exported graph holds one fastbert:: custom op per op and layer (the twins on CPU; the kernels where the
    forward resolved to Triton: the interpreter here, CUDA on a GPU)."""
    fb = fastbert.BertModel.from_hf(hf, kernels=kernels).eval()
    ids, types, ones, _ = _traced_cases()
    with torch.no_grad():
        program = torch.export.export(fb, (ids, ones, types))
        _check_traced(lambda i, m, t: program.module()(i, m, t), hf, fb)
    targets = [str(n.target) for n in program.graph.nodes]
    layers = hf.config.num_hidden_layers
    for op, per_layer in (("qkv_projection", 1), ("attention", 1), ("bias_gelu", 1), ("residual_layernorm", 2)):
        assert targets.count(f"fastbert.{op}.default") == per_layer * layers, op


def test_export_as_plain_aten_ops(hf):
    """dispatch.traced_as_aten(): the twins recorded as aten ops (what an ONNX export needs), same numbers."""
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").eval()
    ids, types, ones, _ = _traced_cases()
    with torch.no_grad(), dispatch.traced_as_aten():
        program = torch.export.export(fb, (ids, ones, types))
    assert not [n for n in program.graph.nodes if "fastbert" in str(n.target)]
    with torch.no_grad():
        _check_traced(lambda i, m, t: program.module()(i, m, t), hf, fb)


def test_torch_jit_trace(hf):
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").eval()
    ids, types, ones, _ = _traced_cases()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values it records as constants
        traced = torch.jit.trace(fb, (ids, ones, types), strict=False)
        _check_traced(traced, hf, fb)


# ---- the CUDA-graph runner: bucketing, buffers and fallbacks (EagerGraph on CPU, real graphs on CUDA) ----------------
def _runner(hf, **kwargs):
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").set_kernels(attention="triton").eval()
    graph_class = None if DEVICE == "cuda" else EagerGraph
    return fb, GraphRunner(fb, graph_class=graph_class, **kwargs)


def test_graph_runner_replays_any_mix_of_lengths(hf):
    """A bucket is captured on its first use; after that, every call within it replays (no new capture), with the
    model's own outputs; a smaller call after a larger one sees none of the larger one's tokens."""
    fb, runner = _runner(hf, token_buckets=(16, 64), max_seqs=6)
    assert runner.stats.captures == 0
    for lengths, seed in (([20, 3, 9, 1], 0), ([2, 2], 1), ([30, 30], 2), ([5], 3), ([1, 1, 1, 1, 1, 1], 4)):
        ids, types, mask, *_ = ragged(lengths, seed=seed)
        mask[-1, 0] = 0 if lengths[-1] > 1 else 1  # a hole at position 0 of the last row
        with torch.no_grad():
            want = fb(ids, attention_mask=mask, token_type_ids=types)
        got = runner(ids, attention_mask=mask, token_type_ids=types)
        assert (got.last_hidden_state - want.last_hidden_state).abs().max() <= 1e-6
        assert (got.pooler_output - want.pooler_output).abs().max() <= 1e-6
    assert runner.stats.captures == 2 and runner.stats.replays == 5 and runner.stats.eager_calls == 0


@pytest.mark.parametrize("lengths, why", [
    ([40, 30], "more than 64 tokens"),
    ([1] * 7, "more than max_seqs=6 sequences"),
])
def test_graph_runner_falls_back_to_eager(hf, lengths, why):
    fb, runner = _runner(hf, token_buckets=(16, 64), max_seqs=6)
    ids, types, mask, *_ = ragged(lengths)
    with torch.no_grad():
        want = fb(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    got = runner(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    assert (got - want).abs().max() <= 1e-6
    assert runner.stats.eager_calls == 1 and any(why in reason for reason in runner.stats.eager_reasons)


def test_graph_runner_packed_input_and_max_seqlen(hf):
    fb, runner = _runner(hf, token_buckets=(64,), max_seqs=4, max_seqlen=16)
    _, _, _, flat_ids, flat_types, cu = ragged([12, 16, 3], seed=5)
    with torch.no_grad():
        want = fb(input_ids=flat_ids, token_type_ids=flat_types, cu_seqlens=cu)
    got = runner(input_ids=flat_ids, token_type_ids=flat_types, cu_seqlens=cu)
    assert (got.last_hidden_state - want.last_hidden_state).abs().max() <= 1e-6 and runner.stats.replays == 1
    ids, types, mask, *_ = ragged([17, 2])  # a sequence longer than max_seqlen=16
    runner(ids, attention_mask=mask, token_type_ids=types)
    assert runner.stats.eager_reasons == {"a sequence longer than max_seqlen=16": 1}


def test_graph_runner_custom_mask_runs_as_the_model_runs_it(hf, monkeypatch):
    """A custom 3-D mask runs eagerly and is resolved as the model's own forward resolves it: attention asked for
    "triton" refuses it there as in the model (the kernel takes key masks only), and "auto" takes the twin, with
    the model's numbers. Never the kernel with the custom mask dropped."""
    ids, types, mask, *_ = ragged([9, 5])
    custom = mask[:, None, :].expand(-1, mask.shape[1], -1).clone()
    custom[:, :, 0] = 0  # no query may attend to the first key: not expressible as a [B, S] key mask
    custom[:, 0, 0] = 1
    fb, runner = _runner(hf, token_buckets=(16, 64), max_seqs=6)
    for call in (fb, runner):
        with torch.no_grad(), pytest.raises(RuntimeError, match="custom 3-D/4-D attention mask"):
            call(ids, attention_mask=custom, token_type_ids=types)
    fb.set_kernels(attention="auto")
    monkeypatch.setattr(dispatch, "_WARNED", set())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "auto" says once that the twin serves custom masks
        want = fb(ids, attention_mask=custom, token_type_ids=types).last_hidden_state
        got = runner(ids, attention_mask=custom, token_type_ids=types).last_hidden_state
    assert (got - want).abs().max() <= 1e-6
    assert runner.stats.eager_reasons == {
        "a custom 3-D/4-D attention mask was given (the kernel takes a [B, S] key mask)": 2}


def test_graph_runner_refuses_what_it_cannot_capture(hf):
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").eval()
    with pytest.raises(ValueError, match="attention on its Triton kernel"):
        GraphRunner(fb, graph_class=EagerGraph)
    with pytest.raises(ValueError, match="call model.eval"):
        GraphRunner(fb.set_kernels(attention="triton").train(), graph_class=EagerGraph)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
            fb.eval().cuda_graphs()


def test_eager_forwards_do_not_go_through_the_custom_ops(hf):
    """The custom ops are for traced graphs; an eager forward calls the twins and kernels directly (the dispatcher
    would add ~10-20 us per op call)."""
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").eval()
    run = fb.resolve_ops(needs_grad=False)
    assert (run.qkv_projection, run.attention, run.bias_gelu, run.residual_layernorm) == tuple(
        unit.twin for unit in units.UNITS.values())
