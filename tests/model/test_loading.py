"""Checkpoints in and out: HF folders, BertFor* checkpoints, TF-style names, .bin, the Hub cache, and every mismatch
reported by name (never a silently random weight)."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import transformers
from helpers import ARCH_VOCAB, has_deberta_v2, has_modernbert, hub_layout_folder, random_arch_model, random_hf_bert
from safetensors.torch import load_file, save_file

import fastbert

IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


@pytest.fixture(scope="module")
def hf():
    return random_hf_bert(hidden=32, heads=2, layers=2, intermediate=40, vocab=50, max_pos=16)


@pytest.fixture(scope="module")
def hf_folder(hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder)
    return folder


def same_output(fb, hf, tol=1e-6):
    with torch.no_grad():
        a, b = fb(IDS, attention_mask=MASK), hf(IDS, attention_mask=MASK)
    d = (a.last_hidden_state - b.last_hidden_state)[MASK.bool()].abs().max()
    return d <= tol and (a.pooler_output - b.pooler_output).abs().max() <= tol


def test_from_pretrained_folder(hf, hf_folder):
    fb = fastbert.BertModel.from_pretrained(str(hf_folder), kernels="torch")
    assert not fb.training and same_output(fb, hf)


def test_dtype_device_and_torch_dtype_alias(hf_folder):
    for kw in ({"dtype": torch.bfloat16}, {"torch_dtype": torch.bfloat16}):
        fb = fastbert.BertModel.from_pretrained(str(hf_folder), device="cpu", **kw)
        assert {p.dtype for p in fb.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="disagree"):
        fastbert.BertModel.from_pretrained(str(hf_folder), dtype=torch.float16, torch_dtype=torch.bfloat16)


def test_from_hf_is_one_copy_of_the_weights(hf):
    """Every parameter is HF's own object but the fused QKV weight, and HF's query/key/value are views of that."""
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    hf_params = {id(p) for p in hf.parameters()}
    for name, p in fb.named_parameters():
        assert (id(p) in hf_params) == ("qkv_" not in name), name
    for hf_layer, layer in zip(hf.encoder.layer, fb.encoder.layer):
        fused = layer.attention.self
        for i, part in enumerate((hf_layer.attention.self.query, hf_layer.attention.self.key,
                                  hf_layer.attention.self.value)):
            assert part.weight.data_ptr() == fused.qkv_weight[i * 32:(i + 1) * 32].data_ptr()
            assert part.bias.data_ptr() == fused.qkv_bias[i * 32:(i + 1) * 32].data_ptr()
    assert same_output(fb, hf)
    again = fastbert.BertModel.from_hf(hf, kernels="torch")  # a second model over the same HF model: still one copy
    assert again.encoder.layer[0].attention.self.qkv_weight is fb.encoder.layer[0].attention.self.qkv_weight


def test_state_dict_round_trips_with_hf(hf):
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    sd = fb.state_dict()
    assert set(sd) == set(hf.state_dict())
    other = random_hf_bert(hidden=32, heads=2, layers=2, intermediate=40, vocab=50, max_pos=16, seed=7)
    other.load_state_dict(sd, strict=True)
    assert same_output(fb, other)
    fresh = fastbert.BertModel(fb.config, kernels="torch").eval()
    assert not same_output(fresh, hf)  # freshly initialised, HF-style: finite, and not the checkpoint
    fresh.load_state_dict(hf.state_dict(), strict=True)
    assert same_output(fresh, hf)


def test_save_pretrained_loads_in_hf(hf, tmp_path):
    fastbert.BertModel.from_hf(hf).save_pretrained(tmp_path)
    back = transformers.BertModel.from_pretrained(tmp_path).eval()
    assert same_output(fastbert.BertModel.from_hf(back, kernels="torch"), hf)
    assert same_output(fastbert.BertModel.from_pretrained(str(tmp_path), kernels="torch"), hf)


def test_bert_for_sequence_classification_checkpoint(hf, tmp_path):
    clf = transformers.BertForSequenceClassification(hf.config)
    clf.bert.load_state_dict(hf.state_dict())
    clf.save_pretrained(tmp_path)
    assert any(k.startswith("bert.") for k in load_file(tmp_path / "model.safetensors"))
    assert same_output(fastbert.BertModel.from_pretrained(str(tmp_path), kernels="torch"), hf)
    assert same_output(fastbert.BertModel.from_hf(clf.eval(), kernels="torch"), hf)


def _write_sharded(folder, hf, form):
    """`hf`'s weights as a two-shard checkpoint: transformers' own safetensors shards, or pytorch_model-*.bin shards
    and their index as transformers 4 writes them (transformers 5 no longer writes .bin)."""
    if form == "safetensors":
        hf.save_pretrained(folder, max_shard_size="40KB")
        assert len([n for n in os.listdir(folder) if n.endswith(".safetensors")]) > 1
        return
    hf.config.save_pretrained(folder)
    keys = sorted(hf.state_dict())
    weight_map = {}
    for i, part in enumerate((keys[:len(keys) // 2], keys[len(keys) // 2:]), 1):
        name = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({k: hf.state_dict()[k].contiguous() for k in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# files a model folder holds besides its weights, some with shard-like names
_OTHER_FILES = ("tokenizer.json", "README.md", "training_args.bin", "adapter_model.safetensors",
                "optimizer-00001-of-00002.bin", "model-00001-of-00002.safetensors.partial")


@pytest.mark.parametrize("old", ["safetensors", "bin"])
@pytest.mark.parametrize("safe_serialization", [True, False], ids=["save-safetensors", "save-bin"])
def test_save_pretrained_over_an_older_sharded_checkpoint(hf, old, safe_serialization, tmp_path):
    """The older shards and their index go, and nothing else: a loader reads an index before a single file of the
    other format, so they would load the old weights."""
    _write_sharded(tmp_path, random_hf_bert(hidden=32, heads=2, layers=2, intermediate=40, vocab=50, max_pos=16,
                                            seed=1), old)
    for name in _OTHER_FILES:
        (tmp_path / name).write_text("not weights")
    fastbert.BertModel.from_hf(hf, kernels="torch").save_pretrained(tmp_path, safe_serialization=safe_serialization)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", weights, *_OTHER_FILES])
    assert all((tmp_path / name).read_text() == "not weights" for name in _OTHER_FILES)
    assert same_output(fastbert.BertModel.from_pretrained(tmp_path, kernels="torch"), hf)
    assert same_output(fastbert.BertModel.from_hf(transformers.BertModel.from_pretrained(tmp_path).eval(),
                                                  kernels="torch"), hf)


def _write(folder, hf, state):
    folder.mkdir(exist_ok=True)
    hf.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    return str(folder)


def test_tf_style_layernorm_names_and_pytorch_bin(hf, tmp_path):
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in hf.state_dict().items()}
    assert same_output(fastbert.BertModel.from_pretrained(_write(tmp_path / "tf", hf, state), kernels="torch"), hf)
    folder = tmp_path / "bin"
    folder.mkdir()
    hf.config.save_pretrained(folder)
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    assert same_output(fastbert.BertModel.from_pretrained(str(folder), kernels="torch"), hf)


def skipped_lines(caplog) -> list:
    """The messages fastbert's loader logged at info level about the keys it did not use."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("fastbert") and r.levelno == logging.INFO and "were not used" in r.getMessage()]


# The keys each Hub layout holds that transformers' AutoModel does not use, and why (fastbert's log says the same)
HUB_SKIPPED = {
    "deberta-v3-base": {"declared by transformers' DebertaV2Model (_keys_to_ignore_on_load_unexpected "
                        "'position_embeddings')": ["deberta.embeddings.position_embeddings.weight"],
                        "the head's (outside 'deberta.')": ["lm_predictions.lm_head.bias",
                                                            "lm_predictions.lm_head.dense.weight",
                                                            "mask_predictions.classifier.weight"]},
    "bert-base-uncased": {"buffers transformers computes, not loads": ["bert.embeddings.position_ids"],
                          "the head's (outside 'bert.')": ["cls.predictions.bias",
                                                           "cls.predictions.transform.LayerNorm.gamma",
                                                           "cls.seq_relationship.weight"]},
    "distilbert-base-uncased": {"the head's (outside 'distilbert.')": ["vocab_layer_norm.weight",
                                                                       "vocab_projector.bias",
                                                                       "vocab_transform.weight"]},
    "modernbert-base": {"the head's (outside 'model.')": ["decoder.bias", "head.dense.weight", "head.norm.weight"]},
}


@pytest.mark.parametrize("name, architectures", [
    ("deberta-v3-base", None), ("deberta-v3-base", ["DebertaV2ForMaskedLM"]), ("bert-base-uncased", None),
    ("distilbert-base-uncased", None), ("modernbert-base", None)])
def test_hub_layouts_load_as_transformers_automodel_does(name, architectures, tmp_path, caplog):
    """Each checkpoint as the Hub lays it out (random weights, small sizes: tests/helpers.py hub_layout_folder) loads
    through fastbert.AutoModel and equals transformers' AutoModel of the same folder on real tokens; what transformers
    leaves unused (the heads, DeBERTa-v3's unused position table, old checkpoints' position_ids) is said in one info
    line, each key under its reason."""
    if name.startswith("deberta") and not has_deberta_v2() or name.startswith("modernbert") and not has_modernbert():
        pytest.skip(f"{name}: fastbert runs this family with transformers >= 4.48")
    folder = hub_layout_folder(name, tmp_path, architectures=architectures)
    caplog.set_level(logging.INFO, logger="fastbert")
    fb = fastbert.AutoModel.from_pretrained(folder, kernels="torch")
    lines = skipped_lines(caplog)
    assert len(lines) == 1, lines
    for why, keys in HUB_SKIPPED[name].items():
        listed = lines[0].split(f"{why}: ", 1)
        assert len(listed) == 2, (why, lines[0])
        assert all(key in listed[1].split(";")[0].split(", ") for key in keys), (keys, listed[1])
    hf = transformers.AutoModel.from_pretrained(folder).eval()
    assert type(fb).__name__ == type(hf).__name__ and getattr(fastbert, type(hf).__name__) is type(fb)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, ARCH_VOCAB, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:], mask[2, 2:] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        out, ref = fb(input_ids=ids, attention_mask=mask), hf(input_ids=ids, attention_mask=mask)
    assert (out.last_hidden_state - ref.last_hidden_state)[mask.bool()].abs().max() <= 1e-5
    if getattr(ref, "pooler_output", None) is not None:
        assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-5
    else:
        assert getattr(out, "pooler_output", None) is None


def _deberta_v3_state(folder):
    return torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)


@pytest.mark.skipif(not has_deberta_v2(), reason="fastbert runs DeBERTa-v2 with transformers >= 4.48")
def test_keys_transformers_does_not_declare_are_still_errors(tmp_path, monkeypatch):
    """Next to what transformers declares ignorable, a key that is neither that nor the model's stays an error, and a
    missing weight too: never a random one. transformers 4.48 declares DebertaV2ForMaskedLM's pattern as a bare
    string: it is one pattern, not one per letter (which would match nearly every key)."""
    monkeypatch.setattr(transformers.DebertaV2ForMaskedLM, "_keys_to_ignore_on_load_unexpected", "mask_predictions.*")
    folder = hub_layout_folder("deberta-v3-base", tmp_path, architectures=["DebertaV2ForMaskedLM"])
    state = _deberta_v3_state(folder)
    state["deberta.encoder.layer.0.attention.self.extra.weight"] = torch.zeros(2)
    del state["deberta.encoder.rel_embeddings.weight"]
    torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    with pytest.raises(ValueError) as info:
        fastbert.AutoModel.from_pretrained(folder)
    msg = str(info.value)
    assert "missing keys (1): encoder.rel_embeddings.weight" in msg
    assert "unexpected keys (1): encoder.layer.0.attention.self.extra.weight" in msg
    assert "position_embeddings" not in msg


def test_the_installed_transformers_declarations_decide(hf, tmp_path, monkeypatch, caplog):
    """The patterns are read from transformers' classes as installed (the encoder's, and the heads config.json's
    architectures names, of the same family), matched with re.search; a buffer transformers computes is never
    required; _keys_to_ignore_on_load_missing never lets a weight go missing."""
    caplog.set_level(logging.INFO, logger="fastbert")
    state = dict(hf.state_dict())
    state["embeddings.position_ids"] = torch.arange(16)[None]  # as transformers < 4.31 saved them
    state["embeddings.token_type_ids"] = torch.zeros(1, 16, dtype=torch.long)
    state["encoder.layer.0.attention.self.extra.weight"] = torch.zeros(2)
    folder = _write(tmp_path / "extra", hf, state)
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): encoder.layer.0.attention.self.extra.weight$"):
        fastbert.BertModel.from_pretrained(folder)
    monkeypatch.setattr(transformers.RobertaModel, "_keys_to_ignore_on_load_unexpected", [r"self\.extra"])
    config = json.loads((tmp_path / "extra" / "config.json").read_text())
    config["architectures"] = ["RobertaForMaskedLM"]  # another family's class declares nothing for BERT
    (tmp_path / "extra" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unexpected keys"):
        fastbert.BertModel.from_pretrained(folder)
    config["architectures"] = ["BertForMaskedLM"]
    (tmp_path / "extra" / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(transformers.BertForMaskedLM, "_keys_to_ignore_on_load_unexpected", [r"self\.extra"])
    caplog.clear()
    assert same_output(fastbert.BertModel.from_pretrained(folder, kernels="torch"), hf)
    (line,) = skipped_lines(caplog)
    assert "3 weights of the checkpoint were not used by the BERT encoder" in line
    assert ("declared by transformers' BertForMaskedLM (_keys_to_ignore_on_load_unexpected 'self\\.extra'): "
            "encoder.layer.0.attention.self.extra.weight") in line
    assert "buffers transformers computes, not loads: embeddings.position_ids, embeddings.token_type_ids" in line
    monkeypatch.setattr(transformers.BertModel, "_keys_to_ignore_on_load_missing", [r"pooler"])
    del state["pooler.dense.bias"]
    with pytest.raises(ValueError, match=r"missing keys \(1\): pooler.dense.bias"):
        fastbert.BertModel.from_pretrained(_write(tmp_path / "nobias", hf, state), add_pooling_layer=True)


def test_missing_unexpected_and_wrong_shape_keys_are_listed(hf, tmp_path):
    state = dict(hf.state_dict())
    del state["encoder.layer.1.output.dense.weight"]
    state["encoder.layer.0.attention.self.extra.weight"] = torch.zeros(2)
    state["pooler.dense.bias"] = torch.zeros(31)
    with pytest.raises(ValueError) as info:
        fastbert.BertModel.from_pretrained(_write(tmp_path / "bad", hf, state))
    msg = str(info.value)
    assert "missing keys (1): encoder.layer.1.output.dense.weight" in msg
    assert "unexpected keys (1): encoder.layer.0.attention.self.extra.weight" in msg
    assert "pooler.dense.bias: checkpoint (31,) vs model (32,)" in msg


def test_checkpoint_without_pooler(hf, tmp_path):
    """BERT-architecture embedding models (BGE, E5, GTE) ship no pooler weights: they load without a pooler, never
    with a random one; asking for one explicitly is an error naming the missing keys."""
    state = {k: v for k, v in hf.state_dict().items() if not k.startswith("pooler.")}
    folder = _write(tmp_path / "nopool", hf, state)
    with pytest.raises(ValueError, match="missing keys.*pooler.dense.bias.*add_pooling_layer=None or False"):
        fastbert.BertModel.from_pretrained(folder, add_pooling_layer=True)
    for fb in (fastbert.BertModel.from_pretrained(folder, kernels="torch"),
               fastbert.BertModel.from_pretrained(folder, add_pooling_layer=False, kernels="torch")):
        assert fb.pooler is None
        with torch.no_grad():
            out, ref = fb(IDS, attention_mask=MASK), hf(IDS, attention_mask=MASK)
        assert out.pooler_output is None
        assert (out.last_hidden_state - ref.last_hidden_state)[MASK.bool()].abs().max() <= 1e-6
    assert fastbert.BertModel.from_pretrained(str(_write(tmp_path / "pool", hf, hf.state_dict()))).pooler is not None


def test_folder_without_weights_and_missing_paths(hf, tmp_path):
    hf.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights in .*looked for model.safetensors.*pytorch_model.bin"):
        fastbert.BertModel.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        fastbert.BertModel.from_pretrained("no-such-org/no-such-model")


def test_hub_id_from_the_local_cache(hf_folder, tmp_path):
    """A Hub id resolves through huggingface_hub's cache and works offline once cached."""
    snap = tmp_path / "models--someone--tiny-bert" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (snap / name).write_bytes((hf_folder / name).read_bytes())
    (tmp_path / "models--someone--tiny-bert" / "refs").mkdir()
    (tmp_path / "models--someone--tiny-bert" / "refs" / "main").write_text("0" * 40)
    code = ("import fastbert, torch; m = fastbert.BertModel.from_pretrained('someone/tiny-bert', kernels='torch'); "
            "print(m.config.hidden_size, m(torch.tensor([[1, 2, 3]])).last_hidden_state.shape)")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["32", "torch.Size([1,", "3,", "32])"]


# ---- configs and checkpoints fastbert must refuse, naming the file and the field -------------------------------------
def test_other_architectures_are_refused_by_model_type(tmp_path):
    """Outside the families fastbert runs a checkpoint is refused by its model_type, never loaded as BERT (nor a
    wall of key errors)."""
    config = transformers.AlbertConfig(vocab_size=50, embedding_size=16, hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=40, max_position_embeddings=20)
    albert = transformers.AlbertModel(config).eval()
    albert.save_pretrained(tmp_path / "albert")
    with pytest.raises(NotImplementedError, match=r"config .*config.json: model_type='albert' is not "
                                                   r"implemented by fastbert"):
        fastbert.AutoModel.from_pretrained(str(tmp_path / "albert"))
    with pytest.raises(NotImplementedError, match=r"model_type='albert'"):
        fastbert.BertModel.from_hf(albert)
    import json
    (tmp_path / "deberta").mkdir()  # the config alone decides: refused before any weight is read (DeBERTa v1)
    (tmp_path / "deberta" / "config.json").write_text(json.dumps({"model_type": "deberta", "hidden_size": 32}))
    with pytest.raises(NotImplementedError, match=r"model_type='deberta' is not implemented by fastbert"):
        fastbert.AutoModel.from_pretrained(str(tmp_path / "deberta"))


@pytest.mark.parametrize("field, value, words", [
    ("hidden_size", "64", "field 'hidden_size' must be an integer >= 1, got '64' (str)"),
    ("num_attention_heads", 4.0, "field 'num_attention_heads' must be an integer >= 1, got 4.0 (float)"),
    ("num_hidden_layers", True, "field 'num_hidden_layers' must be an integer >= 0, got True (bool)"),
    ("vocab_size", 0, "field 'vocab_size' must be an integer >= 1, got 0 (int)"),
    ("layer_norm_eps", "1e-12", "field 'layer_norm_eps' must be a number >= 0.0, got '1e-12' (str)"),
    ("hidden_dropout_prob", 1.5, "field 'hidden_dropout_prob' must be a number in [0.0, 1.0], got 1.5 (float)"),
    ("hidden_act", None, "field 'hidden_act' must be a string, got None (NoneType)"),
    ("is_decoder", "false", "field 'is_decoder' must be true or false, got 'false' (str)"),
])
def test_config_json_fields_of_the_wrong_type(hf_folder, tmp_path, field, value, words):
    import json
    config = json.loads((hf_folder / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((hf_folder / "model.safetensors").read_bytes())
    with pytest.raises(ValueError) as info:
        fastbert.BertModel.from_pretrained(str(tmp_path))
    assert str(tmp_path / "config.json") in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"])
def test_config_json_without_a_size_field_names_it(hf_folder, tmp_path, field):
    """A config.json that leaves out a field setting a tensor's shape gets transformers' default for it; where the
    checkpoint does not fit that default, the error names the file, the field and the default, before the shapes."""
    import json
    config = json.loads((hf_folder / "config.json").read_text())
    del config[field]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((hf_folder / "model.safetensors").read_bytes())
    default = getattr(transformers.BertConfig(), field)
    with pytest.raises(ValueError) as info:
        fastbert.BertModel.from_pretrained(str(tmp_path))
    assert str(info.value).startswith(f"config {tmp_path / 'config.json'} has no {field}, so the model took "
                                      f"transformers' defaults ({field}={default})"), str(info.value)[:300]


@pytest.mark.parametrize("text, words", [
    ('{"hidden_size": 32,', "is not valid JSON"),
    ('[1, 2, 3]', "must hold a JSON object, got list"),
    ('"bert"', "must hold a JSON object, got str"),
    (b'{"hidden_act": "\xff"}', "is not valid JSON"),
])
def test_config_json_that_is_not_a_json_object(tmp_path, text, words):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as info:
        fastbert.BertModel.from_pretrained(str(tmp_path))
    assert str(path) in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("dtype, want", [
    ("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.float32),
    ("torch.float16", torch.float16),
    ("auto", torch.bfloat16), (None, torch.float32), (torch.float16, torch.float16),
])
def test_dtype_as_hf_accepts_it(hf, tmp_path, dtype, want):
    """Names as Hugging Face takes them; "auto" = the checkpoint's own dtype (config.json's, as saved)."""
    hf.save_pretrained(tmp_path)
    import json
    config = json.loads((tmp_path / "config.json").read_text())
    config["dtype"] = "bfloat16"  # "auto" reads this, as transformers does; None keeps the stored (fp32) weights
    (tmp_path / "config.json").write_text(json.dumps(config))
    fb = fastbert.BertModel.from_pretrained(str(tmp_path), dtype=dtype)
    assert {p.dtype for p in fb.parameters()} == {want}


def test_dtype_auto_without_a_config_field_is_the_stored_dtype(hf, tmp_path):
    import copy
    import json
    copy.deepcopy(hf).half().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert {p.dtype for p in fastbert.BertModel.from_pretrained(str(tmp_path), dtype="auto").parameters()} == \
        {torch.float16}


@pytest.mark.parametrize("dtype", ["float64", "half-ish", torch.int8, 3])
def test_bad_dtype_names(hf_folder, dtype):
    with pytest.raises(ValueError, match="dtype="):
        fastbert.BertModel.from_pretrained(str(hf_folder), dtype=dtype)


def test_missing_local_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        fastbert.BertModel.from_pretrained(str(tmp_path / "nothing-here"))


MODERNBERT_CONFIG = {"model_type": "modernbert", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "intermediate_size": 40, "max_position_embeddings": 16,
                     "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, "cls_token_id": 1, "sep_token_id": 1}


def test_modernbert_needs_a_transformers_that_has_it(tmp_path):
    """transformers before 4.48 has no ModernBERT: loading one says so in one clear error (under the installed
    transformers if it is that old, else with its version set back); a transformers that has it builds the model."""
    (tmp_path / "config.json").write_text(json.dumps(MODERNBERT_CONFIG))
    if hasattr(transformers, "ModernBertModel"):
        assert fastbert.BertModel(str(tmp_path)).family.name == "modernbert"
        patch = pytest.MonkeyPatch()
        patch.setattr(transformers, "__version__", "4.47.1")
    else:
        patch = None
    try:
        with pytest.raises(NotImplementedError, match=r"model_type='modernbert' needs transformers >= 4\.48\.0 .*"
                                                      r"transformers 4\.4[17]\.\d+ is installed"):
            fastbert.BertModel.from_pretrained(str(tmp_path))
    finally:
        if patch is not None:
            patch.undo()


@pytest.mark.parametrize("arch", ["bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert", "mpnet",
                                  "modernbert", "deberta-v2"])
def test_each_family_has_transformers_class_name(arch):
    """fastbert.AutoModel builds the class transformers names for the family (fastbert.ModernBertModel for
    ModernBERT, ...), each a fastbert.BertModel; from_config, from_hf and the named class agree, and a named class
    refuses another family's config, naming AutoModel."""
    if arch.startswith("deberta") and not has_deberta_v2() or arch.startswith("modernbert") and not has_modernbert():
        pytest.skip(f"{arch}: fastbert runs this family with transformers >= 4.48")
    hf = random_arch_model(arch, hidden=32, layers=1, intermediate=40)
    name = type(hf).__name__
    fb = fastbert.AutoModel.from_hf(hf, kernels="torch")
    assert type(fb).__name__ == name and isinstance(fb, fastbert.BertModel)
    assert type(fastbert.AutoModel.from_config(hf.config)) is type(fb) is getattr(fastbert, name)
    assert type(getattr(fastbert, name)(hf.config)) is type(fb)
    other = random_arch_model("mpnet" if arch != "mpnet" else "bert", hidden=32, layers=1, intermediate=40).config
    if name != "BertModel":  # fastbert.BertModel runs every family, as before
        with pytest.raises(ValueError, match="fastbert.AutoModel picks the class"):
            getattr(fastbert, name)(other)
