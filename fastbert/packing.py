"""Sequences packed inside a row by their position ids, as the installed transformers reads them.

transformers 5.25 began reading `position_ids` in its encoders' attention mask: called with position_ids and no
attention_mask, a row whose positions restart holds several sequences, and each token attends only within its own.
That is the input `DataCollatorWithFlattening` builds (sequences concatenated into one row, positions restarting,
no mask). The rule: a new sequence starts wherever a position is not the previous position plus one.

Which releases and which families do this is not a version number fastbert could copy: transformers changes it per
model file, between minor releases. So fastbert asks the installed transformers, once per model_type and process: it
builds a tiny random encoder of that type and checks whether a token's output stays the same when the tokens after a
restart of the positions change (`packs_by_position_ids`). Where it does, fastbert splits rows the same way and runs
the sequences padding-free; where it does not, position ids stay positions only, as before.
"""
from __future__ import annotations

import threading

import torch

_PACKS: dict[str, bool] = {}  # model_type -> the answer of the installed transformers, asked once per process
_LOCK = threading.Lock()


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: True where a token starts a sequence (its row's first token, and every token whose position is
    not the previous token's plus one), transformers' rule for sequences packed in a row."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def same_sequence_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S, S] bool: query i and key j lie in the same packed sequence of their row. For padded rows only (traced
    forwards, output_attentions, padding_free=False): the padding-free path never forms it."""
    sequence = sequence_starts(position_ids).cumsum(dim=1)
    return sequence[:, :, None] == sequence[:, None, :]


@torch.compiler.assume_constant_result  # a traced forward bakes the answer in (it is the same for every call)
def packs_by_position_ids(model_type: str) -> bool:
    """Does the installed transformers' encoder of `model_type` split rows into sequences by restarting position ids
    when no attention_mask is given? Asked once per process and model_type (about a second the first time, mostly
    transformers' imports)."""
    answer = _PACKS.get(model_type)
    if answer is None:
        with _LOCK:
            answer = _PACKS.get(model_type)
            if answer is None:
                answer = _PACKS[model_type] = _ask_transformers(model_type)
    return answer


def _ask_transformers(model_type: str) -> bool:
    """Run the probe in a thread of its own: a forward being traced (torch.jit.trace, torch.compile, torch.export),
    a device context (`with torch.device("meta")`) and inference or no-grad modes are per thread, so the probe
    computes real numbers on the CPU whatever the caller is in the middle of."""
    result = {}

    def probe():
        try:
            result["packs"] = _probe(model_type)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=probe, name="fastbert-packing-probe")
    thread.start()
    thread.join()
    if "error" in result:
        raise RuntimeError(f"fastbert could not ask the installed transformers whether its {model_type} encoder reads "
                           f"packed sequences from position_ids") from result["error"]
    return result["packs"]


# A tiny encoder: sizes in BERT's field names (each family's config spells them its own way: Family.raw_name).
_TINY = {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 32,
         "vocab_size": 32, "max_position_embeddings": 64}
_TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id", "mask_token_id")


def _probe(model_type: str) -> bool:
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
    generator = torch.Generator().manual_seed(0)
    # the caller's random stream stays where it was (building a model draws its initial weights from it)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.device("cpu"):
        model = encoder(config).eval().float()
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)

        def first_sequence(position_ids, ids):  # the outputs of the first three tokens
            return model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([position_ids]))[0][0, :3]

        tokens, other = [5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 13]
        restarting, running = [0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]
        apart = (first_sequence(restarting, tokens) - first_sequence(restarting, other)).abs().max().item()
        together = (first_sequence(running, tokens) - first_sequence(running, other)).abs().max().item()
    if not together > 1e-4:
        raise RuntimeError(f"the probe's tokens do not reach each other even with running positions (largest change "
                           f"{together:.3g}): it cannot tell")
    # packed: the first sequence cannot see the second at all (masked probabilities are exact zeros)
    return apart <= 1e-6 * together
