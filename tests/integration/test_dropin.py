"""fastbert.optimize / fastbert.restore in what people already run: transformers heads, Trainer, sentence-transformers
(SentenceTransformer and CrossEncoder, save and reload), pipelines; one copy of the weights throughout.

Outputs are compared on what depends on real tokens only: padding-free execution (the default) returns zeros at
padded positions, so a token-level head's logits there are its bias, where HF's are computed from padding.
"""
import copy

import pytest
import torch
import transformers
from helpers import hf_dtype, random_hf_bert

import fastbert
from fastbert.numerics import FP32_TOL, max_error

B, S, VOCAB = 3, 9, 99
IDS = torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
MASK = torch.ones(B, S, dtype=torch.long)
MASK[1, 6:] = 0
MASK[2, 3:] = 0
TYPES = (torch.arange(S) >= 4).long().expand(B, S).contiguous()


def bert_config(**overrides):
    return transformers.BertConfig(**{**dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=100, max_position_embeddings=32,
                                             type_vocab_size=2, num_labels=3), **overrides})


def perturbed(model, seed=0):
    """Random, non-trivial weights (LayerNorms and biases too), in eval mode."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "LayerNorm" in name else 0.02))
    return model.eval()


HEADS = {  # head class -> (the inputs it takes, its outputs that depend on real tokens only: (name, per-token?))
    "BertForSequenceClassification": ({}, [("logits", False)]),
    "BertForTokenClassification": ({}, [("logits", True)]),
    "BertForQuestionAnswering": ({}, [("start_logits", True), ("end_logits", True)]),
    "BertForMaskedLM": ({}, [("logits", True)]),
    "BertForNextSentencePrediction": ({}, [("logits", False)]),
    "BertForPreTraining": ({}, [("prediction_logits", True), ("seq_relationship_logits", False)]),
    "BertForMultipleChoice": ({"choices": 2}, [("logits", False)]),
}


def head_inputs(name):
    if HEADS[name][0].get("choices"):  # [B, choices, S]: the head flattens it to [B * choices, S]
        return dict(input_ids=IDS[:, None].expand(B, 2, S).contiguous(),
                    attention_mask=MASK[:, None].expand(B, 2, S).contiguous(),
                    token_type_ids=TYPES[:, None].expand(B, 2, S).contiguous())
    return dict(input_ids=IDS, attention_mask=MASK, token_type_ids=TYPES)


def real_part(name, field, value):
    per_token = dict(HEADS[name][1])[field]
    return value[MASK.bool()] if per_token else value


@pytest.mark.parametrize("name", list(HEADS))
def test_each_head_before_after_optimize_and_after_restore(name):
    config = bert_config(num_labels=2 if name == "BertForQuestionAnswering" else 3)  # QA: start and end
    model = perturbed(getattr(transformers, name)(config))
    hf_bert = model.bert
    with torch.no_grad():
        before = model(**head_inputs(name))
    assert fastbert.optimize(model, kernels="torch") is model
    assert isinstance(model.bert, fastbert.BertModel) and model.bert.config is model.config
    with torch.no_grad():
        during = model(**head_inputs(name))
    assert fastbert.restore(model) is model
    assert model.bert is hf_bert
    with torch.no_grad():
        after = model(**head_inputs(name))
    for field, _ in HEADS[name][1]:
        ref = real_part(name, field, before[field])
        assert (real_part(name, field, during[field]) - ref).abs().max() <= 1e-5, field
        assert torch.equal(real_part(name, field, after[field]), ref), field


def test_head_loss_and_kwargs_a_trainer_passes():
    model = perturbed(transformers.BertForSequenceClassification(bert_config()))
    labels = torch.tensor([0, 2, 1])
    inputs = head_inputs("BertForSequenceClassification")
    with torch.no_grad():
        ref = model(**inputs, labels=labels)
        fastbert.optimize(model, kernels="torch")
        out = model(**inputs, labels=labels)
        # transformers 5's heads pass Trainer's keywords down to the encoder (4.x heads take none)
        plain = model.bert(**inputs)
        passed = model.bert(**inputs, num_items_in_batch=torch.tensor(3), output_router_logits=False, return_dict=True)
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-6
    assert torch.equal(plain.pooler_output, passed.pooler_output)
    with pytest.raises(TypeError, match="unexpected keyword argument 'attention_masks'"):
        model.bert(IDS, attention_masks=MASK)


def test_unsupported_configs_and_models_are_refused_and_nothing_changes():
    decoder = transformers.BertLMHeadModel(bert_config(is_decoder=True))
    query = decoder.bert.encoder.layer[0].attention.self.query.weight
    ptr = query.data_ptr()
    with pytest.raises(NotImplementedError, match=r"module 'bert' \(BertModel\) config: is_decoder=True"):
        fastbert.optimize(decoder)
    assert type(decoder.bert) is transformers.BertModel and query.data_ptr() == ptr

    albert = transformers.AlbertForSequenceClassification(transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=40, max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"no supported encoder in AlbertForSequenceClassification.*module "
                                         r"'albert' \(AlbertModel, model_type='albert'\)"):
        fastbert.optimize(albert)
    with pytest.raises(ValueError, match="no supported encoder in Linear"):
        fastbert.optimize(torch.nn.Linear(2, 2))

    class Pair(torch.nn.Module):  # two encoders, the second with a config fastbert refuses: neither is swapped
        def __init__(self):
            super().__init__()
            self.a = transformers.BertModel(bert_config())
            self.b = transformers.BertModel(bert_config(hidden_act="mish"))

    pair = Pair()
    ptr = pair.a.encoder.layer[0].attention.self.query.weight.data_ptr()
    with pytest.raises(NotImplementedError, match=r"module 'b' \(BertModel\) config: hidden_act='mish'"):
        fastbert.optimize(pair)
    assert type(pair.a) is transformers.BertModel
    assert pair.a.encoder.layer[0].attention.self.query.weight.data_ptr() == ptr
    with pytest.raises(ValueError, match="holds no module that fastbert.optimize swapped in"):
        fastbert.restore(pair)


def test_bare_encoder_and_a_module_held_twice():
    hf = perturbed(random_hf_bert(hidden=64, heads=4, vocab=VOCAB, max_pos=32))
    with torch.no_grad():
        ref = hf(IDS, attention_mask=MASK).last_hidden_state
    fb = fastbert.optimize(hf, kernels="torch")  # a bare encoder: the fastbert module comes back
    assert isinstance(fb, fastbert.BertModel)
    with torch.no_grad():
        assert (fb(IDS, attention_mask=MASK).last_hidden_state - ref)[MASK.bool()].abs().max() <= 1e-5
    assert fastbert.restore(fb) is hf

    class Twice(torch.nn.Module):
        def __init__(self, enc):
            super().__init__()
            self.query_encoder = self.doc_encoder = enc

    twice = fastbert.optimize(Twice(hf), kernels="torch")
    assert twice.query_encoder is twice.doc_encoder and isinstance(twice.doc_encoder, fastbert.BertModel)
    fastbert.restore(twice)
    assert twice.query_encoder is twice.doc_encoder is hf


# ---- one copy of the weights ----------------------------------------------------------------------------------------
def train_steps(model, steps=5, lr=1e-2, seed=0, optimizer=torch.optim.AdamW):
    opt = optimizer(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        target = torch.randn(B, S, 64, generator=g)
        out = model(IDS, attention_mask=MASK)
        loss = ((out.last_hidden_state - target) ** 2 * MASK[..., None]).mean() + out.pooler_output.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def no_dropout_bert(seed=0):
    """Dropout off from construction (transformers 4.x's sdpa attention reads its probability once, at __init__)."""
    config = bert_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return perturbed(transformers.BertModel(config), seed=seed).train()


def test_training_a_from_hf_model_trains_the_hf_model(tmp_path):
    """5 AdamW steps on a from_hf model: the HF model it came from holds the trained weights (it once kept its old
    query/key/value, 0.285 away)."""
    hf = no_dropout_bert()
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    before = copy.deepcopy(hf.state_dict())
    train_steps(fb)
    hf.eval(), fb.eval()
    for name, value in hf.state_dict().items():
        assert torch.equal(value, fb.state_dict()[name]), name
    moved = max((hf.state_dict()[k] - before[k]).abs().max().item() for k in before if ".query." in k)
    assert moved > 1e-3
    with torch.no_grad():
        d = (hf(IDS, attention_mask=MASK).last_hidden_state - fb(IDS, attention_mask=MASK).last_hidden_state)
    assert d[MASK.bool()].abs().max() <= 1e-5
    trained = copy.deepcopy(fb.state_dict())
    assert fastbert.restore(fb) is hf  # query/key/value own their storage again: plain safetensors saves it
    from safetensors.torch import save_model
    save_model(hf, str(tmp_path / "hf.safetensors"))
    for name, value in hf.state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_optimize_train_restore_lands_in_hf_and_saves(tmp_path):
    """optimize, train, restore: the HF model holds what training changed, equal to training HF itself, and saves
    with plain safetensors (query/key/value own their storage again)."""
    reference = no_dropout_bert()
    model = copy.deepcopy(reference)
    initial = copy.deepcopy(reference.state_dict())
    # SGD: AdamW would turn the key bias's zero gradient (softmax ignores it) into lr-sized steps of rounding noise
    train_steps(reference, lr=0.5, optimizer=torch.optim.SGD)
    fb = fastbert.optimize(model, kernels="torch")
    train_steps(fb, lr=0.5, optimizer=torch.optim.SGD)
    model = fastbert.restore(fb)
    assert type(model) is transformers.BertModel
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert (p - q).abs().max() <= 1e-5, name
    moved = (model.encoder.layer[1].attention.self.value.weight
             - initial["encoder.layer.1.attention.self.value.weight"])
    assert moved.abs().max() > 1e-3
    ptrs = [p.data_ptr() for layer in model.encoder.layer
            for p in (layer.attention.self.query.weight, layer.attention.self.key.weight)]
    assert len(set(ptrs)) == len(ptrs)
    from safetensors.torch import load_file, save_model
    save_model(model, str(tmp_path / "plain.safetensors"))
    assert torch.equal(load_file(str(tmp_path / "plain.safetensors"))["encoder.layer.0.attention.self.query.weight"],
                       model.encoder.layer[0].attention.self.query.weight)


def test_moving_the_model_keeps_one_copy():
    hf = no_dropout_bert().eval()
    model = transformers.BertForSequenceClassification(hf.config)
    model.bert = hf
    fastbert.optimize(model, kernels="torch")
    model.to(torch.bfloat16)
    fused = model.bert.encoder.layer[0].attention.self.qkv_weight
    assert fused.dtype == torch.bfloat16
    assert hf.encoder.layer[0].attention.self.key.weight.data_ptr() == fused[64:].data_ptr()
    model.to(torch.float32)
    fastbert.restore(model)
    assert model.bert.encoder.layer[0].attention.self.key.weight.dtype == torch.float32
    with torch.no_grad():
        model(IDS, attention_mask=MASK)


# ---- where callers of a transformers model touch it ----------------------------------------------------------------
def test_the_surface_heads_and_trainers_touch(tmp_path):
    model = perturbed(transformers.BertForMaskedLM(bert_config()))
    fastbert.optimize(model, kernels="torch")
    fb = model.bert
    assert fb.device == torch.device("cpu") and fb.dtype == torch.float32 and model.device.type == "cpu"
    assert fb.config.model_type == "bert" and fb.config.return_dict
    assert model.get_input_embeddings() is fb.embeddings.word_embeddings
    decoder = model.get_output_embeddings()
    assert decoder.weight is fb.embeddings.word_embeddings.weight  # MLM decoder stays tied through the swap
    model.resize_token_embeddings(VOCAB + 13)
    assert fb.embeddings.word_embeddings.num_embeddings == VOCAB + 13 == model.config.vocab_size
    assert model.get_output_embeddings().weight is fb.embeddings.word_embeddings.weight
    ids = IDS.clone()
    ids[0, 1] = VOCAB + 5  # a new token
    with torch.no_grad():
        during = model(ids, attention_mask=MASK).logits
    fb.save_pretrained(tmp_path / "st", safe_serialization=True)
    fb.save_pretrained(tmp_path / "bin", safe_serialization=False)
    fastbert.restore(model)
    assert model.bert.embeddings.word_embeddings.num_embeddings == VOCAB + 13
    with torch.no_grad():
        after = model(ids, attention_mask=MASK).logits
    assert (after - during)[MASK.bool()].abs().max() <= 1e-5
    for folder in ("st", "bin"):
        back = transformers.BertModel.from_pretrained(tmp_path / folder).eval()
        with torch.no_grad():
            d = (back(ids, attention_mask=MASK).last_hidden_state
                 - model.bert(ids, attention_mask=MASK).last_hidden_state)
        assert d[MASK.bool()].abs().max() <= 1e-5


def test_gradient_checkpointing_through_the_head():
    config = bert_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    reference = perturbed(transformers.BertForSequenceClassification(config)).train()
    model = copy.deepcopy(reference)
    fastbert.optimize(model, kernels="torch")
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing and model.bert.is_gradient_checkpointing
    recomputed = []
    for layer in model.bert.encoder.layer:  # count the checkpointed calls: the layers really run through it
        layer._gradient_checkpointing_func = (lambda f, *a, _f=layer._gradient_checkpointing_func:
                                              recomputed.append(1) or _f(f, *a))
    labels = torch.tensor([0, 2, 1])
    for m in (reference, model):
        m(**head_inputs("BertForSequenceClassification"), labels=labels).loss.backward()
    ref_grad = torch.cat([reference.bert.encoder.layer[1].attention.self.query.weight.grad,
                          reference.bert.encoder.layer[1].attention.self.key.weight.grad,
                          reference.bert.encoder.layer[1].attention.self.value.weight.grad])
    fused = model.bert.encoder.layer[1].attention.self  # the gradients land on HF's query/key/value parameters
    grad = torch.cat([fused.query.weight.grad, fused.key.weight.grad, fused.value.weight.grad])
    assert len(recomputed) == 2 and (grad - ref_grad).abs().max() <= 1e-5
    fastbert.restore(model)
    assert model.is_gradient_checkpointing  # carried back to HF's modules
    assert torch.equal(model.bert.encoder.layer[1].attention.self.query.weight.grad, grad[:64])


def test_trainer_step_equal_loss_and_weights_land_in_hf(tmp_path, monkeypatch):
    for name in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_IPEX"):  # Trainer sets these: unset afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    config = bert_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    reference = perturbed(transformers.BertForSequenceClassification(config))
    model = copy.deepcopy(reference)
    data = [{"input_ids": IDS[i], "attention_mask": MASK[i], "token_type_ids": TYPES[i], "labels": torch.tensor(i)}
            for i in range(B)]

    def train(m, name):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=B,
                                              max_steps=1, learning_rate=1e-2, report_to=[], use_cpu=True,
                                              save_strategy="no", logging_steps=1, seed=0, optim="sgd")
        # SGD: AdamW's first step would turn the key bias's zero gradient (softmax ignores it) into steps of rounding
        # noise, different noise for any two implementations
        return transformers.Trainer(model=m, args=args, train_dataset=data).train().training_loss

    initial = model.bert.encoder.layer[0].attention.self.query.weight.detach().clone()
    ref_loss = train(reference, "hf")
    fastbert.optimize(model, kernels="torch")
    loss = train(model, "fastbert")
    assert abs(loss - ref_loss) <= 1e-5
    fastbert.restore(model)
    assert type(model.bert) is transformers.BertModel
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert (p - q).abs().max() <= 1e-5, name
    assert not torch.equal(model.bert.encoder.layer[0].attention.self.query.weight.detach(), initial)  # it trained


# ---- sentence-transformers and pipelines, on the bundled real model --------------------------------------------------
SENTENCES = ["A man is eating food.", "Two dogs are playing in the snow while children build a snowman.", "Hi"]


def test_sentence_transformer_optimize_save_reload_restore(minilm_path, tmp_path):
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(minilm_path, device="cpu")
    hf = st[0].auto_model
    ref = st.encode(SENTENCES, convert_to_tensor=True)
    assert fastbert.optimize(st, kernels="torch") is st
    assert isinstance(st[0].auto_model, fastbert.BertModel)
    assert (st.encode(SENTENCES, convert_to_tensor=True) - ref).abs().max() <= 1e-5
    st.save(str(tmp_path / "saved"))
    reloaded = SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    assert type(reloaded[0].auto_model) is transformers.BertModel
    assert (reloaded.encode(SENTENCES, convert_to_tensor=True) - ref).abs().max() <= 1e-5
    fastbert.restore(st)
    assert st[0].auto_model is hf
    assert torch.equal(st.encode(SENTENCES, convert_to_tensor=True), ref)
    st.save(str(tmp_path / "restored"))


def modules_of(cross_encoder):
    """The BertForSequenceClassification inside a CrossEncoder (sentence-transformers 6: in its first module;
    3.x: its .model, the CrossEncoder itself not being a torch module)."""
    if isinstance(cross_encoder, torch.nn.Module):
        return next(m for m in cross_encoder.modules() if hasattr(m, "bert"))
    return cross_encoder.model


def test_cross_encoder_optimize_save_reload(minilm_path, tmp_path):
    from sentence_transformers import CrossEncoder
    torch.manual_seed(0)
    ce = CrossEncoder(minilm_path, num_labels=1, device="cpu")  # a classifier head on MiniLM (randomly initialised)
    pairs = [(SENTENCES[0], SENTENCES[1]), (SENTENCES[2], SENTENCES[0]), (SENTENCES[1], SENTENCES[1])]
    ref = torch.as_tensor(ce.predict(pairs))
    fastbert.optimize(ce, kernels="torch")
    assert isinstance(modules_of(ce).bert, fastbert.BertModel)
    assert (torch.as_tensor(ce.predict(pairs)) - ref).abs().max() <= 1e-5
    ce.save(str(tmp_path / "ce"))
    reloaded = CrossEncoder(str(tmp_path / "ce"), device="cpu")
    assert (torch.as_tensor(reloaded.predict(pairs)) - ref).abs().max() <= 1e-5
    fastbert.restore(ce)
    assert type(modules_of(ce).bert) is transformers.BertModel
    assert (torch.as_tensor(ce.predict(pairs)) - ref).abs().max() <= 1e-6


def test_feature_extraction_pipeline(minilm_path):
    model = transformers.BertModel.from_pretrained(minilm_path, **hf_dtype(torch.float32)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    pipe = transformers.pipeline("feature-extraction", model=model, tokenizer=tokenizer, device="cpu")
    ref = [torch.tensor(pipe(s)) for s in SENTENCES]
    assert fastbert.optimize(pipe, kernels="torch") is pipe
    assert isinstance(pipe.model, fastbert.BertModel)
    for s, r in zip(SENTENCES, ref):
        assert (torch.tensor(pipe(s)) - r).abs().max() <= 1e-5
    fastbert.restore(pipe)
    assert pipe.model is model


@pytest.mark.parametrize("name", ["RobertaForSequenceClassification", "XLMRobertaForTokenClassification",
                                  "CamembertForMaskedLM", "ElectraForPreTraining", "ElectraForSequenceClassification"])
def test_heads_of_the_other_architectures(name):
    """The RoBERTa-family and ELECTRA heads: their encoder (roberta / electra) is swapped and put back; real-token
    outputs equal before, during and after."""
    from helpers import arch_inputs as inputs
    from helpers import random_arch_model as random_hf
    arch = {"Roberta": "roberta", "XLMRoberta": "xlm-roberta", "Camembert": "camembert", "Electra": "electra"}[
        name.split("For")[0]]
    config = random_hf(arch).config
    model = perturbed(getattr(transformers, name)(config))
    encoder = model.base_model
    ids, tt, mask = inputs(encoder, "right")
    field = "logits"
    with torch.no_grad():
        before = model(ids, attention_mask=mask, token_type_ids=tt)[field]
        fastbert.optimize(model, kernels="torch")
        assert isinstance(model.base_model, fastbert.BertModel)
        during = model(ids, attention_mask=mask, token_type_ids=tt)[field]
        assert fastbert.restore(model).base_model is encoder
        after = model(ids, attention_mask=mask, token_type_ids=tt)[field]
    per_token = before.dim() == 3 or "PreTraining" in name  # ElectraForPreTraining: one logit per token
    real = mask.bool()
    pick = (lambda t: t[real]) if per_token else (lambda t: t)
    assert (pick(during) - pick(before)).abs().max() <= 1e-5
    assert torch.equal(pick(after), pick(before))


# ---- the headline usage: optimize(model) with the default kernels ("auto"), then a forward ----------------------
# On CPU the tests run Triton's interpreter, so "auto" takes each kernel there and the optimized head runs all four
# Triton kernels; on a GPU it runs what "auto" measured. Either way the outputs equal stock HF's on real tokens.
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
