"""Module attributes read where transformers reads them. transformers' forward reads each nn.LayerNorm's eps and each
nn.Dropout's p off the module at call time (transformers' own tests set every norm's eps to 1.0:
testing_utils.set_model_for_less_flaky_test); so does fastbert, after optimize, after a first forward, and for its
own BertModel. The reference is the stock transformers model holding the same weights and the same attributes;
bar 1e-5 on real tokens (fp32, the PyTorch twins)."""
import copy

import pytest
import torch
import transformers
from helpers import arch_inputs, has_deberta_v2, has_modernbert, has_rotary_post_norm, random_arch_model, type_kwargs

import fastbert
from fastbert import families

NEEDS_MODERNBERT = pytest.mark.skipif(not has_modernbert(), reason="this transformers has no ModernBERT (4.48+)")
NEEDS_ROTARY = pytest.mark.skipif(not has_rotary_post_norm(),
                                  reason="this transformers has no NomicBERT, GTE, Jina-v3, EuroBERT (5.24+)")
NEEDS_DEBERTA = pytest.mark.skipif(not has_deberta_v2(), reason="fastbert follows transformers 4.48+'s DeBERTa-v2")
ARCHS = ("bert", "roberta", "xlm-roberta", "electra", "distilbert", "mpnet",
         pytest.param("modernbert", marks=NEEDS_MODERNBERT), pytest.param("modernbert-bias", marks=NEEDS_MODERNBERT),
         pytest.param("deberta-v2", marks=NEEDS_DEBERTA), pytest.param("deberta-v2-v2style", marks=NEEDS_DEBERTA),
         *(pytest.param(arch, marks=NEEDS_ROTARY) for arch in ("jina_embeddings_v3", "nomic_bert", "gte", "eurobert",
                                                                 "eurobert-gqa")))


def set_norm_eps(model, eps):
    """What transformers' set_model_for_less_flaky_test does to the norms of these families: a LayerNorm's eps, an
    RMSNorm's variance_epsilon (EuroBERT's, transformers' class or fastbert's of the same name)."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = eps
            count += 1
        elif type(module).__name__.endswith("RMSNorm"):
            module.variance_epsilon = eps
            count += 1
    assert count >= 3  # the embeddings' and every layer's (ModernBERT's layer 0 has one, plus its final norm)


def max_difference(model, reference, padding="right"):
    ids, tt, mask = arch_inputs(reference, padding)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, **type_kwargs(tt)).last_hidden_state
        want = reference(ids, attention_mask=mask, **type_kwargs(tt)).last_hidden_state
    return (got - want).abs()[mask.bool()].max().item()


def optimized_pair(arch):
    reference = random_arch_model(arch)
    return fastbert.optimize(copy.deepcopy(reference), kernels="torch"), reference


# ---- LayerNorm eps -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_layernorm_eps_set_after_optimize_is_read_as_hf_reads_it(arch):
    model, reference = optimized_pair(arch)
    before = max_difference(model, reference)  # and a first forward before the change
    for m in (model, reference):
        set_norm_eps(m, 1.0)
    assert max_difference(model, reference) <= 1e-5
    assert max_difference(model, reference, "left") <= 1e-5
    assert before <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_layernorm_eps_of_fastberts_own_model_is_read_at_every_forward(arch):
    reference = random_arch_model(arch)
    add_pooling_layer = getattr(reference, "pooler", None) is not None if families.of(reference.config).pooler \
        else None
    model = fastbert.BertModel(reference.config, add_pooling_layer=add_pooling_layer, kernels="torch")
    model.load_state_dict(reference.state_dict(), strict=True)
    model.eval()
    assert max_difference(model, reference) <= 1e-5
    for eps in (1.0, 0.25):
        for m in (model, reference):
            set_norm_eps(m, eps)
        assert max_difference(model, reference) <= 1e-5, eps


def test_each_layernorm_is_read_on_its_own():
    """One norm at a time (the embeddings', a layer's first and second): each moves HF's answer, and fastbert's."""
    model, reference = optimized_pair("bert")
    names = ["embeddings.LayerNorm", "encoder.layer.0.attention.output.LayerNorm", "encoder.layer.1.output.LayerNorm"]
    for name in names:
        for m in (model, reference):
            m.get_submodule(name).eps = 0.5
        assert max_difference(model, reference) <= 1e-5, name


# ---- dropout p in train mode ---------------------------------------------------------------------------------------
def layer_list(model):
    container = model.get_submodule(families.of(model.config).layers)
    return container if isinstance(container, torch.nn.ModuleList) else container.layer


def no_dropout(model):
    """Every dropout of the model at p = 0 (ModernBERT's attention probabilities: its attention modules'
    attention_dropout float), whatever the config says."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def set_layer_dropout(model, kind, p):
    """Dropout `kind` (fastbert.families.DROPOUT_KINDS) of every layer set to p at HF's module path; False where the
    family has none of that kind."""
    entry = families.of(model.config).dropouts.get(kind)
    if entry is None:
        return False
    path = entry[0]
    parent, _, name = path.rpartition(".")
    changed = False
    for layer in layer_list(model):
        holder = layer.get_submodule(parent)
        if isinstance(getattr(holder, name, None), float):
            setattr(holder, name, p)
        elif isinstance(getattr(holder, name, None), torch.nn.Dropout):
            getattr(holder, name).p = p
        else:
            continue  # ModernBERT's attn.out_drop is an nn.Identity when built with 0; DeBERTa's pos_dropout may lack
        changed = True
    return changed


@pytest.mark.parametrize("arch", ARCHS)
def test_train_mode_dropout_is_the_modules_p(arch):
    """Every dropout at 0 while the config says 0.1 (the families' defaults): train mode equals HF exactly. One kind at
    p = 1 (everything dropped: no randomness left to differ in): HF's answer moves, fastbert's with it."""
    model, reference = optimized_pair(arch)
    for m in (model, reference):
        no_dropout(m.train())
    assert max_difference(model, reference) <= 1e-5
    moved = 0
    for kind in families.DROPOUT_KINDS:
        for m in (model, reference):
            no_dropout(m)
        if not set_layer_dropout(reference, kind, 1.0):
            continue
        assert set_layer_dropout(model, kind, 1.0), kind
        assert max_difference(model, reference) <= 1e-5, kind
        moved += 1
    assert moved >= min(2, len(families.of(reference.config).dropouts))  # EuroBERT has one: the attention's


@pytest.mark.parametrize("arch", ARCHS)
def test_train_mode_attentions_are_the_dropped_probabilities(arch):
    """output_attentions in train mode: transformers returns its attention probabilities after dropout, the tensor
    its context multiplies; fastbert returns the same kind of tensor. The two draw different dropout masks, so each is
    checked on its own against HF's eval-mode probabilities: in layer 0 (whose input no dropout touched: every other
    dropout is 0) each entry is 0 or that probability / (1 - p); in every layer about half the probabilities that are
    not 0 in eval mode (masked keys, windows) are dropped."""
    reference = random_arch_model(arch)
    model = fastbert.optimize(copy.deepcopy(reference), kernels="torch", padding_free=False)
    ids, tt, mask = arch_inputs(reference, "right")
    kwargs = dict(attention_mask=mask, output_attentions=True, **type_kwargs(tt))
    with torch.no_grad():
        probs = reference(ids, **kwargs).attentions  # eval mode
    real = mask.bool()[:, None, :, None].expand_as(probs[0])  # real queries
    p = 0.5
    for m in (reference, model):
        no_dropout(m.train())
        assert set_layer_dropout(m, "attention", p)
        torch.manual_seed(0)
        with torch.no_grad():
            dropped = m(ids, **kwargs).attentions
        assert len(dropped) == len(probs)
        got, want = dropped[0][real], probs[0][real]
        kept = got != 0
        assert (got[kept] - want[kept] / (1 - p)).abs().max() <= 1e-5, type(m).__name__
        for i, (got, want) in enumerate(zip(dropped, probs)):
            live = real & (want > 0)
            share = (got[live] == 0).float().mean()
            assert 0.35 < share < 0.65, (type(m).__name__, i, share)


def test_dropout_p_set_after_a_first_train_forward_is_seen_by_the_next():
    model, reference = optimized_pair("bert")
    no_dropout(model.train())
    ids, tt, mask = arch_inputs(reference, "right")
    with torch.no_grad():
        first = model(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        again = model(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        assert torch.equal(first, again)  # no dropout anywhere: deterministic
        set_layer_dropout(model, "ffn", 0.5)
        torch.manual_seed(0)
        dropped = model(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        torch.manual_seed(1)
        other = model(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    real = mask.bool()
    assert (dropped - first).abs()[real].max() > 1e-2 and (dropped - other).abs()[real].max() > 1e-2
    set_layer_dropout(model, "ffn", 0.0)
    model.eval()  # and in eval mode none, whatever p says
    set_layer_dropout(model, "ffn", 0.5)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state, first)


def test_fastberts_own_model_holds_hfs_dropout_modules():
    """fastbert.BertModel built from a config has HF's dropout modules at HF's paths, with the config's p."""
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=40, hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.3)
    hf = transformers.BertModel(config)
    fb = fastbert.BertModel(config)
    theirs = {n: m.p for n, m in hf.named_modules() if isinstance(m, torch.nn.Dropout)}
    ours = {n: m.p for n, m in fb.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert ours == theirs and 0.3 in ours.values()


@NEEDS_MODERNBERT
def test_modernberts_attention_dropout_set_on_hfs_module_before_optimize_is_kept():
    """ModernBERT's dropout on the attention probabilities is a float of its attention module (not an nn.Dropout):
    what the user set on HF's module before optimize is what fastbert drops with."""
    reference = random_arch_model("modernbert")
    no_dropout(reference.train())
    set_layer_dropout(reference, "attention", 1.0)
    model = fastbert.optimize(copy.deepcopy(reference), kernels="torch")
    assert [layer.attn.attention_dropout for layer in model.layers] == [1.0] * len(model.layers)
    assert max_difference(model, reference) <= 1e-5
