"""Sequences packed inside rows by their position ids (DataCollatorWithFlattening's input), as the installed
transformers reads them: every family, against its own transformers class, at every position.

Where the installed transformers' encoder of a family splits a row at restarting positions (transformers 5.25's
BERT, RoBERTa, ELECTRA), fastbert must split it the same way; where it does not (4.x, 5.24, the other families), the
position ids stay positions only, and fastbert must not split either. The reference is transformers itself in both
cases, so the same file proves both under whichever release is installed (CI runs it under the newest and under
4.41). The sequences run padding-free on the twins and on the kernels (Triton's interpreter on CPU); the kernel
cases are the families whose transformers packs, where the kernels meet the new layout.
"""
import inspect

import pytest
import torch
import transformers
from helpers import ARCH_VOCAB, DEVICE, has_deberta_v2, has_modernbert, has_rotary_post_norm
from helpers import random_arch_model as random_hf

import fastbert
from fastbert import packing

NEEDS_MODERNBERT = pytest.mark.skipif(not has_modernbert(), reason="this transformers has no ModernBERT (4.48+)")
NEEDS_DEBERTA = pytest.mark.skipif(not has_deberta_v2(), reason="fastbert follows transformers 4.48+'s DeBERTa-v2")
NEEDS_5_24 = pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no NomicBERT, GTE, "
                                                                   "Jina-v3 or EuroBERT (5.24+)")
ARCHS = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert", "mpnet",
         pytest.param("modernbert", marks=NEEDS_MODERNBERT), pytest.param("deberta-v2", marks=NEEDS_DEBERTA),
         *(pytest.param(arch, marks=NEEDS_5_24) for arch in ("jina_embeddings_v3", "nomic_bert", "gte", "eurobert")))
MAX_LEN = 48  # sequences up to 40 tokens: past one key block of the attention kernel (32 keys in the interpreter)

# Rows of position ids: sequences of these lengths back to back (positions 0.. in each), or a named pattern.
CASES = {
    "two sequences": [[7, 5]],
    "five sequences, lengths 1 and past a key block": [[1, 40, 3, 1, 9]],
    "one sequence": [[13]],
    "one sequence at an offset": ["offset"],
    "all-zero positions": ["zeros"],
    "a batch of such rows": [[3, 4, 1, 2], [10], "zeros"],
}


def position_rows(case) -> torch.Tensor:
    rows = CASES[case]
    S = max(sum(r) for r in rows if isinstance(r, list)) if any(isinstance(r, list) for r in rows) else 13
    out = []
    for row in rows:
        if row == "zeros":
            out.append(torch.zeros(S, dtype=torch.long))
        elif row == "offset":
            out.append(torch.arange(3, 3 + S))
        else:
            assert sum(row) == S, (row, S)
            out.append(torch.cat([torch.arange(n) for n in row]))
    return torch.stack(out)


@pytest.fixture(scope="module", params=ARCHS)
def hf(request):
    model = random_hf(request.param, max_len=MAX_LEN)
    if "position_ids" not in inspect.signature(model.forward).parameters:  # DistilBERT before transformers 5
        pytest.skip(f"this transformers' {type(model).__name__} takes no position_ids")
    return model


def inputs(hf, positions, embeds: bool) -> dict:
    g = torch.Generator().manual_seed(positions.shape[1])
    ids = torch.randint(2, ARCH_VOCAB, positions.shape, generator=g)
    kwargs = {"position_ids": positions.to(DEVICE)}
    if embeds:  # the caller's embeddings (the word table's rows), as a trainer with soft prompts passes them
        kwargs["inputs_embeds"] = hf.get_input_embeddings()(ids.to(DEVICE)).detach()
    else:
        kwargs["input_ids"] = ids.to(DEVICE)
    types = getattr(hf.config, "type_vocab_size", 0) or 0
    if "token_type_ids" in inspect.signature(hf.forward).parameters:
        if types > 1:
            kwargs["token_type_ids"] = torch.randint(0, types, positions.shape, generator=g).to(DEVICE)
        elif positions.shape[1] > hf.config.max_position_embeddings:
            # a packed row may be longer than the positions go (they restart), but transformers 4.x's default type ids
            # are a buffer max_position_embeddings long: it runs such a row only with type ids given
            kwargs["token_type_ids"] = torch.zeros_like(positions)
    return kwargs


def check(fb, hf, case, embeds):
    kwargs = inputs(hf, position_rows(case), embeds)
    with torch.no_grad():
        want = hf(**kwargs, output_hidden_states=True)
        got = fb(**kwargs, output_hidden_states=True)
    assert type(got).__name__ == type(want).__name__
    assert (got.last_hidden_state - want.last_hidden_state).abs().max() <= 1e-5
    for i, (g, w) in enumerate(zip(got.hidden_states, want.hidden_states, strict=True)):
        assert (g - w).abs().max() <= 1e-5, f"hidden state {i}"
    if getattr(want, "pooler_output", None) is not None:
        assert (got.pooler_output - want.pooler_output).abs().max() <= 1e-5


@pytest.mark.parametrize("embeds", [False, True], ids=["input_ids", "inputs_embeds"])
@pytest.mark.parametrize("case", CASES)
def test_packed_rows_on_the_twins(hf, case, embeds):
    check(fastbert.BertModel.from_hf(hf, kernels="torch"), hf, case, embeds)


@pytest.mark.parametrize("embeds", [False, True], ids=["input_ids", "inputs_embeds"])
@pytest.mark.parametrize("case", CASES)
def test_packed_rows_on_the_kernels(hf, case, embeds):
    if not packing.packs_by_position_ids(hf.config.model_type):
        pytest.skip(f"this transformers' {type(hf).__name__} does not split rows by position ids: the twins' cases "
                    f"prove that fastbert does not either")
    check(fastbert.BertModel.from_hf(hf, kernels="triton"), hf, case, embeds)


def test_the_probe_sees_what_transformers_does():
    """The answer fastbert acts on is transformers' own: a packed row through transformers' BertModel equals its
    sequences run apart exactly when the probe says BERT packs."""
    hf = random_hf("bert", max_len=MAX_LEN)
    ids = torch.randint(2, ARCH_VOCAB, (1, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE)
    with torch.no_grad():
        row = hf(input_ids=ids, position_ids=positions).last_hidden_state[0]
        apart = torch.cat([hf(input_ids=ids[:, :7]).last_hidden_state[0],
                           hf(input_ids=ids[:, 7:]).last_hidden_state[0]])
    assert ((row - apart).abs().max() <= 1e-5) == packing.packs_by_position_ids("bert")


@pytest.mark.parametrize("arch", ["roberta", "camembert"])
def test_roberta_sequences_counted_from_padding_idx_plus_one(arch):
    """RoBERTa's packed rows give each sequence positions from padding_idx + 1, as DataCollatorWithFlattening(
    position_ids_start=pad_token_id + 1) writes them (transformers' own test of this runs on flash-attn only): the
    rule is the same (a new sequence wherever a position is not the previous one plus one), the answer
    transformers'; where it packs, each sequence's outputs are those of the sequence alone."""
    hf = random_hf(arch, max_len=MAX_LEN)
    lengths = [7, 3, 11, 1]
    positions = torch.cat([torch.arange(n) + hf.config.pad_token_id + 1 for n in lengths])[None].to(DEVICE)
    ids = torch.randint(2, ARCH_VOCAB, positions.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=positions).last_hidden_state
        got = fb(input_ids=ids, position_ids=positions).last_hidden_state
        apart = torch.cat([hf(input_ids=part).last_hidden_state[0] for part in ids.split(lengths, dim=1)])
    assert (got - want).abs().max() <= 1e-5
    if packing.packs_by_position_ids(arch):
        assert (got[0] - apart).abs().max() <= 1e-5


def test_packed_rows_traced_compiled_and_exported(monkeypatch):
    """A traced forward follows the rule without reading the device (transformers' own traced mask applies it
    unconditionally): torch.jit.trace, torch.compile(fullgraph=True) and torch.export give transformers' outputs for
    rows packed differently from the rows they were traced on."""
    import warnings

    from fastbert import dispatch
    monkeypatch.setattr(dispatch, "_WARNED", set())  # what a traced forward says once stays with this test
    hf = random_hf("bert", max_len=MAX_LEN)
    fb = fastbert.BertModel.from_hf(hf)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, ARCH_VOCAB, (3, 12), generator=g).to(DEVICE)
    traced_on = torch.stack([torch.cat([torch.arange(7), torch.arange(5)]), torch.arange(12), torch.zeros(12).long()])
    called_with = torch.stack([torch.arange(12), torch.cat([torch.arange(3), torch.arange(9)]), torch.arange(2, 14)])

    class Rows(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids):
            return self.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python values it records as constants
        traced = torch.jit.trace(Rows(fb), (ids, traced_on.to(DEVICE)), strict=False, check_trace=False)
        compiled = torch.compile(Rows(fb), fullgraph=True)
        exported = torch.export.export(Rows(fb), (ids, traced_on.to(DEVICE))).module()
        for positions in (traced_on.to(DEVICE), called_with.to(DEVICE)):
            want = hf(input_ids=ids, position_ids=positions).last_hidden_state
            for name, run in (("jit.trace", traced), ("compile", compiled), ("export", exported)):
                assert (run(ids, positions) - want).abs().max() <= 1e-5, name


def test_a_mask_turns_packing_off():
    """With an attention_mask, position ids are positions only, packed-looking or not (transformers reads them only
    when no mask is given)."""
    hf = random_hf("bert", max_len=MAX_LEN)
    fb = fastbert.BertModel.from_hf(hf)
    kwargs = inputs(hf, position_rows("two sequences"), embeds=False)
    kwargs["attention_mask"] = torch.ones_like(kwargs["position_ids"])
    with torch.no_grad():
        assert (fb(**kwargs).last_hidden_state - hf(**kwargs).last_hidden_state).abs().max() <= 1e-5


@pytest.mark.skipif(not hasattr(transformers, "DataCollatorWithFlattening"),
                    reason="this transformers has no DataCollatorWithFlattening")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("head", ["masked_lm", "token_classification"])
def test_a_flattening_collator_trainer_step_matches_transformers(head, kernels, tmp_path):
    """Trainer with DataCollatorWithFlattening (one row, positions restarting, no mask): the loss and every gradient
    of a training step with fastbert inside (on the twins, and on the kernels' training path) equal transformers'
    stock step, fp32, dropout off."""
    import copy
    cfg = transformers.BertConfig(vocab_size=ARCH_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=MAX_LEN, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="eager")
    torch.manual_seed(0)
    cls = transformers.BertForMaskedLM if head == "masked_lm" else transformers.BertForTokenClassification
    stock = cls(cfg).to(DEVICE)
    ours = fastbert.optimize(copy.deepcopy(stock), kernels=kernels)
    g = torch.Generator().manual_seed(1)
    rows = []
    for n in (9, 1, 35, 4):
        ids = torch.randint(2, ARCH_VOCAB, (n,), generator=g).tolist()
        if head == "masked_lm":  # a third of the tokens predicted, the rest ignored
            labels = [t if torch.rand((), generator=g) < 0.34 else -100 for t in ids]
        else:
            labels = torch.randint(0, 3, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": labels})
    losses, steps = [], []
    for model in (stock, ours):
        # one plain SGD step at learning rate 1: each parameter moves by exactly minus its gradient
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=len(rows),
                                              max_steps=1, learning_rate=1.0, optim="sgd", weight_decay=0.0,
                                              lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no",
                                              report_to=[], use_cpu=DEVICE == "cpu", remove_unused_columns=False)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                       data_collator=transformers.DataCollatorWithFlattening())
        batch = next(iter(trainer.get_train_dataloader()))
        assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1  # one packed row, no mask
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        losses.append(trainer.train().training_loss)
        steps.append({name: before[name] - p.detach() for name, p in model.named_parameters()})
    assert abs(losses[0] - losses[1]) <= 1e-5, losses
    assert steps[0].keys() == steps[1].keys()
    for name, want in steps[0].items():
        assert (steps[1][name] - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), name
