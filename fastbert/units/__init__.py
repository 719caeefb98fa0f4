"""The four ops, one unit each: everything fastbert knows about an op lives in its unit's module.

    qkv_projection.py      x @ W_qkv^T + b viewed [T, 3, nh, hd]
    attention.py           softmax(q k^T * scale + extras + mask) v, per sequence
    bias_gelu.py           act(x @ W^T + b) (gated: act(a) * g)
    residual_layernorm.py  LayerNorm(y @ W^T + b + residual) (pre-norm: the stream and its norm; rms: RMSNorm)

A unit module holds, under the same names in each:

    twin(...)              the PyTorch definition, with the signature the layers call
    kernel(...)            the Triton kernel behind the same signature (the model has validated its tensors)
    traced(backend)        a callable with twin's signature that records one torch custom op node (its schema and
                           fake are in the unit), for torch.compile and torch.export
    reason(situation, facts)
                           why the kernel cannot serve a forward's situation (dispatch.Situation), or None
    key(dtype, shapes)     "auto"'s table key for these shapes (fastbert/measure.py)
    contenders(dtype, shapes, device, kernel, twin)
                           zero-argument calls of kernel and twin on random inputs of these shapes, which "auto" times

Callers outside the model reach the ops through fastbert/ops.py (a backend per call, the kernels' checked entry
points). For a forward that trains (autograd on, or dropout drawn), each unit also holds

    train_kernel(...)      the kernel forward with its backward, an autograd function (TrainKernel), twin's signature
    train_reason(situation)
                           why train_kernel cannot serve a training forward's situation, or None

and attention `train_unsupported(...)`, for what a call asks (probabilities, a custom mask). docs/training.md.

The custom ops are for traced forwards only (torch.compile, torch.export: one node each, where a tracer cannot follow a
Triton launcher's Python), and for inference; an eager forward calls twin and kernel directly, since the dispatcher
adds a cost per call that a small batch would feel (bench/RESULTS.md, "Measurements cited by the code").

dispatch, measure, fallback and graphs are generic over UNITS: adding a parameter to an op touches its unit and its
kernel file (docs/design.md walks through one).
"""
from . import attention, bias_gelu, qkv_projection, residual_layernorm

# op name -> its unit, in the order the model's `kernels` lists the ops
UNITS = {unit.OP: unit for unit in (qkv_projection, attention, bias_gelu, residual_layernorm)}
OPS = tuple(UNITS)
