"""Questions fastbert asks the installed transformers rather than its version number.

Some of transformers' behaviour changes per model file between minor releases (which encoders read packed sequences
from position ids; whether a return_dict=False tuple keeps an absent pooler's slot). fastbert follows whatever release
is installed by asking it: a tiny random encoder of the model_type, built and run once per question, model_type and
process, in a thread of its own (a forward being traced, a device context and inference or no-grad modes are per
thread, so the question is answered on the CPU in real numbers whatever the caller is in the middle of).
"""
from __future__ import annotations

import inspect
import threading
from typing import Callable

import torch

_ANSWERS: dict[tuple, object] = {}  # (question, model_type) -> the installed transformers' answer
_LOCK = threading.Lock()

# A tiny encoder: sizes in BERT's field names (each family's config spells them its own way: Family.raw_name).
_TINY = {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 32,
         "vocab_size": 32, "max_position_embeddings": 64}
_TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id", "mask_token_id")


def ask(question: Callable[[str], object], model_type: str, what: str):
    """question(model_type)'s answer, computed once per process in a thread of its own, under no_grad on the CPU with
    the caller's random stream left where it was. `what` completes "could not ask the installed transformers ..." ({}
    is the model_type) in the error raised when the question fails."""
    key = (question.__qualname__, model_type)
    if key in _ANSWERS:
        return _ANSWERS[key]
    with _LOCK:
        if key not in _ANSWERS:
            _ANSWERS[key] = _in_a_thread(question, model_type, what)
    return _ANSWERS[key]


def _in_a_thread(question, model_type: str, what: str):
    result = {}

    def run():
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.device("cpu"):
                result["answer"] = question(model_type)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="fastbert-transformers-probe")
    thread.start()
    thread.join()
    if "error" in result:
        raise RuntimeError("fastbert could not ask the installed transformers " + what.format(model_type)) \
            from result["error"]
    return result["answer"]


def tiny_encoder(model_type: str, **kwargs) -> torch.nn.Module:
    """A 1-layer random encoder of the installed transformers' class for `model_type` (its base model class, built
    with `kwargs`), fp32, eval mode, weights drawn from a seeded generator at a scale where tokens reach each other."""
    import transformers

    from . import families

    family = families.MODEL_TYPES[model_type][0]
    config = transformers.AutoConfig.for_model(model_type, **{family.raw_name(k): v for k, v in _TINY.items()})
    for name, value in (("embedding_size", _TINY["hidden_size"]),  # ELECTRA
                        ("num_key_value_heads", _TINY["num_attention_heads"])):  # EuroBERT
        if hasattr(config, name):
            setattr(config, name, value)
    for name in _TOKEN_ID_FIELDS:  # the defaults of the real vocabularies lie outside the tiny one
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= _TINY["vocab_size"]:
            setattr(config, name, 1)
    encoder = getattr(transformers, families.encoder_class(model_type))
    model = encoder(config, **kwargs).eval().float()
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model


@torch.compiler.assume_constant_result  # a traced forward bakes the answer in (it is the same for every call)
def tuple_keeps_absent_pooler(model_type: str) -> bool:
    """Does the installed transformers' encoder, built without a pooler and called with return_dict=False, keep the
    pooler's slot as None in its tuple (transformers 4.x's BERT and RoBERTa: (sequence_output, None, ...)) rather than
    leave it out (5.x)? Families whose encoder takes no add_pooling_layer have no slot to keep."""
    return ask(_keeps_absent_pooler, model_type, "what its {} encoder's return_dict=False tuple holds without a pooler")


def _keeps_absent_pooler(model_type: str) -> bool:
    import transformers

    from . import families

    encoder = getattr(transformers, families.encoder_class(model_type))
    if "add_pooling_layer" not in inspect.signature(encoder.__init__).parameters:
        return False
    out = tiny_encoder(model_type, add_pooling_layer=False)(input_ids=torch.tensor([[5, 6, 7]]), return_dict=False)
    return len(out) > 1 and out[1] is None
