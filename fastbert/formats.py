"""Number formats of the ops' GEMMs: fp32 (the model's own weights), bf16 and int8.

A format is an axis of the three ops that hold a GEMM (qkv_projection, bias_gelu, residual_layernorm), never a
second model: the parameters stay the checkpoint's fp32 tensors (so state_dict, save_pretrained and adapters see
HF's layout), and the format keeps a prepared copy of each weight it has met, made once and re-made only when the
weight changes (its version counter moves). Each op's twin calls `fmt.linear(x, weight, bias)` in place of F.linear;
everything around the GEMM (the bias, the activation, the residual, LayerNorm's statistics, attention's softmax,
pooling) stays fp32. docs/formats.md has the bars, the measured cost and when to pick which.

    bf16   x and W rounded to bf16, products accumulated in fp32, the output fp32. Where the CPU has bf16 dot
           products (avx512_bf16, AMX) or on CUDA the GEMM runs in bf16 through oneDNN / cuBLAS; elsewhere the same
           numbers come from an fp32 GEMM over the rounded operands (no speed, said once).
    int8   W symmetric per output channel, quantized at preparation; x symmetric per token, quantized on the way in
           (dynamic, so a text's vector never depends on its batch). The int32 products are scaled back to fp32
           per token and channel, then the bias is added. CPU: oneDNN's int8 linear (torch.ops.onednn, the path
           Inductor's x86 lowering takes); CUDA: torch._int_mm.
           Outlier channels: a few input channels of each GEMM carry values tens of times larger than the rest
           ([CLS] / [SEP] and LayerNorm's large-gain dimensions), and one token's scale is set by its largest
           value, so they flatten every other channel of that token into a few levels. `calibrate` finds, once,
           from a fixed set of texts run in fp32, the 1% of each GEMM's input channels with the largest |x|; those
           channels are left out of the int8 product (their weight columns and activations zeroed there) and
           added back by an fp32 GEMM of their own (T x 1% of K x N). The channels are fixed at calibration, so
           this too never depends on the batch.

On x86 CPUs without VNNI the int8 dot product (vpmaddubsw) adds pairs of u8 x s8 products into a saturating int16:
full-range weights would overflow it, so there the weights take 7 bits (|q| <= 63); with VNNI they take 8.
On x86 the activations reach oneDNN as u8 with zero point 128 (q + 128: the same integers): its u8 x s8 kernels are
the fast ones. An s8 source measured 6.6 s for a 512 x 384 x 1,536 GEMM on an AVX-512 VNNI EPYC (a reference
path), against 1.1 ms as u8.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F

FORMATS = ("fp32", "bf16", "int8")
ALIASES = {None: "fp32", "fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "int8": "int8"}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset:
    """The x86 feature flags of this machine's CPU (empty where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16() -> bool:
    """bf16 dot products in hardware: oneDNN's bf16 GEMM is then faster than fp32 (else ~9x slower)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_vnni() -> bool:
    """int8 dot products that accumulate in int32 without saturation (VNNI, or AMX)."""
    flags = cpu_flags()
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


def _version(weight: torch.Tensor):
    """The weight's in-place write counter; an inference tensor (a model built under inference_mode) has none, and
    is keyed by its storage instead, as its values can change only in place under inference_mode."""
    return ("inference", weight.data_ptr()) if weight.is_inference() else weight._version


class Format:
    """One GEMM format. `linear(x [T, K] fp32, weight [N, K], bias [N] | None)` -> [T, N] fp32. The weights are
    prepared once per tensor (`prepared`); `name` is what the surfaces take."""

    name = "fp32"

    def __init__(self):
        self._prepared: dict = {}  # id(weight) -> (weight, its _version, the prepared form)

    def prepared(self, weight: torch.Tensor):
        entry = self._prepared.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != _version(weight):
            if weight.requires_grad and torch.is_grad_enabled():
                raise RuntimeError(f"fastbert: the {self.name} format is for inference (its GEMMs read a prepared "
                                   f"copy of the weights, which autograd cannot reach): train the fp32 model, or run "
                                   f"under torch.no_grad() / inference_mode()")
            with torch.no_grad():
                entry = self._prepared[id(weight)] = (weight, _version(weight), self.prepare(weight))
        return entry[2]

    def prepare(self, weight: torch.Tensor):
        return weight

    def linear(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def hidden(self, x, weight, bias):
        """`linear` for a GEMM whose output only an elementwise activation reads before the format's next GEMM
        (bias_gelu): a format may keep that output in its own working dtype. Here: `linear`."""
        return self.linear(x, weight, bias)

    def __repr__(self):
        return f"Format({self.name!r})"


class BF16(Format):
    name = "bf16"

    def native(self, device: torch.device) -> bool:
        return device.type != "cpu" or cpu_has_bf16()

    def prepare(self, weight):
        if self.native(weight.device):
            return weight.to(torch.bfloat16)
        _warn_once("bf16", "this CPU has no bf16 dot products (avx512_bf16 / AMX), so the bf16 format computes its "
                           "numbers with fp32 GEMMs over bf16-rounded operands: bf16's results, slower than fp32 "
                           "(the rounding is extra work)")
        return weight.to(torch.bfloat16).float()

    def linear(self, x, weight, bias):
        w = self.prepared(weight)
        if w.dtype == torch.bfloat16:  # oneDNN / cuBLAS: bf16 operands, fp32 accumulation
            out = F.linear(x.to(torch.bfloat16), w).float()  # each bf16 exact in fp32
            # widened, then biased in fp32: the same numbers as one mixed-dtype add (bf16 + fp32 promotes), which
            # takes TensorIterator's casting loop, ~2x slower than the two plain passes on CPU
            return out if bias is None else out.add_(bias)
        xr = x.to(torch.bfloat16).float()
        return torch.mm(xr, w.t()) if bias is None else torch.addmm(bias, xr, w.t())

    def hidden(self, x, weight, bias):
        """The GEMM whose output only an elementwise activation reads before the next GEMM of the format (the
        FFN's first): kept in bf16, the bias added in the GEMM's fp32 accumulator (the bias rounded to bf16), so
        the [T, I] activation is read and written in bf16 and reaches the next GEMM without a conversion. The
        activation itself computes in fp32 and rounds its result to bf16, the rounding the next GEMM's input takes
        anyway. Where the CPU has no bf16 dot products: `linear` (fp32)."""
        w = self.prepared(weight)
        if w.dtype != torch.bfloat16:
            return self.linear(x, weight, bias)
        return F.linear(x.to(torch.bfloat16), w, None if bias is None else self.prepared(bias))


class Int8Weight:
    """A weight in int8: the device's packed form, one fp32 scale per output channel, and the calibrated outlier
    channels (`outliers`: input column indices, or None) with their fp32 columns (`outlier_weight` [k, N])."""

    __slots__ = ("packed", "scale", "zero_point", "columns", "outliers", "outlier_weight")

    def __init__(self, packed, scale, zero_point, columns, outliers=None, outlier_weight=None):
        self.packed, self.scale, self.zero_point, self.columns = packed, scale, zero_point, columns
        self.outliers, self.outlier_weight = outliers, outlier_weight


def weight_levels(device: torch.device) -> int:
    """The largest |q| a weight takes: 127, or 63 on x86 CPUs without VNNI (see the module's docstring)."""
    if device.type == "cpu" and os.environ.get("FASTBERT_INT8_WEIGHT_LEVELS"):
        return int(os.environ["FASTBERT_INT8_WEIGHT_LEVELS"])
    return 127 if device.type != "cpu" or cpu_has_vnni() else 63


def quantize_rows(t: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q int8 [R, C], scale fp32 [R, 1]) with t ~ q * scale and |q| <= levels."""
    scale = t.abs().amax(1, keepdim=True).float().clamp_min_(1e-12).div_(levels)
    q = torch.round(t / scale).clamp_(-levels, levels).to(torch.int8)
    return q, scale


ZERO_POINT = 128  # the u8 form's offset: q + 128, with q in [-127, 127]
# quantize_tokens works through x in blocks of about this many elements (2 MiB of fp32): each block's passes (copy,
# max, divide, round, offset, narrow) run in cache, where whole-tensor passes over a [16,384, 1,536] activation
# each write a fresh 100 MB buffer (measured on a 2-core Zen 4: 14 ms a call blocked, 97 ms through
# torch.quantize_per_channel and 70 ms as one eager round(x / s) over the whole tensor)
TOKEN_BLOCK_ELEMENTS = 1 << 19


def quantize_tokens(x: torch.Tensor, offset: int = 0, skip: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of x [T, K] fp32: (q [T, K], scale fp32 [T, 1]), q = round(x * (1 / scale)) with
    scale = max |x_t| / 127 (round half to even, as torch.round; the reciprocal's product, 4x cheaper than the
    division on CPU, can differ from x / scale in the last bit, so a value within an ulp of a half may round the
    other way). offset=ZERO_POINT gives q + 128 as uint8 (the form oneDNN's fast x86 kernels take), else q is int8.
    skip: input channels (int64 [k]) left out, of the scale and of q (0 there: q + offset in the u8 form)."""
    rows, columns = x.shape
    q = torch.empty(rows, columns, dtype=torch.uint8 if offset else torch.int8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    step = max(1, TOKEN_BLOCK_ELEMENTS // max(columns, 1)) if x.device.type == "cpu" else max(rows, 1)
    block = torch.empty(min(rows, step), columns, dtype=torch.float32, device=x.device)
    for start in range(0, rows, step):
        b, s = block[:min(step, rows - start)], scale[start:start + step]
        b.copy_(x[start:start + step])
        if skip is not None:
            b.index_fill_(1, skip, 0.0)
        torch.maximum(b.amax(1, keepdim=True), b.amin(1, keepdim=True).neg_(), out=s)
        s.clamp_min_(1e-12).div_(127)
        b.mul_(s.reciprocal()).round_()
        if offset:
            b.add_(offset)
        q[start:start + step].copy_(b)  # exact: whole numbers in [-127, 127] (+ offset)
    return q, scale


OUTLIER_SHARE = 96  # one input channel in 96 (4 of MiniLM's 384, 16 of its 1,536) is kept out of int8


def outlier_count(columns: int) -> int:
    return -(-columns // OUTLIER_SHARE)


class Int8(Format):
    name = "int8"

    def __init__(self):
        super().__init__()
        self.outliers: dict = {}  # id(weight) -> (weight, its calibrated outlier input channels [k] int64)

    @property
    def calibrated(self) -> bool:
        return bool(self.outliers)

    def set_outliers(self, channels: dict) -> None:
        """channels: {weight tensor: its outlier input channels}; the prepared weights are made again."""
        self.outliers = {id(w): (w, torch.as_tensor(c, dtype=torch.int64, device=w.device))
                         for w, c in channels.items()}
        self._prepared.clear()

    def prepare(self, weight):
        w = weight.float()
        entry = self.outliers.get(id(weight))
        outliers = entry[1] if entry is not None and entry[0] is weight else None
        outlier_weight = None
        if outliers is not None:
            outlier_weight = w.index_select(1, outliers).t().contiguous()  # [k, N]: x[:, outliers] @ it
            w = w.index_fill(1, outliers, 0.0)  # those channels leave the int8 product and its scales
        q, scale = quantize_rows(w, weight_levels(weight.device))
        if weight.device.type == "cpu":
            packed = torch.ops.onednn.qlinear_prepack(q, None)
            return Int8Weight(packed, scale.view(-1), torch.zeros(q.shape[0], dtype=torch.int64), q.shape[1],
                              outliers, outlier_weight)
        # q.t(): the column-major [K, N] _int_mm takes
        return Int8Weight(q, scale.view(1, -1), None, q.shape[1], outliers, outlier_weight)

    def linear(self, x, weight, bias):
        w = self.prepared(weight)
        x = x.contiguous()
        if x.device.type == "cpu":
            qx, sx = quantize_tokens(x, ZERO_POINT, w.outliers)
            acc = torch.ops.onednn.qlinear_pointwise(qx, 1.0, ZERO_POINT, w.packed, w.scale, w.zero_point, None,
                                                     1.0, 0, torch.float32, "none", [], "")
            out = acc.mul_(sx) if bias is None else torch.addcmul(bias, acc, sx, out=acc)
        else:
            qx, sx = quantize_tokens(x, skip=w.outliers)
            rows = qx.shape[0]
            if rows <= 16:  # cuBLASLt's int8 GEMM takes more than 16 rows
                qx = F.pad(qx, (0, 0, 0, 17 - rows))
            out = torch._int_mm(qx, w.packed.t())[:rows].float().mul_(sx).mul_(w.scale)
            out = out if bias is None else out.add_(bias)
        if w.outliers is not None:
            out.addmm_(x.index_select(1, w.outliers), w.outlier_weight)
        return out


class ChannelRecorder(Format):
    """fp32 GEMMs that record, per weight, the largest |x| each input channel met (calibration)."""

    name = "calibration"

    def __init__(self):
        super().__init__()
        self.largest: dict = {}  # id(weight) -> (weight, max |x| per input channel [K])

    def linear(self, x, weight, bias):
        seen = x.detach().abs().amax(0).float()
        entry = self.largest.get(id(weight))
        self.largest[id(weight)] = (weight, seen if entry is None else torch.maximum(entry[1], seen))
        return F.linear(x, weight, bias)

    def outliers(self) -> dict:
        """{weight: the outlier_count(K) input channels with the largest |x|}."""
        return {w: m.topk(outlier_count(m.numel())).indices for w, m in self.largest.values()}


_WARNED: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"fastbert: {message}", stacklevel=4)


def format_of(name) -> Format | None:
    """The Format a surface's option names (None, "fp32": None, the model's own weights), or a ValueError."""
    if isinstance(name, Format):
        return None if name.name == "fp32" else name
    key = ALIASES.get(name if name is None else str(name).replace("torch.", ""))
    if key is None:
        raise ValueError(f"quantize={name!r} is not a number format; the formats are {', '.join(FORMATS)}")
    return {"fp32": None, "bf16": BF16, "int8": Int8}[key]() if key != "fp32" else None


def load_dtype(quantize, dtype):
    """The dtype a model loads in to run in format `quantize`: float32, the weights the format prepares from (an
    explicit other dtype is refused: the format would round weights that were rounded already)."""
    if dtype is None or dtype == "auto" or dtype in (torch.float32, "float32", "fp32", "torch.float32"):
        return torch.float32
    raise ValueError(f"quantize={quantize!r} loads the model in float32 and runs its GEMMs in {quantize}; "
                     f"dtype={dtype!r} asks for another dtype: leave dtype unset")
