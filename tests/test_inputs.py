"""Bad input gets a clear exception naming the argument and the value, never an IndexError, a device assert or NaN."""
import pytest
import torch
import transformers

import fastbert
from conftest import random_hf_bert


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
    ({"input_ids": IDS, "token_type_ids": torch.full((2, 4), 2)}, ValueError, "token_type_ids contains 2, outside [0, 2)"),
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
    assert (out3 - ref).abs().max() == 0 and (out4 - ref).abs().max() == 0


@pytest.mark.parametrize("field, value, words", [
    ("position_embedding_type", "relative_key", "position_embedding_type='relative_key' is not supported"),
    ("is_decoder", True, "is_decoder=True is not supported"),
    ("add_cross_attention", True, "add_cross_attention=True is not supported"),
    ("hidden_act", "silu", "hidden_act='silu' is not supported"),
])
def test_unsupported_configs_raise_at_construction(field, value, words):
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=40)
    setattr(cfg, field, value)
    with pytest.raises(NotImplementedError) as info:
        fastbert.BertModel(cfg)
    assert words in str(info.value)


def test_config_sources(tmp_path):
    hf_cfg = transformers.BertConfig(hidden_size=48, num_attention_heads=3, intermediate_size=50)
    hf_cfg.save_pretrained(tmp_path)
    for source in (hf_cfg, hf_cfg.to_dict(), str(tmp_path), str(tmp_path / "config.json")):
        cfg = fastbert.BertConfig.from_any(source)
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.head_dim) == (48, 3, 50, 16)
    assert fastbert.BertConfig.from_pretrained(str(tmp_path)).hidden_size == 48
    with pytest.raises(TypeError, match="cannot build a BertConfig from int"):
        fastbert.BertConfig.from_any(3)
