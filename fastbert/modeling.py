"""fastbert.BertModel: Hugging Face's BertModel, same checkpoints, same calls, same numbers, four fused ops.

One model for the BERT family: BERT and the BERT-architecture embedding models (BGE, E5, GTE), RoBERTa, XLM-RoBERTa,
CamemBERT and ELECTRA discriminators run the same layers; they differ only at the edge, in their embeddings
(`EMBEDDINGS`, chosen by the config's model_type): RoBERTa's position ids count from padding_idx + 1, ELECTRA's
embeddings are narrower than its layers and a projection widens them.

One forward in three parts:

    prepare (host, fastbert/inputs.py): validate, fill defaults, one host read; a padded batch [B, S] becomes its
        T real tokens, packed, and a TokenLayout (cu_seqlens: where each sequence starts)
    encode (device only; what a CUDA graph captures):
        x = LayerNorm(word[ids] + type[types] + position[positions])      [T, H]   (ELECTRA: [T, E] @ W_proj)
        per layer:
            qkv = qkv_projection(x)                          [T, 3, nh, hd]   one GEMM over the fused W_qkv
            ctx = attention(qkv, layout)                     [T, H]           per sequence, never across
            x   = residual_layernorm(ctx @ W_o + b_o + x)    [T, H]
            h   = bias_gelu(x @ W_1 + b_1)                   [T, I]
            x   = residual_layernorm(h @ W_2 + b_2 + x)      [T, H]
    finish: scatter back to [B, S, H] once (zeros at padding); pooler = tanh(first token @ W_p + b_p); HF's outputs

Each op runs on the backend named in `model.kernels`, resolved once per forward (fastbert/dispatch.py). Module and
parameter names follow HF's so that state_dict keys are HF's; the one difference inside is the fused W_qkv, which
state_dict splits back into query/key/value (and load_state_dict concatenates).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import transformers
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from . import auto, dispatch, fallback, twins
from . import config as configs
from .inputs import Batch, prepare
from .layout import first_tokens, pad
from .dispatch import OPS

# With output_attentions, transformers 5 reports an empty cross_attentions tuple alongside attentions (part of the
# return_dict=False tuple); 4.x reports None, which the tuple leaves out.
_EMPTY_CROSS_ATTENTIONS = () if int(transformers.__version__.split(".")[0]) >= 5 else None


class BertEmbeddings(nn.Module):
    """word + token type + position embeddings, LayerNorm, dropout, at `width` (hidden_size; ELECTRA: embedding_size).
    BERT's position ids are each token's index in its sequence."""

    def __init__(self, config, width: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, width)
        self.LayerNorm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.max_length = config.max_position_embeddings  # the longest sequence the position table covers

    def position_ids(self, input_ids, index):
        """The default position ids: `index` holds each token's index in its sequence (the shape of input_ids, [B, S]
        or packed [T]; input_ids is None when the caller gave inputs_embeds)."""
        return index

    def forward(self, input_ids, token_type_ids, position_ids, inputs_embeds):
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        # HF's order of additions, so that fp32 sums round identically
        x = inputs_embeds + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(x))                                   # [T, width]


class RobertaEmbeddings(BertEmbeddings):
    """RoBERTa, XLM-RoBERTa, CamemBERT: fairseq's positions. A token that is not padding_idx sits at padding_idx + its
    count among its sequence's non-padding tokens (1, 2, ...); a padding_idx token sits at padding_idx (HF's
    create_position_ids_from_input_ids). From inputs_embeds, where padding cannot be seen, positions run
    padding_idx + 1, padding_idx + 2, ... So the usable length is max_position_embeddings - padding_idx - 1."""

    def __init__(self, config, width: int):
        super().__init__(config, width)
        self.padding_idx = config.pad_token_id
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width, padding_idx=self.padding_idx)
        self.max_length = config.max_position_embeddings - self.padding_idx - 1

    def position_ids(self, input_ids, index):
        if input_ids is None:
            return index + (self.padding_idx + 1)
        real = (input_ids != self.padding_idx).long()
        if real.dim() == 2:  # padded rows: HF's cumsum along each row
            counts = real.cumsum(dim=1)
        else:  # packed sequences: the same count restarted at each sequence's first token (index 0)
            counts = real.cumsum(dim=0)
            first = torch.arange(real.shape[0], device=real.device) - index
            counts = counts - (counts[first] - real[first])
        return counts * real + self.padding_idx


# model_type's embeddings (fastbert/config.py's ARCHITECTURES names the kind)
EMBEDDINGS = {"bert": BertEmbeddings, "roberta": RobertaEmbeddings, "electra": BertEmbeddings}


class BertSelfAttention(nn.Module):
    """Holds the fused QKV projection: W_qkv [3H, H] = cat(W_q, W_k, W_v), built once at load time. Outside, in
    state_dict() and load_state_dict() (and their errors), it is HF's query/key/value."""

    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        self.qkv_weight = nn.Parameter(torch.empty(3 * H, H))
        self.qkv_bias = nn.Parameter(torch.empty(3 * H))
        self.register_state_dict_post_hook(_split_qkv)
        # HF's query/key/value parameters whose storage is the fused weight (a model built from an HF model): kept
        # pointing into it when the fused weight moves (.to(), .half(), load_state_dict(assign=True)). Not registered:
        # they are HF's parameters, not this module's.
        self._tied = ()

    def tie(self, parts) -> None:
        """Make HF's (query.weight, key.weight, value.weight, query.bias, key.bias, value.bias) views of the fused
        weight and bias: one copy of the weights, whichever model an optimizer steps."""
        self._tied = tuple(parts)
        self._point_tied_at_fused()

    def untie(self) -> None:
        """Give HF's query/key/value their own storage again, holding the fused weight's current values (and its
        gradients): what a trained model leaves behind, in a form safetensors can save."""
        for fused, parts in ((self.qkv_weight, self._tied[:3]), (self.qkv_bias, self._tied[3:])):
            for part, value, grad in zip(parts, fused.detach().chunk(3, dim=0),
                                         (None,) * 3 if fused.grad is None else fused.grad.chunk(3, dim=0)):
                part.data = value.clone()
                part.requires_grad_(fused.requires_grad)
                part.grad = None if grad is None else grad.clone()
        self._tied = ()

    def _point_tied_at_fused(self) -> None:
        for fused, parts in ((self.qkv_weight, self._tied[:3]), (self.qkv_bias, self._tied[3:])):
            for part, view in zip(parts, fused.data.chunk(3, dim=0)):
                part.data = view

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._point_tied_at_fused()
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """HF's query/key/value come in and are concatenated into the fused weight. A missing or mis-shaped part is
        reported under HF's own key, never under the internal fused name."""
        not_loaded = []  # fused names whose HF parts were missing or mis-shaped (reported under HF's names)
        for kind, fused in (("weight", self.qkv_weight), ("bias", self.qkv_bias)):
            fused_key = prefix + "qkv_" + kind
            if fused_key in state_dict:  # already fused (a state dict taken with keep_vars or by hand)
                continue
            keys = [f"{prefix}{name}.{kind}" for name in _QKV]
            present = [k for k in keys if k in state_dict]
            parts = [state_dict.pop(k) for k in present]
            if len(parts) < 3:
                missing_keys.extend(k for k in keys if k not in present)
                not_loaded.append(fused_key)
                continue
            want = (fused.shape[0] // 3, *fused.shape[1:])
            wrong = [f"{k}: checkpoint {tuple(p.shape)} vs model {want}" for k, p in zip(keys, parts)
                     if tuple(p.shape) != want]
            if wrong:
                error_msgs.append("size mismatch for " + "; ".join(wrong))
                not_loaded.append(fused_key)
                continue
            state_dict[fused_key] = torch.cat(parts, dim=0)
        n_missing = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        missing_keys[n_missing:] = [k for k in missing_keys[n_missing:] if k not in not_loaded]
        self._point_tied_at_fused()  # assign=True puts new tensors in place


_QKV = ("query", "key", "value")


def _split_qkv(module, state_dict, prefix, local_metadata):
    """state_dict(): the fused weight goes out as HF's query/key/value (views, no copy)."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(prefix + "qkv_" + kind)
        for name, part in zip(_QKV, fused.chunk(3, dim=0)):
            state_dict[f"{prefix}{name}.{kind}"] = part


class BertSelfOutput(nn.Module):  # also serves as HF's BertOutput: a dense back to H, then residual + LayerNorm
    def __init__(self, config, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config, config.hidden_size)


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class LayerWeights(NamedTuple):
    """The twelve tensors of one BERT layer, as the four ops take them."""
    qkv: torch.Tensor
    qkv_bias: torch.Tensor
    attn_out: torch.Tensor
    attn_out_bias: torch.Tensor
    ln1: torch.Tensor
    ln1_bias: torch.Tensor
    ffn_in: torch.Tensor
    ffn_in_bias: torch.Tensor
    ffn_out: torch.Tensor
    ffn_out_bias: torch.Tensor
    ln2: torch.Tensor
    ln2_bias: torch.Tensor


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config  # read for the dropout probabilities in train mode
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config, config.intermediate_size)
        # read once: a transformers config attribute costs ~1 us, and the weights' shapes fix these anyway
        self.num_heads = config.num_attention_heads
        self.eps = config.layer_norm_eps
        self.activation = twins.ACTIVATIONS[config.hidden_act]
        self.scale = twins.default_scale(config.hidden_size // config.num_attention_heads)
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable (also a head's, transformers')

    def forward(self, x: torch.Tensor, attn, run, output_attentions: bool = False):
        """x [T, H] -> [T, H]. `attn`: a TokenLayout (packed) or an AttentionMask (padded rows); `run`: the four
        ops as resolved for this forward (dispatch.plan)."""
        w, eps = self.weights(), self.eps
        p_attn = self.config.attention_probs_dropout_prob if self.training else 0.0
        p_hidden = self.config.hidden_dropout_prob if self.training else 0.0

        qkv = run.qkv_projection(x, w.qkv, w.qkv_bias, self.num_heads)                         # [T, 3, nh, hd]
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions)           # [T, H]
        x = run.residual_layernorm(ctx, w.attn_out, w.attn_out_bias, x, w.ln1, w.ln1_bias, eps, p_hidden)  # [T, H]
        h = run.bias_gelu(x, w.ffn_in, w.ffn_in_bias, self.activation)                          # [T, I]
        x = run.residual_layernorm(h, w.ffn_out, w.ffn_out_bias, x, w.ln2, w.ln2_bias, eps, p_hidden)      # [T, H]
        return x, probs

    def weights(self) -> LayerWeights:
        """The layer's current parameters, read through the module dicts: nn.Module.__getattr__ costs ~0.3 us a
        step in Python, and reading HF's nested names that way was a quarter of a small batch's forward."""
        attention, ffn_in, ffn_out = self._modules["attention"], self._modules["intermediate"], self._modules["output"]
        fused, attn_out = attention._modules["self"]._parameters, attention._modules["output"]._modules
        ffn_in, ffn_out = ffn_in._modules["dense"]._parameters, ffn_out._modules
        o, ln1 = attn_out["dense"]._parameters, attn_out["LayerNorm"]._parameters
        f, ln2 = ffn_out["dense"]._parameters, ffn_out["LayerNorm"]._parameters
        return LayerWeights(fused["qkv_weight"], fused["qkv_bias"], o["weight"], o["bias"], ln1["weight"], ln1["bias"],
                            ffn_in["weight"], ffn_in["bias"], f["weight"], f["bias"], ln2["weight"], ln2["bias"])


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])


class BertPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_token_states):
        return torch.tanh(self.dense(first_token_states))                        # [n, H] from each [CLS] token


class BertModel(nn.Module):
    """The BERT-family encoder. `config`: a transformers config (kept as the very object: the model's `config`), a
    dict, or a config.json path; its model_type picks the embeddings (EMBEDDINGS). add_pooling_layer: None = the
    architecture's own (a pooler for BERT and RoBERTa, none for ELECTRA)."""

    main_input_name = "input_ids"  # what transformers' pipelines and Trainer read off a model

    def __init__(self, config, add_pooling_layer: bool | None = None, kernels="auto", padding_free: bool = True):
        super().__init__()
        config = configs.load(config)
        self.config = config
        kind = configs.ARCHITECTURES[config.model_type]
        if add_pooling_layer is None:
            add_pooling_layer = kind != "electra"
        elif add_pooling_layer and kind == "electra":
            raise ValueError("add_pooling_layer=True: an ELECTRA model has no pooler (transformers' ElectraModel "
                             "has none)")
        # Padded input runs on its real tokens only; False keeps padded execution (HF's values at padded positions).
        self.padding_free = padding_free
        self._plans = {}  # dispatch.Situation -> the resolved ops (dispatch.plan)
        self._plans_failures = 0  # len(fallback._FAILED) when the plans were made
        H = config.hidden_size
        width = config.embedding_size if kind == "electra" else H
        self.head_dim = H // config.num_attention_heads
        self.embeddings = EMBEDDINGS[kind](config, width)
        # ELECTRA: embeddings narrower than the layers are widened by a projection (HF's module name and key)
        self.embeddings_project = nn.Linear(width, H) if width != H else None
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.activation = twins.ACTIVATIONS[config.hidden_act]
        self._kernels = {op: "auto" for op in OPS}
        self.set_kernels(kernels)
        dispatch.triton_import_error()  # import the kernels now if they import at all: never inside a traced forward
        self.apply(self._init_weights)

    def _init_weights(self, module):
        """HF's initialisation, for models built from a config (loading overwrites it; on meta it costs nothing)."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                nn.init.zeros_(module.weight[module.padding_idx])
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        if isinstance(module, BertSelfAttention):
            nn.init.normal_(module.qkv_weight, std=std)
            nn.init.zeros_(module.qkv_bias)

    # ---- loading and saving (fastbert/loading.py does the work) -------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path, *, dtype=None, device=None, kernels="auto", add_pooling_layer=None,
                        torch_dtype=None, padding_free=True) -> "BertModel":
        """A local folder (config.json + model.safetensors / pytorch_model.bin) or a Hub id from the local cache, of
        any model_type in fastbert.MODEL_TYPES. add_pooling_layer=None: a pooler when the checkpoint has one."""
        from .loading import from_pretrained
        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree; give one of them")
        return from_pretrained(cls, name_or_path, dtype=dtype if dtype is not None else torch_dtype,
                               device=device, kernels=kernels, add_pooling_layer=add_pooling_layer,
                               padding_free=padding_free)

    @classmethod
    def from_hf(cls, hf_model, kernels="auto", padding_free=True) -> "BertModel":
        """From an in-memory transformers encoder (BertModel, RobertaModel, ..., or a head holding one). One copy of
        the weights: every module but the fused QKV is HF's own object, and HF's query/key/value become views of the
        fused weight, so training either model trains both."""
        from .loading import from_hf
        return from_hf(cls, hf_model, kernels=kernels, padding_free=padding_free)

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """config.json + model.safetensors (safe_serialization=False: pytorch_model.bin) that transformers loads."""
        from .loading import save_pretrained
        save_pretrained(self, save_directory, **kwargs)

    # ---- where callers of a transformers model touch it ---------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embeddings.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.word_embeddings.weight.dtype

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """transformers' resize: the first rows kept, new rows the mean of the old ones (mean_resizing, the centre of
        the distribution transformers samples them from) or drawn like a fresh model's; config.vocab_size follows."""
        old = self.get_input_embeddings()
        n = old.num_embeddings if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
        if n == old.num_embeddings:
            return old
        new = nn.Embedding(n, old.embedding_dim, padding_idx=old.padding_idx if (old.padding_idx or 0) < n else None,
                           device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            keep = min(n, old.num_embeddings)
            new.weight[:keep] = old.weight[:keep]
            if n > keep:
                if mean_resizing:
                    new.weight[keep:] = old.weight.mean(dim=0)
                else:
                    new.weight[keep:].normal_(std=self.config.initializer_range)
        new.weight.requires_grad_(old.weight.requires_grad)
        self.set_input_embeddings(new)
        self.config.vocab_size = n
        return new

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each layer in the backward pass instead of keeping its activations (train mode, torch path)."""
        import functools
        from torch.utils.checkpoint import checkpoint
        kwargs = {"use_reentrant": True} if gradient_checkpointing_kwargs is None else gradient_checkpointing_kwargs
        for layer in self.encoder.layer:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        for layer in self.encoder.layer:
            layer.gradient_checkpointing = False

    activation_checkpointing_enable = gradient_checkpointing_enable  # transformers 5's newer names
    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(layer.gradient_checkpointing for layer in self.encoder.layer)

    def can_generate(self) -> bool:  # transformers' pipelines ask
        return False

    # ---- the per-op switch -------------------------------------------------------------------------------------
    @property
    def kernels(self) -> dict:
        """op name -> requested backend ("auto", "torch" or "triton")."""
        return dict(self._kernels)

    def resolved_kernels(self, tokens: int = 512, max_seqlen: int = 128) -> dict:
        """op -> "triton" or "torch": what an inference forward of `tokens` real tokens (longest sequence
        `max_seqlen`) runs here. On a GPU, "auto" ops are measured for that bucket first if they were not yet."""
        run = self.resolve_ops(needs_grad=False, tokens=tokens, max_seqlen=max_seqlen)
        failed = {op for op in run.triton if fallback.failed(op, self.dtype, tokens)}  # "auto" left them on their twin
        return {op: "triton" if op in run.triton - failed else "torch" for op in OPS}

    def set_kernels(self, backend=None, **per_op) -> "BertModel":
        """set_kernels("triton") sets every op; set_kernels(attention="torch", ...) sets single ops; or a dict."""
        if isinstance(backend, dict):
            per_op = {**backend, **per_op}
            backend = None
        wanted = dict.fromkeys(OPS, backend) if backend is not None else {}
        wanted.update(per_op)
        if not wanted:
            raise ValueError(f"set_kernels needs a backend for every op ({', '.join(dispatch.BACKENDS)}) or op=backend "
                             f"pairs (ops: {', '.join(OPS)}); got {'an empty dict' if isinstance(backend, dict) else backend!r}")
        for op, b in wanted.items():
            dispatch.check_backend(op, b)
            if b == "triton" and dispatch.triton_import_error():
                raise RuntimeError(f"kernels: op {op!r} asked for 'triton' but {dispatch.triton_import_error()}")
        self._kernels.update(wanted)
        return self

    # ---- forward -----------------------------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                output_hidden_states=None, output_attentions=None, return_dict=None, use_cache=None,
                cu_seqlens=None, max_seqlen=None, **kwargs):
        """HF's BertModel.forward. Packed input: `input_ids` [T] with `cu_seqlens` [n + 1] (and optionally
        `max_seqlen`) returns packed outputs ([T, H], pooler [n, H]); HF's own `cu_seq_lens_q` / `max_length_q` with
        [1, T] ids are accepted as transformers takes them. Unset output flags take the config's values, as HF's do;
        keywords a head or Trainer passes that an encoder has no use for (num_items_in_batch, ...) are ignored."""
        cfg = self.config
        output_hidden_states = bool(cfg.output_hidden_states if output_hidden_states is None else output_hidden_states)
        output_attentions = bool(getattr(cfg, "output_attentions", False) if output_attentions is None
                                 else output_attentions)
        return_dict = getattr(cfg, "return_dict", True) if return_dict is None else return_dict
        batch = prepare(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                        output_attentions, cu_seqlens, max_seqlen, **kwargs)
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or (batch.inputs_embeds is not None and batch.inputs_embeds.requires_grad))
        run = self.resolve_ops(needs_grad, batch.why_padded(output_attentions), *batch.size)
        x, hidden_states, attentions = self.encode(batch.input_ids, batch.token_type_ids, batch.position_ids,
                                                   batch.attn, run, batch.inputs_embeds, output_hidden_states,
                                                   output_attentions)
        out = self.finish(batch, x, hidden_states, attentions, output_hidden_states, output_attentions)
        return out if return_dict else out.to_tuple()

    def cuda_graphs(self, token_buckets=(128, 256, 512, 1024, 2048, 4096, 8192), max_seqs: int = 256,
                    max_seqlen: int | None = None):
        """A runner that replays CUDA graphs of `encode` captured for packed token-count buckets (fastbert/graphs.py);
        call it like the model. Resolves every bucket's backends now; captures each bucket on its first use (or all of
        them at runner.capture())."""
        from .graphs import GraphRunner
        return GraphRunner(self, token_buckets, max_seqs, max_seqlen)

    def encode(self, input_ids, token_type_ids, position_ids, attn, run, inputs_embeds=None,
               keep_hidden_states=False, output_attentions=False):
        """The device-only part: packed tokens [T] -> final hidden states [T, H]. No host read, no branch on tensor
        values (a CUDA graph captures this)."""
        x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)       # [T, H] (ELECTRA: [T, E])
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)                                               # [T, E] -> [T, H]
        hidden_states, attentions = [x] if keep_hidden_states else None, [] if output_attentions else None
        checkpointing = self.training and torch.is_grad_enabled()
        for layer in self.encoder.layer:
            if checkpointing and layer.gradient_checkpointing:  # recomputed in backward, activations not kept
                x, probs = layer._gradient_checkpointing_func(layer.__call__, x, attn, run, output_attentions)
            else:
                x, probs = layer(x, attn, run, output_attentions)
            if keep_hidden_states:
                hidden_states.append(x)
            if output_attentions:
                attentions.append(probs)
        return x, hidden_states, attentions

    def finish(self, batch: Batch, x, hidden_states, attentions, output_hidden_states, output_attentions):
        """Packed [T, H] -> the caller's shape (zeros at padded positions), the pooler, HF's output class."""
        layout = batch.layout
        if batch.output == "packed":  # packed in, packed out
            shaped, first = (lambda h: h), (lambda h: first_tokens(h, layout))
        elif batch.output == "hf_packed":  # transformers' packed form: one row of T tokens; its pooler reads token 0
            shaped, first = (lambda h: h[None]), (lambda h: h[:1])
        elif layout is not None:
            shaped, first = (lambda h: pad(h, layout)), (lambda h: first_tokens(h, layout))
        elif batch.real_tokens is not None:  # padded rows of a padding-free model: the outputs packing would give
            B, S, keep = *batch.shape, batch.real_tokens
            first_real = keep.to(torch.int32).argmax(dim=1)  # a row with no real token: 0, which is zeroed below
            shaped = lambda h: h.view(B, S, h.shape[-1]) * keep[:, :, None]  # noqa: E731
            first = lambda h: shaped(h)[torch.arange(B, device=h.device), first_real]  # noqa: E731
        else:  # padded rows: HF's pooler reads position 0 of every row
            B, S = batch.shape
            shaped, first = (lambda h: h.view(B, S, h.shape[-1])), (lambda h: h.view(B, S, h.shape[-1])[:, 0])
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=shaped(x),
            pooler_output=self.pooler(first(x)) if self.pooler is not None else None,
            hidden_states=tuple(shaped(h) for h in hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
            cross_attentions=_EMPTY_CROSS_ATTENTIONS if output_attentions else None,  # as the installed transformers
        )

    def resolve_ops(self, needs_grad: bool = False, padded: str | None = None, tokens: int = 0,
                    max_seqlen: int = 0, ragged: bool = True) -> dispatch.Ops:
        """The four ops for this situation (device, dtype, autograd, dropout, why attention runs padded rows if it
        does, and on a GPU the token and sequence-length buckets "auto" measured for, and whether the sequences'
        lengths differ), resolved once and cached: a forward pays one dictionary lookup for its backend choices. A
        kernel failure under "auto" (fallback.kernel_failed) drops the cache, so the plans say what runs."""
        weight = self.embeddings.word_embeddings.weight
        cfg = self.config
        kernels = tuple(self._kernels[op] for op in OPS)
        shapes = None
        if weight.device.type in dispatch.MEASURED_DEVICE_TYPES and "auto" in kernels and not needs_grad \
                and not self.training and tokens:
            shapes = auto.Shapes(auto.token_bucket(tokens), cfg.hidden_size, cfg.intermediate_size,
                                 cfg.num_attention_heads, self.head_dim, auto.token_bucket(max_seqlen), self.activation,
                                 ragged)
        situation = dispatch.Situation(
            kernels, weight.device, weight.dtype, self.head_dim, needs_grad,
            cfg.attention_probs_dropout_prob if self.training else 0.0,
            cfg.hidden_dropout_prob if self.training else 0.0, padded, shapes)
        if dispatch.tracing():  # a compiled graph bakes the choice in; no cache to mutate inside it
            return dispatch.plan(situation)
        if self._plans_failures != len(fallback._FAILED):
            self._plans.clear()
            self._plans_failures = len(fallback._FAILED)
        run = self._plans.get(situation)
        if run is None:
            run = self._plans[situation] = dispatch.plan(situation)
        return run


class AutoModel:
    """transformers.AutoModel's entry points for the family fastbert runs: the model_type in the config picks the
    embeddings (every supported type is a fastbert.BertModel); any other model_type raises NotImplementedError
    naming it."""

    @staticmethod
    def from_pretrained(name_or_path, **kwargs) -> BertModel:
        return BertModel.from_pretrained(name_or_path, **kwargs)

    @staticmethod
    def from_config(config, **kwargs) -> BertModel:
        return BertModel(config, **kwargs)

    @staticmethod
    def from_hf(hf_model, **kwargs) -> BertModel:
        return BertModel.from_hf(hf_model, **kwargs)
