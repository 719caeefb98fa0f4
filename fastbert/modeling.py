"""fastbert.BertModel: Hugging Face's BertModel, same checkpoints, same calls, same numbers, four fused ops.

One forward, token-major (T = batch * seq):

    ids [B, S] -> embeddings (word + type + position, LayerNorm)         -> x [T, H]
    attention_mask [B, S] -> AttentionMask, once per forward
    per layer:
        qkv = qkv_projection(x)                          [T, 3, nh, hd]   one GEMM over the fused W_qkv
        ctx = attention(qkv, mask)                       [T, H]           flash attention over packed qkv
        x   = residual_layernorm(ctx @ W_o + b_o + x)    [T, H]
        h   = bias_gelu(x @ W_1 + b_1)                   [T, I]
        x   = residual_layernorm(h @ W_2 + b_2 + x)      [T, H]
    -> last_hidden_state [B, S, H]; pooler_output = tanh(x[:, 0] @ W_p + b_p)

Each op runs on the backend named in `model.kernels` (see fastbert/ops.py). Module and parameter names follow HF's so
that state_dict keys are HF's; the one difference inside is the fused W_qkv, which state_dict splits back into
query/key/value (and load_state_dict concatenates).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from . import ops
from .config import BertConfig
from .ops import OPS, AttentionMask


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids, position_ids, inputs_embeds):
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        # HF's order of additions, so that fp32 sums round identically
        x = inputs_embeds + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(x))                                   # [B, S, H]


class BertSelfAttention(nn.Module):
    """Holds the fused QKV projection: W_qkv [3H, H] = cat(W_q, W_k, W_v), built once at load time. Outside, in
    state_dict() and load_state_dict() (and their errors), it is HF's query/key/value."""

    def __init__(self, config: BertConfig):
        super().__init__()
        H = config.hidden_size
        self.qkv_weight = nn.Parameter(torch.empty(3 * H, H))
        self.qkv_bias = nn.Parameter(torch.empty(3 * H))
        self.register_state_dict_post_hook(_split_qkv)

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


_QKV = ("query", "key", "value")


def _split_qkv(module, state_dict, prefix, local_metadata):
    """state_dict(): the fused weight goes out as HF's query/key/value (views, no copy)."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(prefix + "qkv_" + kind)
        for name, part in zip(_QKV, fused.chunk(3, dim=0)):
            state_dict[f"{prefix}{name}.{kind}"] = part


class BertSelfOutput(nn.Module):  # also serves as HF's BertOutput: a dense back to H, then residual + LayerNorm
    def __init__(self, config: BertConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config, config.hidden_size)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config, config.intermediate_size)
        self.activation = ops.ACTIVATIONS[config.hidden_act]
        self.scale = ops.default_scale(config.head_dim)

    def forward(self, x: torch.Tensor, mask: AttentionMask, kernels: dict, output_attentions: bool):
        cfg, qkv_w, attn_out = self.config, self.attention.self, self.attention.output
        p_attn = cfg.attention_probs_dropout_prob if self.training else 0.0
        p_hidden = cfg.hidden_dropout_prob if self.training else 0.0
        eps = cfg.layer_norm_eps

        qkv = ops.qkv_projection(x, qkv_w.qkv_weight, qkv_w.qkv_bias, cfg.num_attention_heads,
                                 backend=kernels["qkv_projection"])                          # [T, 3, nh, hd]
        ctx, probs = ops.attention(qkv, mask, self.scale, dropout_p=p_attn, return_probs=output_attentions,
                                   backend=kernels["attention"])                             # [T, H]
        x = ops.residual_layernorm(ctx, attn_out.dense.weight, attn_out.dense.bias, x,
                                   attn_out.LayerNorm.weight, attn_out.LayerNorm.bias, eps,
                                   dropout_p=p_hidden, backend=kernels["residual_layernorm"])  # [T, H]
        h = ops.bias_gelu(x, self.intermediate.dense.weight, self.intermediate.dense.bias, self.activation,
                          backend=kernels["bias_gelu"])                                      # [T, I]
        x = ops.residual_layernorm(h, self.output.dense.weight, self.output.dense.bias, x,
                                   self.output.LayerNorm.weight, self.output.LayerNorm.bias, eps,
                                   dropout_p=p_hidden, backend=kernels["residual_layernorm"])  # [T, H]
        return x, probs


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, last_hidden_state):
        return torch.tanh(self.dense(last_hidden_state[:, 0]))                    # [B, H] from the [CLS] token


# Arguments HF's BertModel.forward accepts that only make sense for decoders / caches: accepted when unused.
_DECODER_ONLY_ARGS = ("encoder_hidden_states", "encoder_attention_mask", "past_key_values", "cache", "head_mask")


class BertModel(nn.Module):
    def __init__(self, config, add_pooling_layer: bool = True, kernels="auto"):
        super().__init__()
        config = BertConfig.from_any(config)
        config.check_supported()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self._kernels = {op: "auto" for op in OPS}
        self.set_kernels(kernels)
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
    def from_pretrained(cls, name_or_path, *, dtype=None, device=None, kernels="auto", add_pooling_layer=True,
                        torch_dtype=None) -> "BertModel":
        """A local folder (config.json + model.safetensors / pytorch_model.bin) or a Hub id from the local cache."""
        from .loading import from_pretrained
        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree; give one of them")
        return from_pretrained(cls, name_or_path, dtype=dtype if dtype is not None else torch_dtype,
                               device=device, kernels=kernels, add_pooling_layer=add_pooling_layer)

    @classmethod
    def from_hf(cls, hf_model, kernels="auto") -> "BertModel":
        """From an in-memory transformers BertModel (or a BertFor* model): shares its parameters, fuses only W_qkv."""
        from .loading import from_hf
        return from_hf(cls, hf_model, kernels=kernels)

    def save_pretrained(self, folder) -> None:
        from .loading import save_pretrained
        save_pretrained(self, folder)

    # ---- the per-op switch -------------------------------------------------------------------------------------
    @property
    def kernels(self) -> dict:
        """op name -> requested backend ("auto", "torch" or "triton")."""
        return dict(self._kernels)

    def set_kernels(self, backend=None, **per_op) -> "BertModel":
        """set_kernels("triton") sets every op; set_kernels(attention="torch", ...) sets single ops; or a dict."""
        if isinstance(backend, dict):
            per_op = {**backend, **per_op}
            backend = None
        wanted = dict.fromkeys(OPS, backend) if backend is not None else {}
        wanted.update(per_op)
        if not wanted:
            raise ValueError(f"set_kernels needs a backend for every op ({', '.join(ops.BACKENDS)}) or op=backend "
                             f"pairs (ops: {', '.join(OPS)}); got {'an empty dict' if isinstance(backend, dict) else backend!r}")
        for op, b in wanted.items():
            ops.check_backend(op, b)
            if b == "triton" and ops.triton_import_error():
                raise RuntimeError(f"kernels: op {op!r} asked for 'triton' but {ops.triton_import_error()}")
        self._kernels.update(wanted)
        return self

    # ---- forward -----------------------------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                output_hidden_states=None, output_attentions=None, return_dict=None, use_cache=None, **unused):
        for name, value in unused.items():
            if name not in _DECODER_ONLY_ARGS:
                raise TypeError(f"BertModel.forward() got an unexpected keyword argument {name!r}")
            if value is not None:
                raise NotImplementedError(f"{name} is not supported: fastbert is an encoder without cross-attention "
                                          f"or caches")
        input_ids, token_type_ids, position_ids, mask_flags = self._check_inputs(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)

        x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)       # [B, S, H]
        B, S, H = x.shape
        mask = AttentionMask.build(attention_mask, B, S, x.dtype, flags=mask_flags)
        x = x.reshape(B * S, H)                                                           # token-major [T, H]

        hidden_states, attentions = [x], []
        for layer in self.encoder.layer:
            x, probs = layer(x, mask, self._kernels, bool(output_attentions))
            hidden_states.append(x)
            attentions.append(probs)

        last_hidden_state = x.view(B, S, H)
        pooled = self.pooler(last_hidden_state) if self.pooler is not None else None
        out = BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=last_hidden_state,
            pooler_output=pooled,
            hidden_states=tuple(h.view(B, S, H) for h in hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
            # transformers 5 reports an empty cross_attentions tuple alongside attentions; so do we (tuple order)
            cross_attentions=() if output_attentions else None,
        )
        return out if return_dict is None or return_dict else out.to_tuple()

    def _check_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds):
        """Turn bad input into a clear error here, never an IndexError, a device assert or NaN deep inside."""
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds "
                             f"(got {'both' if input_ids is not None else 'neither'})")
        device = self.embeddings.word_embeddings.weight.device
        if input_ids is not None:
            if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
                raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
            shape, first = tuple(input_ids.shape), ("input_ids", input_ids)
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != cfg.hidden_size:
                raise ValueError(f"inputs_embeds must be [batch, seq, {cfg.hidden_size}], "
                                 f"got shape {tuple(inputs_embeds.shape)}")
            dtype = self.embeddings.word_embeddings.weight.dtype
            if inputs_embeds.dtype != dtype:
                raise TypeError(f"inputs_embeds has dtype {inputs_embeds.dtype} but the model is {dtype}")
            shape, first = tuple(inputs_embeds.shape[:2]), ("inputs_embeds", inputs_embeds)
        B, S = shape
        if S == 0:
            raise ValueError(f"{first[0]} has sequence length 0 (shape {tuple(first[1].shape)}); every row needs at "
                             f"least one position")
        if S > cfg.max_position_embeddings and position_ids is None:
            raise ValueError(f"sequence length {S} exceeds max_position_embeddings={cfg.max_position_embeddings}")

        named = [("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                 ("position_ids", position_ids)]
        if first[1].device != device:
            raise ValueError(f"{first[0]} is on {first[1].device} but the model is on {device}; "
                             f"move it with .to({str(device)!r})")
        for name, t in named:
            if t is None:
                continue
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but the model is on {device}; move it with .to({str(device)!r})")
            if name != "attention_mask" and (t.is_floating_point() or t.dtype == torch.bool):
                raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
            if name == "attention_mask" and t.dim() in (3, 4):
                continue  # a custom mask: checked by its own shape below
            if name == "position_ids" and tuple(t.shape) == (1, S):
                continue  # HF broadcasts a [1, S] position_ids over the batch
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)} but the input is {list(shape)}")
        if attention_mask is not None and attention_mask.dim() in (3, 4):
            if attention_mask.dim() == 3:
                ok = tuple(attention_mask.shape) == (B, S, S)
            else:
                ok = attention_mask.shape[0] == B and attention_mask.shape[1] in (1, cfg.num_attention_heads) \
                    and tuple(attention_mask.shape[2:]) == (S, S)
            if not ok:
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; a custom mask must be "
                                 f"[{B}, {S}, {S}] or [{B}, 1 or {cfg.num_attention_heads}, {S}, {S}]")

        if token_type_ids is None:
            token_type_ids = torch.zeros(shape, dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = torch.arange(S, device=device).expand(B, S)
        elif position_ids.shape[0] == 1 and B != 1:
            position_ids = position_ids.expand(B, S)

        # Index ranges, 0/1 masks, and what a 2-D mask pads, in one host sync per forward: an out-of-range id would
        # be a device assert on CUDA, an all-ones mask lets attention skip masking altogether, and only a batch with
        # a fully padded row needs the twin's extra pass for it.
        checks = [(name, t, limit) for name, t, limit in (
            ("input_ids", input_ids, cfg.vocab_size), ("token_type_ids", token_type_ids, cfg.type_vocab_size),
            ("position_ids", position_ids, cfg.max_position_embeddings)) if t is not None and t.numel()]
        values = [v.long() for _, t, _ in checks for v in torch.aminmax(t)]
        zero_one = attention_mask is not None and not (attention_mask.dim() == 4 and attention_mask.is_floating_point())
        if zero_one:
            values.append(ops.not_zero_one(attention_mask).long())
        two_d_mask = attention_mask is not None and attention_mask.dim() == 2
        if two_d_mask:
            values.extend(ops.padding_flags(attention_mask != 0))
        if ops.tracing():  # no host read while a graph is recorded: the checks become asynchronous asserts
            for i, (name, _, limit) in enumerate(checks):
                torch._assert_async((values[2 * i] >= 0) & (values[2 * i + 1] < limit), f"{name} out of range")
            return input_ids, token_type_ids, position_ids, None
        stats = torch.stack(values).tolist() if values else []
        for i, (name, _, limit) in enumerate(checks):
            lo, hi = stats[2 * i], stats[2 * i + 1]
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{name} contains {bad}, outside [0, {limit})"
                                 f"{' (vocab_size)' if name == 'input_ids' else ''}")
        if zero_one and stats[2 * len(checks)]:
            raise ValueError(f"attention_mask holds values other than 0 and 1 (dtype {attention_mask.dtype}, "
                             f"{attention_mask.dim()}-D); only a floating 4-D mask may be additive (see README, Masks)")
        mask_flags = tuple(stats[-2:]) if two_d_mask else None
        return input_ids, token_type_ids, position_ids, mask_flags
