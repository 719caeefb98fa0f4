"""DeBERTa-v2/v3 (model_type "deberta-v2") against transformers' DebertaV2Model (eager: HF has no other attention for
it), fp32, CPU, the PyTorch path. The disentangled attention: the one column per distance that both of HF's terms
gather (proved with HF's own functions), its saturation, then the model: v3's shape and its variants (separate
position projections, c2p or p2c only, v2's absolute positions and token types, an embedding projection, no
relative attention), ragged, left-padded, fully padded and packed rows, sequences past position_buckets and
max_relative_positions, padded execution, probabilities, a training step's gradients, and the refusals.
Bar: 1e-5 on real tokens."""
import copy

import pytest
import torch
import transformers
from helpers import assert_close_on, deberta_config, fused_rows_alias_parts, perturb_
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf_deberta

import fastbert
from fastbert import relative

VOCAB = 99
# (position_buckets, max_relative_positions): v3's, the small one the tests run, no buckets, an odd bucket count
POSITION_CONFIGS = [(256, 512), (8, 16), (-1, 16), (7, 20)]


def hf_model(seed=0, **fields):
    torch.manual_seed(seed)
    return perturb_(transformers.DebertaV2Model(deberta_config(**fields)), weight_std=0.05).eval()


def rows(kind, B=3, S=40, seed=1):
    """ids and a mask: ragged right padding, left padding, or a fully padded row; S = 40 reaches past 8 buckets and
    max_relative_positions 16."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    if kind == "right":
        mask[1, 23:] = 0
        mask[2, 5:] = 0
    elif kind == "left":
        mask[1, :17] = 0
        mask[2, :33] = 0
    elif kind == "fully_padded_row":
        mask[1, 30:] = 0
        mask[2] = 0
    return ids.masked_fill(mask == 0, 0), mask


# ---- the column: HF's two gathers read one index -----------------------------------------------------------------
@pytest.mark.parametrize("buckets, max_relative", POSITION_CONFIGS)
def test_c2p_and_p2c_gather_the_column_table_entry(buckets, max_relative):
    """HF's c2p index clamp(relative_pos + span) at (i, j) and its p2c index clamp(-r_pos + span) read at (j, i) (the
    transposed gather) are one and the same column, and it is the table's column[(j - i) + R - 1], for sequences
    shorter and longer than the table's reach: built here with HF's own build_relative_position and build_rpos."""
    config = deberta_config(position_buckets=buckets, max_relative_positions=max_relative, max_len=512)
    table = relative.deberta_column_table(config)
    reach = (table.shape[0] + 1) // 2
    span = relative.deberta_span(config)
    att = hf_deberta.DisentangledSelfAttention(config)
    assert att.pos_ebd_size == span
    for L in (1, 5, reach - 1, reach, reach + 37):
        layer = torch.empty(1, L, 1)
        rel = hf_deberta.build_relative_position(layer, layer, bucket_size=att.position_buckets,
                                                 max_position=att.max_relative_positions)[0]
        c2p = torch.clamp(rel + span, 0, 2 * span - 1)
        r_pos = hf_deberta.build_rpos(layer, layer, rel[None], att.max_relative_positions, att.position_buckets)
        p2c = torch.clamp(-r_pos[0] + span, 0, 2 * span - 1)
        assert torch.equal(c2p, p2c.t()), L  # HF gathers p2c at (j, i) and transposes
        i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        ours = table.long()[(j - i + reach - 1).clamp(0, 2 * reach - 2)]
        assert torch.equal(ours, c2p), L


@pytest.mark.parametrize("buckets, max_relative", POSITION_CONFIGS)
def test_column_table_saturates_at_its_reach(buckets, max_relative):
    """Past +-(R - 1) HF's column no longer changes, out to 40,000 tokens apart: the end entries serve every
    length. Computed with HF's make_log_bucket_position directly. Without buckets the reach is span + 1."""
    config = deberta_config(position_buckets=buckets, max_relative_positions=max_relative, max_len=512)
    table = relative.deberta_column_table(config)
    reach = (table.shape[0] + 1) // 2
    span = relative.deberta_span(config)
    distance = torch.arange(-40000, 40001)  # j - i
    rel = -distance
    if buckets > 0:
        rel = hf_deberta.make_log_bucket_position(rel, buckets, max_relative).long()
    want = torch.clamp(rel + span, 0, 2 * span - 1)
    got = table.long()[(distance + reach - 1).clamp(0, 2 * reach - 2)]
    assert torch.equal(got, want)
    assert want[distance <= -(reach - 1)].unique().numel() == 1 and want[distance >= reach - 1].unique().numel() == 1
    if buckets <= 0:
        assert reach == span + 1
    # the reach is the smallest that works: one less and a changing column would be cut off
    assert (want[distance == -(reach - 2)] != want[distance == -(reach - 1)]).any() or \
        (want[distance == reach - 2] != want[distance == reach - 1]).any()


# ---- the model against HF -----------------------------------------------------------------------------------------
VARIANTS = {
    "v3": {},
    "separate-position-projections": dict(share_att_key=False),
    "c2p-only": dict(pos_att_type=["c2p"]),
    "p2c-only": dict(pos_att_type="p2c", share_att_key=False),  # HF's string form too
    "v2style": dict(v2style=True),  # absolute positions, 2 token types, pos_*_proj, embedding_size 32 != 64
    "embedding-projection": dict(embedding_size=48),
    "no-buckets": dict(position_buckets=-1),
    "no-relative-attention": dict(relative_attention=False),  # HF's scale still counts pos_att_type
    # transformers' own DeBERTa-v2 model tests: plain attention over absolute positions and 16 token types (HF's
    # config turns "None" into ["none"], which names no term)
    "transformers-tests": dict(relative_attention=False, position_biased_input=True, pos_att_type="None",
                               type_vocab_size=16, share_att_key=False, norm_rel_ebd="none", heads=4,
                               intermediate=37),
    "relative-attention-without-terms": dict(pos_att_type="none"),  # rel_embeddings and their LayerNorm, unused
}


@pytest.fixture(scope="module", params=VARIANTS)
def hf(request):
    return hf_model(max_len=64, **VARIANTS[request.param])


def types_for(hf, ids):
    return {"token_type_ids": (ids % 2)} if hf.config.type_vocab_size else {}


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("kind", ["none", "right", "left", "fully_padded_row"])
def test_matches_hf(hf, kind, padding_free):
    """Every hidden state on real tokens; padding_free=False: HF's values at padded positions too (its embeddings
    are zero there and a padded query attends uniformly to all keys, mask_i * mask_j)."""
    fb = fastbert.BertModel.from_hf(hf, kernels="torch", padding_free=padding_free)
    ids, mask = rows(kind)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_hidden_states=True, **types_for(hf, ids))
        out = fb(ids, attention_mask=mask, output_hidden_states=True, **types_for(hf, ids))
    assert type(out).__name__ == "BaseModelOutput" and len(out.hidden_states) == len(ref.hidden_states) == 3
    for got, want in zip(out.hidden_states, ref.hidden_states, strict=True):
        assert_close_on(got, want, mask, padding_free=padding_free)
    assert out.hidden_states[-1] is out.last_hidden_state


def test_probabilities_are_hfs(hf):
    """output_attentions: HF's [B, nh, S, S] probabilities, padded queries' uniform rows included."""
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = rows("fully_padded_row")
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_attentions=True, **types_for(hf, ids))
        out = fb(ids, attention_mask=mask, output_attentions=True, **types_for(hf, ids))
    for got, want in zip(out.attentions, ref.attentions, strict=True):
        assert (got - want).abs().max() <= 1e-6
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask)


def test_packed_input_matches_each_sequence_alone(hf):
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = rows("right")
    lengths = mask.sum(1).tolist()
    packed = torch.cat([ids[b, :n] for b, n in enumerate(lengths)])
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    with torch.no_grad():
        out = fb(packed, cu_seqlens=cu, **types_for(hf, packed))
        for b, n in enumerate(lengths):
            ref = hf(ids[b:b + 1, :n], **types_for(hf, ids[b:b + 1, :n])).last_hidden_state[0]
            assert (out.last_hidden_state[cu[b]:cu[b + 1]] - ref).abs().max() <= 1e-5, b


def test_state_dict_is_hfs_with_one_copy_of_the_weights(hf):
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    assert list(fb.state_dict()) == list(hf.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fb.state_dict().values(), hf.state_dict().values()))
    assert fused_rows_alias_parts(fb)


def test_v3_base_shape_matches_hf():
    """deberta-v3-base's shape (12 layers of 768, 12 heads, 256 buckets, max_relative_positions 512, shared
    position keys, both terms, no absolute positions, no token types), one short ragged forward."""
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(
        vocab_size=1000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        max_position_embeddings=512, relative_attention=True, position_buckets=256, max_relative_positions=512,
        share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm",
        type_vocab_size=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = perturb_(transformers.DebertaV2Model(cfg), weight_std=0.02).eval()
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids = torch.randint(2, 1000, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask).last_hidden_state, fb(ids, attention_mask=mask).last_hidden_state
    assert_close_on(got, want, mask)


@pytest.mark.parametrize("variant", ["v3", "v2style"])
def test_training_step_gradients_are_hfs(variant):
    """Train mode (dropout 0), a loss on real tokens: every parameter's gradient is HF's (within 1e-5 of the largest),
    rel_embeddings and the position projections included."""
    hf = hf_model(max_len=64, **VARIANTS[variant]).train()
    fb = fastbert.BertModel.from_hf(copy.deepcopy(hf), kernels="torch").train()
    ids, mask = rows("right")
    weights = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(5))
    for m in (hf, fb):
        out = m(ids, attention_mask=mask, **types_for(hf, ids)).last_hidden_state
        (out * weights)[mask.bool()].sum().backward()
    theirs = dict(hf.named_parameters())
    for name, p in fb.named_parameters():
        want = theirs[name].grad
        if want is None:  # (the padding row of word_embeddings and the like)
            assert p.grad is None or not p.grad.any(), name
            continue
        # (fp32 sums over 120 tokens: gradients reach ~25, so the bar is relative to the largest)
        assert p.grad is not None and (p.grad - want).abs().max() <= 1e-5 * max(1.0, want.abs().max()), name


# pos_att_type as transformers takes it: None, a "|"-joined string in any case, a list; "none" names no term
POS_ATT_TYPES = {"null": None, "None": "None", "none": "none", "p2c|c2p": "p2c|c2p", "P2C|C2P": "P2C|C2P",
                 "list": ["p2c", "c2p"], "list-None": ["None"], "c2p|none": "c2p|none", "list-p2c": ["p2c"]}


@pytest.mark.parametrize("relative_attention", [True, False], ids=["relative", "no-relative"])
@pytest.mark.parametrize("pos_att_type", POS_ATT_TYPES)
def test_every_pos_att_type_transformers_runs_matches_hf(pos_att_type, relative_attention):
    """Each spelling builds the model HF builds (the same terms, position projections and scale) and gives HF's
    numbers on real tokens, with and without relative attention."""
    value = POS_ATT_TYPES[pos_att_type]
    hf = hf_model(max_len=64, pos_att_type=value, relative_attention=relative_attention, share_att_key=False)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    terms = {t for t in ("c2p", "p2c") if t in hf.encoder.layer[0].attention.self.pos_att_type}
    assert {t for t in ("c2p", "p2c") if getattr(fb.layers[0], t)} == (terms if relative_attention else set())
    assert list(fb.state_dict()) == list(hf.state_dict())
    ids, mask = rows("right")
    with torch.no_grad():
        assert_close_on(fb(ids, attention_mask=mask).last_hidden_state,
                        hf(ids, attention_mask=mask).last_hidden_state, mask)


def test_transformers_model_tests_config_matches_hf():
    """DebertaV2ModelTester's config as transformers' tests build it (dropout 0.1, in eval mode): fastbert runs it
    as HF does, plain attention at 1/sqrt(hd) over absolute positions, token types and all."""
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
        type_vocab_size=16, initializer_range=0.02, relative_attention=False, position_biased_input=True,
        pos_att_type="None")
    hf = perturb_(transformers.DebertaV2Model(config), weight_std=0.05).eval()
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    assert fb.layers[0].scale == pytest.approx(hf.encoder.layer[0].attention.self.attention_head_size ** -0.5)
    ids, mask = rows("left")
    types = torch.randint(0, 16, ids.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = fb(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
        ref = hf(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    for got, want in zip(out.hidden_states, ref.hidden_states, strict=True):
        assert_close_on(got, want, mask)


# ---- refusals -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("conv_kernel_size", 3, r"conv_kernel_size=3 is not supported: DeBERTa-v2's ConvLayer"),
    ("pos_att_type", ["c2p", "p2p"], r"pos_att_type=\['c2p', 'p2p'\] is not supported: .* no term for 'p2p'"),
    ("pos_att_type", ["C2P"], r"pos_att_type=\['C2P'\] is not supported"),  # HF matches list entries exactly
    ("pos_att_type", "c2p|p2p", r"pos_att_type='c2p\|p2p' is not supported"),
    ("norm_rel_ebd", "batch_norm", r"norm_rel_ebd='batch_norm' is not supported"),
    ("attention_head_size", 16, r"attention_head_size=16 is not supported"),
])
def test_unimplemented_fields_are_refused_by_name(field, value, words):
    config = deberta_config()
    setattr(config, field, value)
    with pytest.raises(NotImplementedError, match=words):
        fastbert.BertModel(config)


def test_pos_att_type_of_another_type_is_refused_by_name():
    config = deberta_config()
    object.__setattr__(config, "pos_att_type", 3)  # (transformers 5's config validates its fields; 4's does not)
    with pytest.raises(ValueError, match=r"field 'pos_att_type' must be a string .* got 3 \(int\)"):
        fastbert.BertModel(config)


def test_one_position_bucket_is_refused():
    with pytest.raises(ValueError, match="position_buckets=1 leaves no bucket"):
        fastbert.BertModel(deberta_config(position_buckets=1))


def test_custom_masks_are_refused():
    """HF's DebertaV2Model multiplies its embeddings by the mask: a 3-D/4-D mask cannot run there either."""
    fb = fastbert.BertModel.from_hf(hf_model(), kernels="torch")
    ids = torch.randint(2, VOCAB, (2, 5))
    with pytest.raises(NotImplementedError, match="3-D attention_mask is not supported for DeBERTa-v2"):
        fb(ids, attention_mask=torch.ones(2, 5, 5))


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("kind", ["right", "left", "fully_padded_row"])
@pytest.mark.parametrize("variant", ["v3", "transformers-tests"])
def test_attention_kernel_in_the_model_matches_hf(variant, kind, padding_free):
    """attention="triton": the disentangled kernel (Triton's interpreter here) inside the model gives HF's numbers on
    real tokens past the buckets and max_relative_positions, and with padding_free=False HF's values at padded
    positions too (a padded query's uniform row, mask_i * mask_j); transformers' test config runs the plain kernel."""
    hf = hf_model(max_len=64, **VARIANTS[variant])
    fb = fastbert.BertModel.from_hf(hf, kernels={**dict.fromkeys(fastbert.OPS, "torch"), "attention": "triton"},
                                    padding_free=padding_free)
    ids, mask = rows(kind)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, **types_for(hf, ids))
        out = fb(ids, attention_mask=mask, **types_for(hf, ids))
        run = fb.resolve_ops()
    assert "attention" in run.triton
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask, padding_free=padding_free)
