"""fastbert.BertModel: Hugging Face's BertModel, same checkpoints, same calls, same numbers, four fused ops.

One model for every family fastbert runs (fastbert/families.py): BERT and the BERT-architecture embedding models
(BGE, E5, GTE), RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA discriminators, DistilBERT, MPNet, ModernBERT,
DeBERTa-v2/v3, Jina-Embeddings-v3, NomicBERT, GTE (model_type gte) and EuroBERT. A family is data: HF's module path
of each of the layer's tensors, and its values along a few named axes (embeddings, positions, norm placement and
kind, MLP kind, attention bias kind, windows). The axes pick the embeddings and the layer shape (fastbert/layers/:
one file each); this file holds what every family shares.

One forward in three parts:

    prepare (host, fastbert/inputs.py): validate, fill defaults, one host read; a padded batch [B, S] becomes its
        T real tokens, packed, and a TokenLayout (cu_seqlens: where each sequence starts)
    encode (device only; what a CUDA graph captures):
        x = embeddings(ids, types, positions)                              [T, H]   (ELECTRA: [T, E] @ W_proj)
        positions = what attention reads of positions, once per forward    (bias table, rotary cos/sin, ...)
        per layer: x = layer(x, layout, positions)                          [T, H]   fastbert/layers/<shape>.py
        x = final_norm(x)                                                   (pre-norm families)
    finish: scatter back to [B, S, H] once (zeros at padding); pooler = tanh(first token @ W_p + b_p); HF's outputs

Each op runs on the backend named in `model.kernels`, resolved once per forward (fastbert/dispatch.py). Module and
parameter names are HF's (query/key/value included: named_parameters, state_dict, PEFT targets); underneath, query/
key/value's weights are rows of one fused W_qkv, so the projection is one GEMM (docs/contract.md says why).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import transformers
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPast,
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPooling,
    BaseModelOutputWithPoolingAndCrossAttentions,
)

from . import (
    adapters,
    dispatch,
    fallback,
    families,
    formats,
    installed,
    layers,
    measure,
    relative,
    rotary,
    twins,
    units,
)
from . import config as configs
from .compat import TransformersModelMixin
from .dispatch import OPS
from .inputs import Batch, prepare
from .layers import host
from .layers.base import NO_DROPOUT, OffsetRMSNorm, RMSNorm
from .layout import first_tokens, pad, unpad
from .mask import AttentionMask, tracing

# MPNet's buckets stop changing at 128 tokens apart (HF's max_distance): a table reaching 128 is exact at any length
RELATIVE_REACH = 129

# With output_attentions, transformers 5 reports an empty cross_attentions tuple alongside attentions (part of the
# return_dict=False tuple); 4.x reports None, which the tuple leaves out.
_EMPTY_CROSS_ATTENTIONS = () if int(transformers.__version__.split(".")[0]) >= 5 else None


class BertEncoder(nn.Module):
    """The layers (HF's `encoder`; DistilBERT's `transformer`) and what the attention bias reads, built once per
    forward: MPNet's relative position bias embedding [buckets, nh], DeBERTa's rel_embeddings."""

    def __init__(self, config, family: families.Family = families.BERT):
        super().__init__()
        shape = layers.layer_class(family)
        self.layer = nn.ModuleList([shape(config, family, i) for i in range(config.num_hidden_layers)])
        if family.attention_bias == "buckets":
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets,
                                                        config.num_attention_heads)
        if family.attention_bias == "disentangled":  # HF's rel_embeddings [2 * span, H] and their LayerNorm, in order
            if getattr(config, "relative_attention", False):
                self.rel_embeddings = nn.Embedding(2 * relative.deberta_span(config), config.hidden_size)
            if "layer_norm" in configs.deberta_norm_rel_ebd(config):
                self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_token_states, tasks=None):
        """tanh(dense(x)) [n, H] from each sequence's first token; `tasks` [n, tasks * rank]: each sequence's task
        selection (adapters.task_select), where the model has task adapters (Jina's pooler has one)."""
        h = host.linear(self._modules["dense"], first_token_states)
        if tasks is not None:
            h = self._modules["task_adapters"]["dense"].add_delta(h, first_token_states, tasks)
        return torch.tanh(h)


def _same(h):
    return h


def _shapes(batch: Batch):
    """(shaped, unshaped, first) for a batch: packed [T, H] -> the caller's shape (zeros at padded positions), its
    inverse, and the tokens the pooler reads."""
    layout = batch.layout
    if batch.output == "packed":  # packed in, packed out
        return _same, _same, lambda h: first_tokens(h, layout)
    B, S = batch.shape
    unshaped = lambda h: h.reshape(B * S, h.shape[-1])  # noqa: E731
    if batch.output == "rows":  # sequences packed inside B rows of S real tokens: transformers pools each row's token 0
        return (lambda h: h.view(B, S, h.shape[-1])), unshaped, (lambda h: h[::S])
    if layout is not None:
        return (lambda h: pad(h, layout)), (lambda h: unpad(h, layout)), (lambda h: first_tokens(h, layout))
    if batch.real_tokens is not None:  # padded rows of a padding-free model: the outputs packing would give
        keep = batch.real_tokens
        first_real = keep.to(torch.int32).argmax(dim=1)  # a row with no real token: 0, which is zeroed below
        shaped = lambda h: h.view(B, S, h.shape[-1]) * keep[:, :, None]  # noqa: E731
        return shaped, unshaped, lambda h: shaped(h)[torch.arange(B, device=h.device), first_real]
    # padded rows: HF's pooler reads position 0 of every row
    return (lambda h: h.view(B, S, h.shape[-1])), unshaped, (lambda h: h.view(B, S, h.shape[-1])[:, 0])


class HiddenStates:
    """Which hidden states a forward returns, and in the caller's shape. As in transformers, hidden_states[i] is the
    tensor layer i consumes: the packed layer input is gathered back from it, so gradients reach it (attribution
    methods read them). Layers not selected cost nothing; without output_hidden_states there is no HiddenStates."""

    def __init__(self, selected, shaped, unshaped):
        self.selected, self.shaped, self.unshaped = selected, shaped, unshaped

    @staticmethod
    def of(output_hidden_states, num_layers: int, batch: Batch) -> "HiddenStates | None":
        """transformers' `output_hidden_states`: a flag, or (transformers 5) the index or indices of the hidden states
        to keep (negative ones count from the end; out of range select nothing); the others come back as None."""
        if not output_hidden_states:
            return None
        selected = None
        if not isinstance(output_hidden_states, bool):
            indices = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
                raise TypeError(f"output_hidden_states must be a bool, an int or a list of ints, got "
                                f"{output_hidden_states!r}")
            n = num_layers + 1
            selected = {i % n for i in indices if -n <= i < n}
        shaped, unshaped, _ = _shapes(batch)
        return HiddenStates(selected, shaped, unshaped)

    def record(self, states: list, x: torch.Tensor) -> torch.Tensor:
        """Append hidden state len(states) (or None) and return what the next layer consumes."""
        if self.selected is not None and len(states) not in self.selected:
            states.append(None)
            return x
        h = self.shaped(x)
        states.append(h)
        return self.unshaped(h)


class BertModel(TransformersModelMixin, nn.Module):
    """The encoder of every family fastbert runs. `config`: a transformers config (kept as the very object: the
    model's `config`), a dict, or a config.json path; its model_type picks the family (fastbert/families.py: HF's
    module paths, the embeddings, the attention bias). add_pooling_layer: None = the family's own (a pooler for BERT,
    RoBERTa and MPNet, none for ELECTRA and DistilBERT)."""

    main_input_name = "input_ids"  # what transformers' pipelines and Trainer read off a model

    def __init__(self, config, add_pooling_layer: bool | None = None, kernels="auto", padding_free: bool = True):
        super().__init__()
        config = configs.load(config)
        self.config = config
        self.family = family = families.of(config)
        if add_pooling_layer is None:
            add_pooling_layer = family.pooler
        elif add_pooling_layer and not family.can_pool:
            raise ValueError(f"add_pooling_layer=True: {family.title} has no pooler (transformers' "
                             f"{families.encoder_class(config.model_type)} has none)")
        # Padded input runs on its real tokens only; False keeps padded execution (HF's values at padded positions).
        self.padding_free = padding_free
        self._plans = {}  # dispatch.Situation -> the resolved ops (dispatch.plan)
        self._plans_failures = 0  # len(fallback._FAILED) when the plans were made
        self._warned_autograd = False  # said once per model (BertModel._warn_autograd_in_eval)
        H = config.hidden_size
        width = config.embedding_size if family.projection else H
        self.head_dim = family.head_dim(config)
        embeddings = layers.embeddings_class(family)(config, width, family)
        if isinstance(embeddings, nn.Module):
            self.embeddings = embeddings
        else:  # EuroBERT's table sits on the model itself (HF's embed_tokens); `embeddings` reads it there
            embeddings.attach(self)
            self.__dict__["embeddings"] = embeddings
        # ELECTRA: embeddings narrower than the layers are widened by a projection (HF's module name and key)
        self.embeddings_project = nn.Linear(width, H) if width != H else None
        self._layer_class = layers.layer_class(family)
        if family.layers == "layers":  # ModernBERT: the layers' list itself under the model (HF's `layers`, which is
            # also the name of the property below: add_module would refuse it)
            self._modules[family.layers] = nn.ModuleList([self._layer_class(config, family, i)
                                                          for i in range(config.num_hidden_layers)])
        else:
            self.add_module(family.layers, BertEncoder(config, family))  # HF's: encoder (DistilBERT: transformer)
        # the norm after the last layer, at HF's name (ModernBERT: final_norm; EuroBERT: norm), or None
        self.__dict__["_final_norm_name"] = family.final_norm_name if family.final_norm else None
        if family.final_norm:
            eps = family.get(config, "layer_norm_eps")
            norm = {"rms": RMSNorm, "rms_offset": OffsetRMSNorm}.get(family.norm_kind)
            self.add_module(family.final_norm_name, norm(H, eps) if norm is not None
                            else nn.LayerNorm(H, eps=eps, bias=config.norm_bias))
        self.__dict__["_inv_freq"] = {}  # (layer type, device) -> rotary (inv_freq, factor), made on first use
        # DeBERTa: the column each distance j - i reads, one table for every length (relative.deberta_column_table)
        self._disentangled = family.attention_bias == "disentangled" and any(layer.c2p or layer.p2c
                                                                             for layer in self.layers)
        self.__dict__["_columns"] = {"cpu": relative.deberta_column_table(config)} if self._disentangled else {}
        if self._disentangled:
            for layer in self.layers:  # one table (per device) for every layer
                layer.__dict__["_columns"] = self._columns
        # what "auto" times each op with besides the shapes (its unit's Variant). Attention: the bias table's reach,
        # the local layers' half-window (attention is timed as the local layers run it, two of every three in
        # ModernBERT; its global layers take the same choice), rotary q/k, DeBERTa's P columns, the query heads per
        # key/value head (EuroBERT)
        window = next((layer.window for layer in self.layers if getattr(layer, "window", None) is not None), None)
        kv_heads = next((layer.kv_heads for layer in self.layers if hasattr(layer, "kv_heads")), None)
        self._variants = (
            units.attention.Variant(RELATIVE_REACH if family.attention_bias == "buckets" else 0, window,
                                    family.positions == "rotary",
                                    2 * relative.deberta_span(config) if self._disentangled else 0,
                                    config.num_attention_heads // kv_heads if kv_heads else 1, family.causal),
            units.bias_gelu.Variant(gated=family.mlp == "gated"),
            units.residual_layernorm.Variant(pre_norm=family.norm == "pre", rms=family.norm_kind == "rms"))
        self.pooler = BertPooler(config) if add_pooling_layer else None
        # Jina-Embeddings-v3's task adapters, where a checkpoint brings them (adapters.attach_task_adapters): the
        # tasks' names (adapter_mask's indices), their rank and scaling
        self.task_names, self.task_rank, self.task_scaling = (), 0, 0.0
        self.activation = twins.ACTIVATIONS[family.get(config, "hidden_act")]
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
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:  # ModernBERT's norm_bias=False
                nn.init.zeros_(module.bias)
        if module is self.embeddings and getattr(self.config, "sinusoidal_pos_embds", False):  # DistilBERT's option
            from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings
            weight = module.position_embeddings.weight
            if weight.device.type != "meta":
                with torch.no_grad():
                    create_sinusoidal_embeddings(weight.shape[0], weight.shape[1], weight)

    @property
    def layers(self) -> nn.ModuleList:
        """The encoder layers (HF's encoder.layer; DistilBERT's transformer.layer; ModernBERT's layers)."""
        container = self._modules[self.family.layers]
        return container if isinstance(container, nn.ModuleList) else container.layer

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
            got = "an empty dict" if isinstance(backend, dict) else repr(backend)
            raise ValueError(f"set_kernels needs a backend for every op ({', '.join(dispatch.BACKENDS)}) or op=backend "
                             f"pairs (ops: {', '.join(OPS)}); got {got}")
        for op, b in wanted.items():
            dispatch.check_backend(op, b)
            if b == "triton" and dispatch.triton_import_error():
                raise RuntimeError(f"kernels: op {op!r} asked for 'triton' but {dispatch.triton_import_error()}")
        self._kernels.update(wanted)
        return self

    # ---- the number format of the GEMMs (fastbert/formats.py) ---------------------------------------------------
    @property
    def quantize(self) -> str:
        """The GEMMs' number format: "fp32" (the weights as they are, in the model's dtype), "bf16" or "int8"."""
        fmt = self.__dict__.get("number_format")
        return "fp32" if fmt is None else fmt.name

    def set_format(self, quantize) -> "BertModel":
        """Run the GEMMs of the three ops that hold one in `quantize` ("fp32", "bf16", "int8"), for inference; the
        parameters stay as they are (state_dict, save_pretrained: the checkpoint's). The weights are prepared on the
        first forward. fastbert.quality measures what a format costs against the model's own weights. int8 set
        here runs without outlier channels until `quality.calibrate` (or `quality.measure`) finds them; every
        loading surface (quantize=) does both."""
        fmt = formats.format_of(quantize)
        if fmt is not None and self.dtype != torch.float32:
            raise ValueError(f"quantize={quantize!r} takes a float32 model (its GEMMs round the fp32 weights); this "
                             f"one is {self.dtype}: load it with dtype=torch.float32")
        self.__dict__["number_format"] = fmt
        self.__dict__["format_quality"] = None  # measured for the format it was measured in only
        return self

    # ---- forward -----------------------------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                output_hidden_states=None, output_attentions=None, return_dict=None, use_cache=None,
                cu_seqlens=None, max_seqlen=None, adapter_mask=None, **kwargs):
        """HF's BertModel.forward. Packed input: `input_ids` [T] with `cu_seqlens` [n + 1] (and optionally
        `max_seqlen`) returns packed outputs ([T, H], pooler [n, H]); HF's own `cu_seq_lens_q` / `max_length_q` with
        [1, T] ids are accepted as transformers takes them. Unset output flags take the config's values, as HF's do;
        keywords a head or Trainer passes that an encoder has no use for (num_items_in_batch, ...) are ignored.
        adapter_mask: with Jina-Embeddings-v3's task adapters, one task index per sequence ([B] padded, [n] packed;
        -1: none), as Jina's remote code takes it (docs/model.md, "Task adapters")."""
        cfg = self.config
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        output_attentions = bool(getattr(cfg, "output_attentions", False) if output_attentions is None
                                 else output_attentions)
        return_dict = getattr(cfg, "return_dict", True) if return_dict is None else return_dict
        batch = prepare(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                        output_attentions, cu_seqlens, max_seqlen, adapter_mask, **kwargs)
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or (batch.inputs_embeds is not None and batch.inputs_embeds.requires_grad))
        padded = batch.why_padded(output_attentions)
        if padded is None and self._variants[0].window is not None and isinstance(batch.attn, AttentionMask) \
                and (needs_grad or self.training):
            padded = "a sliding window over padded rows has no backward in the kernels (padding_free=True has one)"
        run = self.resolve_ops(needs_grad, padded, *batch.size)
        if needs_grad and not self.training and not self._warned_autograd:
            self._warn_autograd_in_eval(run, padded, batch.size)
        if not self.family.selects_hidden_states and output_hidden_states:
            output_hidden_states = True  # MPNet's forward reads a selection as a flag: every layer, as HF gives it
        keep = HiddenStates.of(output_hidden_states, len(self.layers), batch)
        tasks = None if batch.adapter_mask is None else adapters.per_token(batch.adapter_mask, batch)
        x, hidden_states, attentions = self.encode(batch.input_ids, batch.token_type_ids, batch.position_ids,
                                                   batch.attn, run, batch.inputs_embeds, keep, output_attentions,
                                                   tasks)
        out = self.finish(batch, x, hidden_states, attentions, keep is not None, output_attentions)
        return out if return_dict else self.output_tuple(out)

    def output_tuple(self, out) -> tuple:
        """HF's return_dict=False tuple of the family: the output's non-None fields in order. MPNet's keeps a
        pooler_output of None in its slot (its heads take outputs[2:] as hidden_states and attentions), and so do
        BERT's and RoBERTa's in transformers 4.x, which fastbert asks the installed release about."""
        absent_pooler = getattr(out, "pooler_output", False) is None
        if not (self.family.tuple_keeps_pooler
                or absent_pooler and installed.tuple_keeps_absent_pooler(self.config.model_type)):
            return out.to_tuple()
        rest = tuple(v for v in (out.hidden_states, out.attentions) if v is not None)
        return (out.last_hidden_state, out.pooler_output, *rest)

    def _warn_autograd_in_eval(self, run: dispatch.Ops, padded, size) -> None:
        """An eval-mode forward with autograd on (model(**inputs) without torch.no_grad(), a common habit) runs an op
        on its PyTorch twin wherever no training kernel serves it or its twin measured faster forward + backward: on
        a GPU under "auto" that is a silent speed cliff against the same forward without autograd, so it is said
        once per model, naming those ops."""
        device = self.embeddings.word_embeddings.weight.device
        if device.type not in dispatch.MEASURED_DEVICE_TYPES or "auto" not in self._kernels.values() \
                or dispatch.triton_unavailable(device):
            return
        lost = [op for op in self.resolve_ops(False, padded, *size).triton - run.triton if self._kernels[op] == "auto"]
        if not lost:
            return
        self._warned_autograd = True
        warnings.warn(f"fastbert: this eval-mode forward runs with autograd enabled, so {', '.join(sorted(lost))} "
                      "run their PyTorch twin instead of their Triton kernel (no training kernel serves them, or the "
                      "twin is faster with its backward). Call the model under torch.inference_mode() (or "
                      "torch.no_grad()) for the fast path; said once for this model", stacklevel=3)

    def cuda_graphs(self, token_buckets=(128, 256, 512, 1024, 2048, 4096, 8192), max_seqs: int = 256,
                    max_seqlen: int | None = None):
        """A runner that replays CUDA graphs of `encode` captured for packed token-count buckets (fastbert/graphs.py);
        call it like the model. Resolves every bucket's backends now; captures each bucket on its first use (or all of
        them at runner.capture())."""
        from .graphs import GraphRunner
        return GraphRunner(self, token_buckets, max_seqs, max_seqlen)

    def encode(self, input_ids, token_type_ids, position_ids, attn, run, inputs_embeds=None,
               keep_hidden_states=None, output_attentions=False, tasks=None):
        """The device-only part: packed tokens [T] -> final hidden states [T, H]. No host read, no branch on tensor
        values (a CUDA graph captures this). `keep_hidden_states`: a HiddenStates saying which layer inputs to return
        and in what shape (True: all of them, packed), or None. `tasks`: each token's task [T] (-1: none) where the
        model has task adapters, or None (the base weights)."""
        select = None if tasks is None else self.task_select(tasks)                     # [T, tasks * rank]
        with_tasks = () if select is None else (select,)
        if self.family.embeddings == "masked":  # zero at the padded positions of padded rows, as HF's DeBERTa
            mask = attn.key_valid.reshape(-1, 1) if isinstance(attn, AttentionMask) and attn.key_valid is not None \
                else None
            x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds, mask)  # [T, H]
        else:
            x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds, *with_tasks)  # [T, H]
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)                                               # [T, E] -> [T, H]
        if keep_hidden_states is True:
            keep_hidden_states = HiddenStates(None, _same, _same)
        hidden_states, attentions = [] if keep_hidden_states else None, [] if output_attentions else None
        layers = self.layers
        positions = self.attention_positions(position_ids, len(layers))                 # one per layer, or None
        shape = self._layer_class
        workspace = shape.workspace(x, run)                                             # twins' buffers, or None
        call = host.layer_call(layers, run, shape)                                      # layer(...), or its forward
        for layer, at in zip(layers, positions):  # (a checkpointing layer recomputes itself in backward)
            if keep_hidden_states:
                x = keep_hidden_states.record(hidden_states, x)
            x, probs = call(layer, x, attn, run, output_attentions, at, workspace, *with_tasks)
            if output_attentions:
                attentions.append(probs)
        if self._final_norm_name is not None:  # pre-norm: the last hidden state is normed (HF's last hidden_states)
            x = self._modules[self._final_norm_name](x)
        if keep_hidden_states:
            x = keep_hidden_states.record(hidden_states, x)
        return x, hidden_states, attentions

    def task_select(self, tasks: torch.Tensor) -> torch.Tensor:
        """Each token's task [T] -> [T, tasks * rank]: the task adapters' scaling in its task's columns, 0 elsewhere
        (adapters.task_select), in the model's dtype."""
        dtype = self.embeddings.word_embeddings.weight.dtype
        return adapters.task_select(tasks, len(self.task_names), self.task_rank, self.task_scaling, dtype)

    def attention_positions(self, position_ids, num_layers: int) -> list:
        """What each layer's attention reads of positions, built once per forward: the per-distance bias table of
        "buckets" (one for every layer), the rel_embeddings of "disentangled", the rotary cos/sin of the packed
        tokens (one per layer type), else None."""
        if self.family.attention_bias == "buckets":
            return [self.relative_bias()] * num_layers
        if self.family.attention_bias == "disentangled":
            return [self.rel_positions()] * num_layers
        if self.family.positions != "rotary":
            return [None] * num_layers
        tables = {}
        for layer in self.layers:
            if layer.layer_type not in tables:
                tables[layer.layer_type] = twins.rotary_tables(position_ids.reshape(-1),
                                                               *self._rotary_inv_freq(layer.layer_type,
                                                                                      position_ids.device))
        return [tables[layer.layer_type] for layer in self.layers]

    def _rotary_inv_freq(self, layer_type: str, device) -> tuple[torch.Tensor, float]:
        """A layer type's inv_freq and attention factor (rotary.inv_freq), computed from the config once per device
        (not a buffer: nothing to load, nothing for to_empty to leave uninitialised)."""
        if tracing():
            return rotary.inv_freq(self.config, layer_type, self.head_dim, device)
        key = (layer_type, device)
        if key not in self._inv_freq:
            self._inv_freq[key] = rotary.inv_freq(self.config, layer_type, self.head_dim, device)
        return self._inv_freq[key]

    def rel_positions(self):
        """DeBERTa's rel_embeddings for this forward: HF's get_rel_embedding (the table through the
        encoder's LayerNorm when norm_rel_ebd says so), once for every layer; None without relative_attention."""
        if not self._disentangled:
            return None
        encoder = self._modules[self.family.layers]
        rel = encoder.rel_embeddings.weight
        norm = encoder._modules.get("LayerNorm")
        if norm is not None:
            rel = norm(rel)
        return rel

    def relative_bias(self) -> torch.Tensor | None:
        """MPNet's attention bias for this forward as one per-distance table (fastbert/relative.py): distances past
        +-RELATIVE_REACH all fall in the last bucket, so the table is exact at any length; None for other families."""
        if self.family.attention_bias != "buckets":
            return None
        weight = self._modules[self.family.layers].relative_attention_bias.weight
        return relative.relative_bias_table(weight, RELATIVE_REACH)

    def finish(self, batch: Batch, x, hidden_states, attentions, output_hidden_states, output_attentions):
        """Packed [T, H] -> the caller's shape (zeros at padded positions), the pooler, HF's output class.
        `hidden_states` come from encode already in the caller's shape; the last one, when kept, is the
        last_hidden_state itself (as in transformers)."""
        shaped, _, first = _shapes(batch)
        last = hidden_states[-1] if output_hidden_states and hidden_states and hidden_states[-1] is not None \
            else shaped(x)
        out = dict(last_hidden_state=last,
                   hidden_states=tuple(hidden_states) if output_hidden_states else None,
                   attentions=tuple(attentions) if output_attentions else None)
        kind = self.family.output  # HF's output class of the family: its fields and its tuple order
        if kind == "BaseModelOutput":  # DistilBERT: no pooler output at all
            return BaseModelOutput(**out)
        if kind == "BaseModelOutputWithPast":  # Qwen3: a decoder's output, with no cache (an encoder keeps none)
            return BaseModelOutputWithPast(**out)
        cross = _EMPTY_CROSS_ATTENTIONS if output_attentions else None  # as the installed transformers reports it
        if kind == "BaseModelOutputWithPastAndCrossAttentions":  # ELECTRA: no pooler either
            return BaseModelOutputWithPastAndCrossAttentions(**out, cross_attentions=cross)
        pooler = self.pooler
        if pooler is not None and batch.adapter_mask is not None:  # each sequence's task adapter on the dense
            out["pooler_output"] = pooler(first(x), self.task_select(adapters.pooled_tasks(batch.adapter_mask, batch)))
        else:
            out["pooler_output"] = None if pooler is None else \
                (pooler.forward if host.plain(pooler, BertPooler) else pooler)(first(x))
        if kind == "BaseModelOutputWithPooling":  # MPNet
            return BaseModelOutputWithPooling(**out)
        return BaseModelOutputWithPoolingAndCrossAttentions(**out, cross_attentions=cross)

    def _largest_dropouts(self) -> tuple[float, float]:
        """(attention probabilities, residual_layernorm's) dropout: the largest of any layer's now (train mode), which
        the plan's kernels are chosen by."""
        p = [layer.dropouts() for layer in self.layers] or [NO_DROPOUT]
        return max(d[0] for d in p), max(max(d[1], d[2]) for d in p)

    def resolve_ops(self, needs_grad: bool = False, padded: str | None = None, tokens: int = 0,
                    max_seqlen: int = 0, ragged: bool = True) -> dispatch.Ops:
        """The four ops for this situation (device, dtype, autograd, dropout, why attention runs padded rows if it
        does, and on a GPU the token and sequence-length buckets "auto" measured for, and whether the sequences'
        lengths differ), resolved once and cached: a forward pays one dictionary lookup for its backend choices. A
        kernel failure under "auto" (fallback.kernel_failed) drops the cache, so the plans say what runs."""
        embeddings = self._modules.get("embeddings") or self.__dict__["embeddings"]  # (EuroBERT's: not a module)
        weight = embeddings.tables()[0].weight  # the word table: the model's device and dtype
        cfg = self.config
        kernels = tuple(map(self._kernels.__getitem__, OPS))
        shapes = None
        if weight.device.type in dispatch.MEASURED_DEVICE_TYPES and "auto" in kernels and tokens \
                and not dispatch.invariant():  # batch-invariant: one choice for every size (dispatch.batch_invariant)
            bucket = measure.token_bucket
            shapes = measure.Shapes(bucket(tokens), cfg.hidden_size, self.family.get(cfg, "intermediate_size"),
                                    cfg.num_attention_heads, self.head_dim, bucket(max_seqlen), self.activation,
                                    ragged, *self._variants)
        p_attn, p_hidden = self._largest_dropouts() if self.training else (0.0, 0.0)
        situation = dispatch.Situation(kernels, weight.device, weight.dtype, self.head_dim, needs_grad, p_attn,
                                       p_hidden, padded, shapes, self._variants, self.__dict__.get("number_format"))
        if dispatch.tracing():  # a compiled graph bakes the choice in; no cache to mutate inside it
            return dispatch.plan(situation)
        if self._plans_failures != len(fallback._FAILED):
            self._plans.clear()
            self._plans_failures = len(fallback._FAILED)
        run = self._plans.get(situation)
        if run is None:
            run = self._plans[situation] = dispatch.plan(situation)
        return run
