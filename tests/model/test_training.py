"""Train mode: autograd through the PyTorch path, gradients equal to HF's, dropout where HF has it."""
import torch
from helpers import random_hf_bert

import fastbert

IDS = torch.tensor([[5, 6, 7, 8, 9, 3], [10, 11, 12, 13, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


def test_fine_tuning_step_gradients_match_hf():
    hf = random_hf_bert(hidden=64, heads=4, layers=2, intermediate=100, vocab=50, max_pos=16)
    hf.config.hidden_dropout_prob = hf.config.attention_probs_dropout_prob = 0.0
    for m in hf.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "dropout_prob"):  # transformers 4.x's sdpa attention keeps its own copy of the probability
            m.dropout_prob = 0.0
    hf.train()
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    fb.config.hidden_dropout_prob = fb.config.attention_probs_dropout_prob = 0.0
    fb.embeddings.dropout.p = 0.0
    assert fb.training
    target = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(0))
    for model in (hf, fb):
        out = model(IDS, attention_mask=MASK)
        loss = ((out.last_hidden_state - target) ** 2 * MASK[..., None]).mean() + out.pooler_output.sum()
        loss.backward()
    grads = {n: p.grad for n, p in fb.named_parameters()}
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    compared = 0
    for name, g in grads.items():
        if "qkv_" in name:  # the fused weight's gradient is HF's query/key/value gradients stacked
            prefix, kind = name.rsplit(".qkv_", 1)
            ref = torch.cat([hf_grads[f"{prefix}.{q}.{kind}"] for q in ("query", "key", "value")])
        else:
            ref = hf_grads[name]
        assert g is not None and torch.isfinite(g).all(), name
        assert (g - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item()), name
        compared += 1
    assert compared == len(grads) > 20


def test_dropout_is_active_in_train_mode_only():
    hf = random_hf_bert(hidden=32, heads=2, layers=1, intermediate=40, vocab=50, max_pos=16)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").train()
    a, b = fb(IDS, attention_mask=MASK).last_hidden_state, fb(IDS, attention_mask=MASK).last_hidden_state
    assert not torch.equal(a, b)
    fb.eval()
    with torch.no_grad():
        assert torch.equal(fb(IDS, attention_mask=MASK).last_hidden_state,
                           fb(IDS, attention_mask=MASK).last_hidden_state)


def test_embeddings_dropout_draws_what_hf_draws():
    """In train mode the embeddings' dropout is HF's: under one seed, fastbert's embeddings of the packed tokens are
    HF's embeddings of the same tokens, row by row, dropped elements included (a full forward's dropout order differs
    from HF's in the layers, so the embeddings are compared on their own)."""
    hf = random_hf_bert(hidden=32, heads=2, layers=1, intermediate=40, vocab=50, max_pos=16)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    hf.train(), fb.train()
    ids = IDS[:1]  # one unpadded row: packed order is the row's order
    positions, types = torch.arange(ids.shape[1]), torch.zeros(ids.shape[1], dtype=torch.long)
    torch.manual_seed(0)
    want = hf.embeddings(input_ids=ids)[0]
    torch.manual_seed(0)
    got = fb.embeddings(ids[0], types, positions, None)
    assert hf.config.hidden_dropout_prob > 0 and (want == 0).any()
    assert torch.equal(got, want)
