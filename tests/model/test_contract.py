"""transformers' model contract with fastbert inside: the checks of transformers' own model tests
(tests/test_modeling_common.py) that equal numbers do not cover, each written out here for a head whose encoder
fastbert.optimize swapped. Every family fastbert runs goes through the same checks (FAMILIES): a family that lands
later adds its entry and keeps the contract."""
import collections
import copy
import os
import tempfile
import warnings

import pytest
import torch
import transformers
from helpers import (
    deberta_config,
    eurobert_config,
    fused_rows_alias_parts,
    has_modernbert,
    has_rotary_post_norm,
    modernbert_config,
    perturb_,
    rotary_post_norm_config,
)

import fastbert
from fastbert.layers.base import RMSNorm

S = 7
IDS = torch.tensor([[5, 8, 13, 21, 34, 2, 3], [9, 10, 11, 12, 0, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
SMALL = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40,
             max_position_embeddings=16, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# model_type -> (its config class with the family's own fields, its masked-LM head)
FAMILIES = {
    "bert": (lambda: transformers.BertConfig(**SMALL), transformers.BertForMaskedLM),
    "roberta": (lambda: transformers.RobertaConfig(**{**SMALL, "max_position_embeddings": S + 3, "pad_token_id": 1}),
                transformers.RobertaForMaskedLM),
    "electra": (lambda: transformers.ElectraConfig(**SMALL, embedding_size=24), transformers.ElectraForMaskedLM),
    "distilbert": (lambda: transformers.DistilBertConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, hidden_dim=40,
                                                         max_position_embeddings=16, dropout=0.0,
                                                         attention_dropout=0.0),
                   transformers.DistilBertForMaskedLM),
    "mpnet": (lambda: transformers.MPNetConfig(**{k: v for k, v in SMALL.items() if k != "type_vocab_size"}),
              transformers.MPNetForMaskedLM),
    # v3's shape (buckets 8, max_relative 16), its legacy masked-LM head (cls.: HF's default)
    "deberta-v2": (lambda: deberta_config(hidden=32, heads=2, layers=2, intermediate=40, max_len=16, vocab_size=50),
                   transformers.DebertaV2ForMaskedLM),
}
if has_rotary_post_norm():  # transformers 5.24+: rotary post-norm (NomicBERT: SwiGLU, no biases); EuroBERT (grouped)
    FAMILIES["nomic_bert"] = (lambda: rotary_post_norm_config("nomic_bert", hidden=32, heads=2, layers=2,
                                                              intermediate=40, max_len=16, vocab_size=50),
                              transformers.NomicBertForMaskedLM)
    FAMILIES["jina_embeddings_v3"] = (lambda: rotary_post_norm_config("jina_embeddings_v3", hidden=32, heads=2,
                                                                      layers=2, intermediate=40, max_len=16,
                                                                      vocab_size=50),
                                      transformers.JinaEmbeddingsV3ForMaskedLM)
    FAMILIES["eurobert"] = (lambda: eurobert_config(hidden=32, heads=2, layers=2, intermediate=40, max_len=16,
                                                    vocab_size=50, gqa=True),
                            transformers.EuroBertForMaskedLM)
if has_modernbert():  # layer 0 full attention, layer 1 a window of +-2 keys
    FAMILIES["modernbert"] = (lambda: modernbert_config(hidden=32, heads=2, layers=2, intermediate=40, max_len=16,
                                                        vocab_size=50),
                              transformers.ModernBertForMaskedLM)


def hf_head(family, head=None, seed=0, **config):
    """A transformers head of `family` with random, non-trivial weights, in eval mode."""
    make_config, default_head = FAMILIES[family]
    cfg = make_config()
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    return perturb_((head or default_head)(cfg), weight_std=0.05).eval()


def with_fastbert(model, padding_free=True):
    """The same model, its encoder swapped for fastbert (the PyTorch twins: these are CPU checks)."""
    return fastbert.optimize(copy.deepcopy(model), kernels="torch", padding_free=padding_free)


# ---- construction on the meta device (transformers' test_all_tensors_are_parameter_or_buffer,
# ---- test_init_weights_can_init_buffers; init_empty_weights, big-model loading, FSDP's deferred init) -------------
@pytest.mark.parametrize("family", FAMILIES)
def test_meta_device_then_to_empty_init_and_loading(family):
    reference = hf_head(family)
    with torch.device("meta"):
        model = type(reference)(copy.deepcopy(reference.config)).eval()
    fastbert.optimize(model, kernels="torch")
    model.to_empty(device="cpu")
    model.init_weights()  # transformers' own initialisation reaches fastbert's modules
    with torch.no_grad():
        logits = model(IDS, attention_mask=MASK).logits
    assert logits.device.type == "cpu" and torch.isfinite(logits).all()
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "cpu"]
    # buffers as a model built on the CPU has them (test_init_weights_can_init_buffers)
    built = with_fastbert(type(reference)(copy.deepcopy(reference.config)))
    ours, theirs = dict(model.named_buffers()), dict(built.named_buffers())
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)

    model.load_state_dict(reference.state_dict(), strict=True)
    with torch.no_grad():
        got, want = model(IDS, attention_mask=MASK).logits, reference(IDS, attention_mask=MASK).logits
    real = MASK.bool()
    assert (got[real] - want[real]).abs().max() <= 1e-5
    assert fused_rows_alias_parts(model.base_model)  # one copy of the weights after to_empty + loading


@pytest.mark.parametrize("materialise", ["init_weights", "load_state_dict", "assign"])
@pytest.mark.parametrize("family", FAMILIES)
def test_restore_after_a_meta_device_build(family, materialise):
    """Built on meta, optimized, then given real tensors (to_empty + init_weights, to_empty + load_state_dict, or
    load_state_dict(assign=True) alone): restore gives back transformers' own modules, holding the same weights, and
    the buffers a model built on the CPU holds (position_ids, token_type_ids, ModernBERT's rotary inv_freq: they live
    in HF modules fastbert does not hold, so nothing else gave them values); its forward is the optimized one's."""
    reference = hf_head(family)
    with torch.device("meta"):
        model = type(reference)(copy.deepcopy(reference.config)).eval()
    fastbert.optimize(model, kernels="torch")
    if materialise == "assign":
        model.load_state_dict(reference.state_dict(), strict=True, assign=True)
    else:
        model.to_empty(device="cpu")
        model.init_weights() if materialise == "init_weights" else model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        optimized = model(IDS, attention_mask=MASK).logits
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    fastbert.restore(model)
    encoder = model.base_model
    assert type(encoder) is type(reference.base_model)
    assert not [n for n, m in model.named_modules() if type(m).__module__.startswith("fastbert")]
    restored = model.state_dict()
    assert sorted(restored) == sorted(weights) and all(torch.equal(restored[k], weights[k]) for k in weights)
    ours, theirs = dict(model.named_buffers()), dict(type(reference)(copy.deepcopy(reference.config)).named_buffers())
    assert sorted(ours) == sorted(theirs) and theirs
    assert all(ours[k].device.type == "cpu" and torch.equal(ours[k], theirs[k]) for k in ours)
    with torch.no_grad():
        back = model(IDS, attention_mask=MASK).logits
    real = MASK.bool()
    assert (back[real] - optimized[real]).abs().max() <= 1e-5
    if materialise != "init_weights":
        assert (back[real] - reference(IDS, attention_mask=MASK).logits[real]).abs().max() <= 1e-5


def test_from_pretrained_low_cpu_mem_usage_and_device_map_then_optimize(tmp_path):
    reference = hf_head("bert")
    reference.save_pretrained(tmp_path)
    for kwargs in ({"low_cpu_mem_usage": True}, {"device_map": "cpu"}):
        model = fastbert.optimize(transformers.BertForMaskedLM.from_pretrained(tmp_path, **kwargs), kernels="torch")
        with torch.no_grad():
            got, want = model(IDS, attention_mask=MASK).logits, reference(IDS, attention_mask=MASK).logits
        assert (got[MASK.bool()] - want[MASK.bool()]).abs().max() <= 1e-5, kwargs
        assert fused_rows_alias_parts(model.bert)


def test_meta_bare_encoder_to_empty_then_loading():
    """fastbert's own model built on meta (what from_pretrained does), to_empty, then HF's weights."""
    hf = hf_head("bert").bert
    with torch.device("meta"):
        fb = fastbert.BertModel(hf.config, add_pooling_layer=False, kernels="torch")  # a masked-LM head has none
    fb.to_empty(device="cpu").load_state_dict(hf.state_dict(), strict=True)
    with torch.no_grad():
        got, want = fb(IDS, attention_mask=MASK).last_hidden_state, hf(IDS, attention_mask=MASK).last_hidden_state
    assert (got[MASK.bool()] - want[MASK.bool()]).abs().max() <= 1e-5 and fused_rows_alias_parts(fb)


# ---- the autograd graph (test_retain_grad_hidden_states_attentions) ------------------------------------------------
@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attentions", [False, True], ids=["hidden", "hidden+attentions"])
def test_hidden_states_and_attentions_are_in_the_graph(family, padding_free, attentions):
    """hidden_states[i] is the tensor layer i consumes: gradients reach it, and they are HF's."""
    reference = hf_head(family, output_hidden_states=True, output_attentions=attentions)
    if attentions:
        reference.config._attn_implementation = "eager"  # transformers' own test does the same
    model = with_fastbert(reference, padding_free)
    weights = torch.randn(2, S, reference.config.vocab_size)
    grads = []
    for m in (reference, model):
        out = m(IDS, attention_mask=MASK)
        kept = [*out.hidden_states, *(out.attentions if attentions else ())]
        for t in kept:
            t.retain_grad()
        (out.logits * weights)[MASK.bool()].sum().backward()
        grads.append([t.grad for t in kept])
    assert all(g is not None for g in grads[1]), [i for i, g in enumerate(grads[1]) if g is None]
    real = MASK.bool()
    for i, (ours, theirs) in enumerate(zip(grads[1], grads[0])):
        if ours.dim() == 3:  # a hidden state [B, S, H]: HF's gradient on the real tokens
            assert (ours[real] - theirs[real]).abs().max() <= 1e-5, i
        else:  # attention probabilities [B, nh, S, S]: between real tokens
            pair = real[:, None, :, None] & real[:, None, None, :]
            assert (ours.masked_select(pair) - theirs.masked_select(pair)).abs().max() <= 1e-5, i


EMPTY_ROW = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_attentions_with_a_fully_padded_row_are_in_the_graph(family, padding_free):
    """A fully padded row attends uniformly to every key (HF eager's answer); the attentions returned are still the
    tensor the context was computed from, so a gradient retained on them arrives, in every layer, and is HF's
    (transformers' test_retain_grad_hidden_states_attentions draws masks with such rows)."""
    reference = hf_head(family, output_hidden_states=True, output_attentions=True)
    reference.config._attn_implementation = "eager"
    model = with_fastbert(reference, padding_free)
    weights = torch.randn(2, S, reference.config.vocab_size)
    grads = []
    for m in (reference, model):
        out = m(IDS, attention_mask=EMPTY_ROW)
        for t in out.attentions:
            t.retain_grad()
        (out.logits * weights)[EMPTY_ROW.bool()].sum().backward()
        grads.append([t.grad for t in out.attentions])
    assert all(g is not None for g in grads[1]), [i for i, g in enumerate(grads[1]) if g is None]
    for i, (ours, theirs) in enumerate(zip(grads[1], grads[0], strict=True)):
        assert (ours - theirs).abs().max() <= 1e-5, i  # (the padded row's: zeros, as HF's)


def test_last_hidden_state_is_the_last_hidden_states_entry():
    model = with_fastbert(hf_head("bert"))
    for padding_free in (True, False):
        model.bert.padding_free = padding_free
        out = model.bert(IDS, attention_mask=MASK, output_hidden_states=True)
        assert out.hidden_states[-1] is out.last_hidden_state


# ---- output_hidden_states as layer indices (test_can_capture_specific_layers_hidden_states) -----------------------
@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_output_hidden_states_selects_layers(family, padding_free):
    reference = hf_head(family)
    model = with_fastbert(reference, padding_free)
    with torch.no_grad():
        every = model(IDS, attention_mask=MASK, output_hidden_states=True).hidden_states
        n = len(every)
        for selection in ([*range(0, n, 2), -1], [1], 2, [-2, 99]):
            want = reference(IDS, attention_mask=MASK, output_hidden_states=selection).hidden_states
            got = model(IDS, attention_mask=MASK, output_hidden_states=selection).hidden_states
            # the layers HF keeps for that selection: in transformers 5 the selected ones; MPNet's and DeBERTa-v2's
            # forwards (and every transformers 4 model) read any selection as True
            kept = {i for i, h in enumerate(want) if h is not None}
            if family not in ("mpnet", "deberta-v2") and int(transformers.__version__.split(".")[0]) >= 5:
                indices = [selection] if isinstance(selection, int) else selection
                assert kept == {i % n for i in indices if -n <= i < n}, selection
            assert len(got) == n == len(want), selection
            for i in range(n):
                if i in kept:
                    assert torch.equal(got[i], every[i])
                    assert (got[i][MASK.bool()] - want[i][MASK.bool()]).abs().max() <= 1e-5
                else:
                    assert got[i] is None and want[i] is None, (selection, i)


def test_output_hidden_states_selection_on_packed_input():
    fb = fastbert.BertModel.from_hf(hf_head("bert").bert, kernels="torch")
    ids, cu = torch.tensor([5, 8, 13, 9, 10]), torch.tensor([0, 3, 5], dtype=torch.int32)
    with torch.no_grad():
        every = fb(ids, cu_seqlens=cu, output_hidden_states=True).hidden_states
        got = fb(ids, cu_seqlens=cu, output_hidden_states=[0, -1]).hidden_states
    assert [h is None for h in got] == [False, True, False] and torch.equal(got[0], every[0])
    with pytest.raises(TypeError, match="output_hidden_states must be a bool, an int or a list of ints"):
        fb(ids, cu_seqlens=cu, output_hidden_states=["1"])


# ---- the keyword contract (test_causal_lm_loss_honors_shift_labels) -----------------------------------------------
def test_keywords_heads_pass_down_are_accepted_and_ignored():
    reference = hf_head("bert")
    model = with_fastbert(reference)
    labels = IDS.masked_fill(MASK == 0, -100)  # padded positions (zeros under padding_free) take no part
    with torch.no_grad():
        want = reference(IDS, attention_mask=MASK, labels=labels).loss
        got = model(IDS, attention_mask=MASK, labels=labels, shift_labels=IDS, ignore_index=-100)
        plain = model.bert(IDS, attention_mask=MASK)
        passed = model.bert(IDS, attention_mask=MASK, shift_labels=IDS, ignore_index=-100, seq_idx=None,
                            output_router_logits=False, num_items_in_batch=torch.tensor(5), is_causal=False)
    assert abs(got.loss.item() - want.item()) <= 1e-5
    assert torch.equal(plain.last_hidden_state, passed.last_hidden_state)


def test_causal_lm_head_loss_follows_shift_labels():
    """transformers' differential check: with shift_labels given, the loss moves when shift_labels changes and stays
    when only labels changes."""
    model = with_fastbert(hf_head("bert", head=transformers.BertLMHeadModel))
    other = torch.roll(IDS, 1, dims=1)
    with torch.no_grad():
        base = model(IDS, attention_mask=MASK, labels=IDS, shift_labels=IDS).loss
        labels_changed = model(IDS, attention_mask=MASK, labels=other, shift_labels=IDS).loss
        shift_changed = model(IDS, attention_mask=MASK, labels=IDS, shift_labels=other).loss
    assert torch.equal(base, labels_changed) and not torch.equal(base, shift_changed)


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"past_key_values": object()}, NotImplementedError, "past_key_values is not supported"),
    ({"cache": object()}, NotImplementedError, "cache is not supported"),
    ({"is_causal": True}, NotImplementedError, "is_causal=True is not supported"),
    ({"attention_masks": MASK}, TypeError, "unexpected keyword argument 'attention_masks'"),
])
def test_keywords_that_would_change_the_answer_are_refused(kwargs, exc, words):
    model = with_fastbert(hf_head("bert"))
    with pytest.raises(exc, match=words):
        model.bert(IDS, attention_mask=MASK, **kwargs)


# ---- gradient checkpointing (test_gradient_checkpointing_enable_disable, test_training_gradient_checkpointing*) ----
# transformers' MPNet heads do not support gradient checkpointing (they refuse it): tested apart below
CHECKPOINTING_FAMILIES = [f for f in FAMILIES if f != "mpnet"]


@pytest.mark.parametrize("family", CHECKPOINTING_FAMILIES)
@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": False}, {"use_reentrant": True}])
def test_gradient_checkpointing_layers_as_transformers_finds_them(family, kwargs):
    from transformers.modeling_layers import GradientCheckpointingLayer
    model = with_fastbert(hf_head(family)).train()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers == list(model.base_model.layers)
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable(**({} if kwargs is None else {"gradient_checkpointing_kwargs" if enable.__name__.startswith("gradient")
                                         else "activation_checkpointing_kwargs": kwargs}))
    assert all(m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing"))
    # transformers' check: the first checkpointing layer runs its forward through _gradient_checkpointing_func
    layer, calls = layers[0], []
    func = layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = lambda forward, *args: calls.append(1) or func(forward, *args)
    for p in model.parameters():
        p.requires_grad_(True)
    model(IDS, attention_mask=MASK, labels=IDS).loss.backward()
    assert calls == [1]
    missing = [n for n, p in model.named_parameters() if p.grad is None and "pooler" not in n]
    assert not missing, missing
    model.gradient_checkpointing_disable()
    assert not any(m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing"))


def test_mpnet_heads_refuse_checkpointing_as_stock_and_the_encoder_checkpoints_alone():
    """An MPNet head refuses gradient checkpointing with fastbert inside as it does stock (its class says it does
    not support it); fastbert's MPNet encoder itself checkpoints, with the gradients it gives without."""
    reference = hf_head("mpnet")
    model = with_fastbert(reference)
    assert not type(reference).supports_gradient_checkpointing
    for m in (reference, model):
        with pytest.raises(ValueError, match="does not support"):
            m.gradient_checkpointing_enable()
    grads = []
    for checkpointing in (False, True):
        fb = fastbert.BertModel.from_hf(copy.deepcopy(reference.mpnet), kernels="torch").train()
        if checkpointing:
            fb.gradient_checkpointing_enable({"use_reentrant": False})
        fb(IDS, attention_mask=MASK).last_hidden_state[MASK.bool()].square().sum().backward()
        grads.append({n: p.grad for n, p in fb.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert grads[0][name] is not None and torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


# ---- the weights contract (test_tied_weights_keys, test_model_weights_reload_no_missing_tied_weights) --------------
def storage_groups(model) -> list:
    """state_dict names grouped by the storage they share, as transformers' tied-weights checks group them."""
    from transformers.pytorch_utils import id_tensor_storage
    groups = collections.defaultdict(list)
    for name, tensor in model.state_dict().items():
        groups[id_tensor_storage(tensor)].append(name)
    return [names for names in groups.values() if len(names) > 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_names_and_storages_are_hfs(family):
    reference = hf_head(family, tie_word_embeddings=True)
    model = with_fastbert(reference)
    # in HF's order too: an optimizer's state is saved and loaded by parameter position
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert {n for n, _ in model.named_modules()} >= {n for n, m in reference.named_modules()
                                                     if isinstance(m, torch.nn.Linear)}
    assert storage_groups(model) == storage_groups(reference)  # only what the head declares tied (its decoder)
    assert fused_rows_alias_parts(model.base_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_reload_reports_hfs_missing_keys(family):
    """save_pretrained, every weight on file removed, from_pretrained: the missing keys are the parameters' names."""
    from safetensors.torch import save_file
    model = with_fastbert(hf_head(family))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        save_file({"tensor": torch.tensor([1, 2])}, os.path.join(folder, "model.safetensors"),
                  metadata={"format": "pt"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reloaded, info = type(model).from_pretrained(folder, output_loading_info=True)
    fastbert.optimize(reloaded, kernels="torch")
    names = {n for n, _ in [*reloaded.named_parameters(), *reloaded.named_buffers()]}
    missing = set(info["missing_keys"])
    extra_missing = missing - names
    for group in storage_groups(reloaded):  # a tied group counts as present if one of its names is
        if set(group) - extra_missing:
            extra_missing -= set(group)
    assert extra_missing == set()
    assert names - missing == set()


def test_state_dict_round_trips_through_safetensors_and_in_place_writes_reach_the_model():
    """Three independent tensors to safetensors; and a write through state_dict() (an EMA's habit) is in the
    fused weight the forward reads."""
    from safetensors.torch import load_file, save_file
    reference = hf_head("bert")
    model = with_fastbert(reference)
    with tempfile.TemporaryDirectory() as folder:
        save_file(model.bert.state_dict(), os.path.join(folder, "w.safetensors"))  # (the head ties its decoder)
        loaded = load_file(os.path.join(folder, "w.safetensors"))
    buffers = {"embeddings.position_ids", "embeddings.token_type_ids"}
    assert loaded.keys() == reference.bert.state_dict().keys() - buffers
    assert all(torch.equal(loaded[k], reference.bert.state_dict()[k]) for k in loaded)
    with torch.no_grad():
        model.state_dict()["bert.encoder.layer.0.attention.self.key.weight"].mul_(0.5)
        reference.bert.encoder.layer[0].attention.self.key.weight.mul_(0.5)
        got, want = model(IDS, attention_mask=MASK).logits, reference(IDS, attention_mask=MASK).logits
    assert (got[MASK.bool()] - want[MASK.bool()]).abs().max() <= 1e-5


def test_a_part_given_new_storage_is_packed_again():
    """`.data =` on query's weight (PEFT's safe merge, user code) is seen: the fused weight is rebuilt."""
    reference = hf_head("bert")
    model = with_fastbert(reference)
    with torch.no_grad():
        for m in (reference, model):
            q = m.bert.encoder.layer[1].attention.self.query
            q.weight.data = q.weight.data * 2 + 0.01
        got, want = model(IDS, attention_mask=MASK).logits, reference(IDS, attention_mask=MASK).logits
    assert (got[MASK.bool()] - want[MASK.bool()]).abs().max() <= 1e-5 and fused_rows_alias_parts(model.bert)


def logits_of(*models, handles=()):
    """Each model's logits on IDS / MASK without autograd; the hook `handles` are removed afterwards, whatever
    happens."""
    try:
        with torch.no_grad():
            return tuple(m(IDS, attention_mask=MASK).logits for m in models)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("where", ["layer forward", "layer pre-forward", "global forward", "global pre-forward",
                                   "instance forward"])
def test_hooks_on_the_layers_run_as_on_any_module(where):
    """A hook on a layer (or a global one, or a layer's forward replaced on the instance) is honoured: the encoder
    calls its layers straight to their forward only where nothing is hooked, and through nn.Module otherwise. The
    hook doubles layer 0's output, so the logits say whether it ran."""
    reference = hf_head("bert")
    model, stock = with_fastbert(reference), copy.deepcopy(reference)
    seen = []

    def double(module, args, output):
        seen.append(module)
        return (output[0] * 2, *output[1:]) if isinstance(output, tuple) else output * 2

    def double_input(module, args):
        seen.append(module)
        return (args[0] * 2, *args[1:])

    layers = [m.bert.encoder.layer[0] for m in (model, stock)]
    register = {"layer forward": lambda m: m.register_forward_hook(double),
                "layer pre-forward": lambda m: m.register_forward_pre_hook(double_input)}
    handles = []
    if where in register:
        handles = [register[where](m) for m in layers]
    elif where == "instance forward":
        for m in layers:
            inner = m.forward
            m.forward = lambda *a, _inner=inner, _m=m, **k: double(_m, a, _inner(*a, **k))
    else:  # global: every module of both models sees it; only the layers' hooks touch the values
        hook = torch.nn.modules.module.register_module_forward_hook if where == "global forward" else \
            torch.nn.modules.module.register_module_forward_pre_hook
        handles = [hook(lambda m, *a: (double if len(a) == 2 else double_input)(m, *a) if m in layers else None)]
    got, want, plain = logits_of(model, stock, reference, handles=handles)
    real = MASK.bool()
    assert layers[0] in seen and layers[1] in seen
    assert (got[real] - want[real]).abs().max() <= 1e-5 and (got[real] - plain[real]).abs().max() > 1e-2


class _Changed(torch.nn.Module):
    """A module put where another was: its output times 2 plus 0.5 (a type fastbert's shortcuts do not know). Like
    PEFT's wrappers, it shows the inner module's attributes (the model reads the word table's size, device, dtype)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def forward(self, *args):
        return self.inner(*args) * 2 + 0.5


@pytest.mark.parametrize("how", ["forward hook", "global forward hook", "replaced"])
@pytest.mark.parametrize("where", ["embeddings.word_embeddings", "embeddings.token_type_embeddings",
                                   "embeddings.position_embeddings", "embeddings.LayerNorm", "embeddings.dropout",
                                   "pooler", "pooler.dense"])
def test_hooks_on_the_embeddings_and_pooler_run_as_on_any_module(where, how):
    """The embeddings' tables, LayerNorm and dropout and the pooler run as their ops on their parameters only where
    nothing could tell: a hook on one (its own or a global one), or another module in its place, is honoured as in
    stock transformers. Each changes that module's output (a hook doubles it), so the classifier's logits say whether
    it ran."""
    reference = hf_head("bert", head=transformers.BertForSequenceClassification)
    model, stock = with_fastbert(reference), copy.deepcopy(reference)
    targets = [m.bert.get_submodule(where) for m in (model, stock)]
    seen = []

    def double(module, args, output):
        if module in targets:
            seen.append(module)
            return output * 2

    handles = []
    if how == "forward hook":
        handles = [t.register_forward_hook(double) for t in targets]
    elif how == "global forward hook":
        handles = [torch.nn.modules.module.register_module_forward_hook(double)]
    else:
        parent, _, name = where.rpartition(".")
        for m, target in zip((model, stock), targets):
            m.bert.get_submodule(parent).add_module(name, _Changed(target)) if parent else \
                m.bert.add_module(name, _Changed(target))
    got, want, plain = logits_of(model, stock, reference, handles=handles)
    assert how == "replaced" or targets[0] in seen and targets[1] in seen
    assert (got - want).abs().max() <= 1e-5 and (got - plain).abs().max() > 1e-4  # (the module mattered)


LAYER_PATHS = [("bert", "attention.output.LayerNorm"), ("bert", "output.LayerNorm"), ("bert", "intermediate.dense")]
if has_modernbert():  # pre-norm: the norms before attention and before the MLP
    LAYER_PATHS += [("modernbert", "attn_norm"), ("modernbert", "mlp_norm")]


@pytest.mark.parametrize("family, where", LAYER_PATHS)
def test_another_module_at_a_layer_path_runs_as_that_module(family, where):
    """A module other than the plain nn.LayerNorm / nn.Linear at one of a layer's paths (a norm of another kind, a
    wrapper) is called as the module it is, as in stock transformers: the fused ops never read its parameters as if
    it were the plain one."""
    head = transformers.ModernBertForSequenceClassification if family == "modernbert" else \
        transformers.BertForSequenceClassification
    reference = hf_head(family, head=head)
    model, stock = with_fastbert(reference), copy.deepcopy(reference)
    for m in (model, stock):
        base = m.base_model
        layer = (base.layers if family == "modernbert" else base.encoder.layer)[1]
        parent, _, name = where.rpartition(".")
        container = layer.get_submodule(parent) if parent else layer
        container.add_module(name, _Changed(container.get_submodule(name)))
    got, want, plain = logits_of(model, stock, reference)
    assert (got - want).abs().max() <= 1e-5 and (got - plain).abs().max() > 1e-4  # (the module mattered)


# ---- no silent speed cliff: an eval-mode forward with autograd on, under "auto" on a GPU ---------------------------
def test_autograd_in_eval_warns_once_per_model_not_in_train_mode(monkeypatch):
    """On a GPU (here: the CPU standing in for one, the interpreter making Triton runnable) an eval-mode forward
    without no_grad that costs ops their kernel (the twin measured faster with its backward: forced here) is said
    once per model, naming those ops and torch.inference_mode(). Train mode and no_grad say nothing."""
    from fastbert import dispatch
    from fastbert.kernels import utils as kernel_utils
    monkeypatch.setattr(kernel_utils, "INTERPRET", True)
    monkeypatch.setattr(dispatch, "MEASURED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(dispatch, "_WARNED", set())
    monkeypatch.setattr(dispatch, "_measured", lambda op, situation, training=False: not training)
    hf = hf_head("bert").bert
    fb = fastbert.BertModel.from_hf(hf, kernels="auto")
    with pytest.warns(UserWarning, match=r"eval-mode forward runs with autograd enabled, so attention, bias_gelu, "
                                         r"qkv_projection, residual_layernorm run their PyTorch twin.*"
                                         r"torch\.inference_mode\(\)"):
        fb(IDS, attention_mask=MASK)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fb(IDS, attention_mask=MASK)  # said once for this model
        fb.train()(IDS, attention_mask=MASK)  # train mode: a training forward, nothing to say
        fastbert.BertModel.from_hf(hf, kernels="torch").eval()(IDS, attention_mask=MASK)  # no kernel asked for
    assert not [w for w in record if "eval-mode forward" in str(w.message)]
    other = fastbert.BertModel.from_hf(hf, kernels="auto")
    with pytest.warns(UserWarning, match="said once for this model"):
        other(IDS, attention_mask=MASK)  # another model: said again


def test_no_autograd_warning_where_the_kernels_serve_autograd(monkeypatch):
    """Where the training kernels serve every op (measured at least as fast forward + backward: forced here), an
    eval-mode forward under autograd loses nothing, and nothing is said."""
    from fastbert import dispatch
    from fastbert.kernels import utils as kernel_utils
    from fastbert.units import attention, residual_layernorm
    monkeypatch.setattr(kernel_utils, "INTERPRET", True)
    monkeypatch.setattr(dispatch, "MEASURED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(dispatch, "_WARNED", set())
    monkeypatch.setattr(dispatch, "_measured", lambda op, situation, training=False: True)
    for unit in (attention, residual_layernorm):  # whatever their training kernels serve yet (planned, not run)
        monkeypatch.setattr(unit, "reason", lambda situation, facts: None)
        monkeypatch.setattr(unit, "train_kernel", unit.kernel, raising=False)
    fb = fastbert.BertModel.from_hf(hf_head("bert").bert, kernels="auto")
    plan = fb.resolve_ops(needs_grad=True, tokens=IDS.numel(), max_seqlen=IDS.shape[1])
    assert plan.triton == frozenset(dispatch.OPS) and plan.grad
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fb.resolve_ops(needs_grad=False, tokens=IDS.numel(), max_seqlen=IDS.shape[1])
        fb._warn_autograd_in_eval(plan, None, (IDS.numel(), IDS.shape[1], False))
    assert not [w for w in record if "eval-mode forward" in str(w.message)]


def test_no_autograd_warning_off_the_gpu(monkeypatch):
    from fastbert import dispatch
    monkeypatch.setattr(dispatch, "_WARNED", set())
    fb = fastbert.BertModel.from_hf(hf_head("bert").bert, kernels="auto")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fb(IDS, attention_mask=MASK)
    assert not [w for w in record if "eval-mode forward" in str(w.message)]


# ---- the bare encoder's PreTrainedModel surface (transformers' test_model_is_small, test_correct_missing_keys,
# ---- test_model_get_set_embeddings, test_resize_tokens_embeddings, test_gradient_checkpointing_enable_disable) -----
def bare_pair(family):
    """(HF's bare encoder, fastbert's module over a copy of it)."""
    hf = hf_head(family).base_model
    return hf, fastbert.BertModel.from_hf(copy.deepcopy(hf), kernels="torch")


@pytest.mark.parametrize("family", FAMILIES)
def test_bare_encoder_answers_what_callers_ask_a_transformers_model(family):
    hf, fb = bare_pair(family)
    assert fb.base_model_prefix == hf.base_model_prefix
    assert fb.base_model is fb and hf.base_model is hf  # a bare encoder is its own base model
    assert fb.get_output_embeddings() is None is hf.get_output_embeddings()
    for m in (hf, fb):
        m.get_input_embeddings().weight.requires_grad_(False)
    for kwargs in ({}, {"only_trainable": True}, {"exclude_embeddings": True}):
        assert fb.num_parameters(**kwargs) == hf.num_parameters(**kwargs), kwargs
    assert fb.is_activation_checkpointing is False is hf.is_activation_checkpointing
    if type(hf).supports_gradient_checkpointing:  # (HF's MPNet refuses it; fastbert's checkpoints: tested above)
        for m in (hf, fb):
            m.gradient_checkpointing_enable()
        assert fb.is_activation_checkpointing is True is hf.is_activation_checkpointing
    n = hf.config.vocab_size + 10
    for m in (hf, fb):
        m.resize_token_embeddings(n)
    assert fb.vocab_size == hf.vocab_size == n


@pytest.mark.parametrize("family", FAMILIES)
def test_bare_encoder_enable_input_require_grads(family):
    """PEFT and gradient checkpointing over a frozen model: the embeddings' output requires grad, so gradients reach
    the adapters of the first layers; disable undoes it."""
    hf, fb = bare_pair(family)
    for m in (hf, fb):
        m.requires_grad_(False)
    for enabled in (True, False):
        for m in (hf, fb):
            (m.enable_input_require_grads if enabled else m.disable_input_require_grads)()
        want = hf(IDS, attention_mask=MASK).last_hidden_state.requires_grad
        assert fb(IDS, attention_mask=MASK).last_hidden_state.requires_grad is want is enabled


@pytest.mark.parametrize("family", FAMILIES)
def test_bare_encoder_on_meta_then_to_empty_and_init_weights(family):
    """transformers' test_all_tensors_are_parameter_or_buffer for fastbert's own module: built on meta, to_empty,
    init_weights() gives HF's initialisation (LayerNorm ones and zeros, zero biases, zero padding row) and a forward."""
    config = hf_head(family).config
    with torch.device("meta"):
        fb = fastbert.BertModel(config, kernels="torch")
    fb.to_empty(device="cpu")
    fb.init_weights()
    norms = {f"{name}.{kind}" for name, m in fb.named_modules() if isinstance(m, (torch.nn.LayerNorm, RMSNorm))
             for kind in ("weight", "bias")}  # (DistilBERT's are sa_layer_norm, output_layer_norm; EuroBERT's RMS)
    for name, p in fb.named_parameters():
        if name in norms:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert 0 < p.std() < 2 * config.initializer_range, name
    pad = fb.get_input_embeddings().padding_idx
    if pad is not None:
        assert not fb.get_input_embeddings().weight[pad].any()
    with torch.no_grad():
        assert torch.isfinite(fb(IDS, attention_mask=MASK).last_hidden_state).all()
    assert fused_rows_alias_parts(fb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_save_pretrained_writes_the_dtype_into_config_json_as_transformers_does(tmp_path, dtype):
    """transformers' from_pretrained(dtype="auto") reads config.json's dtype before it looks at the weights."""
    import json
    hf, fb = bare_pair("bert")
    hf.to(dtype).save_pretrained(tmp_path / "hf")
    fb.to(dtype).save_pretrained(tmp_path / "fb")
    written = [json.loads((tmp_path / side / "config.json").read_text()) for side in ("hf", "fb")]
    key = "dtype" if "dtype" in written[0] else "torch_dtype"  # (transformers 4 writes torch_dtype)
    assert written[1].get(key) == written[0][key] == str(dtype).split(".")[1]


def test_optimized_bare_encoder_forward_shows_its_parameters():
    """Trainer keeps the dataset columns named in inspect.signature(model.forward) and drops the rest; transformers'
    tests (test_inputs_embeds) look for inputs_embeds there. The module optimize returns shows BertModel's."""
    import inspect
    model = fastbert.optimize(hf_head("bert").bert, kernels="torch")
    names = list(inspect.signature(model.forward).parameters)
    assert names == list(inspect.signature(fastbert.BertModel(model.config).forward).parameters)
    assert {"input_ids", "attention_mask", "token_type_ids", "inputs_embeds"} <= set(names)


@pytest.mark.parametrize("kwargs, words", [
    # transformers' sentence, typo included: its test_resize_tokens_embeddings matches it
    ({"new_num_tokens": 60, "pad_to_multiple_of": 1.3}, r"multiple of `1\.3`, which is not and integer"),
    ({"new_num_tokens": 60, "pad_to_multiple_of": 0}, "pad_to_multiple_of must be a positive integer or None, got 0"),
    ({"new_num_tokens": 60.0}, r"new_num_tokens must be an integer or None, got 60\.0"),
])
def test_resize_token_embeddings_refuses_sizes_that_are_not_integers(kwargs, words):
    """Refused before anything changes; a non-integer multiple in transformers' own words."""
    _, fb = bare_pair("bert")
    with pytest.raises(ValueError, match=words):
        fb.resize_token_embeddings(**kwargs)
    assert fb.get_input_embeddings().num_embeddings == fb.config.vocab_size == 50  # unchanged


# ---- position embeddings (transformers' test_resize_position_vector_embeddings: DistilBERT's classes have it) -----
@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("change", [10, -5])
def test_distilbert_resize_position_embeddings_as_transformers_does(change, padding_free):
    """Called on the head, it reaches fastbert's encoder: config.max_position_embeddings follows, the kept rows are
    HF's, the outputs stay HF's, and the longest input allowed is the new table's length."""
    hf = hf_head("distilbert")
    fb = with_fastbert(hf, padding_free)
    n = hf.config.max_position_embeddings + change
    kept = hf.get_position_embeddings().weight[:n].clone()
    for m in (hf, fb):
        m.resize_position_embeddings(n)
        assert m.config.max_position_embeddings == n
        assert m.get_position_embeddings().num_embeddings == n
        assert torch.equal(m.get_position_embeddings().weight[:len(kept)], kept)
    assert fb.get_position_embeddings() is fb.distilbert.embeddings.position_embeddings
    with torch.no_grad():
        want = hf(IDS, attention_mask=MASK).logits
        got = fb(IDS, attention_mask=MASK).logits
        assert (got - want)[MASK.bool()].abs().max() <= 1e-5
        assert fb(torch.full((1, n), 5)).logits.shape == (1, n, hf.config.vocab_size)
        with pytest.raises(ValueError, match="exceeds"):
            fb(torch.full((1, n + 1), 5))


def test_distilbert_resize_sinusoidal_position_embeddings_recomputes_the_table():
    from transformers.models.distilbert.modeling_distilbert import _create_sinusoidal_embeddings
    config = FAMILIES["distilbert"][0]()
    config.sinusoidal_pos_embds = True
    fb = fastbert.BertModel(config, kernels="torch")
    fb.resize_position_embeddings(24)
    want = _create_sinusoidal_embeddings(24, config.dim, torch.empty(24, config.dim))
    assert torch.equal(fb.get_position_embeddings().weight, want)
    assert not fb.get_position_embeddings().weight.requires_grad  # a fixed table, as transformers keeps it


@pytest.mark.parametrize("family", ["bert", "mpnet"])
def test_position_embeddings_methods_are_refused_where_transformers_refuses_them(family):
    hf, fb = bare_pair(family)
    for method, args in (("get_position_embeddings", ()), ("resize_position_embeddings", (20,))):
        with pytest.raises(NotImplementedError):
            getattr(hf, method)(*args)
        with pytest.raises(NotImplementedError, match=method):
            getattr(fb, method)(*args)


@pytest.mark.parametrize("size", [0, 20.0, True])
def test_resize_position_embeddings_refuses_sizes_that_are_not_positive_integers(size):
    _, fb = bare_pair("distilbert")
    with pytest.raises(ValueError, match=f"new_num_position_embeddings must be a positive integer, got {size!r}"):
        fb.resize_position_embeddings(size)
    assert fb.get_position_embeddings().num_embeddings == fb.config.max_position_embeddings == 16


# ---- return_dict=False (transformers' test_model_outputs_equivalence) --------------------------------------------
def _entries(out, path=()):
    """A nested output tuple as (position, shape or None) pairs and its tensors, in order."""
    if isinstance(out, (tuple, list)):
        pairs, tensors = [], []
        for i, item in enumerate(out):
            p, t = _entries(item, (*path, i))
            pairs += p
            tensors += t
        return pairs, tensors
    return [(path, None if out is None else tuple(out.shape))], [] if out is None else [out]


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_return_dict_false_tuples_are_hfs(family, padding_free):
    """Heads build their tuple from the encoder's by position (MPNet's take outputs[2:], past a pooler slot that is
    None in a head's encoder), so the encoder's tuple and the head's hold HF's entries, None slots included."""
    hf = hf_head(family)
    hf.config._attn_implementation = "eager"  # (HF's sdpa returns no attentions)
    fb = with_fastbert(hf, padding_free)
    kwargs = dict(output_hidden_states=True, output_attentions=True, return_dict=False)
    with torch.no_grad():
        for run in (lambda m: m(IDS, labels=IDS, **kwargs), lambda m: m.base_model(IDS, **kwargs)):
            (want, want_tensors), (got, got_tensors) = _entries(run(hf)), _entries(run(fb))
            assert got == want
            for w, g in zip(want_tensors, got_tensors):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_loading_hints_read_as_transformers_declares_them(family):
    """transformers' tests read PreTrainedModel's loading hints off the bare encoder
    (test_model_weights_reload_no_missing_tied_weights, test_keep_in_fp32_modules*): fastbert's module carries them
    with the values a transformers model holds (empty: its __init__ turns the classes' None into a set)."""
    hf, fb = bare_pair(family)
    for name in ("_keys_to_ignore_on_load_missing", "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        assert getattr(fb, name) == set(getattr(hf, name, None) or ()), name
        assert len(getattr(fb, name)) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_no_tensor_parallel_plan_is_declared(family):
    """fastbert reads q/k/v as one fused tensor, which sharding each part's parameter would break: its encoder
    declares an empty tp_plan, even where transformers' config names one (EuroBERT), rather than one it cannot keep."""
    hf, fb = bare_pair(family)
    assert fb.tp_plan == {}
