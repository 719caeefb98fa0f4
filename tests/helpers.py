"""What the tests share: the device, model and input builders, the kernel-output checks, the CLI runner.

Tests import from here (`from helpers import ...`), never from each other; tests/conftest.py holds only fixtures and
the guard on global state. The accuracy rule itself is fastbert.numerics.
"""
import contextlib
import dataclasses
import functools
import inspect
import os
import sys

import pytest
import torch

from fastbert.numerics import FP32_TOL, error_bound, max_error  # noqa: F401  (FP32_TOL: the tests' fp32 bar)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def optional(module: str, reason: str):
    """An optional dependency the test extras install: required in CI (CI=1: its absence fails the tests that need
    it), skipped with `reason` elsewhere."""
    if os.environ.get("CI"):
        import importlib
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)


def cuda_test(reason: str = "a CUDA test: no GPU here"):
    """Marks a test that needs a CUDA GPU (`-m cuda` selects them); without one it skips, saying why."""
    def mark(test):
        return pytest.mark.cuda(pytest.mark.skipif(DEVICE != "cuda", reason=reason)(test))
    return mark


# ---- torch switches ------------------------------------------------------------------------------------------------
def tf32_on() -> bool:
    """The effective TF32 switch ("none" = neither API used yet, so the legacy flag holds the default)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", "none")
    return precision == "tf32" or (precision == "none" and matmul.allow_tf32)


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """torch's fp32-matmul TF32 switch set for the block and put back after it. Through the legacy `allow_tf32`
    setter: it keeps `fp32_precision` consistent, while setting `fp32_precision` would make later reads of
    `allow_tf32` (by any library) raise in torch >= 2.9."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = saved


# ---- models and inputs ---------------------------------------------------------------------------------------------
def perturb_(model, weight_std: float | None = None):
    """Non-trivial weights, in place, from the current torch seed: LayerNorm scales and shifts moved by N(0, 0.1),
    biases drawn N(0, 0.05), and with weight_std every other weight drawn N(0, weight_std) (padding rows too)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.05)
            elif weight_std is not None:
                p.copy_(torch.randn_like(p) * weight_std)
    return model


def random_hf_bert(hidden=64, heads=4, layers=2, intermediate=100, act="gelu", vocab=99, max_pos=64, types=3,
                   attn="sdpa", seed=0):
    """A transformers BertModel with random, non-trivial weights (LayerNorm scales and biases perturbed too)."""
    import transformers
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=intermediate, hidden_act=act,
                                  max_position_embeddings=max_pos, type_vocab_size=types,
                                  attn_implementation=attn)
    torch.manual_seed(seed)
    return perturb_(transformers.BertModel(cfg).eval())


def hf_dtype(dtype) -> dict:
    """from_pretrained's dtype keyword for the installed transformers: `dtype` since 4.56, `torch_dtype` before."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


def make_inputs(kind, B=3, S=11, vocab=99, types=3, seed=1, low=1):
    """ids in [low, vocab), token types, and a 0/1 mask: no padding, right, left, or a fully padded row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (B, S), generator=g)
    tt = torch.randint(0, types, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    if kind == "right":
        for b, n in enumerate([S, 5, 1][:B]):
            mask[b, n:] = 0
    elif kind == "left":
        for b, n in enumerate([S, 4, 2][:B]):
            mask[b, : S - n] = 0
    elif kind == "fully_padded_row":
        mask[1, 6:] = 0
        mask[2] = 0
    return ids, tt, mask


# The architectures fastbert runs, built from random configs: BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA, no pooler,
# DistilBERT, MPNet (whose padding_idx is 1 whatever the config says, like RoBERTa's here).
ARCH_VOCAB, PAD_ROBERTA = 99, 1
PADDING_IDX_TYPES = ("roberta", "xlm-roberta", "camembert", "mpnet")


def random_arch_model(arch, hidden=64, heads=2, layers=2, intermediate=100, max_len=24, seed=0):
    """A transformers encoder of `arch` with random, non-trivial weights (LayerNorms and biases perturbed too).
    max_len: the longest sequence it takes (RoBERTa's and MPNet's tables are padding_idx + 1 rows longer)."""
    import transformers
    common = dict(vocab_size=ARCH_VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=intermediate, hidden_act="gelu", attn_implementation="eager")
    if arch == "distilbert":
        model = transformers.DistilBertModel(transformers.DistilBertConfig(
            vocab_size=ARCH_VOCAB, dim=hidden, n_layers=layers, n_heads=heads, hidden_dim=intermediate,
            activation="gelu", max_position_embeddings=max_len, attn_implementation="eager"))
    elif arch == "mpnet":
        model = transformers.MPNetModel(transformers.MPNetConfig(**common, max_position_embeddings=max_len + 2))
    elif arch.startswith("modernbert"):  # a window of +-2 keys, so that short rows cross it; "-bias": every bias on
        model = transformers.ModernBertModel(modernbert_config(hidden, heads, layers, intermediate, max_len,
                                                               biases=arch == "modernbert-bias"))
    elif arch.startswith("deberta-v2"):  # "-v2style": absolute positions, token types, pos_*_proj, a projection
        model = transformers.DebertaV2Model(deberta_config(hidden, heads, layers, intermediate, max_len,
                                                           v2style=arch == "deberta-v2-v2style"))
    elif arch.startswith("eurobert"):
        model = transformers.EuroBertModel(eurobert_config(hidden, heads, layers, intermediate, max_len,
                                                           gqa=arch == "eurobert-gqa", biases=arch == "eurobert-gqa"))
    elif arch in ROTARY_POST_NORM:
        model = rotary_post_norm_model(arch, hidden, heads, layers, intermediate, max_len)
    elif arch in ("bert", "bert-no-pooler"):
        model = transformers.BertModel(transformers.BertConfig(**common, max_position_embeddings=max_len,
                                                               type_vocab_size=3),
                                       add_pooling_layer=arch == "bert")
    elif arch == "electra":
        model = transformers.ElectraModel(transformers.ElectraConfig(**common, embedding_size=hidden // 2,
                                                                     max_position_embeddings=max_len,
                                                                     type_vocab_size=3))
    else:
        cls = {"roberta": (transformers.RobertaConfig, transformers.RobertaModel),
               "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
               "camembert": (transformers.CamembertConfig, transformers.CamembertModel)}[arch]
        model = cls[1](cls[0](**common, max_position_embeddings=max_len + PAD_ROBERTA + 1, pad_token_id=PAD_ROBERTA,
                              type_vocab_size=1 if arch == "xlm-roberta" else 2))
    torch.manual_seed(seed)
    return perturb_(model, weight_std=0.05).eval().to(DEVICE)  # padding rows too: HF reads them, so must fastbert


# The post-norm families with rotary q/k (transformers 5.24+): Jina-Embeddings-v3 (plain GELU MLP, every bias),
# NomicBERT (SwiGLU, no bias on any linear, 2 token types), GTE (a gated GELU MLP, biases but on gate/up;
# gte-base-en-v1.5 has no token type table: "gte-notypes"). "-yarn" / "-linear" / "-llama3": a scaled rope type.
ROTARY_POST_NORM = ("jina_embeddings_v3", "nomic_bert", "gte", "gte-notypes", "nomic_bert-yarn", "gte-linear",
                    "jina_embeddings_v3-llama3")
ROPE_SCALINGS = {"yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
                 "linear": {"rope_type": "linear", "factor": 2.0},
                 "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8}}


def eurobert_config(hidden=64, heads=2, layers=2, intermediate=100, max_len=24, gqa=False, biases=False, **extra):
    """A small EuroBertConfig (special ids inside ARCH_VOCAB, pad 0, a theta small enough that short rows turn every
    frequency); gqa: one key/value head for every two query heads; biases: attention_bias and mlp_bias."""
    import transformers
    fields = dict(vocab_size=ARCH_VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=heads // 2 if gqa else heads, intermediate_size=intermediate,
                  max_position_embeddings=max_len, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3, attn_implementation="eager",
                  attention_bias=biases, mlp_bias=biases)
    fields.update(extra)
    return transformers.EuroBertConfig(**fields)


def sharpen_qk_(model, gain: float):
    """q_proj and k_proj of every layer scaled by `gain`, in place: with small random weights every score is near 0,
    and a wrong rotary angle or key/value head would hide under the bar."""
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(gain)
            layer.self_attn.k_proj.weight.mul_(gain)
    return model


def ragged_rows(lengths, low=2, seed=1, left=False):
    """ids in [low, ARCH_VOCAB) and a 0/1 mask: one row per length, right (or left) padded to the longest."""
    S = max(lengths)
    ids = torch.randint(low, ARCH_VOCAB, (len(lengths), S), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            mask[b, S - n:] = 1
        else:
            mask[b, :n] = 1
    return ids, mask


def error_on_real_tokens(got, want, mask) -> float:
    return (got - want)[mask.bool()].abs().max().item()


def has_rotary_post_norm() -> bool:
    import transformers
    return hasattr(transformers, "NomicBertModel")


def rotary_post_norm_config(arch, hidden=64, heads=2, layers=2, intermediate=100, max_len=24, **extra):
    """A small config of one of ROTARY_POST_NORM (the base name picks the family, a suffix a scaled rope type), a
    theta small enough that short rows turn every frequency, token ids inside ARCH_VOCAB."""
    import transformers
    family, _, scaling = arch.partition("-")
    cls = {"jina_embeddings_v3": transformers.JinaEmbeddingsV3Config, "nomic_bert": transformers.NomicBertConfig,
           "gte": transformers.GteConfig}[family]
    rope = {"rope_type": "default", "rope_theta": 100.0}
    if scaling and scaling != "notypes":
        rope.update(ROPE_SCALINGS[scaling])
    fields = dict(vocab_size=ARCH_VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=intermediate, max_position_embeddings=max_len, rope_parameters=rope,
                  attn_implementation="eager", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "gte" and scaling == "notypes":
        fields["type_vocab_size"] = 0
    if family == "nomic_bert":
        fields["type_vocab_size"] = 2
    fields.update(extra)
    return cls(**fields)


def rotary_post_norm_model(arch, hidden=64, heads=2, layers=2, intermediate=100, max_len=24, **extra):
    import transformers
    config = rotary_post_norm_config(arch, hidden, heads, layers, intermediate, max_len, **extra)
    cls = {"jina_embeddings_v3": transformers.JinaEmbeddingsV3Model, "nomic_bert": transformers.NomicBertModel,
           "gte": transformers.GteModel}[config.model_type]
    return cls(config)


def modernbert_config(hidden=64, heads=2, layers=2, intermediate=100, max_len=24, biases=False, window=2, **extra):
    """A small ModernBertConfig: layer 0 full attention, layer 1 sliding (+-window), token ids inside ARCH_VOCAB."""
    import transformers
    flags = dict(attention_bias=True, mlp_bias=True, norm_bias=True) if biases else {}
    extra = {"vocab_size": ARCH_VOCAB, "attn_implementation": "eager", **extra}
    return transformers.ModernBertConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, hidden_activation="gelu", max_position_embeddings=max_len,
        local_attention=2 * window, pad_token_id=0, bos_token_id=1, eos_token_id=1, cls_token_id=1, sep_token_id=1,
        **flags, **extra)


def deberta_config(hidden=64, heads=2, layers=2, intermediate=100, max_len=24, v2style=False, **extra):
    """A small DebertaV2Config shaped like v3's (log buckets, shared position keys, no absolute positions, no token
    types, relative embeddings LayerNorm'd) at position_buckets 8, max_relative_positions 16, so that short rows
    reach past both; v2style: position_biased_input, 2 token types, pos_key_proj / pos_query_proj, embedding_size
    hidden / 2 (an embed_proj). Dropout 0 (HF's defaults are 0.1), token ids inside ARCH_VOCAB."""
    import transformers
    fields = dict(vocab_size=ARCH_VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=intermediate, hidden_act="gelu", max_position_embeddings=max_len,
                  relative_attention=True, position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"],
                  share_att_key=True, position_biased_input=False, norm_rel_ebd="layer_norm", type_vocab_size=0,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0, pad_token_id=0)
    if v2style:
        fields.update(position_biased_input=True, type_vocab_size=2, share_att_key=False, embedding_size=hidden // 2)
    fields.update(extra)
    return transformers.DebertaV2Config(**fields)


def has_modernbert() -> bool:
    import transformers
    return hasattr(transformers, "ModernBertModel")


def has_deberta_v2() -> bool:
    """transformers 4.48+: the DeBERTa-v2 definition fastbert follows (before it, StableDropout and XSoftmax)."""
    import transformers
    from packaging.version import Version
    return Version(transformers.__version__) >= Version("4.48.0")


NEEDS_MODERNBERT = pytest.mark.skipif(not has_modernbert(), reason="this transformers has no ModernBERT (4.48+)")
NEEDS_DEBERTA = pytest.mark.skipif(not has_deberta_v2(), reason="fastbert follows transformers 4.48+'s DeBERTa-v2")
NEEDS_ROTARY_POST_NORM = pytest.mark.skipif(not has_rotary_post_norm(),
                                            reason="this transformers has no NomicBERT, GTE or Jina-v3 (5.24+)")

# Every architecture random_arch_model builds, each marked with the transformers it needs
ARCHS = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "bert-no-pooler", "distilbert", "mpnet",
         pytest.param("modernbert", marks=NEEDS_MODERNBERT), pytest.param("modernbert-bias", marks=NEEDS_MODERNBERT),
         pytest.param("deberta-v2", marks=NEEDS_DEBERTA), pytest.param("deberta-v2-v2style", marks=NEEDS_DEBERTA),
         *(pytest.param(arch, marks=NEEDS_ROTARY_POST_NORM)
           for arch in (*ROTARY_POST_NORM, "eurobert", "eurobert-gqa")))


def pad_id(hf):
    return hf.config.pad_token_id if hf.config.model_type in PADDING_IDX_TYPES else 0


def type_kwargs(tt) -> dict:
    """token_type_ids=tt for a forward call, or nothing where the family has none (tt None: DistilBERT, MPNet, whose
    transformers 4.x forward has no such argument)."""
    return {} if tt is None else {"token_type_ids": tt}


def arch_inputs(hf, padding, B=3, S=11, seed=1):
    """ids / token types (None for a family without them) / mask. Padded positions hold the pad id (as a tokenizer
    writes them); for RoBERTa and MPNet one real token of row 0 is the pad id too (HF gives it position padding_idx:
    so must fastbert, packed or not)."""
    types = getattr(hf.config, "type_vocab_size", None)
    ids, tt, mask = make_inputs(padding, B, S, vocab=ARCH_VOCAB, types=types or 1, seed=seed, low=2)
    ids = ids.masked_fill(mask == 0, pad_id(hf))
    if pad_id(hf):
        ids[0, 3] = pad_id(hf)
    return ids.to(DEVICE), None if types is None else tt.to(DEVICE), mask.to(DEVICE)


def fused_rows_alias_parts(encoder) -> bool:
    """query/key/value's parameters (DistilBERT's q_lin/k_lin/v_lin, MPNet's q/k/v), and a gated MLP's gate/up where
    the checkpoint keeps them apart, are rows of the layer's fused weights (one copy, one GEMM). (ModernBERT: the
    checkpoint's own Wqkv and Wi are the fused weights.)"""
    for layer in encoder.layers:
        for holder in layer.fused_holders():
            n = len(holder.names)
            weight, bias = holder.qkv_weight, holder.qkv_bias
            widths = [getattr(holder, name).weight.shape[0] for name in holder.names]  # (grouped k/v: narrower)
            rows = weight.split(widths), (None,) * n if bias is None else bias.split(widths)
            for i, name in enumerate(holder.names):
                part = getattr(holder, name)
                if part.weight.data_ptr() != rows[0][i].data_ptr():
                    return False
                if (part.bias is None) != (rows[1][i] is None) or \
                        part.bias is not None and part.bias.data_ptr() != rows[1][i].data_ptr():
                    return False
    return True


# ---- comparisons with HF -------------------------------------------------------------------------------------------
def assert_close_on(actual, expected, mask, padding_free=True, real_tol=1e-5, pad_tol=1e-4):
    """Real tokens within real_tol. Padded positions: exactly 0 when padding-free; else, on rows that have a real
    token, within pad_tol of HF's values."""
    assert torch.isfinite(actual).all()
    real = mask.bool()
    d = (actual.float() - expected.float()).abs().amax(-1)  # [B, S]
    if real.any():
        assert d[real].max() <= real_tol, f"real tokens: max |delta| {d[real].max():.3g} > {real_tol}"
    if padding_free:
        assert (actual[~real] == 0).all(), "padding-free execution leaves padded positions at 0"
        return
    pad = ~real & real.any(1)[:, None]
    if pad.any():
        assert d[pad].max() <= pad_tol, f"padded positions: max |delta| {d[pad].max():.3g} > {pad_tol}"


def assert_pooler_matches(fb_pooled, hf, ids, mask, tt, tol=1e-5):
    """Rows whose position 0 is real: HF's pooler_output. Other rows with a real token: HF's pooler applied to HF's
    own hidden state of the row's first real token (its [CLS]), where HF's pooler reads position 0, a padding slot.
    Rows with none: the pooler of a zero vector, tanh(b_p)."""
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=tt)
        for b in range(ids.shape[0]):
            real = mask[b].bool()
            if real[0]:
                want = ref.pooler_output[b]
            elif real.any():
                want = torch.tanh(hf.pooler.dense(ref.last_hidden_state[b, real.nonzero()[0, 0]]))
            else:
                want = torch.tanh(hf.pooler.dense.bias)
            assert (fb_pooled[b] - want).abs().max() <= tol, f"pooler row {b}"


def host_reads(monkeypatch) -> list:
    """A list that fills with the name of every tensor method that reads a value back to the host (tolist, item,
    bool(), int(), ...) while the test runs."""
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name, **k:
                            reads.append(_name) or _real(self, *a, **k))
    return reads


def launched_precisions(monkeypatch, kernel) -> list:
    """A list that fills with the INPUT_PRECISION of every launch of `kernel` (a JITFunction or the interpreter's
    stand-in) while the test runs: what the tf32 switch reaches, on any device."""
    launched, real_run = [], kernel.run
    monkeypatch.setattr(kernel, "run", lambda *args, **kwargs: (
        launched.append(kwargs["INPUT_PRECISION"]), real_run(*args, **kwargs))[1])
    return launched


# ---- what the kernels launched ---------------------------------------------------------------------------------------
# Each op's Triton kernels as its unit launches them: (its forward's, one of which runs; its backward's, each of
# which runs). bias_gelu's forward is the GEMM with its activation epilogue; qkv_projection's backward is torch's
# GEMMs (a linear's own backward, no kernel of fastbert's).
OP_KERNELS = {
    "qkv_projection": (("gemm_kernel", "gemm_tma_kernel"), ()),
    "attention": (("_attention_fwd_kernel",), ("_attention_bwd_dkdv_kernel", "_attention_bwd_dq_kernel")),
    "bias_gelu": (("gemm_kernel", "gemm_tma_kernel"), ("bias_gelu_backward_kernel",)),
    "residual_layernorm": (("bias_residual_layernorm_kernel",), ("layernorm_backward_kernel",)),
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a fastbert kernel: the op whose unit (fastbert/units/<op>.py) launched it, found on the call
    stack (None outside the units), the kernel's name, and its non-tensor arguments by name, defaults included."""
    op: str | None
    kernel: str
    args: dict

    @property
    def dropout_p(self) -> float:
        """The probability the launch drops with: its dropout_p where its DROPOUT is on, else 0."""
        return float(self.args["dropout_p"]) if self.args.get("DROPOUT") else 0.0


class Launches(list):
    """The launches made inside a `launches()` block, in order."""

    def ops(self) -> frozenset:
        return frozenset(launch.op for launch in self if launch.op is not None)

    def dropouts(self, op: str) -> dict:
        """{kernel: the set of dropout probabilities it launched with} over `op`'s launches."""
        found: dict = {}
        for launch in self:
            if launch.op == op:
                found.setdefault(launch.kernel, set()).add(launch.dropout_p)
        return found


def _fastbert_kernels() -> tuple:
    from fastbert.kernels import attention, attention_backward, bias_gelu, gemm, residual_layernorm
    return (gemm.gemm_kernel, gemm.gemm_tma_kernel, attention._attention_fwd_kernel,
            attention_backward._attention_bwd_dkdv_kernel, attention_backward._attention_bwd_dq_kernel,
            bias_gelu.bias_gelu_backward_kernel, residual_layernorm.bias_residual_layernorm_kernel,
            residual_layernorm.layernorm_backward_kernel)


def _launching_op(units_by_module: dict) -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        op = units_by_module.get(frame.f_globals.get("__name__"))
        if op is not None:
            return op
        frame = frame.f_back
    return None


@contextlib.contextmanager
def launches():
    """Records every launch of a fastbert kernel inside the block (a Launches list), on any device: each kernel's
    `run` (what `kernel[grid](...)` and Triton's autotuner call; a JITFunction on a GPU, the interpreter's stand-in
    on CPU) is wrapped, and the launch still runs. On a GPU an autotuner's first call launches each config it times:
    count kinds of launches there, not launches. The autograd engine may run a backward on another thread: the
    recording is process-wide."""
    from fastbert import units

    units_by_module = {unit.__name__: op for op, unit in units.UNITS.items()}
    recorded, restore = Launches(), []
    try:
        for kernel in _fastbert_kernels():
            signature, real = inspect.signature(kernel.fn), kernel.run

            def run(*args, _name=kernel.fn.__name__, _signature=signature, _real=real, **kwargs):
                bound = _signature.bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                          if k in _signature.parameters})
                bound.apply_defaults()
                recorded.append(Launch(_launching_op(units_by_module), _name,
                                       {k: v for k, v in bound.arguments.items() if not isinstance(v, torch.Tensor)}))
                return _real(*args, **kwargs)

            restore.append((kernel, vars(kernel).get("run")))
            kernel.run = run
        yield recorded
    finally:
        for kernel, own in reversed(restore):
            if own is None:
                del kernel.run
            else:
                kernel.run = own


def assert_trained_on_kernels(forward: Launches, backward: Launches | None = None, ops=tuple(OP_KERNELS)):
    """Each op of `ops` launched its forward kernel in `forward` (a training forward's launches) and each of its
    backward kernels in `backward` (that forward's backward; None: `forward` holds both, a whole training step)."""
    backward = forward if backward is None else backward
    missing = [f"{op}'s forward ({' or '.join(OP_KERNELS[op][0])})" for op in ops
               if not any(launch.op == op and launch.kernel in OP_KERNELS[op][0] for launch in forward)]
    missing += [f"{op}'s backward {kernel}" for op in ops for kernel in OP_KERNELS[op][1]
                if not any(launch.op == op and launch.kernel == kernel for launch in backward)]
    assert not missing, f"these kernels never launched: {'; '.join(missing)}"


def torch_dropout_off(monkeypatch):
    """torch's own dropout (F.dropout, which nn.Dropout and HF's modules call, and fastbert's twins.dropout) made the
    identity for the test: all that stays random is what the Triton kernels draw."""
    from fastbert import twins
    monkeypatch.setattr(torch.nn.functional, "dropout", lambda x, p=0.5, training=True, inplace=False: x)
    monkeypatch.setattr(twins, "dropout", lambda x, p: x)


# ---- kernel outputs ------------------------------------------------------------------------------------------------
def poisoned(shape, dtype):
    """An output buffer full of NaN: an element the kernel fails to write keeps it, and NaN never passes."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_kernel_matches(out, twin, ref64, dtype, fp32_tol=FP32_TOL, baseline_where=None):
    """fastbert.numerics' rule. fp32: within fp32_tol of the torch twin and of the fp64 reference. fp16/bf16: error
    against fp64 within error_bound of the twin's own error. `baseline_where` (a mask over rows) limits where the
    twin's error is measured, for rows where the twin is no yardstick; the kernel's error counts everywhere."""
    assert out.shape == twin.shape == ref64.shape
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "NaN/inf in the kernel output (an unwritten element keeps its NaN poison)"
    err = max_error(out, ref64)
    if dtype == torch.float32:
        twin_diff = max_error(out, twin)
        assert twin_diff <= fp32_tol, f"kernel vs torch twin: {twin_diff:.3g} > {fp32_tol:.3g}"
    twin_err = max_error(twin, ref64, where=baseline_where)
    bound = error_bound(dtype, twin_err, fp32_tol)
    assert err <= bound, f"kernel error {err:.3g} against fp64 > bound {bound:.3g} (twin's error {twin_err:.3g})"


# Runs in a fresh process: counts the autotuner's benchmark calls (utils.Benchmark is every fastbert autotuner's
# do_bench), runs CALL once and prints {"benchmarks": n, "choice": str(the autotuner's pick)}.
_TUNING_PROBE = """
import json, torch
from fastbert.kernels import utils
calls = []
_bench = utils.Benchmark.__call__
utils.Benchmark.__call__ = lambda self, *args, **kwargs: (calls.append(1), _bench(self, *args, **kwargs))[1]
{call}
torch.cuda.synchronize()
print(json.dumps({{"benchmarks": len(calls), "choice": str(TUNER.best_config)}}))
"""


def tuning_in_fresh_processes(call: str, cache_dir) -> list:
    """Runs `call` (code that launches a kernel through its autotuner and names that autotuner TUNER) in two fresh
    processes sharing one TRITON_CACHE_DIR: [first process's {"benchmarks", "choice"}, second's]."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    results = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _TUNING_PROBE.format(call=call)], capture_output=True, text=True,
                              env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


# ---- the command line ----------------------------------------------------------------------------------------------
def main_in_process(capsys, *args):
    """`python -m fastbert ARGS` in this process (its main(), as the console script calls it): (exit code, stdout,
    stderr)."""
    from fastbert import __main__ as cli
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, words):
    """Exit 2 with one line on stderr, no traceback, saying `words`."""
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]


# ---- sentence-transformers folders on the other families (random weights, no model hub) ----------------------------
def _family_tokenizer(family, minilm_path):
    """The family's own tokenizer class over BERT's uncased vocabulary (the bundled model's vocab.txt); for MPNet
    with its specials around it, as all-mpnet-base-v2's vocabulary is laid out (<s> 0, <pad> 1, </s> 2, <unk> 3,
    then BERT's, then <mask>: 30,527 entries)."""
    import transformers
    with open(os.path.join(minilm_path, "vocab.txt"), encoding="utf-8") as f:
        words = f.read().splitlines()
    if family == "mpnet":
        return transformers.MPNetTokenizer(vocab={w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>",
                                                                             *words, "<mask>"])})
    # (ModernBERT's BPE and DeBERTa's sentencepiece vocabularies are not on this machine: BERT's WordPiece without
    # token types stands in)
    return transformers.DistilBertTokenizer(vocab={w: i for i, w in enumerate(words)})


def tiny_minilm_folder(minilm_path, root) -> str:
    """The bundled MiniLM's folder with its model shrunk: every file as shipped (tokenizer, modules.json, pooling,
    sentence_bert_config.json) but a random BERT of 2 layers, hidden 64, 4 heads of 16, over the same vocabulary. For
    tests of the machinery around a model (graphs, surfaces) that run its kernels through Triton's interpreter, where
    the real model's 6 layers of 12 heads cost a minute a test."""
    import json
    import shutil

    import transformers
    folder = root / "tiny-minilm"
    if folder.exists():
        return str(folder)
    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("model.safetensors", "pytorch_model.bin"))
    config = transformers.BertConfig.from_pretrained(minilm_path)
    config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.intermediate_size = 64, 2, 4, 128
    torch.manual_seed(0)
    perturb_(transformers.BertModel(config), weight_std=0.05).save_pretrained(folder)
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "word_embedding_dimension": 64}))
    return str(folder)


def family_st_folder(family, minilm_path, root):
    """A sentence-transformers folder: all-mpnet-base-v2's layout for MPNet (mean pooling, Normalize,
    max_seq_length 384), CLS pooling without Normalize for DistilBERT, ModernBERT, DeBERTa-v2 and GTE, mean pooling
    for Jina-Embeddings-v3, EuroBERT, RoBERTa, XLM-R, CamemBERT and ELECTRA, and for NomicBERT with Normalize and
    nomic-embed-text's query / document prompts; random weights."""
    import transformers
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    try:  # sentence-transformers 6 moved the modules
        from sentence_transformers.sentence_transformer import modules as st_modules
    except ImportError:
        st_modules = st.models
    tok = _family_tokenizer(family, minilm_path)
    hidden = 64
    if family == "mpnet":
        cfg = transformers.MPNetConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=100, max_position_embeddings=514)
        cls = transformers.MPNetModel
    elif family == "modernbert":
        cfg = modernbert_config(hidden=hidden, heads=4, layers=3, intermediate=100, max_len=512, window=8)
        cfg.vocab_size, cfg.attn_implementation = len(tok), "sdpa"
        cls = transformers.ModernBertModel
    elif family == "deberta-v2":
        cfg = deberta_config(hidden=hidden, heads=4, layers=2, intermediate=100, max_len=512, vocab_size=len(tok))
        cls = transformers.DebertaV2Model
    elif family == "eurobert":
        cfg = eurobert_config(hidden=hidden, heads=4, layers=2, intermediate=100, max_len=512, gqa=True,
                              vocab_size=len(tok), attn_implementation="sdpa")
        cls = transformers.EuroBertModel
    elif family in ("jina_embeddings_v3", "nomic_bert", "gte"):
        cls = type(rotary_post_norm_model(family, hidden, 4, 1, 16, 512))
        cfg = rotary_post_norm_config(family, hidden=hidden, heads=4, layers=2, intermediate=100, max_len=512,
                                      vocab_size=len(tok), attn_implementation="sdpa")
    elif family in ("roberta", "xlm-roberta", "camembert", "electra"):  # the BERT vocabulary's pad id, 0, is theirs
        common = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=100, max_position_embeddings=514, pad_token_id=tok.pad_token_id)
        cfg, cls = {"roberta": (transformers.RobertaConfig, transformers.RobertaModel),
                    "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
                    "camembert": (transformers.CamembertConfig, transformers.CamembertModel),
                    "electra": (functools.partial(transformers.ElectraConfig, embedding_size=32),
                                transformers.ElectraModel)}[family]
        cfg = cfg(**common)
    else:
        cfg = transformers.DistilBertConfig(vocab_size=len(tok), dim=hidden, n_layers=2, n_heads=4, hidden_dim=100,
                                            max_position_embeddings=512)
        cls = transformers.DistilBertModel
    torch.manual_seed(0)
    hf_folder = root / "hf"
    perturb_(cls(cfg), weight_std=0.05).save_pretrained(hf_folder)
    tok.save_pretrained(hf_folder)
    word = st_modules.Transformer(str(hf_folder), max_seq_length=384 if family == "mpnet" else 256)
    mean = family in ("mpnet", "jina_embeddings_v3", "nomic_bert", "eurobert", "roberta", "xlm-roberta",
                      "camembert", "electra")  # GTE's pool CLS, as the others
    modules = [word, st_modules.Pooling(hidden, "mean" if mean else "cls")]
    if family in ("mpnet", "nomic_bert"):
        modules.append(st_modules.Normalize())
    # nomic-embed-text's task prefixes
    prompts = {"query": "search_query: ", "document": "search_document: "} if family == "nomic_bert" else None
    folder = root / "st"
    st.SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(folder))
    return folder


# ---- checkpoints laid out as the Hub ships them (random weights, small sizes, the real key layout) -----------------
HUB_LAYOUTS = ("deberta-v3-base", "bert-base-uncased", "distilbert-base-uncased", "modernbert-base")


def _save_bin(folder, state: dict, config: dict) -> str:
    """pytorch_model.bin only (the format these checkpoints were first published in) and a config.json as written."""
    import json
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.contiguous() for k, v in state.items()}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def hub_layout_folder(name, root, architectures=None, seed=0) -> str:
    """A folder laid out as the Hub's `name` (one of HUB_LAYOUTS), shrunk, random non-trivial weights built with
    transformers:
    - deberta-v3-base: the RTD pre-training checkpoint, pytorch_model.bin only: deberta.* with the unused
      embeddings.position_embeddings.weight (position_biased_input is false), the generator's
      lm_predictions.lm_head.* and the discriminator's mask_predictions.* (the encoder is transformers' DebertaV2Model,
      the heads' tensors are named as the RTD checkpoint names them, whatever transformers' own MaskedLM head calls
      its modules); config.json with pos_att_type "p2c|c2p" as a string and no architectures (as on the Hub;
      `architectures` sets one);
    - bert-base-uncased: pytorch_model.bin of BertForPreTraining with TF-style LayerNorm.gamma / beta, the
      bert.embeddings.position_ids buffer, cls.predictions.* and cls.seq_relationship.*, config.json saying
      BertForMaskedLM;
    - distilbert-base-uncased: DistilBertForMaskedLM as transformers saves it (vocab_transform, vocab_layer_norm,
      vocab_projector), config.json with the Hub's extra fields (sinusoidal_pos_embds, tie_weights_, ...);
    - modernbert-base: ModernBertForMaskedLM as saved (model.*, head.*, decoder.*), config.json with the Hub's fields
      (global_rope_theta / local_rope_theta, global_attn_every_n_layers, classifier_*, reference_compile, ...)."""
    import json

    import transformers
    folder = root / name
    torch.manual_seed(seed)
    if name == "deberta-v3-base":
        config = {"model_type": "deberta-v2", "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
                  "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48,
                  "max_position_embeddings": 512, "relative_attention": True, "position_buckets": 256,
                  "norm_rel_ebd": "layer_norm", "share_att_key": True, "pos_att_type": "p2c|c2p",
                  "layer_norm_eps": 1e-7, "max_relative_positions": -1, "position_biased_input": False,
                  "num_attention_heads": 2, "num_hidden_layers": 2, "type_vocab_size": 0, "vocab_size": ARCH_VOCAB}
        if architectures:
            config["architectures"] = list(architectures)
        hf = perturb_(transformers.DebertaV2Model(transformers.DebertaV2Config(**config)), weight_std=0.05)
        state = {"deberta." + k: v for k, v in hf.state_dict().items()}
        H, V = config["hidden_size"], config["vocab_size"]

        def head(prefix, out=None):  # dense + LayerNorm (+ a classifier): the RTD generator's and discriminator's
            tensors = {f"{prefix}.dense.weight": torch.randn(H, H) * 0.05,
                       f"{prefix}.dense.bias": torch.randn(H) * 0.05,
                       f"{prefix}.LayerNorm.weight": 1 + torch.randn(H) * 0.1,
                       f"{prefix}.LayerNorm.bias": torch.randn(H) * 0.05}
            if out:
                tensors.update({f"{prefix}.classifier.weight": torch.randn(out, H) * 0.05,
                                f"{prefix}.classifier.bias": torch.randn(out) * 0.05})
            return tensors
        state.update({**head("lm_predictions.lm_head"), "lm_predictions.lm_head.bias": torch.randn(V) * 0.05,
                      **head("mask_predictions", out=1),
                      "deberta.embeddings.position_embeddings.weight": torch.randn(512, H) * 0.05})
        return _save_bin(folder, state, config)
    if name == "bert-base-uncased":
        config = {"architectures": list(architectures or ["BertForMaskedLM"]), "attention_probs_dropout_prob": 0.1,
                  "gradient_checkpointing": False, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                  "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48, "layer_norm_eps": 1e-12,
                  "max_position_embeddings": 64, "model_type": "bert", "num_attention_heads": 2,
                  "num_hidden_layers": 2, "pad_token_id": 0, "position_embedding_type": "absolute",
                  "transformers_version": "4.6.0.dev0", "type_vocab_size": 2, "use_cache": True,
                  "vocab_size": ARCH_VOCAB}
        hf = transformers.BertForPreTraining(transformers.BertConfig(**config))
        state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
                 for k, v in perturb_(hf, weight_std=0.05).state_dict().items()}
        state["bert.embeddings.position_ids"] = torch.arange(64)[None]
        assert any(k.startswith("cls.seq_relationship.") for k in state) and "cls.predictions.bias" in state
        return _save_bin(folder, state, config)
    if name == "distilbert-base-uncased":
        hub = {"activation": "gelu", "architectures": list(architectures or ["DistilBertForMaskedLM"]),
               "attention_dropout": 0.1, "dim": 32, "dropout": 0.1, "hidden_dim": 48, "initializer_range": 0.02,
               "max_position_embeddings": 64, "model_type": "distilbert", "n_heads": 2, "n_layers": 2,
               "pad_token_id": 0, "qa_dropout": 0.1, "seq_classif_dropout": 0.2, "sinusoidal_pos_embds": False,
               "tie_weights_": True, "transformers_version": "4.10.0.dev0", "vocab_size": ARCH_VOCAB}
        hf = transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(**hub))
        perturb_(hf, weight_std=0.05).save_pretrained(folder)
    elif name == "modernbert-base":
        hub = {"architectures": list(architectures or ["ModernBertForMaskedLM"]), "attention_bias": False,
               "attention_dropout": 0.0, "bos_token_id": 1, "classifier_activation": "gelu",
               "classifier_bias": False, "classifier_dropout": 0.0, "classifier_pooling": "mean", "cls_token_id": 1,
               "decoder_bias": True, "deterministic_flash_attn": False, "embedding_dropout": 0.0,
               "eos_token_id": 2, "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0,
               "gradient_checkpointing": False, "hidden_activation": "gelu", "hidden_size": 32,
               "initializer_cutoff_factor": 2.0, "initializer_range": 0.02, "intermediate_size": 48,
               "layer_norm_eps": 1e-05, "local_attention": 4, "local_rope_theta": 10000.0,
               "max_position_embeddings": 64, "mlp_bias": False, "mlp_dropout": 0.0, "model_type": "modernbert",
               "norm_bias": False, "norm_eps": 1e-05, "num_attention_heads": 2, "num_hidden_layers": 3,
               "pad_token_id": 0, "position_embedding_type": "absolute", "reference_compile": True,
               "repad_logits_with_grad": False, "sep_token_id": 2, "sparse_pred_ignore_index": -100,
               "sparse_prediction": False, "torch_dtype": "float32", "transformers_version": "4.47.0.dev0",
               "vocab_size": ARCH_VOCAB}
        hf = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**hub))
        perturb_(hf, weight_std=0.05).save_pretrained(folder)
    else:
        raise ValueError(f"no Hub layout {name!r}; known: {', '.join(HUB_LAYOUTS)}")
    (folder / "config.json").write_text(json.dumps(hub, indent=2))  # the Hub's file, not transformers' rewrite
    return str(folder)


# ---- Jina-Embeddings-v3 with its task adapters, laid out as the Hub ships it (random weights, small sizes) ----------
JINA_TASKS = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")
JINA_PROMPTS = {"retrieval.query": "Represent the query for retrieving evidence documents: ",
                "retrieval.passage": "Represent the document for retrieval: ", "separation": "",
                "classification": "", "text-matching": ""}


def jina_task_checkpoint(hf, rank=4, alpha=1, seed=0, adapter_std=0.3) -> dict:
    """Jina-Embeddings-v3's checkpoint for the HF model `hf` (a JinaEmbeddingsV3Model) and random task adapters, in
    the Hub's layout: the encoder under "roberta." in the remote code's module names (emb_ln, encoder.layers.<i>.
    mixer.Wqkv, ...), every linear's and embedding table's weight at X.parametrizations.weight.original and one
    adapter per task stacked beside it at X.parametrizations.weight.0.lora_A / lora_B (linear [out, in]: A [tasks,
    rank, in], B [tasks, out, rank]; table [rows, dim]: A [tasks, rows, rank], B [tasks, rank, dim]), A and B both
    random and non-zero, so that every task changes every module."""
    from fastbert.loading import original_layout
    hub = original_layout({k: v.detach().clone() for k, v in hf.state_dict().items()}, hf.config)
    gen = torch.Generator().manual_seed(seed)
    tasks = len(JINA_TASKS)
    out = {}
    for key, tensor in hub.items():
        module = key[:-len(".weight")]
        table = module.startswith("embeddings.")
        if not key.endswith(".weight") or not (table or module.split(".")[-1] in ("Wqkv", "out_proj", "fc1", "fc2",
                                                                                  "dense")):
            out["roberta." + key] = tensor
            continue
        rows, cols = tensor.shape
        shapes = ((tasks, rows, rank), (tasks, rank, cols)) if table else ((tasks, rank, cols), (tasks, rows, rank))
        out[f"roberta.{module}.parametrizations.weight.original"] = tensor
        for part, shape in zip(("lora_A", "lora_B"), shapes):
            out[f"roberta.{module}.parametrizations.weight.0.{part}"] = torch.randn(shape, generator=gen) * adapter_std
    return out


def jina_hub_config(hf_config, rank=4, alpha=1) -> dict:
    """config.json as the Hub's jina-embeddings-v3 fills it for its adapters (lora_adaptations in adapter_mask's
    order, lora_rank, lora_alpha, task_instructions, ...), over the small model's own fields."""
    values = hf_config.to_dict()
    values.update(lora_adaptations=list(JINA_TASKS), lora_rank=rank, lora_alpha=alpha, lora_dropout_p=0.0,
                  lora_main_params_trainable=False, load_trained_adapters=True, task_instructions=dict(JINA_PROMPTS),
                  matryoshka_dimensions=[8, 16, 32])
    return values


def jina_merged_state(checkpoint: dict, task: int, alpha=1) -> dict:
    """The Hub checkpoint's weights with task `task`'s adapter merged (W + s B_t A_t; a table E + s A_t B_t), computed
    in float64 and cast back, in the Hub's layout without adapters (X.weight), for transformers to load."""
    merged = {}
    for key, tensor in checkpoint.items():
        if key.endswith(".parametrizations.weight.original"):
            module = key[:-len(".parametrizations.weight.original")]
            A = checkpoint[f"{module}.parametrizations.weight.0.lora_A"][task].double()
            B = checkpoint[f"{module}.parametrizations.weight.0.lora_B"][task].double()
            table = ".embeddings." in key
            rank = A.shape[1] if table else A.shape[0]
            low = A @ B if table else B @ A
            merged[f"{module}.weight"] = (tensor.double() + alpha / rank * low).to(tensor.dtype)
        elif ".parametrizations." not in key:
            merged[key] = tensor
    return merged


def jina_reference(hf, checkpoint: dict, task) -> "torch.nn.Module":
    """transformers' JinaEmbeddingsV3Model holding `hf`'s config with the checkpoint's weights, task `task`'s adapter
    merged in (None: the base weights), loaded by transformers' own conversion of the Hub's layout."""
    import copy

    from fastbert.loading import encoder_part, hub_layout
    merged = jina_merged_state(checkpoint, task) if task is not None else {
        k.replace(".parametrizations.weight.original", ".weight"): v for k, v in checkpoint.items()
        if "lora_" not in k}
    ref = copy.deepcopy(hf)
    ref.load_state_dict(encoder_part(hub_layout(merged, "jina_embeddings_v3"), "jina_embeddings_v3"), strict=True)
    return ref.eval()


def jina_hub_folder(root, hidden=32, heads=2, layers=2, intermediate=40, vocab_size=ARCH_VOCAB, max_len=64, seed=0,
                    **config):
    """A folder as the Hub ships jina-embeddings-v3, shrunk: model.safetensors in the Hub's layout with random task
    adapters (jina_task_checkpoint), config.json with its adapter fields. -> (folder, the HF model, checkpoint)."""
    import json

    import transformers
    from safetensors.torch import save_file
    torch.manual_seed(seed)
    hf = perturb_(transformers.JinaEmbeddingsV3Model(rotary_post_norm_config(
        "jina_embeddings_v3", hidden=hidden, heads=heads, layers=layers, intermediate=intermediate, max_len=max_len,
        vocab_size=vocab_size, **config)), weight_std=0.05).eval()
    checkpoint = jina_task_checkpoint(hf, seed=seed + 1)
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in checkpoint.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(jina_hub_config(hf.config), indent=2))
    return str(root), hf, checkpoint


def jina_task_references(root, minilm_path):
    """(a Jina-v3 folder laid out as the Hub ships it, adapters included; {task (None: no adapter):
    sentence-transformers over transformers' JinaEmbeddingsV3Model holding that task's merged weights, mean pooling,
    Normalize}; the tokenizer): the references of every test of the task adapters through sentence-transformers."""
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    try:  # sentence-transformers 6 moved the modules
        from sentence_transformers.sentence_transformer import modules as st_modules
    except ImportError:
        st_modules = st.models
    folder, hf, checkpoint, tok = jina_st_folder(root / "jina-embeddings-v3", minilm_path)
    references = {}
    for t, task in enumerate((*JINA_TASKS, None)):
        merged = root / f"merged-{task}"
        jina_reference(hf, checkpoint, None if task is None else t).save_pretrained(merged)
        tok.save_pretrained(merged)
        references[task] = st.SentenceTransformer(modules=[st_modules.Transformer(str(merged)),
                                                           st_modules.Pooling(32, "mean"), st_modules.Normalize()],
                                                  device="cpu")
    return folder, references, tok


def jina_st_folder(root, minilm_path):
    """jina-embeddings-v3's sentence-transformers folder as the Hub ships it, shrunk (random weights): the model in
    the Hub's layout with its task adapters (jina_hub_folder), a tokenizer (BERT's uncased WordPiece stands in for
    XLM-R's, which is not on this machine), modules.json naming Jina's own custom_st.Transformer, mean Pooling and
    Normalize, and config_sentence_transformers.json with the tasks' prompts; no sentence_bert_config.json (as on
    the Hub). -> (folder, the HF model, checkpoint, tokenizer)."""
    import json
    tok = _family_tokenizer("jina_embeddings_v3", minilm_path)
    folder, hf, checkpoint = jina_hub_folder(root, hidden=32, heads=2, layers=2, intermediate=40,
                                             vocab_size=len(tok), max_len=128, attn_implementation="sdpa")
    tok.save_pretrained(folder)
    modules = [{"idx": 0, "name": "transformer", "path": "", "type": "custom_st.Transformer", "kwargs": ["task"]},
               {"idx": 1, "name": "pooler", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "normalizer", "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize"}]
    (root / "modules.json").write_text(json.dumps(modules, indent=2))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (root / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": dict(JINA_PROMPTS), "default_prompt_name": None, "similarity_fn_name": "cosine"}))
    return folder, hf, checkpoint, tok


# ---- "auto" and its safety net (tests/model/test_auto.py, test_faults.py) -----------------------------------------
AUTO_IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
AUTO_MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


class FakeTimer:
    """Milliseconds from a script; each call also runs the function once, so both contenders are exercised."""

    def __init__(self, script):
        self.script, self.calls = list(script), 0

    def __call__(self, fn):
        fn()
        self.calls += 1
        return self.script.pop(0)


class Breaks:
    """Stands in for a kernel's `launch` that raises; counts how often it was tried."""

    def __init__(self, error):
        self.error, self.calls = error, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise self.error()


def kernel_module(op):
    """`op`'s kernel module (fastbert.kernels.<op>), as its unit imports it."""
    from fastbert import units
    return units.UNITS[op].kernels()


def twin_for(hf, op):
    """The answer "auto" owes when `op`'s kernel fails: that op on its twin, the others on their kernels."""
    import fastbert
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").set_kernels(**{op: "torch"}).eval()
    with torch.no_grad():
        return fb(AUTO_IDS, attention_mask=AUTO_MASK).last_hidden_state


def failure_warnings(record):
    """The safety net's warnings among `record`'s (a pytest.warns or recwarn list)."""
    return [w for w in record if "failed" in str(w.message) and "fastbert: the Triton kernel" in str(w.message)]


# ---- residual_layernorm's gradients (tests/kernels/test_residual_layernorm_backward.py, ..._dropout.py) ----------
RESIDUAL_LAYERNORM_INPUTS = ("y", "weight", "bias", "residual", "ln_weight", "ln_bias")


def seeded(shape, dtype, scale=1.0, shift=0.0, seed=0):
    """N(shift, scale^2) drawn in float64 from its own seed, rounded to dtype, on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype).to(DEVICE)


def residual_layernorm_inputs(T, K, H, dtype, has_bias, has_ln_bias):
    """residual_layernorm's inputs in RESIDUAL_LAYERNORM_INPUTS' order (None for an absent bias)."""
    return [seeded((T, K), dtype), seeded((H, K), dtype, scale=K ** -0.5, seed=1),
            seeded((H,), dtype, scale=0.5, seed=2) if has_bias else None, seeded((T, H), dtype, seed=3),
            seeded((H,), dtype, scale=0.2, shift=1.0, seed=4),
            seeded((H,), dtype, scale=0.2, seed=5) if has_ln_bias else None]


def check_gradient(name, dtype, got, twin, ref):
    """One output or gradient against the fp64 reference and the twin's: fp32 within FP32_TOL scaled by the
    reference's size (max(1, max |ref|)) from both; fp16/bf16 within error_bound of the twin's own error. None (an
    absent input) must be None on every side."""
    if got is None or ref is None:
        assert got is None and ref is None and twin is None, name
        return
    assert got.dtype == dtype and got.shape == ref.shape, (name, got.dtype, got.shape)
    err = max_error(got, ref)
    if dtype == torch.float32:
        bar = FP32_TOL * max(1.0, float(ref.double().abs().max()))
        assert err <= bar, f"{name}: {err:.3g} from fp64 > {bar:.3g}"
        assert max_error(got, twin) <= bar, f"{name}: {max_error(got, twin):.3g} from the twin > {bar:.3g}"
    else:
        bound = error_bound(dtype, max_error(twin, ref))
        assert err <= bound, f"{name}: {err:.3g} from fp64 > {bound:.3g} (2x the twin's + 1e-6)"


# How a drawn row of an attention mask is padded (the fuzz tests and the call-surface test draw them)
ROW_KINDS = ("full", "right", "left", "holes", "empty", "one")


def mask_row(kind: str, n: int, S: int, generator) -> torch.Tensor:
    """One [S] 0/1 row of `kind`: full; right- or left-padded to n real tokens; holes at random; empty (fully
    padded); one real token, at position n - 1."""
    row = torch.ones(S, dtype=torch.long)
    if kind == "right":
        row[n:] = 0
    elif kind == "left":
        row[:S - n] = 0
    elif kind == "holes":
        row = torch.randint(0, 2, (S,), generator=generator)
    elif kind == "empty":
        row[:] = 0
    elif kind == "one":
        row[:] = 0
        row[n - 1] = 1
    return row


def max_delta(got, want) -> float:
    """max |got - want| over every component (float64), the shapes equal: how far a served vector is from its
    reference, held to FP32_TOL (the project's fp32 bar) where both are fp32."""
    import numpy as np
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max())


def cosines(a, b):
    """Row-wise cosine of two [n, dim] arrays, in float64."""
    import numpy as np
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ---- real text and live servers (tests/serve) ------------------------------------------------------------------------
def real_texts(n: int, min_chars: int = 20) -> list:
    """`n` distinct paragraphs of real text no one here wrote, of mixed lengths: the descriptions of the Python
    distributions installed here (sorted by name), spread evenly."""
    import importlib.metadata
    import re
    paragraphs, seen = [], set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        for paragraph in re.split(r"\n\s*\n", dist.metadata.get_payload() or ""):
            paragraph = " ".join(paragraph.split())
            if len(paragraph) >= min_chars and paragraph not in seen:
                seen.add(paragraph)
                paragraphs.append(paragraph)
    if len(paragraphs) < n:
        pytest.skip(f"the installed packages give {len(paragraphs)} paragraphs, {n} wanted")
    step = len(paragraphs) / n
    return [paragraphs[int(i * step)] for i in range(n)]


def real_texts_that_fit(model_path, n: int, max_tokens: int = 256) -> list:
    """`n` of real_texts(2 n) that the model's tokenizer makes at most `max_tokens` tokens of (a longer one is a 413
    at a server unless the request asks to truncate it)."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    texts = real_texts(2 * n)
    fits = [t for t, ids in zip(texts, tokenizer(texts)["input_ids"]) if len(ids) <= max_tokens]
    assert len(fits) >= n, f"{len(fits)} of {2 * n} real texts fit {max_tokens} tokens, {n} wanted"
    return fits[:n]


def reranker_folder(minilm_path, root):
    """A random-weight BERT cross-encoder (one label) with the bundled model's tokenizer, saved under root/reranker:
    what the live reranker servers serve."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    cfg = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=100, num_labels=1)
    torch.manual_seed(0)
    folder = root / "reranker"
    perturb_(transformers.BertForSequenceClassification(cfg), weight_std=0.05).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def splade_folder(minilm_path, root):
    """A random-weight BertForMaskedLM SPLADE model (sentence-transformers' SparseEncoder: MLMTransformer then
    SpladePooling, max over tokens of log1p(relu(logits))) with the bundled model's tokenizer, saved under
    root/splade."""
    import transformers
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    cfg = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=100)
    torch.manual_seed(2)
    mlm = root / "splade-mlm"
    perturb_(transformers.BertForMaskedLM(cfg), weight_std=0.05).save_pretrained(mlm)
    tokenizer.save_pretrained(mlm)
    folder = root / "splade"
    SparseEncoder(modules=[MLMTransformer(str(mlm), max_seq_length=256), SpladePooling(pooling_strategy="max")],
                  device="cpu").save(str(folder))
    return str(folder)


class LiveServer:
    """A server in a process of its own on 127.0.0.1, on a port the system picks (read from the line it prints),
    ready when GET `ready_path` answers 200. Stopped by its pid (SIGTERM, then SIGKILL if it hangs)."""

    def __init__(self, command: list, log_path, timeout: float = 120.0, headers=None, ready_path="/health"):
        import re
        import subprocess
        import sys
        import time

        import httpx
        env = dict(os.environ, TRITON_INTERPRET="0", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.process = subprocess.Popen([sys.executable, *command], stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env)
        deadline, self.url, self.health_codes = time.monotonic() + timeout, None, []
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            if self.url is None:
                found = re.search(r"on (http://127\.0\.0\.1:\d+)", self.output())
                self.url = found.group(1) if found else None
            if self.url is not None:
                try:
                    code = httpx.get(self.url + ready_path, headers=headers, timeout=5).status_code
                    self.health_codes.append(code)
                    if code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server was not ready within {timeout:.0f} s:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> int:
        """SIGTERM to its pid; its exit code (SIGKILL after 60 s)."""
        import signal
        import subprocess
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        return self.process.returncode


@contextlib.contextmanager
def serving(app, headers=None, timeout: float = 120.0):
    """A fastbert.serve app in this process (starlette's TestClient: its lifespan runs, the model loads on its
    thread), yielded once GET /health answers 200."""
    import time

    from fastapi.testclient import TestClient
    with TestClient(app, headers=headers) as client:
        deadline = time.monotonic() + timeout
        while client.get("/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready within {timeout:.0f} s: {client.get('/health').json()}")
            time.sleep(0.05)
        yield client


# ---- the decoder-shaped embedders: Qwen3-Embedding, EmbeddingGemma (random weights, small, their folders' layout) ---
# Qwen3-Embedding's query instruction and EmbeddingGemma's query / document prompts, as their
# config_sentence_transformers.json hold them
QWEN3_QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def has_decoder_embedders() -> bool:
    """transformers 5 or later: Qwen3 and Gemma 3 as fastbert reads them (rope_parameters, Gemma's bidirectional
    attention)."""
    import transformers
    return int(transformers.__version__.split(".")[0]) >= 5


def qwen3_config(hidden=64, heads=4, kv_heads=2, head_dim=32, layers=2, intermediate=96, vocab=30522, **extra):
    fields = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, pad_token_id=0, use_cache=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, attn_implementation="sdpa",
                  tie_word_embeddings=True)
    fields.update(extra)
    import transformers
    return transformers.Qwen3Config(**fields)


def qwen3_model(seed=0, qk_gain=4.0, **config):
    torch.manual_seed(seed)
    import transformers
    model = perturb_(transformers.Qwen3Model(qwen3_config(**config)), weight_std=0.05).eval()
    return sharpen_qk_(model, qk_gain)


def qwen3_st_folder(root, tokenizer):
    """A Qwen3-Embedding folder as the Hub lays it out: model.safetensors with Qwen3Model's keys and no "model."
    prefix, config.json naming Qwen3ForCausalLM, the tokenizer padding left; for sentence-transformers, modules.json
    (Transformer, last-token Pooling, Normalize) and the query instruction prompt."""
    import json

    from safetensors.torch import save_file
    hf = qwen3_model(vocab=len(tokenizer))
    model_dir = root / "qwen3-embedding"
    model_dir.mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, model_dir / "model.safetensors")
    config = hf.config.to_dict()
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(model_dir)
    # Qwen3-Embedding's tokenizer_config.json says "padding_side": "left" (save_pretrained does not write it)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "padding_side": "left"}))
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256,
                                                                      "do_lower_case": False}))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hf.config.hidden_size, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True}))
    (model_dir / "2_Normalize").mkdir()
    (model_dir / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": QWEN3_QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"}))
    return hf, model_dir


def gemma3_config(hidden=64, heads=4, kv_heads=1, head_dim=32, layers=3, intermediate=96, vocab=30522, window=16,
                  **extra):
    fields = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, pad_token_id=0, use_cache=False,
                  query_pre_attn_scalar=head_dim, sliding_window=window, use_bidirectional_attention=True,
                  layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
                  attn_implementation="sdpa")
    fields.update(extra)
    import transformers
    return transformers.Gemma3TextConfig(**fields)


def gemma3_model(seed=0, qk_gain=3.0, **config):
    torch.manual_seed(seed)
    import transformers
    model = perturb_(transformers.Gemma3TextModel(gemma3_config(**config)), weight_std=0.05).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return sharpen_qk_(model, qk_gain)


def gemma3_st_folder(root, tokenizer):
    """An EmbeddingGemma folder: the encoder saved as transformers saves Gemma3TextModel (the Hub's layout: keys
    without a prefix, architectures Gemma3TextModel), then sentence-transformers' Transformer, mean Pooling, Dense
    64 -> 256 and 256 -> 64 without bias or activation, Normalize, the query / document prompts."""
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    try:
        from sentence_transformers.sentence_transformer import modules as st_modules
    except ImportError:
        st_modules = st.models
    hf = gemma3_model(vocab=len(tokenizer))
    hf.save_pretrained(root / "hf")
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(root / "hf")
    torch.manual_seed(1)
    word = st_modules.Transformer(str(root / "hf"), max_seq_length=256)
    modules = [word, st_modules.Pooling(64, "mean"),
               st_modules.Dense(64, 256, bias=False, activation_function=torch.nn.Identity()),
               st_modules.Dense(256, 64, bias=False, activation_function=torch.nn.Identity()),
               st_modules.Normalize()]
    folder = root / "st"
    st.SentenceTransformer(modules=modules, device="cpu", prompts=GEMMA_PROMPTS).save(str(folder))
    return hf, root


# ---- grouped qkv and its float64 pieces (the attention kernel tests: grouped key/value heads, causal) ------------
def make_grouped(T, nh, kv, hd, dtype, layout="contiguous", seed=0):
    """qkv [T, nh + 2 kv, hd], values ~ N(0, 1), in one of several memory layouts:

    contiguous:  the view of the grouped GEMM's [T, (nh + 2 kv) hd] output (what the layer passes)
    slice:       columns 8.. of a wider buffer (row stride (nh + 2 kv) hd + 24, base offset 8 elements)
    heads_major: a permuted view of [nh + 2 kv, T, hd] memory (token stride hd, head stride T hd)
    """
    N = nh + 2 * kv
    values = torch.randn(T, N, hd, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    if layout == "contiguous":
        qkv = values.reshape(T, N * hd).to(DEVICE).view(T, N, hd)
    elif layout == "slice":
        big = torch.zeros(T, N * hd + 24, dtype=dtype, device=DEVICE)
        big[:, 8:8 + N * hd] = values.reshape(T, N * hd)
        qkv = big[:, 8:8 + N * hd].view(T, N, hd)
    elif layout == "heads_major":
        qkv = values.permute(1, 0, 2).contiguous().to(DEVICE).permute(1, 0, 2)
    else:
        raise ValueError(layout)
    assert torch.equal(qkv.cpu(), values) and qkv.stride(-1) == 1
    return qkv


def rotary_for(positions, hd, theta=10000.0):
    """HF's default RoPE tables for the given per-token positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    from fastbert import twins
    return twins.rotary_tables(positions.to(DEVICE), inv_freq.to(DEVICE))


def repeat_kv64(x, group):
    """[L, kv, hd] -> [L, kv * group, hd]: key/value head j serves query heads j * group .. j * group + group - 1."""
    L, kv, hd = x.shape
    return x[:, :, None, :].expand(L, kv, group, hd).reshape(L, kv * group, hd)


def rotate64(x, cos, sin):
    """x [L, h, hd] rotated in float64 by cos/sin [L, hd/2] (rotate-half, the frequencies repeated)."""
    cos, sin = torch.cat([cos, cos], -1).double()[:, None], torch.cat([sin, sin], -1).double()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin
