"""CUDA graphs by default where they are safe: lazy per-bucket capture, the capture budget, a failing capture, the
attention twin, the opt-outs, and the wiring of encode / optimize / the main job through the runner.

There is no GPU here: `graphs_on_cpu` registers EagerGraph (graphs.py's stand-in with CUDAGraph's contract) as the
graph class of the CPU, so the path a CUDA machine takes by default runs here. Attention runs its Triton kernel
through the interpreter (a graph needs it); every answer is compared with the eager model's (fp32, 1e-5).
"""
import copy
import warnings

import numpy as np
import pytest
import torch
import transformers
from helpers import (
    arch_inputs,
    cuda_test,
    has_modernbert,
    has_rotary_post_norm,
    main_in_process,
    random_arch_model,
    random_hf_bert,
)

import fastbert
from fastbert import dispatch, graphs
from fastbert.graphs import EagerGraph, Graphed, GraphRunner, stats_of

# The kernel where a graph needs it (attention), the twins elsewhere: the interpreter stays quick.
KERNELS = {"qkv_projection": "torch", "attention": "triton", "bias_gelu": "torch", "residual_layernorm": "torch"}
SENTENCES = ["A man is eating food.", "Two dogs are playing in the snow while children build a snowman.", "Hi"]


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The CUDA default, on the CPU: EagerGraph as the CPU's graph class, small buckets."""
    monkeypatch.setitem(graphs.GRAPH_CLASSES, "cpu", EagerGraph)
    monkeypatch.setitem(graphs.DEFAULT_OPTIONS, "token_buckets", (16, 32, 64, 128))
    monkeypatch.setitem(graphs.DEFAULT_OPTIONS, "max_seqs", 4)


@pytest.fixture(scope="module")
def hf():
    return random_hf_bert(hidden=64, heads=2, layers=2, intermediate=100, vocab=60, max_pos=40, types=2)


def tiny(hf):
    return fastbert.BertModel.from_hf(hf, kernels=KERNELS).eval()


def batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 60, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def assert_same(got, want, tol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max() <= tol


def eager(model, ids, mask, **kwargs):
    """The model's own forward, eager (not what a module fastbert.optimize swapped in runs)."""
    with torch.no_grad():
        return fastbert.BertModel.forward(model, ids, attention_mask=mask, **kwargs)


# ---- the runner: lazy, bounded, never failing a call ---------------------------------------------------------------
def test_only_the_buckets_used_are_captured(hf):
    fb = tiny(hf)
    runner = GraphRunner(fb, token_buckets=(16, 32, 64), max_seqs=4, graph_class=EagerGraph)
    assert runner.stats.captures == 0 and runner.graphs == {}
    for lengths, seed in (([9, 5], 0), ([3], 1), ([7, 7, 2], 2)):  # 14, 3, 16 tokens: all in the 16-token bucket
        ids, mask = batch(lengths, seed)
        assert_same(runner(ids, attention_mask=mask).last_hidden_state, eager(fb, ids, mask).last_hidden_state)
    assert set(runner.graphs) == {16} and runner.stats.captures == 1 and runner.stats.replays == 3
    ids, mask = batch([30, 20], 3)  # 50 tokens: the 64-token bucket, 32 stays uncaptured
    assert_same(runner(ids, attention_mask=mask).pooler_output, eager(fb, ids, mask).pooler_output)
    assert set(runner.graphs) == {16, 64} and runner.stats.captures == 2


@pytest.mark.parametrize("arch", ["distilbert", "mpnet", pytest.param("modernbert", marks=pytest.mark.skipif(
    not has_modernbert(), reason="this transformers has no ModernBERT (4.48+)"))])
def test_families_without_token_types_replay(arch):
    """DistilBERT, MPNet and ModernBERT have no token types: the runner's token-type buffer stays zeros (their
    embeddings never read it) and the replay matches the eager model, MPNet's relative bias and padding_idx positions
    and ModernBERT's rotary tables (built inside the captured forward) and windows included."""
    fb = fastbert.BertModel.from_hf(random_arch_model(arch, hidden=64, heads=2), kernels=KERNELS).eval()
    runner = GraphRunner(fb, token_buckets=(16, 32), max_seqs=4, graph_class=EagerGraph)
    ids, types, mask = arch_inputs(fb, "right")
    assert types is None
    for _ in range(2):  # the capture, then a replay
        assert_same(runner(ids, attention_mask=mask).last_hidden_state, eager(fb, ids, mask).last_hidden_state)
    assert runner.stats.captures == 1 and runner.stats.replays == 2


@pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no NomicBERT, GTE, Jina-v3, EuroBERT")
@pytest.mark.parametrize("arch", ["jina_embeddings_v3", "nomic_bert", "gte-notypes", "eurobert-gqa"])
def test_rotary_families_replay(arch):
    """Jina-v3, NomicBERT, GTE (without token types) and EuroBERT (grouped key/value heads, RMSNorm, its embedding
    table on the model): each token's rotary angle follows its position in its own sequence, built inside the
    captured forward, so a replay on other lengths matches the eager model."""
    fb = fastbert.BertModel.from_hf(random_arch_model(arch, hidden=64, heads=4), kernels=KERNELS).eval()
    runner = GraphRunner(fb, token_buckets=(16, 32), max_seqs=4, graph_class=EagerGraph)
    for seed, lengths in enumerate(([9, 5], [3, 12, 10], [7, 7, 2])):  # the 16-token bucket, 32, then 16 again
        ids, mask = batch(lengths, seed)
        assert_same(runner(ids, attention_mask=mask).last_hidden_state, eager(fb, ids, mask).last_hidden_state)
    assert runner.stats.captures == 2 and runner.stats.replays == 3


def test_deberta_replays_its_disentangled_terms():
    """DeBERTa's c2p/p2c terms are computed inside the captured forward (two GEMMs a layer over the packed tokens)
    and its attention kernel gathers them: the replay matches the eager model."""
    fb = fastbert.BertModel.from_hf(random_arch_model("deberta-v2", hidden=64, heads=2), kernels=KERNELS).eval()
    runner = GraphRunner(fb, token_buckets=(16, 32), max_seqs=4, graph_class=EagerGraph)
    ids, types, mask = arch_inputs(fb, "right")
    kw = {} if types is None else {"token_type_ids": types}
    for _ in range(2):  # the capture, then a replay
        assert_same(runner(ids, attention_mask=mask, **kw).last_hidden_state,
                    eager(fb, ids, mask, **kw).last_hidden_state)
    assert runner.stats.captures == 1 and runner.stats.replays == 2


def test_capture_now_rather_than_on_first_use(hf):
    fb = tiny(hf)
    runner = GraphRunner(fb, token_buckets=(16, 32, 64), max_seqs=4, graph_class=EagerGraph)
    with pytest.raises(ValueError, match=r"buckets \[48\] are not among"):
        runner.capture([48])
    assert runner.capture([32]).captures == 1 and set(runner.graphs) == {32}
    runner.capture()
    assert set(runner.graphs) == {16, 32, 64} and runner.stats.captures == 3
    ids, mask = batch([20, 9])
    assert_same(runner(ids, attention_mask=mask).last_hidden_state, eager(fb, ids, mask).last_hidden_state)
    assert runner.stats.captures == 3 and runner.stats.replays == 1


def test_max_captures_bounds_the_graphs(hf):
    fb = tiny(hf)
    runner = GraphRunner(fb, token_buckets=(16, 64), max_seqs=4, graph_class=EagerGraph, max_captures=1)
    small, large = batch([5, 4]), batch([30, 20], 1)
    for ids, mask in (small, large, large, small):
        assert_same(runner(ids, attention_mask=mask).last_hidden_state, eager(fb, ids, mask).last_hidden_state)
    assert set(runner.graphs) == {16} and runner.stats.replays == 2
    assert runner.stats.eager_reasons == {"max_captures=1 buckets captured already": 2}


def test_a_bucket_holds_at_most_its_tokens_in_sequences(hf):
    """A small bucket's graph covers no more sequences (nor a longer sequence) than it has tokens: its attention
    grid is sized by the bucket, not by max_seqs and max_seqlen."""
    fb = tiny(hf)
    runner = GraphRunner(fb, token_buckets=(4, 64), max_seqs=8, graph_class=EagerGraph)
    assert runner._limits(4) == (4, 4) and runner._limits(64) == (8, 40)
    ids, mask = batch([1, 1, 1, 1, 1])  # 5 tokens, 5 sequences: past the 4-token bucket
    got = runner(ids, attention_mask=mask)
    assert set(runner.graphs) == {64}
    assert_same(got.last_hidden_state, eager(fb, ids, mask).last_hidden_state)


# ---- the stand-in is as strict as a graph: replay reads only what the capture read -----------------------------------
def test_the_stand_in_replays_only_the_captured_reads():
    """A graph replays its kernels on the captured addresses: writing into a static input changes the answer,
    rebinding it does not (EagerGraph raises), nor may the replay branch differently or read a value on the host."""
    static, other = torch.arange(4.0), torch.full((4,), 10.0)
    holder = {"x": static}
    graph = EagerGraph()
    out = graph.capture(lambda: holder["x"] * 2)
    static.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    graph.replay()
    assert out.tolist() == [2.0, 4.0, 6.0, 8.0]
    holder["x"] = other  # rebound, not copied
    with pytest.raises(RuntimeError, match=r"read 1 tensor\(s\) the capture did not \(first: torch.float32 \(4,\)\)"):
        graph.replay()

    branch = [True]
    graph = EagerGraph()
    graph.capture(lambda: static * 2 if branch[0] else static + 2)
    branch[0] = False
    with pytest.raises(RuntimeError, match="other ops than the captured one"):
        graph.replay()
    with pytest.raises(RuntimeError, match="a host read"):
        EagerGraph().capture(lambda: static * static.sum().item())


class RebindingRunner(GraphRunner):
    """A runner with a static-buffer bug: it rebinds its input buffers to each call's inputs instead of copying
    them into the buffers the graph was captured on."""

    def _load(self, batch, bucket):
        T, n, size = batch.layout.num_tokens, batch.layout.num_seqs, self.buckets[-1]
        for name in ("input_ids", "token_type_ids", "position_ids"):
            setattr(self, name, torch.cat([getattr(batch, name), torch.zeros(size - T, dtype=torch.long)]))
        self.cu_seqlens = torch.cat([batch.layout.cu_seqlens,
                                     torch.full((self.max_seqs - n,), T, dtype=torch.int32)])


class ForgetfulRunner(GraphRunner):
    """A runner that never copies a call's inputs into the static buffers."""

    def _load(self, batch, bucket):
        pass


def test_a_static_buffer_bug_in_the_runner_shows_on_cpu(hf):
    fb = tiny(hf)
    first, second = batch([9, 5], 0), batch([7, 3], 1)
    want = eager(fb, *second).last_hidden_state
    runner = RebindingRunner(fb, token_buckets=(16,), max_seqs=4, graph_class=EagerGraph)
    with pytest.raises(RuntimeError, match="new inputs must be copied into the static buffers"):
        runner(*second)
    runner = ForgetfulRunner(fb, token_buckets=(16,), max_seqs=4, graph_class=EagerGraph)
    runner(*first)
    stale = runner(*second).last_hidden_state  # the capture's example inputs, not this call's
    assert (stale - want).abs().max() > 1e-2
    runner = GraphRunner(fb, token_buckets=(16,), max_seqs=4, graph_class=EagerGraph)
    runner(*first)
    assert_same(runner(*second).last_hidden_state, want)
    assert runner.stats.replays == 2


class FailingGraph(EagerGraph):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_leaves_its_bucket_eager_with_one_warning(hf):
    fb = tiny(hf)
    runner = GraphRunner(fb, token_buckets=(16, 64), max_seqs=4, graph_class=FailingGraph)
    ids, mask = batch([9, 5])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = runner(ids, attention_mask=mask)
        second = runner(ids, attention_mask=mask)
    said = [str(w.message) for w in caught if "capturing" in str(w.message)]
    assert len(said) == 1, said
    assert "16-token bucket" in said[0] and "RuntimeError: operation not permitted" in said[0]
    want = eager(fb, ids, mask)
    for got in (first, second):
        assert_same(got.last_hidden_state, want.last_hidden_state)
        assert_same(got.pooler_output, want.pooler_output)
    assert runner.graphs == {} and runner.stats.replays == 0 and runner.stats.eager_calls == 2
    assert runner.stats.failed == {16: "RuntimeError: operation not permitted when stream is capturing"}


def test_moved_cast_or_replaced_weights_are_captured_again(hf):
    """The recorded kernels point at the weights' memory: after .data is replaced (what .to() and .half() do), a
    weight is replaced, or the backends change, the bucket is captured again and answers for the model as it is."""
    fb = tiny(hf)
    runner = GraphRunner(fb, token_buckets=(16,), max_seqs=4, graph_class=EagerGraph)
    ids, mask = batch([9, 5])
    runner(ids, attention_mask=mask)
    runner(ids, attention_mask=mask)
    assert runner.stats.captures == 1
    layer = fb.encoder.layer[0].intermediate.dense
    layer.weight.data = layer.weight.data * 1.5
    runner(ids, attention_mask=mask)
    assert runner.stats.captures == 2
    fb.encoder.layer[1].output.dense.bias = torch.nn.Parameter(fb.encoder.layer[1].output.dense.bias + 0.1)
    got = runner(ids, attention_mask=mask)
    assert runner.stats.captures == 3
    assert_same(got.last_hidden_state, eager(fb, ids, mask).last_hidden_state)
    fb.set_kernels(bias_gelu="triton")
    runner(ids, attention_mask=mask)
    assert runner.stats.captures == 4 and "bias_gelu" in runner.ops[16].triton


def test_first_capture_inside_inference_mode_then_calls_outside(hf):
    """Static buffers and outputs are plain tensors, whatever mode the first call ran in."""
    fb = tiny(hf)
    runner = GraphRunner(fb, token_buckets=(16,), max_seqs=4, graph_class=EagerGraph)
    ids, mask = batch([9, 5])
    with torch.inference_mode():
        runner(ids, attention_mask=mask)
    with torch.no_grad():
        got = runner(ids, attention_mask=mask).last_hidden_state
    assert not got.is_inference() and runner.stats.replays == 2


# ---- Graphed: the default path -------------------------------------------------------------------------------------
def test_graphed_replays_inference_calls(hf, graphs_on_cpu):
    fb = tiny(hf)
    call = Graphed(fb)
    ids, mask = batch([9, 5, 12])
    with torch.no_grad():
        got = call(ids, attention_mask=mask)
        as_tuple = call(ids, mask, return_dict=False)
    want = eager(fb, ids, mask)
    assert_same(got.last_hidden_state, want.last_hidden_state)
    assert_same(got.pooler_output, want.pooler_output)
    assert_same(as_tuple[0], want.last_hidden_state)
    assert call.stats.replays == 2 and call.stats.captures == 1 and call.stats.eager_calls == 0


@pytest.mark.parametrize("case, why", [
    ("train", "train mode"),
    ("grad", "autograd (gradients enabled; run under torch.no_grad() or torch.inference_mode())"),
    ("hidden_states", "output_hidden_states"),
    ("attentions", "output_attentions"),
    ("inputs_embeds", "inputs_embeds"),
    ("custom_mask", "a custom 3-D/4-D attention mask was given (the kernel takes a [B, S] key mask)"),
    ("padded", "padded rows (padding_free=False)"),
    ("large", "more than 128 tokens (the largest bucket)"),
])
def test_graphed_runs_the_model_where_graphs_are_not_safe(hf, graphs_on_cpu, monkeypatch, case, why):
    monkeypatch.setattr(dispatch, "_WARNED", set())  # "auto" says once why attention takes its twin
    fb = fastbert.BertModel.from_hf(hf, kernels=KERNELS, padding_free=case != "padded").eval()
    call = Graphed(fb)
    ids, mask = batch([40, 40, 30, 30] if case == "large" else [9, 5])
    kwargs, grad = {"attention_mask": mask}, False
    if case in ("train", "grad", "attentions", "custom_mask"):
        fb.set_kernels(attention="auto")  # the kernel serves none of these (the model takes the twin)
    if case == "train":
        fb.train()
    elif case == "grad":
        grad = True
    elif case == "hidden_states":
        kwargs["output_hidden_states"] = True
    elif case == "attentions":
        kwargs["output_attentions"] = True
    elif case == "inputs_embeds":
        kwargs["inputs_embeds"] = fb.embeddings.word_embeddings(ids)
        ids = None
    elif case == "custom_mask":
        custom = mask[:, None, :].expand(-1, mask.shape[1], -1).clone()
        custom[:, :, 0] = 0
        custom[:, 0, 0] = 1
        kwargs["attention_mask"] = custom
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")
        torch.manual_seed(0)  # train mode: the same dropout masks in both
        got = call(ids, **kwargs)
        torch.manual_seed(0)
        want = type(fb).forward(fb, ids, **kwargs)
    assert_same(got.last_hidden_state, want.last_hidden_state)
    if case == "grad":
        assert got.last_hidden_state.requires_grad
    if case == "hidden_states":
        assert len(got.hidden_states) == 3 and all(torch.equal(a, b) for a, b in zip(got.hidden_states,
                                                                                    want.hidden_states))
    assert call.stats.replays == 0 and call.stats.eager_reasons == {why: 1}


def test_graphed_with_attention_on_its_twin_runs_eagerly_with_one_note(hf, graphs_on_cpu):
    """Explicit cuda_graphs() refuses attention on the twin; the default path runs such a model eagerly."""
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").eval()
    with pytest.raises(ValueError, match="attention on its Triton kernel"):
        GraphRunner(fb, graph_class=EagerGraph)
    call = Graphed(fb)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for lengths in ([9, 5], [30, 20], [3]):
            ids, mask = batch(lengths)
            assert_same(call(ids, attention_mask=mask).last_hidden_state, eager(fb, ids, mask).last_hidden_state)
    notes = [str(w.message) for w in caught if "CUDA graphs" in str(w.message)]
    assert len(notes) == 1 and "attention runs its PyTorch twin" in notes[0], notes
    assert call.stats.replays == 0 and call.stats.captures == 0 and call.stats.eager_calls == 3


def test_graphed_is_eager_on_a_device_without_graphs(hf):
    fb = tiny(hf)
    call = Graphed(fb)
    ids, mask = batch([9, 5])
    with torch.no_grad():
        got = call(ids, attention_mask=mask)
    assert_same(got.last_hidden_state, eager(fb, ids, mask).last_hidden_state, tol=0)
    assert call.runner is None and call.stats.eager_reasons == {"no CUDA graphs on cpu": 1}


# ---- what runs by default where ------------------------------------------------------------------------------------
def test_a_plain_bert_model_stays_eager(hf, graphs_on_cpu):
    fb = tiny(hf)
    ids, mask = batch([9, 5])
    with torch.no_grad():
        fb(ids, attention_mask=mask)
    assert type(fb) is fastbert.BertModel and stats_of(fb) is None


def test_encode_and_sentence_encoder_replay_graphs_by_default(tiny_minilm, graphs_on_cpu):
    options = dict(device="cpu", kernels=KERNELS)
    encoder = fastbert.SentenceEncoder.from_pretrained(tiny_minilm, **options)
    plain = fastbert.SentenceEncoder.from_pretrained(tiny_minilm, cuda_graphs=False, **options)
    got = encoder.encode(SENTENCES, batch_size=2)  # texts of 16 and 8 tokens, then one of 3
    assert encoder.graph_stats.replays == 2 and encoder.graph_stats.eager_calls == 0
    assert encoder.graph_stats.captures == 2  # the 32- and 16-token buckets
    assert plain.graph_stats is None and type(encoder.model) is fastbert.BertModel  # the model stays plain
    want = plain.encode(SENTENCES, batch_size=2)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    model = fastbert.BertModel.from_pretrained(tiny_minilm, add_pooling_layer=False, kernels=KERNELS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_minilm)
    calls = []
    real = GraphRunner.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(GraphRunner, "__call__", counted)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a plain model's defaults note
            off = fastbert.encode(model, SENTENCES, tokenizer=tokenizer, cuda_graphs=False)
            assert calls == []
            on = fastbert.encode(model, SENTENCES, tokenizer=tokenizer)
            assert calls == [1]
    np.testing.assert_allclose(on, off, atol=1e-5, rtol=0)


def test_optimized_sentence_transformer_replays_graphs(tiny_minilm, graphs_on_cpu):
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(tiny_minilm, device="cpu")
    ref = st.encode(SENTENCES, convert_to_tensor=True)
    fastbert.optimize(st, kernels=KERNELS)
    fb = st[0].auto_model
    assert_same(st.encode(SENTENCES, convert_to_tensor=True), ref)
    assert stats_of(fb).replays == 1 and stats_of(fb).eager_calls == 0
    fastbert.optimize(st, cuda_graphs=False)  # optimized already: only the graphs are turned off
    assert stats_of(st[0].auto_model) is None and st[0].auto_model is fb
    assert_same(st.encode(SENTENCES, convert_to_tensor=True), ref)
    fastbert.optimize(st)
    st.encode(SENTENCES)
    copied = copy.deepcopy(st)  # a copy starts without graphs and captures its own
    assert_same(copied.encode(SENTENCES, convert_to_tensor=True), ref)
    assert stats_of(copied[0].auto_model).captures == 1 and stats_of(copied[0].auto_model).replays == 1
    fastbert.restore(st)
    assert stats_of(fb) is None


def test_optimized_cross_encoder_and_pipeline_replay_graphs(tiny_minilm, graphs_on_cpu):
    from sentence_transformers import CrossEncoder
    torch.manual_seed(0)
    ce = CrossEncoder(tiny_minilm, num_labels=1, device="cpu")
    pairs = [(SENTENCES[0], SENTENCES[1]), (SENTENCES[2], SENTENCES[0])]
    ref = torch.as_tensor(ce.predict(pairs))
    fastbert.optimize(ce, kernels=KERNELS)
    bert = next(m for m in (ce.modules() if isinstance(ce, torch.nn.Module) else ce.model.modules())
                if isinstance(m, fastbert.BertModel))
    assert_same(torch.as_tensor(ce.predict(pairs)), ref)
    assert stats_of(bert).replays == 1

    model = transformers.BertModel.from_pretrained(tiny_minilm).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_minilm)
    pipe = transformers.pipeline("feature-extraction", model=model, tokenizer=tokenizer, device="cpu")
    ref = torch.tensor(pipe(SENTENCES[1]))
    fastbert.optimize(pipe, kernels=KERNELS)
    assert_same(torch.tensor(pipe(SENTENCES[1])), ref)
    assert stats_of(pipe.model).replays == 1
    fastbert.optimize(pipe, cuda_graphs=False)
    assert stats_of(pipe.model) is None


def test_optimize_with_cuda_graphs_off(tiny_minilm, graphs_on_cpu):
    clf = transformers.BertForSequenceClassification.from_pretrained(tiny_minilm, num_labels=2).eval()
    fastbert.optimize(clf, kernels=KERNELS, cuda_graphs=False)
    assert stats_of(clf.bert) is None
    fastbert.optimize(clf)
    enc = transformers.AutoTokenizer.from_pretrained(tiny_minilm)(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        got = clf(**enc).logits
        fastbert.optimize(clf, cuda_graphs=False)
        want = clf(**enc).logits
    assert_same(got, want)


def test_optimized_module_and_its_data_parallel_replica(hf, graphs_on_cpu):
    """optimize's module runs its graphs; a replica sharing its __dict__ (what nn.DataParallel makes) runs its own
    eager forward, never the original's graphs."""
    fb = fastbert.optimize(copy.deepcopy(hf).eval(), kernels=KERNELS)
    assert isinstance(fb, fastbert.BertModel)
    ids, mask = batch([9, 5])
    with torch.no_grad():
        got = fb(ids, attention_mask=mask)
        replica = fb._replicate_for_data_parallel()
        from_replica = replica(ids, attention_mask=mask)
    want = eager(fb, ids, mask)
    assert_same(got.last_hidden_state, want.last_hidden_state)
    assert_same(from_replica.last_hidden_state, want.last_hidden_state)
    assert stats_of(fb).replays == 1 and stats_of(fb).eager_calls == 0


MAIN_JOB = ["--kernels", ",".join(f"{op}={b}" for op, b in KERNELS.items()), "--device", "cpu", "--repeats", "1",
            "--limit", "3"]


def test_main_job_compares_the_graphed_path(capsys, tiny_minilm, graphs_on_cpu):
    """Where graphs run by default, the parity row is the graphed path's: its stats are printed under the row."""
    code, out, err = main_in_process(capsys, "--model", tiny_minilm, *MAIN_JOB)
    assert code == 0, out + err
    lines = out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("custom "))
    assert float(lines[row].split()[3]) <= 1e-5 and lines[row].split()[-1] == "ok"
    graphs_line = lines[row + 1].split()
    assert graphs_line[:4] == ["CUDA", "graphs:", "2", "replays,"]  # the first pass and the timed one
    code, out, err = main_in_process(capsys, "--model", tiny_minilm, *MAIN_JOB, "--no-cuda-graphs")
    assert code == 0 and "CUDA graphs:" not in out, out + err


def test_encode_command_turns_graphs_off(capsys, tiny_minilm, graphs_on_cpu, tmp_path, monkeypatch):
    built = []
    real = GraphRunner.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(GraphRunner, "__init__", counted)
    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    args = ["encode", "--model", tiny_minilm, "--input", tmp_path / "in.txt", "--device", "cpu", "--kernels",
            MAIN_JOB[1]]
    code, _, err = main_in_process(capsys, *args, "--output", tmp_path / "off.npy", "--no-cuda-graphs")
    assert code == 0 and built == [], err
    code, _, err = main_in_process(capsys, *args, "--output", tmp_path / "on.npy")
    assert code == 0 and built == [1], err
    np.testing.assert_allclose(np.load(tmp_path / "on.npy"), np.load(tmp_path / "off.npy"), atol=1e-5, rtol=0)


@cuda_test()
def test_a_users_own_cuda_graph_over_a_fresh_model():
    """A user's own torch.cuda.graph over the device part of a forward (`encode`, the inputs prepared outside the
    capture) on a fresh model, every op on its Triton kernel, at widths no other test launches. Captured cold, it is
    refused with NotWarmedUp, saying to warm up, before anything is loaded inside the capture (so the context stays
    usable); after one eager forward of the shape the capture goes through, and its replays equal the eager forward,
    for new input values too. fp16: on sm_90 the GEMMs take the TMA kernel and its scratch allocator."""
    from fastbert.inputs import prepare
    from fastbert.kernels.utils import NotWarmedUp

    hf = random_hf_bert(hidden=96, heads=3, layers=2, intermediate=160, vocab=60, max_pos=40, types=2)
    model = fastbert.BertModel.from_hf(hf, kernels="triton").cuda().half().eval()
    ids, mask = batch([9, 6, 3])
    with torch.no_grad():
        prepared = prepare(model, ids.cuda(), mask.cuda())
        run = model.resolve_ops(False, prepared.why_padded(False), *prepared.size)

        def step():
            return model.encode(prepared.input_ids, prepared.token_type_ids, prepared.position_ids, prepared.attn,
                                run)[0]

        with pytest.raises(NotWarmedUp, match="eager forward"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                step()
        want = step().clone()  # the warm-up: Triton compiles, tunes and loads here, outside any capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        graph.replay()
        torch.cuda.synchronize()
        # The same kernels and tiles give the same bits; the tolerance (a few fp16 ulps at |x| < 4) only lets
        # cuBLAS pick another algorithm inside the graph.
        assert torch.isfinite(out).all()
        assert_same(out, want, tol=1e-2)
        prepared.input_ids.copy_(torch.randint(1, 60, prepared.input_ids.shape, device="cuda"))
        graph.replay()
        new = step()
        assert (new - want).abs().max() > 0.1  # the new ids changed the answer, and the replay follows it
        assert_same(out, new, tol=1e-2)
