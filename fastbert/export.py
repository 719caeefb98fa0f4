"""ONNX export of the PyTorch path, with dynamic batch and sequence axes.

    fastbert.export_onnx(model, "bert.onnx")        inputs input_ids, attention_mask, token_type_ids [batch, sequence]
                                                    (DistilBERT, MPNet: no token_type_ids);
                                                    outputs last_hidden_state [batch, sequence, H] (+ pooler_output)
    fastbert.export_onnx(encoder, "embed.onnx")     a SentenceEncoder: inputs input_ids, attention_mask;
                                                    output sentence_embedding [batch, dim], pooled as it pools

The graph is the PyTorch twins recorded as plain aten ops (ONNX has no Triton and no fastbert ops), traced on the
padded path that serves any mask (see the README's "Traced forwards"): padded positions come out as 0, as from the
model. Needs the `onnx` and `onnxscript` packages (torch.onnx's exporter); onnxruntime runs the file.
"""
from __future__ import annotations

import os

import torch

from . import dispatch
from .modeling import BertModel


class _BertGraph(torch.nn.Module):
    """The model's forward with named tensor outputs, for the exporter."""

    def __init__(self, model: BertModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        pooled = getattr(out, "pooler_output", None)  # DistilBERT's output has no such field
        return (out.last_hidden_state,) if pooled is None else (out.last_hidden_state, pooled)


class _EncoderGraph(torch.nn.Module):
    """A SentenceEncoder's forward: token vectors, its pooling, its Normalize."""

    def __init__(self, encoder):
        super().__init__()
        self.model, self.pipeline = encoder.model, encoder.pipeline

    def forward(self, input_ids, attention_mask):
        from .encode import embed
        return embed(self.model, self.pipeline, input_ids, attention_mask)


def export_onnx(model_or_encoder, path, *, example_length: int = 16, opset: int | None = None) -> str:
    """Write an ONNX file of `model_or_encoder` (a fastbert.BertModel or fastbert.SentenceEncoder) to `path`, with
    batch and sequence dynamic. Returns the path. The model is exported in its dtype, on its device, in eval mode."""
    from .encode import SentenceEncoder
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise ImportError(f"ONNX export needs the onnx and onnxscript packages ({e}); "
                          f"pip install onnx onnxscript (and onnxruntime to run the file)") from None
    if isinstance(model_or_encoder, SentenceEncoder):
        model, graph, names = model_or_encoder.model, _EncoderGraph(model_or_encoder), ["input_ids", "attention_mask"]
        outputs = ["sentence_embedding"]
    elif isinstance(model_or_encoder, BertModel):
        model, graph = model_or_encoder, _BertGraph(model_or_encoder)
        types = model.embeddings.token_type_embeddings is not None  # (DeBERTa: by its config's type_vocab_size)
        names = ["input_ids", "attention_mask"] + (["token_type_ids"] if types else [])
        outputs = ["last_hidden_state"] + (["pooler_output"] if model.pooler is not None else [])
    else:
        raise TypeError(f"export_onnx takes a fastbert.BertModel or a fastbert.SentenceEncoder, got "
                        f"{type(model_or_encoder).__name__}")
    device = model.embeddings.word_embeddings.weight.device
    length = max(2, min(example_length, model.embeddings.max_length))
    ids = torch.randint(0, model.config.vocab_size, (2, length), device=device)
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence", max=model.embeddings.max_length)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), dispatch.traced_as_aten():  # the twins, as plain ONNX operators
            torch.onnx.export(graph, tuple(example[n] for n in names), os.fspath(path), dynamo=True,
                              input_names=names, output_names=outputs, opset_version=opset,
                              dynamic_shapes={n: {0: batch, 1: sequence} for n in names})
    finally:
        model.train(was_training)
    return os.fspath(path)
