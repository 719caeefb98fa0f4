"""Checkpoints: HF BERT folders and Hub ids in, HF folders out. Every key accounted for, never a random weight."""
from __future__ import annotations

import json
import os

import torch

from .config import BertConfig

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# Top-level prefixes of BertFor* heads: ignored when loading a base model out of such a checkpoint.
_HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.", "lm_head.", "dropout.")
_IGNORED = ("embeddings.position_ids", "embeddings.token_type_ids")  # buffers, not weights


def resolve_folder(name_or_path, weights: bool = True) -> str:
    """A local folder as is; otherwise a Hub id looked up through huggingface_hub's cache (offline when cached)."""
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        folder = path
    elif os.path.exists(path):
        raise ValueError(f"{path!r} is a file; give the folder that holds config.json and the weights")
    elif looks_like_a_path(path):
        raise FileNotFoundError(f"no such folder: {path!r}")
    else:
        from huggingface_hub import snapshot_download
        patterns = ["config.json"] + (list(WEIGHT_FILES) + ["model-*.safetensors", "pytorch_model-*.bin"] if weights else [])
        try:
            folder = snapshot_download(path, allow_patterns=patterns)
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise FileNotFoundError(f"{path!r} is not a local folder, and the Hub could not provide it "
                                    f"({type(e).__name__}: {reason})") from e
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"no config.json in {folder!r}")
    return folder


def looks_like_a_path(name: str) -> bool:
    """A Hub id is "name" or "owner/name"; anything else that is not on disk was meant as a folder."""
    return (os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") > 1
            or (os.sep != "/" and os.sep in name))


def read_checkpoint(folder: str) -> dict:
    """All tensors of the checkpoint in `folder`, as saved (safetensors preferred, sharded or not)."""
    from safetensors.torch import load_file
    for name in WEIGHT_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".index.json"):
            with open(path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            files = [os.path.join(folder, s) for s in shards]
        else:
            files = [path]
        state = {}
        for file in files:
            if file.endswith(".safetensors"):
                state.update(load_file(file))
            else:
                state.update(torch.load(file, map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"no weights in {folder!r}: looked for {', '.join(WEIGHT_FILES)}")


def hf_state_dict(raw: dict, model) -> dict:
    """Map a BertModel / BertFor* checkpoint onto the model's HF key names, or raise listing every mismatch."""
    if any(k.startswith("bert.") for k in raw):  # a BertFor* checkpoint: the encoder lives under bert.
        raw = {k[len("bert."):]: v for k, v in raw.items() if k.startswith("bert.")}
    state = {}
    for key, value in raw.items():
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if key in _IGNORED or key.startswith(_HEAD_PREFIXES):
            continue
        if key.startswith("pooler.") and model.pooler is None:
            continue
        state[key] = value

    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k])}"
                   for k in set(state) & set(expected) if state[k].shape != expected[k])
    if missing or unexpected or wrong:
        lines = []
        if missing:
            lines.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
        if wrong:
            lines.append(f"wrong shapes ({len(wrong)}): {'; '.join(wrong)}")
        hint = " (a checkpoint without a pooler loads with add_pooling_layer=False)" if any(
            k.startswith("pooler.") for k in missing) else ""
        raise ValueError("checkpoint does not match the model: " + " | ".join(lines) + hint)
    return state


def _build(cls, config, add_pooling_layer, kernels, padding_free):
    with torch.device("meta"):  # no time or memory spent on an initialisation that is overwritten at once
        return cls(config, add_pooling_layer=add_pooling_layer, kernels=kernels, padding_free=padding_free)


DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_dtype(dtype, config: BertConfig, state: dict) -> torch.dtype | None:
    """from_pretrained's `dtype`, as Hugging Face accepts it: a torch.dtype, its name ("float16", ...), or "auto" (the
    checkpoint's own: config.json's dtype / torch_dtype, else the dtype its weights are stored in). None keeps the
    weights as stored."""
    if dtype is None or isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        named = config.extra.get("dtype") or config.extra.get("torch_dtype")
        if named is not None:
            return resolve_dtype(str(named).replace("torch.", ""), config, state)
        resolved = next((v.dtype for v in state.values() if v.is_floating_point()), None)
    elif isinstance(dtype, str) and dtype.replace("torch.", "") in DTYPE_NAMES:
        resolved = DTYPE_NAMES[dtype.replace("torch.", "")]
    else:
        raise ValueError(f"dtype={dtype!r} is not one of torch.float32 / float16 / bfloat16, their names "
                         f"({', '.join(repr(n) for n in DTYPE_NAMES)}), or 'auto'")
    if resolved is not None and resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={resolved} is not supported; use float32, float16 or bfloat16")
    return resolved


def from_pretrained(cls, name_or_path, *, dtype=None, device=None, kernels="auto", add_pooling_layer=True,
                    padding_free=True):
    folder = resolve_folder(name_or_path)
    config = BertConfig.from_any(os.path.join(folder, "config.json"))
    model = _build(cls, config, add_pooling_layer, kernels, padding_free)
    state = hf_state_dict(read_checkpoint(folder), model)
    dtype = resolve_dtype(dtype, config, state)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if device is not None:
        model.to(device)
    return model.eval()  # like HF's from_pretrained


def from_hf(cls, hf_model, kernels="auto", padding_free=True):
    base = getattr(hf_model, "bert", hf_model)  # BertFor* -> its BertModel
    model = _build(cls, base.config, getattr(base, "pooler", None) is not None, kernels, padding_free)
    # state_dict() holds detached tensors sharing storage with hf_model's parameters: only W_qkv is a new tensor.
    state = hf_state_dict(base.state_dict(), model)
    model.load_state_dict(state, strict=True, assign=True)
    return model.train(base.training)


def save_pretrained(model, folder) -> None:
    """Writes config.json + model.safetensors that transformers' BertModel.from_pretrained loads."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f, indent=2, sort_keys=True)
    # query/key/value are views of the fused weight: safetensors wants separate storage
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
