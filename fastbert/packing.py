"""Sequences packed inside a row by their position ids, as the installed transformers reads them.

transformers 5.25 began reading `position_ids` in its encoders' attention mask: called with position_ids and no
attention_mask, a row whose positions restart holds several sequences, and each token attends only within its own.
That is the input `DataCollatorWithFlattening` builds (sequences concatenated into one row, positions restarting,
no mask). The rule: a new sequence starts wherever a position is not the previous position plus one.

Which releases and which families do this is not a version number fastbert could copy: transformers changes it per
model file, between minor releases. So fastbert asks the installed transformers, once per model_type and process
(fastbert/installed.py): a tiny random encoder of that type, and whether a token's output stays the same when the
tokens after a restart of the positions change (`packs_by_position_ids`). Where it does, fastbert splits rows the same
way and runs the sequences padding-free; where it does not, position ids stay positions only, as before.
"""
from __future__ import annotations

import torch

from . import installed


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
    return installed.ask(_packs, model_type, "whether its {} encoder reads packed sequences from position_ids")


def _packs(model_type: str) -> bool:
    model = installed.tiny_encoder(model_type)

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
