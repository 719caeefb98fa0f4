"""Checkpoints in and out: HF folders, BertFor* checkpoints, TF-style names, .bin, the Hub cache, and every mismatch
reported by name (never a silently random weight)."""
import os
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import fastbert
from conftest import random_hf_bert

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


def test_from_hf_shares_weights_except_fused_qkv(hf):
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    hf_ptrs = {p.data_ptr() for p in hf.parameters()}
    for name, p in fb.named_parameters():
        assert (p.data_ptr() in hf_ptrs) == ("qkv_" not in name), name
    assert same_output(fb, hf)


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
    state = {k: v for k, v in hf.state_dict().items() if not k.startswith("pooler.")}
    folder = _write(tmp_path / "nopool", hf, state)
    with pytest.raises(ValueError, match="missing keys.*pooler.dense.bias.*add_pooling_layer=False"):
        fastbert.BertModel.from_pretrained(folder)
    fb = fastbert.BertModel.from_pretrained(folder, add_pooling_layer=False, kernels="torch")
    with torch.no_grad():
        out = fb(IDS, attention_mask=MASK)
    assert out.pooler_output is None


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
