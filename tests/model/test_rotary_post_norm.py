"""Jina-Embeddings-v3, NomicBERT and GTE against transformers' own classes (sdpa and eager), random weights, fp32, the
PyTorch path: each real checkpoint's shape (nomic-embed-text-v1.5, gte-base-en-v1.5, jina-embeddings-v3), rows of 1
to 1,030 tokens (past one key block, and past a scaled rope type's original length), right- and left-padded rows and a
fully padded one, packed input, every scaled rope type the configs can name, and the refusals. q and k are scaled up
so that attention is sharp and a wrong angle cannot hide under the bar. Bar: 1e-5 on real tokens."""
import pytest
import torch
import transformers
from helpers import (
    ROPE_SCALINGS,
    error_on_real_tokens,
    has_rotary_post_norm,
    perturb_,
    ragged_rows,
    rotary_post_norm_config,
    sharpen_qk_,
)

import fastbert

pytestmark = pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no NomicBERT (5.24+)")

FAMILIES = ("jina_embeddings_v3", "nomic_bert", "gte")
CLASSES = {"jina_embeddings_v3": "JinaEmbeddingsV3Model", "nomic_bert": "NomicBertModel", "gte": "GteModel"}
LENGTHS = [1, 63, 64, 65, 129, 1030]

# The published checkpoints' shapes (vocabularies cut to 99 ids: the table's size changes nothing in the layers)
# The published checkpoints' widths, heads, MLP sizes and rope thetas; two of their layers (every layer runs the same
# code: the depth adds run time, not a path)
REAL_SHAPES = {
    "nomic-embed-text-v1.5": ("nomic_bert", dict(hidden=768, heads=12, layers=2, intermediate=3072,
                                                 rope={"rope_type": "default", "rope_theta": 1000.0})),
    "gte-base-en-v1.5": ("gte", dict(hidden=768, heads=12, layers=2, intermediate=3072, type_vocab_size=0,
                                     rope={"rope_type": "default", "rope_theta": 160000.0})),
    "jina-embeddings-v3": ("jina_embeddings_v3", dict(hidden=1024, heads=16, layers=2, intermediate=4096,
                                                      rope={"rope_type": "default", "rope_theta": 20000.0})),
}


def hf_model(family, impl="sdpa", seed=0, qk_gain=4.0, rope=None, hidden=64, heads=4, layers=2, intermediate=96,
             **extra):
    config = rotary_post_norm_config(family, hidden=hidden, heads=heads, layers=layers, intermediate=intermediate,
                                     max_len=2048, attn_implementation=impl, **extra)
    if rope is not None:
        config.rope_parameters = rope
    torch.manual_seed(seed)
    model = perturb_(getattr(transformers, CLASSES[family])(config), weight_std=0.05).eval()
    return sharpen_qk_(model, qk_gain)


def ragged(lengths, seed=1, left=False):
    return ragged_rows(lengths, low=2, seed=seed, left=left)


error = error_on_real_tokens


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_long_and_short_rows(family, impl, left):
    """Rows shorter than, at and past one key block, right and left padded. HF's positions are column indices,
    fastbert's each token's index in its sequence: rotary scores depend on j - i only, which both share."""
    hf = hf_model(family, impl)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged(LENGTHS, left=left)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_hidden_states=True)
        got = fb(ids, attention_mask=mask, output_hidden_states=True)
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        assert error(g, w, mask) <= 1e-5
    assert error(got.last_hidden_state, want.last_hidden_state, mask) <= 1e-5
    assert got.last_hidden_state[~mask.bool()].abs().max() == 0  # padding-free: padded positions are 0


@pytest.mark.parametrize("name", REAL_SHAPES)
def test_real_checkpoint_shapes(name):
    family, shape = REAL_SHAPES[name]
    hf = hf_model(family, qk_gain=1.0, **shape)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([3, 70, 130])
    with torch.no_grad():
        assert error(fb(ids, attention_mask=mask).last_hidden_state,
                     hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_fully_padded_row_stays_finite_and_apart(family):
    """A row with no real token: zeros out, and the other rows are what they are alone."""
    hf = hf_model(family, "eager")
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([9, 4, 1])
    mask[2] = 0
    with torch.no_grad():
        got = fb(ids, attention_mask=mask).last_hidden_state
        want = hf(ids[:2], attention_mask=mask[:2]).last_hidden_state
    assert torch.isfinite(got).all() and got[2].abs().max() == 0
    assert error(got[:2], want, mask[:2]) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_input_is_each_sequence_alone(family):
    hf = hf_model(family)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([5, 70, 1, 33])
    lengths = mask.sum(1).tolist()
    packed = torch.cat([ids[b, :n] for b, n in enumerate(lengths)])
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    with torch.no_grad():
        out = fb(packed, cu_seqlens=cu).last_hidden_state
        for b, n in enumerate(lengths):
            alone = hf(ids[b:b + 1, :n]).last_hidden_state[0]
            assert (out[cu[b]:cu[b + 1]] - alone).abs().max() <= 1e-5, f"sequence {b}"


@pytest.mark.parametrize("scaling", ROPE_SCALINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_scaled_rope_types_past_their_original_length(family, scaling):
    """yarn (attention factor != 1), linear and llama3, with an original length of 64 that the long rows pass."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, **ROPE_SCALINGS[scaling]}
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = 64
    hf = hf_model(family, "eager", rope=rope)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([40, 64, 65, 300])
    with torch.no_grad():
        assert error(fb(ids, attention_mask=mask).last_hidden_state,
                     hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_batch_dependent_rope_types_are_refused(kind):
    """HF recomputes their frequencies from each batch's longest position: refused by name, before any weight."""
    rope = {"rope_type": kind, "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64}
    if kind == "longrope":
        rope.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    config = rotary_post_norm_config("gte", hidden=64, heads=4, layers=1, intermediate=32, max_len=256)
    config.rope_parameters = rope
    with pytest.raises(NotImplementedError, match=f"rope_type={kind!r}"):
        fastbert.BertModel(config)


def test_gte_inner_dropout_is_read_off_its_module():
    """GTE drops out act(gate) * up before down_proj (mlp.dropout) besides the two post-norm dropouts: each layer's
    five dropout probabilities are its modules' p, as transformers' forward reads them."""
    config = rotary_post_norm_config("gte", hidden=64, heads=4, layers=1, intermediate=32, max_len=64,
                                     hidden_dropout_prob=0.25, attention_probs_dropout_prob=0.125)
    fb = fastbert.BertModel(config).train()
    layer = fb.layers[0]
    assert layer.dropouts() == (0.125, 0.25, 0.25, 0.0, 0.25)
    layer.mlp.dropout.p = 0.5
    assert layer.dropouts()[4] == 0.5
    assert fb.eval().layers[0].dropouts() == (0.0,) * 5


def test_a_head_dim_apart_from_hidden_over_heads_is_refused():
    config = rotary_post_norm_config("nomic_bert", hidden=64, heads=4, layers=1, intermediate=32, max_len=64)
    config.head_dim = 32
    with pytest.raises(NotImplementedError, match="head_dim=32"):
        fastbert.BertModel(config)
