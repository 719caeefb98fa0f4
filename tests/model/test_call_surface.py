"""The whole call surface, differentially: calls drawn at random over the forms transformers' encoders accept, each
compared with the installed transformers at every position its contract defines.

transformers changes what a call means between minor releases (5.25 began reading packed sequences from
`position_ids`); CI installs the newest release, so a release that moves the contract turns this file red the day it
is installed, before a user meets it. Every family fastbert runs, random weights, fp32, eager attention in
transformers. A call draws:
    attention_mask   absent, all ones, or per row: full, right- or left-padded, holes, fully padded, one token
    position_ids     absent, arange, offset, restarting (sequences packed in the row), constant
    token types      absent or random (where the family has them)
    input            input_ids, or inputs_embeds (the word table's rows)
    outputs          return_dict or the tuple, with or without every hidden state
    shape            batch 1..4, lengths 1 to past one key block of the attention kernel (32 keys in the interpreter)
and, as its own form, transformers' packed keywords (cu_seq_lens_q / max_length_q with a [1, T] row), whose
reference is each sequence run alone (what transformers' varlen flash-attention path computes).

Compared: the last hidden state and every hidden state at real positions (mask 1; all positions without a mask),
pooler_output where transformers' pooler reads a real token, the tuple's length and order. Twins on every family;
the kernels (Triton's interpreter on CPU) on fewer calls. Seeded and bounded (hypothesis derandomized), so CI runs
the same calls every time.
"""
import inspect

import pytest
import torch
from helpers import (
    ARCH_VOCAB,
    DEVICE,
    ROW_KINDS,
    has_deberta_v2,
    has_modernbert,
    has_rotary_post_norm,
    mask_row,
    pad_id,
)
from helpers import random_arch_model as random_hf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastbert

NEEDS_MODERNBERT = pytest.mark.skipif(not has_modernbert(), reason="this transformers has no ModernBERT (4.48+)")
NEEDS_DEBERTA = pytest.mark.skipif(not has_deberta_v2(), reason="fastbert follows transformers 4.48+'s DeBERTa-v2")
NEEDS_5_24 = pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no NomicBERT, GTE, "
                                                                   "Jina-v3 or EuroBERT (5.24+)")
ARCHS = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "bert-no-pooler", "distilbert", "mpnet",
         pytest.param("modernbert", marks=NEEDS_MODERNBERT), pytest.param("deberta-v2", marks=NEEDS_DEBERTA),
         pytest.param("deberta-v2-v2style", marks=NEEDS_DEBERTA),
         *(pytest.param(arch, marks=NEEDS_5_24) for arch in ("jina_embeddings_v3", "nomic_bert", "gte", "eurobert")))
KERNEL_ARCHS = ("bert", "roberta", "electra", "distilbert", "mpnet", pytest.param("modernbert", marks=NEEDS_MODERNBERT),
                pytest.param("eurobert", marks=NEEDS_5_24))
MAX_LEN = 48  # the position table's reach; drawn rows stay under it, offsets included
LONGEST = 40  # past one key block
POSITION_KINDS = ("absent", "arange", "offset", "restarting", "restarting", "constant")  # (drawn this often)


def settings_for(examples: int):
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


_MODELS = {}


def model_pair(arch: str, kernels: str):
    """(transformers' model, fastbert's on the same weights), built once per process."""
    if arch not in _MODELS:
        _MODELS[arch] = random_hf(arch, max_len=MAX_LEN)
    hf = _MODELS[arch]
    key = (arch, kernels)
    if key not in _MODELS:
        _MODELS[key] = fastbert.BertModel.from_hf(hf, kernels=kernels)
    return hf, _MODELS[key]


def takes(hf, name: str) -> bool:
    return name in inspect.signature(hf.forward).parameters


@st.composite
def calls(draw, hf):
    """A call of transformers' encoder `hf` (keyword arguments) and the [B, S] bool of its real positions."""
    B = draw(st.integers(1, 4))
    S = draw(st.integers(1, LONGEST))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    ids = torch.randint(2, ARCH_VOCAB, (B, S), generator=g)
    call = {}
    mask_kind = draw(st.sampled_from(("absent", "absent", "ones", "rows")))  # absent: where position ids may pack
    real = torch.ones(B, S, dtype=torch.bool)
    if mask_kind != "absent":
        mask = torch.ones(B, S, dtype=torch.long)
        if mask_kind == "rows":
            for b in range(B):
                mask[b] = mask_row(draw(st.sampled_from(ROW_KINDS)), draw(st.integers(1, S)), S, g)
            if draw(st.booleans()):  # padded positions hold the pad id, as a tokenizer writes them
                ids = ids.masked_fill(mask == 0, pad_id(hf))
        call["attention_mask"] = mask
        real = mask.bool()
    if takes(hf, "position_ids"):
        kind = draw(st.sampled_from(POSITION_KINDS))
        if kind == "arange":
            call["position_ids"] = torch.arange(S).expand(B, S) if draw(st.booleans()) else torch.arange(S)[None]
        elif kind == "offset":
            call["position_ids"] = torch.arange(S).expand(B, S) + draw(st.integers(1, MAX_LEN - S))
        elif kind == "constant":
            call["position_ids"] = torch.full((B, S), draw(st.integers(0, min(3, MAX_LEN - 1))))
        elif kind == "restarting":
            rows = []
            for _ in range(B):
                cuts = sorted(set(draw(st.lists(st.integers(1, S - 1), min_size=1, max_size=4)))) if S > 1 else []
                bounds = [0, *cuts, S]
                rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
            call["position_ids"] = torch.stack(rows)
    types = getattr(hf.config, "type_vocab_size", 0) or 0
    if types > 1 and takes(hf, "token_type_ids") and draw(st.booleans()):
        call["token_type_ids"] = torch.randint(0, types, (B, S), generator=g)
    if draw(st.booleans()):
        call["input_ids"] = ids
    else:
        call["inputs_embeds"] = hf.get_input_embeddings()(ids.to(DEVICE)).detach()
    call["output_hidden_states"] = draw(st.booleans())
    call["return_dict"] = draw(st.booleans())
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in call.items()}, real.to(DEVICE)


def same(got, want, real, what: str):
    """One output of fastbert against transformers' at every position the contract defines: [B, S, H] states at real
    positions, a [B, H] pooler where transformers' pooler reads a real token (position 0), tuples element by element."""
    if want is None:
        assert got is None, what
    elif isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), (what, type(got).__name__, len(want))
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, real, f"{what}[{i}]")
    else:
        assert isinstance(got, torch.Tensor) and got.shape == want.shape, (what, getattr(got, "shape", got))
        delta = (got - want)[real if want.dim() == 3 else real[:, 0]]
        assert delta.numel() == 0 or delta.abs().max() <= 1e-5, (what, delta.abs().max().item())


def compare(got, want, real, call):
    if call["return_dict"]:
        assert type(got).__name__ == type(want).__name__
        assert list(got.keys()) == list(want.keys()), (list(got.keys()), list(want.keys()))
        for name in want.keys():
            same(got[name], want[name], real, name)
    else:
        same(got, want, real, "the tuple")


def check_call(arch, kernels, data):
    hf, fb = model_pair(arch, kernels)
    call, real = data.draw(calls(hf))
    with torch.no_grad():
        want = hf(**call)
        got = fb(**call)
    compare(got, want, real, call)


@pytest.mark.parametrize("arch", ARCHS)
@settings_for(20)
@given(data=st.data())
def test_calls_on_the_twins_match_transformers(arch, data):
    check_call(arch, "torch", data)


@pytest.mark.parametrize("arch", KERNEL_ARCHS)
@settings_for(4 if DEVICE == "cpu" else 30)
@given(data=st.data())
def test_calls_on_the_kernels_match_transformers(arch, data):
    check_call(arch, "triton", data)


@pytest.mark.parametrize("arch", ARCHS)
@settings_for(8)
@given(data=st.data())
def test_transformers_packed_keywords_match_each_sequence_alone(arch, data):
    """[1, T] input with cu_seq_lens_q / max_length_q (and position ids restarting, as DataCollatorWithFlattening
    writes them with return_flash_attn_kwargs): each sequence's outputs are those of the sequence run alone, which is
    what transformers computes on its varlen flash-attention path."""
    hf, fb = model_pair(arch, "torch")
    lengths = data.draw(st.lists(st.integers(1, LONGEST), min_size=1, max_size=4))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    ids = torch.randint(2, ARCH_VOCAB, (1, sum(lengths)), generator=g).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    with torch.no_grad():
        got = fb(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                 max_length_q=max(lengths), max_length_k=max(lengths))
        def alone(a, n):  # one sequence, with its own positions
            where = {"position_ids": positions[:, a:a + n]} if takes(hf, "position_ids") else {}
            return hf(input_ids=ids[:, a:a + n], **where)

        for i, n in enumerate(lengths):
            a = cu[i].item()
            assert (got.last_hidden_state[0, a:a + n] - alone(a, n).last_hidden_state[0]).abs().max() <= 1e-5, i
        if getattr(got, "pooler_output", None) is not None:  # the row's token 0, as transformers pools a packed row
            first = alone(0, lengths[0]).pooler_output
            assert (got.pooler_output - first).abs().max() <= 1e-5


@pytest.mark.parametrize("hidden_states", [False, True])
def test_a_tuple_without_a_pooler_is_the_installed_transformers_own(hidden_states):
    """return_dict=False from BERT built without a pooler: transformers 4.x keeps the pooler's slot as None
    ((sequence_output, None, hidden_states)), 5.x leaves it out; fastbert's tuple is the installed release's, slot for
    slot (CI runs this under both)."""
    hf, fb = model_pair("bert-no-pooler", "torch")
    ids = torch.randint(2, ARCH_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        want = hf(input_ids=ids, return_dict=False, output_hidden_states=hidden_states)
        got = fb(input_ids=ids, return_dict=False, output_hidden_states=hidden_states)
    same(got, want, torch.ones(2, 9, dtype=torch.bool), "the tuple")
