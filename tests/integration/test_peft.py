"""PEFT LoRA with fastbert, in both orders: get_peft_model then fastbert.optimize, and fastbert.optimize then
get_peft_model. The reference is stock transformers + PEFT with the same adapter weights: same forward, same LoRA
gradients, the same trainable parameters, an adapter that loads into the stock model, merge_and_unload, restore.
Underneath, query/key/value stay one fused GEMM with each adapter's x·A·B added to its output."""
import copy

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
from fastbert.units import qkv_projection

peft = pytest.importorskip("peft")

IDS = torch.tensor([[5, 8, 13, 21, 34, 2, 3], [9, 10, 11, 12, 0, 0, 0], [7, 6, 0, 0, 0, 0, 0]])
MASK = (IDS != 0).long()
REAL = MASK.bool()
LABELS = torch.tensor([0, 2, 1])
TARGETS = {"query+value": ["query", "value"], "all-linear": "all-linear"}


def hf_classifier(seed=0):
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=40, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    return perturb_(transformers.BertForSequenceClassification(cfg), weight_std=0.05).eval()


def lora_config(targets):
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="SEQ_CLS")


def randomize_adapters_(model, seed=1):
    """LoRA's B starts at zero (the adapter adds nothing): draw every adapter weight, from a seed, by name."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def stock_and_fastbert(order, targets):
    """(stock HF + PEFT, the same with fastbert inside built in `order`), adapters equal."""
    hf = hf_classifier()
    stock = randomize_adapters_(peft.get_peft_model(copy.deepcopy(hf), lora_config(targets)))
    if order == "peft-then-optimize":
        ours = fastbert.optimize(peft.get_peft_model(copy.deepcopy(hf), lora_config(targets)), kernels="torch")
    else:
        ours = peft.get_peft_model(fastbert.optimize(copy.deepcopy(hf), kernels="torch"), lora_config(targets))
    randomize_adapters_(ours)
    assert isinstance(ours.base_model.model.bert, fastbert.BertModel)
    return stock, ours


ORDERS = ["peft-then-optimize", "optimize-then-peft"]


def assert_forward_and_lora_grads_match(stock, ours):
    """The logits (eval, no grad) and, after one training step's backward, every trainable parameter's gradient
    equal stock PEFT's (fp32, 1e-5). Returns stock's logits."""
    with torch.no_grad():
        want = stock(IDS, attention_mask=MASK).logits
        assert (ours(IDS, attention_mask=MASK).logits - want).abs().max() <= 1e-5
    for m in (stock, ours):
        m.train()(IDS, attention_mask=MASK, labels=LABELS).loss.backward()
    mine = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    theirs = {n: p for n, p in stock.named_parameters() if p.requires_grad}
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert mine[name].grad is not None and (mine[name].grad - theirs[name].grad).abs().max() <= 1e-5, name
    return want


@pytest.mark.parametrize("targets", TARGETS)
@pytest.mark.parametrize("order", ORDERS)
def test_forward_gradients_and_trainable_parameters_equal_stock_peft(order, targets):
    stock, ours = stock_and_fastbert(order, TARGETS[targets])
    trainable = lambda m: {n: p for n, p in m.named_parameters() if p.requires_grad}  # noqa: E731
    assert trainable(ours).keys() == trainable(stock).keys()
    assert all("lora_" in n or "classifier" in n for n in trainable(ours))  # the adapter (and the new head)
    with torch.no_grad():
        want = stock(IDS, attention_mask=MASK).logits
        assert (ours(IDS, attention_mask=MASK).logits - want).abs().max() <= 1e-5
        with stock.disable_adapter():
            assert (stock(IDS, attention_mask=MASK).logits - want).abs().max() > 1e-3  # the adapters do something
    for m in (stock, ours):
        m.train()(IDS, attention_mask=MASK, labels=LABELS).loss.backward()
    mine, theirs = trainable(ours), trainable(stock)
    for name in theirs:
        assert mine[name].grad is not None and (mine[name].grad - theirs[name].grad).abs().max() <= 1e-5, name
    frozen = [n for n, p in ours.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, frozen


@pytest.mark.parametrize("order", ORDERS)
def test_the_base_projection_stays_one_fused_gemm(order, monkeypatch):
    """The QKV projection runs once per layer over the fused base weight; query/key/value's base layers are never
    called as three GEMMs; the adapters' low-rank paths run."""
    _, ours = stock_and_fastbert(order, TARGETS["query+value"])
    projections, base_calls, lora_calls = [], [], []
    real = qkv_projection.twin
    monkeypatch.setattr(qkv_projection, "twin",
                        lambda x, w, b, nh: projections.append(tuple(w.shape)) or real(x, w, b, nh))
    encoder = ours.base_model.model.bert
    for layer in encoder.encoder.layer:
        for name in ("query", "key", "value"):
            wrapped = getattr(layer.attention.self, name)
            fastbert.adapters.base_layer(wrapped).register_forward_hook(lambda *a: base_calls.append(1))
            if hasattr(wrapped, "lora_A"):
                wrapped.lora_A["default"].register_forward_hook(lambda *a: lora_calls.append(1))
    encoder._plans.clear()  # resolved again: the patched twin is looked up when the plan is made
    with torch.no_grad():
        ours(IDS, attention_mask=MASK)
    assert projections == [(96, 32)] * 2 and base_calls == [] and len(lora_calls) == 4


@pytest.mark.parametrize("order", ORDERS)
def test_adapter_saved_from_fastbert_loads_into_stock_peft(order, tmp_path):
    stock, ours = stock_and_fastbert(order, TARGETS["query+value"])
    ours.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(hf_classifier(), tmp_path).eval()
    with torch.no_grad():
        want, got = stock(IDS, attention_mask=MASK).logits, loaded(IDS, attention_mask=MASK).logits
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("targets", TARGETS)
@pytest.mark.parametrize("order", ORDERS)
def test_merge_and_unload_and_restore(order, targets):
    stock, ours = stock_and_fastbert(order, TARGETS[targets])
    with torch.no_grad():
        want = stock(IDS, attention_mask=MASK).logits
        restored = fastbert.restore(copy.deepcopy(ours))  # a stock PEFT model again
        encoder = restored.base_model.model.bert
        assert type(encoder) is transformers.BertModel
        assert isinstance(encoder.encoder.layer[0].attention.self.query, peft.tuners.lora.LoraLayer)
        assert (restored(IDS, attention_mask=MASK).logits - want).abs().max() <= 1e-5
        merged = ours.merge_and_unload()  # fastbert still inside, the adapters in its weights
        assert isinstance(merged.bert, fastbert.BertModel)
        assert type(merged.bert.encoder.layer[0].attention.self.query) is torch.nn.Linear
        got = merged(IDS, attention_mask=MASK).logits
    assert (got - want).abs().max() <= 1e-5
    assert fused_rows_alias_parts(merged.bert)  # the merged weights are in the fused QKV the forward reads


@pytest.mark.parametrize("order", ORDERS)
def test_sentence_transformer_with_lora(order, minilm_path):
    from sentence_transformers import SentenceTransformer
    texts = ["A man is eating food.", "The cat sits on the mat, quietly.", "Short."]
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"])
    stock = SentenceTransformer(minilm_path, device="cpu")
    peft.inject_adapter_in_model(config, stock[0].auto_model)
    randomize_adapters_(stock)
    ours = SentenceTransformer(minilm_path, device="cpu")
    if order == "peft-then-optimize":
        peft.inject_adapter_in_model(config, ours[0].auto_model)
        fastbert.optimize(ours, kernels="torch")
    else:
        fastbert.optimize(ours, kernels="torch")
        peft.inject_adapter_in_model(config, ours[0].auto_model)
    randomize_adapters_(ours)
    assert isinstance(ours[0].auto_model, fastbert.BertModel)
    want, got = stock.encode(texts, convert_to_tensor=True), ours.encode(texts, convert_to_tensor=True)
    assert (got - want).abs().max() <= 1e-5
    plain = SentenceTransformer(minilm_path, device="cpu").encode(texts, convert_to_tensor=True)
    assert (want - plain).abs().max() > 1e-3


# DistilBERT, MPNet and ModernBERT (PEFT has no default targets for them): their own names, the same checks
NEW_FAMILIES = {
    "distilbert": lambda: transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        vocab_size=50, dim=32, n_layers=2, n_heads=2, hidden_dim=40, max_position_embeddings=16, num_labels=3,
        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)),
    "mpnet": lambda: transformers.MPNetForSequenceClassification(transformers.MPNetConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}
# DeBERTa-v3's shape: with share_att_key, query_proj's adapter reaches the position-to-content term too (HF projects
# rel_embeddings through the adapted module)
NEW_FAMILIES["deberta-v2"] = lambda: transformers.DebertaV2ForSequenceClassification(deberta_config(
    hidden=32, heads=2, layers=2, intermediate=40, max_len=16, vocab_size=50, num_labels=3))
if has_modernbert():  # its fused Wqkv and its gated MLP's Wi: the adapted paths of the pre-norm layer
    NEW_FAMILIES["modernbert"] = lambda: transformers.ModernBertForSequenceClassification(modernbert_config(
        hidden=32, heads=2, layers=2, intermediate=40, max_len=16, vocab_size=50, num_labels=3))

if has_rotary_post_norm():  # rotary q/k; NomicBERT's and GTE's gate/up over one fused weight: the adapted paths
    for _family, _cls in (("jina_embeddings_v3", "JinaEmbeddingsV3"), ("nomic_bert", "NomicBert"), ("gte", "Gte")):
        NEW_FAMILIES[_family] = (lambda family, cls: lambda: getattr(transformers, cls + "ForSequenceClassification")(
            rotary_post_norm_config(family, hidden=32, heads=2, layers=2, intermediate=40, max_len=16, vocab_size=50,
                                    num_labels=3)))(_family, _cls)
    # grouped-query attention (q_proj adapted beside narrower k/v) and the SwiGLU's up projection
    NEW_FAMILIES["eurobert"] = lambda: transformers.EuroBertForSequenceClassification(eurobert_config(
        hidden=32, heads=2, layers=2, intermediate=40, max_len=16, vocab_size=50, num_labels=3, gqa=True))
TARGETS_OF = {"distilbert": ["q_lin", "v_lin"], "mpnet": ["q", "v"], "modernbert": ["Wqkv", "Wi"],
              "deberta-v2": ["query_proj", "value_proj"], "jina_embeddings_v3": ["q_proj", "v_proj"],
              "nomic_bert": ["k_proj", "gate_proj"], "gte": ["v_proj", "up_proj"], "eurobert": ["q_proj", "up_proj"]}


@pytest.mark.parametrize("family", NEW_FAMILIES)
@pytest.mark.parametrize("order", ORDERS)
def test_query_value_of_other_families_equal_stock_peft(family, order):
    torch.manual_seed(0)
    hf = perturb_(NEW_FAMILIES[family](), weight_std=0.05).eval()
    targets = TARGETS_OF[family]
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="SEQ_CLS")
    stock = randomize_adapters_(peft.get_peft_model(copy.deepcopy(hf), config))
    if order == "peft-then-optimize":
        ours = fastbert.optimize(peft.get_peft_model(copy.deepcopy(hf), config), kernels="torch")
    else:
        ours = peft.get_peft_model(fastbert.optimize(copy.deepcopy(hf), kernels="torch"), config)
    randomize_adapters_(ours)
    encoder = ours.base_model.model.base_model
    assert isinstance(encoder, fastbert.BertModel)
    adapted = [n for n, m in encoder.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 4, adapted  # two targets in each of the two layers
    want = assert_forward_and_lora_grads_match(stock, ours)
    ours.eval()
    with torch.no_grad():
        restored = fastbert.restore(copy.deepcopy(ours))
        assert type(restored.base_model.model.base_model).__module__.startswith("transformers.")
        assert (restored(IDS, attention_mask=MASK).logits - want).abs().max() <= 1e-5
        merged = ours.merge_and_unload()
        assert isinstance(merged.base_model, fastbert.BertModel)
        assert (merged(IDS, attention_mask=MASK).logits - want).abs().max() <= 1e-5
    assert fused_rows_alias_parts(merged.base_model)


@pytest.mark.parametrize("v2style", [False, True], ids=["v3", "v2style"])
@pytest.mark.parametrize("targets", [["key_proj"], "all-linear"], ids=["key_proj", "all-linear"])
def test_deberta_adapters_reach_the_position_terms_as_in_stock_peft(targets, v2style):
    """DeBERTa's c2p term projects rel_embeddings through key_proj (v3: share_att_key) or pos_key_proj (v2style), and
    all-linear adapts those too: fastbert's forward and LoRA gradients equal stock PEFT's, and merging keeps them."""
    torch.manual_seed(0)
    hf = perturb_(transformers.DebertaV2ForSequenceClassification(deberta_config(
        hidden=32, heads=2, layers=2, intermediate=40, max_len=16, vocab_size=50, num_labels=3, v2style=v2style)),
        weight_std=0.05).eval()
    stock = randomize_adapters_(peft.get_peft_model(copy.deepcopy(hf), lora_config(targets)))
    ours = randomize_adapters_(fastbert.optimize(peft.get_peft_model(copy.deepcopy(hf), lora_config(targets)),
                                                 kernels="torch"))
    adapted = [n for n, m in ours.base_model.model.deberta.named_modules() if hasattr(m, "lora_A")]
    assert any("key_proj" in n for n in adapted) and (not v2style or targets == ["key_proj"]
                                                      or any("pos_key_proj" in n for n in adapted)), adapted
    want = assert_forward_and_lora_grads_match(stock, ours)
    with torch.no_grad():
        merged = ours.eval().merge_and_unload()
        assert (merged(IDS, attention_mask=MASK).logits - want).abs().max() <= 1e-5


@pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no Jina-Embeddings-v3 (5.24+)")
@pytest.mark.parametrize("order", ORDERS)
def test_jina_task_adapters_switched_per_call(order):
    """Jina-Embeddings-v3's use: one LoRA adapter per task on q/k/v/o and the MLP, the task chosen per call
    (set_adapter). Each task's forward equals stock PEFT's with the same adapters; the base projection stays one
    fused GEMM with the active adapter's x·A·B added."""
    torch.manual_seed(0)
    hf = perturb_(transformers.JinaEmbeddingsV3Model(rotary_post_norm_config(
        "jina_embeddings_v3", hidden=32, heads=2, layers=2, intermediate=40, max_len=16, vocab_size=50)),
        weight_std=0.05).eval()
    tasks = ("retrieval_query", "classification")  # (PEFT adapter names cannot hold a dot)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"])

    def with_tasks(model):
        model = peft.get_peft_model(model, config, adapter_name=tasks[0])
        model.add_adapter(tasks[1], config)
        for seed, task in enumerate(tasks, start=1):  # each task's weights from its own seed, by name
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in sorted(model.named_parameters()):
                    if f".{task}." in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        return model.eval()

    stock = with_tasks(copy.deepcopy(hf))
    if order == "peft-then-optimize":
        ours = fastbert.optimize(with_tasks(copy.deepcopy(hf)), kernels="torch")
    else:
        ours = with_tasks(fastbert.optimize(copy.deepcopy(hf), kernels="torch"))
    assert isinstance(ours.base_model.model, fastbert.BertModel)
    assert fused_rows_alias_parts(ours.base_model.model)  # q/k/v: rows of one fused weight under the adapters
    outputs = []
    with torch.no_grad():
        for task in (*tasks, tasks[0]):
            stock.set_adapter(task)
            ours.set_adapter(task)
            want = stock(input_ids=IDS, attention_mask=MASK).last_hidden_state
            got = ours(input_ids=IDS, attention_mask=MASK).last_hidden_state
            assert (got - want)[REAL].abs().max() <= 1e-5, task
            outputs.append(want)
    assert (outputs[0] - outputs[1])[REAL].abs().max() > 1e-3  # the tasks' adapters differ, and each was applied
