"""Bad input gets a clear exception naming the argument and the value, never an IndexError, a device assert or NaN."""
import warnings

import pytest
import torch
import transformers
from helpers import arch_inputs, assert_close_on, host_reads, random_arch_model, random_hf_bert, type_kwargs

import fastbert


@pytest.fixture(scope="module")
def fb():
    return fastbert.BertModel.from_hf(random_hf_bert(hidden=32, heads=2, layers=1, intermediate=40, vocab=50,
                                                     max_pos=16, types=2), kernels="torch")


IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])


@pytest.mark.parametrize("kwargs, exc, words", [
    ({}, ValueError, "exactly one of input_ids and inputs_embeds (got neither)"),
    ({"input_ids": IDS, "inputs_embeds": torch.zeros(2, 4, 32)}, ValueError, "(got both)"),
    ({"input_ids": IDS.float()}, TypeError, "input_ids must be an integer tensor, got dtype torch.float32"),
    ({"input_ids": IDS[0]}, ValueError, "input_ids must be [batch, seq], got shape (4,)"),
    ({"input_ids": IDS - 2}, ValueError, "input_ids contains -1, outside [0, 50)"),
    ({"input_ids": IDS + 42}, ValueError, "input_ids contains 50, outside [0, 50)"),
    ({"input_ids": IDS, "token_type_ids": torch.full((2, 4), 2)}, ValueError,
     "token_type_ids contains 2, outside [0, 2)"),
    ({"input_ids": torch.ones(1, 17, dtype=torch.long)}, ValueError,
     "sequence length 17 exceeds max_position_embeddings=16"),
    ({"input_ids": IDS, "position_ids": torch.tensor([[0, 1, 2, 16]] * 2)}, ValueError,
     "position_ids contains 16, outside [0, 16)"),
    ({"input_ids": IDS, "attention_mask": torch.ones(2, 5)}, ValueError,
     "attention_mask has shape (2, 5) but the input is [2, 4]"),
    ({"input_ids": IDS, "token_type_ids": torch.zeros(2, 3, dtype=torch.long)}, ValueError,
     "token_type_ids has shape (2, 3) but the input is [2, 4]"),
    ({"input_ids": IDS, "position_ids": torch.zeros(3, 4, dtype=torch.long)}, ValueError,
     "position_ids has shape (3, 4) but the input is [2, 4]"),
    ({"input_ids": IDS, "attention_mask": torch.ones(2, 3, 3)}, ValueError, "a custom mask must be [2, 4, 4]"),
    ({"inputs_embeds": torch.zeros(2, 4, 31)}, ValueError, "inputs_embeds must be [batch, seq, 32]"),
    ({"inputs_embeds": torch.zeros(2, 4, 32, dtype=torch.float64)}, TypeError,
     "inputs_embeds has dtype torch.float64 but the model is torch.float32"),
    ({"inputs_embeds": torch.zeros(2, 4, 32, dtype=torch.long)}, TypeError,
     "inputs_embeds must be a floating tensor (torch.float32, the model's dtype), got torch.int64"),
    ({"input_ids": IDS, "encoder_hidden_states": torch.zeros(2, 4, 32)}, NotImplementedError,
     "encoder_hidden_states is not supported"),
    ({"input_ids": IDS, "no_such_argument": 1}, TypeError, "unexpected keyword argument 'no_such_argument'"),
])
def test_bad_inputs_raise_clearly(fb, kwargs, exc, words):
    with pytest.raises(exc) as info:
        fb(**kwargs)
    assert words in str(info.value)


def test_inputs_on_another_device(fb):
    meta_ids = IDS.to("meta")
    with pytest.raises(ValueError, match=r"input_ids is on meta but the model is on cpu; move it"):
        fb(meta_ids)
    with pytest.raises(ValueError, match=r"attention_mask is on meta but the model is on cpu"):
        fb(IDS, attention_mask=torch.ones(2, 4, device="meta"))


def test_custom_masks_follow_hf_semantics(fb):
    """A 3-D 0/1 mask [B, S, S] and a 4-D bool mask mean "query i may attend to key j"; a key-padding pattern
    expressed that way gives the same answer as the 2-D mask."""
    mask2 = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    mask3 = mask2[:, None, :].expand(2, 4, 4)
    with torch.no_grad():
        ref = fb(IDS, attention_mask=mask2).last_hidden_state
        out3 = fb(IDS, attention_mask=mask3).last_hidden_state
        out4 = fb(IDS, attention_mask=mask3[:, None].bool()).last_hidden_state
    real = mask2.bool()  # a custom mask runs padded rows: HF's values at padded positions, packing gives zeros there
    assert (out3 - ref)[real].abs().max() <= 1e-6 and (out4 - ref)[real].abs().max() <= 1e-6


@pytest.mark.parametrize("field, value, words", [
    ("position_embedding_type", "relative_key", "position_embedding_type='relative_key' is not supported"),
    ("is_decoder", True, "is_decoder=True is not supported"),
    ("add_cross_attention", True, "add_cross_attention=True is not supported"),
    ("hidden_act", "mish", "hidden_act='mish' is not supported"),
])
def test_unsupported_configs_raise_at_construction(field, value, words):
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=40)
    setattr(cfg, field, value)
    with pytest.raises(NotImplementedError) as info:
        fastbert.BertModel(cfg)
    assert words in str(info.value)


def test_config_sources(tmp_path):
    """The model's config is a transformers config: the object given (kept as is, so a head that shares it sees
    every change), or built from a dict or a config.json path as transformers.AutoConfig would."""
    hf_cfg = transformers.BertConfig(hidden_size=48, num_attention_heads=3, intermediate_size=50)
    hf_cfg.save_pretrained(tmp_path)
    assert fastbert.BertModel(hf_cfg).config is hf_cfg
    for source in (hf_cfg, hf_cfg.to_dict(), str(tmp_path), str(tmp_path / "config.json")):
        model = fastbert.BertModel(source)
        cfg = model.config
        assert isinstance(cfg, transformers.BertConfig)
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, model.head_dim) == (48, 3, 50, 16)
    with pytest.raises(TypeError, match="cannot build a model from a config of type int"):
        fastbert.BertModel(3)


# ---- more bad input: each was once a wrong answer or an error pointing at the wrong thing ---------------------------
def test_sequence_length_zero(fb):
    with pytest.raises(ValueError, match=r"input_ids has sequence length 0 \(shape \(2, 0\)\)"):
        fb(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="inputs_embeds has sequence length 0"):
        fb(inputs_embeds=torch.zeros(1, 0, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_broadcast_position_ids_must_be_integers(fb, dtype):
    """A [1, S] position_ids is broadcast over the batch; it gets the same dtype check as a [B, S] one."""
    for shape in ((1, 4), (2, 4)):
        with pytest.raises(TypeError, match=f"position_ids must be an integer tensor, got dtype {dtype}"):
            fb(IDS, position_ids=torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize("value", [None, {}, 3, "cuda", ["torch"]])
def test_set_kernels_refuses_non_values(fb, value):
    before = fb.kernels
    with pytest.raises(ValueError):
        fb.set_kernels(value)
    assert fb.kernels == before
    with pytest.raises(ValueError, match="unknown backend None for op 'attention'"):
        fb.set_kernels(attention=None)
    with pytest.raises(ValueError, match="set_kernels needs a backend"):
        fb.set_kernels()


def test_load_state_dict_errors_name_hfs_keys(fb):
    """The fused W_qkv is internal: load_state_dict reports query/key/value, as HF's own model would."""
    sd = fb.state_dict()
    broken = {k: v for k, v in sd.items() if k != "encoder.layer.0.attention.self.key.weight"}
    with pytest.raises(RuntimeError) as info:
        fb.load_state_dict(broken, strict=True)
    assert '"encoder.layer.0.attention.self.key.weight"' in str(info.value) and "qkv" not in str(info.value)
    wrong = dict(sd, **{"encoder.layer.0.attention.self.value.bias": torch.zeros(5)})
    with pytest.raises(RuntimeError) as info:
        fb.load_state_dict(wrong, strict=True)
    assert ("size mismatch for encoder.layer.0.attention.self.value.bias: copying a param with shape "
            "torch.Size([5])") in str(info.value)  # torch's own words, as for HF's model
    assert "qkv" not in str(info.value)
    result = fb.load_state_dict({k: v for k, v in sd.items() if ".query." not in k}, strict=False)
    assert sorted(result.missing_keys) == ["encoder.layer.0.attention.self.query.bias",
                                           "encoder.layer.0.attention.self.query.weight"]
    assert result.unexpected_keys == []
    fb.load_state_dict(sd, strict=True)  # and the whole thing still loads


# ---- attention_mask: the rule for every rank and dtype (README, "Masks") ---------------------------------------------
MASK2 = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


@pytest.fixture(scope="module")
def hf_and_fb():
    hf = random_hf_bert(hidden=32, heads=2, layers=2, intermediate=40, vocab=50, max_pos=16, types=2, attn="sdpa")
    return hf, fastbert.BertModel.from_hf(hf, kernels="torch")


def _masks_equivalent_to(mask2):
    """Every rank x dtype form of the key-padding mask `mask2` [B, S] under the README's rules."""
    B, S = mask2.shape
    keep3 = mask2[:, None, :].expand(B, S, S)  # query i may attend to key j
    additive = (1.0 - keep3[:, None].float()) * torch.finfo(torch.float32).min
    return {
        "2d-long": mask2, "2d-int32": mask2.int(), "2d-uint8": mask2.to(torch.uint8), "2d-bool": mask2.bool(),
        "2d-float": mask2.float(),
        "3d-long": keep3, "3d-bool": keep3.bool(), "3d-float": keep3.float(), "3d-half": keep3.half(),
        "4d-long": keep3[:, None], "4d-bool": keep3[:, None].bool(),
        "4d-bool-per-head": keep3[:, None].bool().expand(B, 2, S, S),
        "4d-float-additive": additive,
    }


@pytest.mark.parametrize("form", list(_masks_equivalent_to(MASK2)))
def test_every_mask_rank_and_dtype_means_what_the_readme_says(hf_and_fb, form):
    """Each form of the same padding gives HF's answer for the 2-D mask on every real token (a float 0/1 3-D mask was
    once added to the scores as if additive: padding not masked)."""
    hf, fb = hf_and_fb
    mask = _masks_equivalent_to(MASK2)[form]
    with torch.no_grad():
        ref = hf(IDS, attention_mask=MASK2).last_hidden_state
        out = fb(IDS, attention_mask=mask).last_hidden_state
    real = MASK2.bool()
    assert (out - ref)[real].abs().max() <= 1e-5


@pytest.mark.parametrize("mask", [
    torch.tensor([[1, 1, 1, 1], [1, 1, 0, 2]]),
    torch.tensor([[1, 1, 1, 1], [1, 1, -1, 1]], dtype=torch.int32),  # (row sums as a 0/1 mask's: 4 and 2)
    torch.tensor([[1, 1, 1, 3], [1, 1, 0, 0]]),
    torch.tensor([[1, 1, 1, 1], [1, 1, 255, 0]], dtype=torch.uint8),
    torch.tensor([[1.0, 1.0, 0.5, 1.0], [1.0, 1.0, 0.0, 0.0]]),
    torch.tensor([[1, 1, 1, 1], [1, 1, -1, 0]])[:, None, :].expand(2, 4, 4),
    torch.full((2, 1, 4, 4), 3),
], ids=["2d-int-2", "2d-int32-minus-one", "2d-int-3", "2d-uint8-255", "2d-float-half", "3d-int-minus-one",
        "4d-int-3"])
def test_masks_that_are_not_zero_one_are_refused(fb, mask):
    with pytest.raises(ValueError, match="attention_mask holds values other than 0 and 1"):
        fb(IDS, attention_mask=mask)


def test_float_4d_mask_is_additive_as_in_hf(hf_and_fb):
    """A floating 4-D mask is added to the scores as is: a bias that is not just 0 / -inf means the same in both."""
    hf, fb = hf_and_fb
    bias = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(IDS, attention_mask=bias).last_hidden_state
        out = fb(IDS, attention_mask=bias).last_hidden_state
    assert (out - ref).abs().max() <= 1e-5


def test_jit_trace_is_right_for_any_mask(hf_and_fb):
    """A model traced on an unpadded batch, then called with a padded one (and a fully padded row), gives HF's answer
    on real tokens and the untraced model's outputs everywhere: while tracing, no shortcut depends on the mask."""
    import warnings
    hf, fb = hf_and_fb
    ids = torch.randint(1, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    ones = torch.ones(3, 7, dtype=torch.long)
    padded = ones.clone()
    padded[1, 4:] = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values it records as constants
        traced = torch.jit.trace(fb, (ids, ones), strict=False)
        for mask in (ones, padded):
            got = traced(ids, mask)["last_hidden_state"]
            want = hf(ids, attention_mask=mask).last_hidden_state
            assert (got - want)[mask.bool()].abs().max() <= 1e-5
        # the fully padded row: HF eager's uniform attention (what the untraced model returns too)
        padded[2] = 0
        got = traced(ids, padded)["last_hidden_state"]
        assert (got - fb(ids, attention_mask=padded).last_hidden_state).abs().max() <= 1e-5


# ---- the forms transformers accepts (docs/drop-in.md, "Input forms") -----------------------------------------------
@pytest.fixture(scope="module")
def saved_bert(tmp_path_factory):
    hf = random_arch_model("bert")
    folder = tmp_path_factory.mktemp("bert")
    hf.save_pretrained(folder)
    return hf, folder


@pytest.mark.parametrize("entry", ["BertModel", "AutoModel"])
@pytest.mark.parametrize("attn", ["eager", "sdpa", "flash_attention_2"])
def test_from_pretrained_takes_attn_implementation_and_notes_it_is_ignored(saved_bert, entry, attn):
    """transformers' from_pretrained takes attn_implementation=; fastbert runs its own attention, so the keyword changes
    nothing and is said once (one warning), never a TypeError."""
    hf, folder = saved_bert
    ids = torch.randint(1, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fb = getattr(fastbert, entry).from_pretrained(folder, attn_implementation=attn, kernels="torch")
    notes = [str(w.message) for w in caught if "attn_implementation" in str(w.message)]
    assert len(notes) == 1 and f"attn_implementation={attn!r}" in notes[0], notes
    assert "fastbert runs its own attention" in notes[0]
    with torch.no_grad():
        assert (fb(ids).last_hidden_state - hf(ids).last_hidden_state).abs().max() <= 1e-5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(fastbert, entry).from_pretrained(folder, kernels="torch")
    assert not [w for w in caught if "attn_implementation" in str(w.message)]  # nothing to say when not given


FAMILIES = ("bert", "roberta", "electra", "distilbert", "mpnet")
HF4 = int(transformers.__version__.split(".")[0]) < 5


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    hf = random_arch_model(request.param)
    return hf, fastbert.BertModel.from_hf(hf, kernels="torch")


def assert_matches(out, ref, hf, mask, padding_free=True):
    """HF's numbers on real tokens (and its pooler, where position 0 of every row is real)."""
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask, padding_free)
    if getattr(hf, "pooler", None) is not None:
        assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-5


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding-free", "padded"])
def test_one_row_mask_and_token_types_broadcast_over_the_batch(family, padding_free, monkeypatch):
    """attention_mask and token_type_ids of shape [1, S] hold for every row of a [B, S] batch. HF's embeddings add
    [1, S] token types to every row; transformers 4.x broadcasts a [1, S] mask too (except its DistilBERT), where
    transformers 5 fails with an IndexError: the reference is HF given that mask for every row."""
    hf, fb = family
    monkeypatch.setattr(fb, "padding_free", padding_free)
    ids, tt, mask = arch_inputs(hf, "right")
    B, S = ids.shape
    one_mask, one_tt = mask[1:2], None if tt is None else tt[1:2]  # row 1: 5 real tokens, then padding
    with torch.no_grad():
        out = fb(ids, attention_mask=one_mask, **type_kwargs(one_tt))
        ref = hf(ids, attention_mask=one_mask.expand(B, S), **type_kwargs(one_tt))
    assert_matches(out, ref, hf, one_mask.expand(B, S), padding_free)
    if HF4 and hf.config.model_type != "distilbert":  # and HF on the very same call
        with torch.no_grad():
            same = hf(ids, attention_mask=one_mask, **type_kwargs(one_tt))
        assert_matches(out, same, hf, one_mask.expand(B, S), padding_free)


def test_one_row_mask_and_token_types_cost_one_host_read(monkeypatch):
    """Broadcast [1, S] inputs keep the padding-free forward at one device-to-host read."""
    hf = random_arch_model("bert")
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, tt, mask = arch_inputs(hf, "right")
    reads = host_reads(monkeypatch)
    with torch.no_grad():
        fb(ids, attention_mask=mask[1:2], token_type_ids=tt[1:2])
        reads.clear()
        fb(ids, attention_mask=mask[1:2], token_type_ids=tt[1:2])
    assert reads == ["tolist"]


def test_int32_ids_run_as_in_hf(family):
    """int32 ids, token types and positions are what torch's embedding lookup takes besides int64: HF runs them, and
    so does fastbert, with HF's numbers."""
    hf, fb = family
    ids, tt, mask = arch_inputs(hf, "right")
    kwargs = dict(attention_mask=mask, **type_kwargs(None if tt is None else tt.int()))
    with torch.no_grad():
        assert_matches(fb(ids.int(), **kwargs), hf(ids.int(), **kwargs), hf, mask)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int8])
def test_narrow_integer_input_ids_are_refused_by_name(family, dtype):
    """HF cannot embed int16 / uint8 / int8 ids (torch's embedding lookup refuses them, deep inside); fastbert refuses
    them where they enter, naming input_ids and the cast."""
    hf, fb = family
    ids, tt, mask = arch_inputs(hf, "right")
    with pytest.raises(RuntimeError):  # (torch's words differ by op and version)
        hf(ids.to(dtype), attention_mask=mask)
    with pytest.raises(TypeError, match=rf"input_ids has dtype {dtype}.*input_ids\.long\(\)"):
        fb(ids.to(dtype), attention_mask=mask)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8])
@pytest.mark.parametrize("name", ["token_type_ids", "position_ids"])
def test_narrow_integer_types_and_positions_are_refused_by_name(hf_and_fb, name, dtype):
    hf, fb = hf_and_fb
    given = {"token_type_ids": torch.zeros_like(IDS), "position_ids": torch.arange(4).expand(2, 4)}
    given = {name: given[name].to(dtype)}
    with pytest.raises(RuntimeError):  # (torch's words differ by op and version)
        hf(IDS, **given)
    with pytest.raises(TypeError, match=rf"{name} has dtype {dtype}.*{name}\.long\(\)"):
        fb(IDS, **given)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_embeds_into_an_fp32_model_are_promoted_as_in_hf(family, dtype):
    """HF adds fp16 / bf16 inputs_embeds to its fp32 position embeddings, so the sum is fp32; widening them first is
    exact, and gives HF's numbers."""
    hf, fb = family
    ids, tt, mask = arch_inputs(hf, "right")
    embeds = hf.get_input_embeddings()(ids).to(dtype)
    with torch.no_grad():
        out = fb(inputs_embeds=embeds, attention_mask=mask, **type_kwargs(tt))
        ref = hf(inputs_embeds=embeds, attention_mask=mask, **type_kwargs(tt))
    assert out.last_hidden_state.dtype == ref.last_hidden_state.dtype == torch.float32
    assert_matches(out, ref, hf, mask)


@pytest.mark.parametrize("model_dtype, dtype", [
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.float64),
    (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
])
def test_inputs_embeds_a_cast_would_round_are_refused_with_the_cast(model_dtype, dtype):
    """Embeddings that the model's dtype cannot hold exactly (HF: 'mixed dtype' deep inside, on CPU) are refused,
    saying how to cast either side."""
    fb = fastbert.BertModel.from_hf(random_hf_bert(hidden=32, heads=2, layers=1, intermediate=40, vocab=50,
                                                   max_pos=16).to(model_dtype), kernels="torch")
    with pytest.raises(TypeError) as info:
        fb(inputs_embeds=torch.zeros(2, 4, 32, dtype=dtype))
    message = str(info.value)
    assert f"inputs_embeds has dtype {dtype} but the model is {model_dtype}" in message
    assert f"inputs_embeds.to({model_dtype})" in message
    assert (f"model.to({dtype})" in message) == (dtype != torch.float64)  # a model's dtype: fp32, fp16 or bf16
