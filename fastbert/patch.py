"""fastbert.optimize(model) / fastbert.restore(model): fastbert in place of the transformers encoders a model holds.

    model = fastbert.optimize(model)       # a BertFor* head, a SentenceTransformer, a CrossEncoder, a pipeline, ...
    ...                                    # inference, fine-tuning, Trainer, save()
    model = fastbert.restore(model)        # transformers' own modules again, holding what training changed

optimize finds every transformers encoder fastbert runs (BertModel, RobertaModel, XLMRobertaModel, CamembertModel,
ElectraModel, DistilBertModel, MPNetModel) anywhere in the model's module tree (a pipeline: in its .model) and puts
a fastbert.BertModel in its place, at every reference to it. The fastbert module is built with BertModel.from_hf: one
copy of the weights (it holds HF's own modules, query/key/value included, whose weights become rows of its fused QKV
weight) and HF's config object itself. restore puts each HF encoder back where it was: whatever sits at its module
paths meanwhile (a resized vocabulary, PEFT's adapters) goes back into it, and query/key/value get plain storage of
their own again.

Use the return value: for a bare encoder (optimize(BertModel)), the fastbert module itself is what comes back.
Nothing is changed when optimize refuses: every encoder is checked (the config's fields, the modules' layout) before
the first one is swapped.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from . import config as configs
from . import families, quality
from .graphs import Graphed
from .loading import check_hf, share_hf, shared_leaves
from .modeling import BertModel

# transformers' encoder classes fastbert runs (their heads hold one of these as base_model)
SUPPORTED_CLASSES = tuple(dict.fromkeys(families.encoder_class(t) for t in families.MODEL_TYPES))


class OptimizedBertModel(BertModel):
    """The fastbert module optimize swaps in: a BertModel whose call runs `graphed` (CUDA graphs where they are safe,
    fastbert/graphs.py) when it has one. Its forward stays on the class, so a copy that shares its __dict__ (an
    nn.DataParallel replica) runs its own eager forward rather than the original's graphs."""

    @functools.wraps(BertModel.forward)  # its signature: Trainer keeps the dataset columns forward names
    def forward(self, *args, **kwargs):
        graphed = self.__dict__.get("graphed")
        if graphed is None or graphed.model is not self:
            return super().forward(*args, **kwargs)
        return graphed(*args, **kwargs)


def set_cuda_graphs(fb: OptimizedBertModel, enabled: bool) -> None:
    """Give a swapped-in module its CUDA graphs, or take them away (their pool is freed with them)."""
    if not enabled:
        fb.__dict__.pop("graphed", None)
    elif "graphed" not in fb.__dict__:
        fb.__dict__["graphed"] = Graphed(fb, forward=BertModel.forward)


def _root(model):
    """The module tree to search: the model itself, or a pipeline's model."""
    if isinstance(model, nn.Module):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module):
        return inner
    raise TypeError(f"fastbert.optimize takes a torch module (a transformers model, a SentenceTransformer, a "
                    f"CrossEncoder, ...) or a transformers pipeline; got {type(model).__name__}")


def _set_root(model, new):
    """Replace the root itself: for a pipeline its .model; for a bare module, the caller gets `new` back."""
    if not isinstance(model, nn.Module):
        model.model = new
        return model
    return new


def _references(root):
    """module id -> [the paths under which it appears] (a module held in two places is swapped in both)."""
    paths = {}
    for path, module in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    return paths


def _put(root, path, module):
    parent, _, name = path.rpartition(".")
    root.get_submodule(parent)._modules[name] = module


def _is_base_encoder(module) -> bool:
    """A transformers model that is its own base model (an encoder, not a head around one)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel) and getattr(module, "base_model", None) is module


def _describe(path: str) -> str:
    return f"module {path!r}" if path else "the model"


def optimize(model, kernels="auto", padding_free: bool = True, cuda_graphs: bool = True, quantize=None,
             quality_texts=None, tokenizer=None):
    """Swap fastbert in for every supported transformers encoder inside `model`; returns the model (for a bare
    encoder, the fastbert module). `kernels`, `padding_free`: as BertModel takes them. cuda_graphs: on CUDA, the
    swapped-in modules replay CUDA graphs for inference calls (fastbert/graphs.py, Graphed); False keeps them eager.
    On a model optimized already, only cuda_graphs (and quantize) is applied. quantize: "bf16" or "int8" runs the
    encoders' GEMMs in that format (BertModel.set_format), measured against fp32 on quality_texts (None: the
    built-in sample) with `tokenizer` (None: the one in the model's folder): labels for a classifier, top-1 and order
    for a reranker (one label), pooled vectors otherwise (quality.measure_transformers)."""
    model = _swap(model, kernels, padding_free, cuda_graphs)
    if quantize is not None:
        encoders = [m for m in model.modules() if isinstance(m, BertModel)]
        for fb in encoders:
            fb.set_format(quantize)
        if encoders and encoders[0].quantize != "fp32":
            quality.measure_transformers(model, tokenizer, quality_texts)
    return model


def _swap(model, kernels, padding_free: bool, cuda_graphs: bool):
    root = _root(model)
    references = _references(root)
    found, others = {}, []
    for path, module in root.named_modules():
        if isinstance(module, BertModel) or not _is_base_encoder(module):
            continue
        kind = type(module).__name__
        if kind in SUPPORTED_CLASSES and type(module).__module__.startswith("transformers."):
            found[id(module)] = (path, module)
        else:
            others.append(f"{_describe(path)} ({kind}, model_type={getattr(module.config, 'model_type', None)!r})")
    if not found:
        already = [m for m in root.modules() if isinstance(m, BertModel)]
        if already:  # optimized already
            for fb in already:
                if isinstance(fb, OptimizedBertModel):
                    set_cuda_graphs(fb, cuda_graphs)
            return model
        what = f"; it holds {', '.join(others)}, which fastbert does not implement" if others else ""
        raise ValueError(f"fastbert.optimize: no supported encoder in {type(root).__name__} (fastbert runs "
                         f"{', '.join(SUPPORTED_CLASSES)}, model_type {', '.join(configs.MODEL_TYPES)}){what}")

    generates = getattr(root, "can_generate", None)
    decoders = [p for p, m in found.values() if families.of(m.config).output == "BaseModelOutputWithPast"]
    if decoders and callable(generates) and generates():  # Qwen3ForCausalLM, Gemma3ForCausalLM, ...
        raise ValueError(f"fastbert.optimize: {type(root).__name__} generates text, with a key/value cache; "
                         f"fastbert runs its decoder for embeddings, without one. Optimize the base model instead "
                         f"({', '.join(_describe(p) for p in decoders)})")
    # Check every encoder before changing any: an error leaves the model as it was.
    built = [(path, hf, check_hf(OptimizedBertModel, hf, kernels, padding_free, where=_describe(path)))
             for path, hf in found.values()]
    for path, hf, fb in built:
        share_hf(fb, hf)
        fb.__dict__["_hf_encoder"] = hf  # not a submodule: its parameters are not the fastbert module's
        if any(getattr(m, "gradient_checkpointing", False) for m in hf.modules()):
            fb.gradient_checkpointing_enable()
        set_cuda_graphs(fb, cuda_graphs)
        if path == "":
            return _set_root(model, fb)
        for where in references[id(hf)]:
            _put(root, where, fb)
    return model


def restore(model):
    """Put back the transformers encoders optimize() replaced, holding the current weights; returns the model (for
    a bare fastbert module that optimize() or BertModel.from_hf returned, the transformers encoder)."""
    root = _root(model)
    references = _references(root)
    swapped = {id(m): (path, m) for path, m in root.named_modules() if "_hf_encoder" in getattr(m, "__dict__", {})}
    if not swapped:
        raise ValueError(f"fastbert.restore: {type(root).__name__} holds no module that fastbert.optimize swapped in")
    for path, fb in swapped.values():
        hf = write_back(fb)
        if path == "":
            return _set_root(model, hf)
        for where in references[id(fb)]:
            _put(root, where, hf)
    return model


def write_back(fb: BertModel):
    """The HF encoder a fastbert module replaced, brought up to date with it; the fastbert module lets go of it."""
    hf = fb.__dict__.pop("_hf_encoder")
    if isinstance(fb, OptimizedBertModel):
        set_cuda_graphs(fb, False)  # its graphs hold device memory
    for name, module in shared_leaves(fb):  # a module fastbert's side replaced (resize_token_embeddings, ...)
        parent, _, leaf = name.rpartition(".")
        holder = hf.get_submodule(parent)
        if holder._modules.get(leaf) is not module:
            holder._modules[leaf] = module
    for layer in fb.layers:
        for holder in layer.fused_holders():
            holder.untie()
    _bring_buffers(hf, fb.device)
    checkpointing = fb.is_gradient_checkpointing
    for module in hf.modules():
        if hasattr(module, "gradient_checkpointing") and module.gradient_checkpointing != checkpointing:
            if checkpointing:
                module._gradient_checkpointing_func = fb.layers[0]._gradient_checkpointing_func
            module.gradient_checkpointing = checkpointing
    return hf.train(fb.training)


def _bring_buffers(hf, device) -> None:
    """HF's buffers (the embeddings' position_ids and token_type_ids, ModernBERT's rotary inv_freq), which live in HF
    modules the fastbert module does not hold, to wherever the weights went meanwhile. A model built on the meta
    device and then materialised (to_empty, load_state_dict(assign=True)) left them on meta, holding nothing: they get
    the values a freshly built HF module holds, from transformers' own _init_weights (which fills these buffers since
    transformers 5); before that, position ids and token types by name, and an error naming any other."""
    if device.type == "meta":
        return
    fresh = {}  # module -> the names of its buffers that were on meta
    for module in hf.modules():
        for name, buffer in module._buffers.items():
            if buffer is None or buffer.device == device:
                continue
            if buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)
                continue
            if name == "position_ids":  # arange(n) as [1, n]
                value = torch.arange(buffer.shape[-1], dtype=buffer.dtype, device=device).expand(buffer.shape)
            elif name == "token_type_ids" or not buffer.is_floating_point():
                value = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
            else:  # NaN until _init_weights gives it its value: what is left NaN is said below
                value = torch.full(buffer.shape, float("nan"), dtype=buffer.dtype, device=device)
            module._buffers[name] = value
            fresh.setdefault(module, []).append(name)
    init = getattr(hf, "_init_weights", None)
    if init is not None and fresh:
        # _init_weights(module) may also initialise what the module holds besides its buffers (DistilBERT's
        # sinusoidal position table, from its embeddings): transformers' initializers leave a tensor marked
        # initialised as it is
        params = {p: None for module in fresh for p in module.parameters() if not hasattr(p, "_is_hf_initialized")}
        for p in params:
            p._is_hf_initialized = True
        try:
            for module in fresh:
                init(module)
        finally:
            for p in params:
                del p._is_hf_initialized
    unset = [f"{type(module).__name__}.{name}" for module, names in fresh.items() for name in names
             if module._buffers[name].is_floating_point() and module._buffers[name].isnan().any()]
    if unset:
        raise RuntimeError(f"fastbert.restore: the model was built on the meta device and this transformers does not "
                           f"initialise {', '.join(unset)} (a buffer of transformers' modules that fastbert does not "
                           f"hold); build the model on its device, or give those buffers values before restore")
