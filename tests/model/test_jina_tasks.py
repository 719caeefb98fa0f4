"""Jina-Embeddings-v3's task adapters: a random-weight checkpoint laid out as the Hub ships it (every linear's and
embedding table's weight at X.parametrizations.weight.original, five tasks' random non-zero lora_A / lora_B stacked
beside it), loaded into fastbert and run with adapter_mask. The reference for task t is transformers' own
JinaEmbeddingsV3Model holding the merged weights W + s B_t A_t (merged in float64, then cast), loaded by transformers'
conversion of the Hub's layout; the base weights for -1. Every task on every sequence, and mixed batches (different
tasks per sequence, -1 among them), padded and packed, on the twins and on the kernels (Triton's interpreter on a CPU):
fp32 <= 1e-5 at every real position and on the pooler output."""
import copy

import pytest
import torch
from helpers import (
    ARCH_VOCAB,
    JINA_TASKS,
    error_on_real_tokens,
    has_rotary_post_norm,
    jina_hub_folder,
    jina_reference,
    ragged_rows,
)

import fastbert
from fastbert import loading
from fastbert.graphs import EagerGraph, GraphRunner

pytestmark = pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no Jina-v3 (5.24+)")

LENGTHS = [5, 9, 1, 7]  # one row of a single token: its pooler reads that token
MIXED = [3, -1, 0, 4]  # a task per row; -1: the base weights


@pytest.fixture(scope="module")
def jina(tmp_path_factory):
    """(folder, transformers' model, the checkpoint, {task index or None: the merged reference})."""
    folder, hf, checkpoint = jina_hub_folder(tmp_path_factory.mktemp("jina") / "jina-embeddings-v3")
    refs = {t: jina_reference(hf, checkpoint, t) for t in (None, *range(len(JINA_TASKS)))}
    return folder, hf, checkpoint, refs


@pytest.fixture(scope="module")
def rows():
    ids, mask = ragged_rows(LENGTHS, seed=3)
    return ids, mask


_REFERENCE_OUTPUTS = {}  # (the reference, the rows) -> its outputs: each reference runs once per batch of rows


def reference(refs, ids, mask, tasks):
    """Row b of each output from the reference of tasks[b]: (last hidden state [B, S, H], pooler [B, H])."""
    outs = {}
    with torch.no_grad():
        for t in set(tasks):
            key = (id(refs[None if t < 0 else t]), str(ids.tolist()), str(mask.tolist()))
            if key not in _REFERENCE_OUTPUTS:
                _REFERENCE_OUTPUTS[key] = refs[None if t < 0 else t](input_ids=ids, attention_mask=mask)
            outs[t] = _REFERENCE_OUTPUTS[key]
    last = torch.stack([outs[t].last_hidden_state[b] for b, t in enumerate(tasks)])
    pooled = torch.stack([outs[t].pooler_output[b] for b, t in enumerate(tasks)])
    return last, pooled


def packed(ids, mask):
    lengths = mask.sum(dim=1)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return ids[mask.bool()], cu


def run(model, ids, mask, tasks, layout):
    """(last hidden state [B, S, H] with zeros at padding, pooler [B, H]) of the model with adapter_mask=tasks."""
    adapter_mask = torch.tensor(tasks)
    with torch.no_grad():
        if layout == "padded":
            out = model(input_ids=ids, attention_mask=mask, adapter_mask=adapter_mask)
            return out.last_hidden_state, out.pooler_output
        flat, cu = packed(ids, mask)
        out = model(input_ids=flat, cu_seqlens=cu, adapter_mask=adapter_mask)
    last = torch.zeros(*ids.shape, out.last_hidden_state.shape[-1])
    last[mask.bool()] = out.last_hidden_state
    return last, out.pooler_output


def assert_matches(got, want, mask, tol=1e-5):
    assert error_on_real_tokens(got[0], want[0], mask) <= tol
    assert (got[1] - want[1]).abs().max() <= tol


# ---- loading ---------------------------------------------------------------------------------------------------------
def test_every_key_of_the_hub_layout_is_accounted_for(jina):
    """Each checkpoint tensor lands somewhere: the originals as the layers' weights (q/k/v split from mixer.Wqkv), the
    adapters on the layers, the embeddings and the pooler, in the checkpoint's own shapes; the config names the tasks
    in adapter_mask's order and gives the scaling (lora_alpha / rank)."""
    folder, _, checkpoint, _ = jina
    model = fastbert.BertModel.from_pretrained(folder, kernels="torch")
    assert model.task_names == JINA_TASKS and model.task_rank == 4 and model.task_scaling == 0.25
    state = model.state_dict()
    adapter_keys = {k for k in state if ".task_adapters." in k}
    # 2 tables, 4 per layer, the pooler: each an A and a B
    assert len(adapter_keys) == 2 * (2 + 4 * 2 + 1)
    lora = checkpoint["roberta.encoder.layers.1.mixer.Wqkv.parametrizations.weight.0.lora_B"]
    assert torch.equal(state["layers.1.task_adapters.qkv.lora_B"], lora)  # [tasks, 3H, rank], unsplit
    table = checkpoint["roberta.embeddings.word_embeddings.parametrizations.weight.0.lora_A"]
    assert torch.equal(state["embeddings.task_adapters.word_embeddings.lora_A"], table)
    # each layer's mixer.Wqkv weight and bias become q/k/v's: 3 keys of 1, twice
    assert len(state) - len(adapter_keys) == sum(1 for k in checkpoint if "lora_" not in k) + 2 * 2 * 2


def test_a_damaged_adapter_is_refused(jina, tmp_path):
    """Strict, as for every key: an adapter without its lora_B, or one for a task count the config does not name."""
    from safetensors.torch import save_file
    folder, _, checkpoint, _ = jina
    for name, change in (("no lora_B", lambda c: c.pop("roberta.pooler.dense.parametrizations.weight.0.lora_B")),
                         ("a task short", lambda c: c.update(
                             {k: v[:4] for k, v in c.items() if k.endswith(("lora_A", "lora_B"))}))):
        broken = dict(checkpoint)
        change(broken)
        target = tmp_path / name.replace(" ", "-")
        target.mkdir()
        save_file({k: v.contiguous() for k, v in broken.items()}, str(target / "model.safetensors"))
        (target / "config.json").write_text(open(f"{folder}/config.json").read())
        with pytest.raises(ValueError, match="lora_B|lora_adaptations"):
            fastbert.BertModel.from_pretrained(target, kernels="torch")


def test_a_checkpoint_without_adapters_loads_as_before(jina, tmp_path):
    """transformers' own save of the model (no adapters) loads without task adapters, and asking for a task there is
    a ValueError."""
    _, hf, _, refs = jina
    hf.save_pretrained(tmp_path)
    model = fastbert.BertModel.from_pretrained(tmp_path, kernels="torch")
    assert model.task_names == () and not any(".task_adapters." in k for k in model.state_dict())
    ids, mask = ragged_rows(LENGTHS, seed=3)
    with torch.no_grad():
        assert error_on_real_tokens(model(ids, attention_mask=mask).last_hidden_state,
                                    refs[None](ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5
        with pytest.raises(ValueError, match="no task adapters"):
            model(ids, attention_mask=mask, adapter_mask=torch.zeros(len(LENGTHS), dtype=torch.long))


def test_save_pretrained_writes_the_hub_layout_back(jina, tmp_path):
    """What fastbert saves is the Hub's checkpoint again, key for key and tensor for tensor (a base model's: without
    the remote code's "roberta." wrapper), and loads back with its tasks; transformers' names cannot hold an adapter
    that spans q, k and v, so save_original_format=False refuses."""
    from safetensors.torch import load_file
    folder, _, checkpoint, _ = jina
    model = fastbert.BertModel.from_pretrained(folder, kernels="torch")
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    hub = {k[len("roberta."):]: v for k, v in checkpoint.items()}
    assert set(saved) == set(hub) and all(torch.equal(saved[k], hub[k]) for k in hub)
    assert fastbert.BertModel.from_pretrained(tmp_path / "saved").task_names == JINA_TASKS
    with pytest.raises(NotImplementedError, match="save_original_format=False"):
        model.save_pretrained(tmp_path / "plain", save_original_format=False)
    assert not (tmp_path / "plain").exists()  # refused before anything is written


def test_sentence_encoder_loads_without_the_pooler_and_its_adapter(jina):
    folder, _, _, _ = jina
    model = fastbert.BertModel.from_pretrained(folder, kernels="torch", add_pooling_layer=False)
    assert model.pooler is None and not any(k.startswith("pooler.") for k in model.state_dict())


# ---- the forward: each task, and tasks mixed in one batch ------------------------------------------------------------
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_each_task_on_every_sequence(jina, rows, kernels, layout):
    folder, _, _, refs = jina
    model = fastbert.BertModel.from_pretrained(folder, kernels=kernels)
    ids, mask = rows
    for t in range(len(JINA_TASKS)):
        tasks = [t] * len(LENGTHS)
        assert_matches(run(model, ids, mask, tasks, layout), reference(refs, ids, mask, tasks), mask)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_tasks_mixed_in_one_batch(jina, rows, kernels, layout):
    """Each sequence gets its own task's numbers, whatever the tasks beside it; -1 gets the base model's."""
    folder, _, _, refs = jina
    model = fastbert.BertModel.from_pretrained(folder, kernels=kernels)
    if kernels == "triton":
        assert set(model.resolved_kernels().values()) == {"triton"}
    ids, mask = rows
    want = reference(refs, ids, mask, MIXED)
    assert_matches(run(model, ids, mask, MIXED, layout), want, mask)
    # the tasks do change the numbers: a row of task 3 is far from the base model's
    assert error_on_real_tokens(want[0][:1], reference(refs, ids, mask, [-1] * 4)[0][:1], mask[:1]) > 1e-3


def test_padded_rows_and_hf_packed_input(jina, rows):
    """The other layouts a forward can take: padded rows (output_attentions keeps them), and transformers' own
    packed form ([1, T] ids with cu_seq_lens_q; its pooler reads token 0, the first sequence's)."""
    folder, _, _, refs = jina
    model = fastbert.BertModel.from_pretrained(folder, kernels="torch")
    ids, mask = rows
    want = reference(refs, ids, mask, MIXED)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, adapter_mask=torch.tensor(MIXED), output_attentions=True)
        assert_matches((out.last_hidden_state, out.pooler_output), want, mask)
        flat, cu = packed(ids, mask)
        out = model(input_ids=flat[None], cu_seq_lens_q=cu, max_length_q=max(LENGTHS),
                    adapter_mask=torch.tensor(MIXED))
    assert (out.last_hidden_state[0] - want[0][mask.bool()]).abs().max() <= 1e-5
    assert out.pooler_output.shape == (1, want[1].shape[-1])
    assert (out.pooler_output[0] - want[1][0]).abs().max() <= 1e-5


def test_under_autograd_on_the_twins(jina, rows):
    """Inference is what task adapters are for, but an eval-mode call with autograd on (no torch.no_grad) gives the
    same numbers, and a backward runs through them."""
    folder, _, _, refs = jina
    model = fastbert.BertModel.from_pretrained(folder, kernels="torch")
    ids, mask = rows
    out = model(input_ids=ids, attention_mask=mask, adapter_mask=torch.tensor(MIXED))
    assert_matches((out.last_hidden_state.detach(), out.pooler_output.detach()), reference(refs, ids, mask, MIXED),
                   mask)
    out.pooler_output.sum().backward()
    assert model.layers[0].task_adapters["qkv"].lora_B.grad is not None


def test_a_model_loaded_under_inference_mode(jina, rows):
    """Its weights are inference tensors, which keep no version counter (the MLP's widened weight is keyed on it)."""
    folder, _, _, refs = jina
    ids, mask = rows
    with torch.inference_mode():
        model = fastbert.BertModel.from_pretrained(folder, kernels="torch")
        for _ in range(2):  # the widened weight built, then reused
            assert_matches(run(model, ids, mask, MIXED, "padded"), reference(refs, ids, mask, MIXED), mask)


# ---- CUDA graphs' logic (EagerGraph: a graph's contract, run on the CPU) ---------------------------------------------
def test_graphs_carry_each_tokens_task(jina):
    """One graph per bucket serves every mix of tasks: each token's task is a static input. A call without
    adapter_mask replays the same graph (every token selects no adapter) and gives the base model's numbers."""
    folder, _, _, refs = jina
    # attention on its kernel, as a graph needs it; the twins elsewhere (the spare tokens' rows hold garbage, which
    # the interpreter would warn about)
    model = fastbert.BertModel.from_pretrained(folder, kernels={"qkv_projection": "torch", "attention": "triton",
                                                                "bias_gelu": "torch", "residual_layernorm": "torch"})
    runner = GraphRunner(model, token_buckets=(16, 32), max_seqs=4, graph_class=EagerGraph)
    for lengths, tasks, seed in (([5, 9, 1], [3, -1, 0], 1), ([7, 2, 4], [1, 1, 4], 2), ([3, 3], None, 3)):
        ids, mask = ragged_rows(lengths, seed=seed)
        with torch.no_grad():
            out = runner(ids, attention_mask=mask, adapter_mask=None if tasks is None else torch.tensor(tasks))
        assert_matches((out.last_hidden_state, out.pooler_output),
                       reference(refs, ids, mask, tasks or [-1] * len(lengths)), mask)
    ids, mask = ragged_rows([4, 6, 2], seed=4)  # packed input replays the same graph
    flat, cu = packed(ids, mask)
    with torch.no_grad():
        out = runner(input_ids=flat, cu_seqlens=cu, adapter_mask=torch.tensor([2, 0, -1]))
    want = reference(refs, ids, mask, [2, 0, -1])
    assert (out.last_hidden_state - want[0][mask.bool()]).abs().max() <= 1e-5
    assert (out.pooler_output - want[1]).abs().max() <= 1e-5
    assert runner.stats.captures == 1 and runner.stats.replays == 4 and runner.stats.eager_calls == 0


# ---- what is refused, and how ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter_mask, error, words", [
    (torch.tensor([0, 1, 5, 0]), ValueError, r"adapter_mask contains 5, outside \[-1, 5\)"),
    (torch.tensor([0, -2, 0, 0]), ValueError, r"adapter_mask contains -2, outside \[-1, 5\)"),
    (torch.tensor([0, 1]), ValueError, "2 entries but the input has 4 sequences"),
    (torch.zeros(4), TypeError, "integer tensor"),
    (torch.zeros(4, 1, dtype=torch.long), TypeError, "1-D"),
])
def test_bad_adapter_masks(jina, rows, adapter_mask, error, words):
    folder, _, _, _ = jina
    model = fastbert.BertModel.from_pretrained(folder, kernels="torch")
    ids, mask = rows
    with pytest.raises(error, match=words), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, adapter_mask=adapter_mask)


def test_refused_calls(jina, rows):
    folder, _, _, _ = jina
    model = fastbert.BertModel.from_pretrained(folder, kernels="torch")
    ids, mask = rows
    tasks = torch.tensor(MIXED)
    with torch.no_grad():
        with pytest.raises(ValueError, match="needs input_ids"):
            model(inputs_embeds=model.embeddings.word_embeddings(ids), attention_mask=mask, adapter_mask=tasks)
        with pytest.raises(NotImplementedError, match="inference only"):
            copy.deepcopy(model).train()(input_ids=ids, attention_mask=mask, adapter_mask=tasks)
    with pytest.raises(ValueError, match="unknown task 'retrieval'; this model's tasks are 'retrieval.query'"):
        fastbert.adapters.adapter_mask(model, ["retrieval", None])
    with pytest.raises(NotImplementedError, match="task adapters hold a row per token"):
        model.resize_token_embeddings(ARCH_VOCAB + 8)


def test_parametrized_weights_of_another_family_are_refused():
    with pytest.raises(NotImplementedError, match="parametrized weight"):
        config = fastbert.BertModel(dict(model_type="bert", vocab_size=ARCH_VOCAB, hidden_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, intermediate_size=40)).config
        loading.task_adapter_layout({"bert.pooler.dense.parametrizations.weight.original": torch.zeros(1)}, config)
