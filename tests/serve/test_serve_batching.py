"""What the server's batches compute: texts tokenized already, packed padding-free into one forward
(SentenceEncoder.embed_tokenized), pooled per text on the packed tokens (fastbert.encode.pool_packed), equal to
sentence-transformers; and a text's vector against what shares its batch, measured on the CPU twins against an fp64
reference (the figure docs/serve.md gives)."""
import os
import random

import numpy as np
import pytest
import torch
from helpers import FP32_TOL, max_delta, optional, real_texts

import fastbert
from fastbert.encode import POOLING_MODES, pool, pool_packed


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_pooling_packed_tokens_equals_pooling_padded_rows(mode):
    """Lengths 1..9 with prompts left out of the pooling (skips), a text whose prompt covers all of it (nothing to
    pool: pool()'s answer for an all-0 row) and one that is all prompt but its last token."""
    torch.manual_seed(0)
    lengths = torch.tensor([5, 1, 9, 3, 2, 7, 4])
    skips = torch.tensor([2, 0, 0, 3, 1, 6, 0])
    H = 6
    hidden = torch.randn(int(lengths.sum()), H)
    B, S = len(lengths), int(lengths.max())
    rows, mask = torch.zeros(B, S, H), torch.zeros(B, S)
    start = 0
    for i, (n, skip) in enumerate(zip(lengths.tolist(), skips.tolist())):
        rows[i, :n] = hidden[start:start + n]
        mask[i, skip:n] = 1
        start += n
    want = pool(rows, mask, [mode])
    got = pool_packed(hidden, lengths, skips, [mode])
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.fixture(scope="module")
def texts():
    return real_texts(24)


@pytest.fixture(scope="module")
def encoder(minilm_path):
    return fastbert.SentenceEncoder.from_pretrained(minilm_path, device="cpu", kernels="torch")


def test_embed_tokenized_equals_sentence_transformers(encoder, minilm_path, texts):
    """The bundled model: each text with and without a prompt in one packed batch, pooled, then normalised as the
    folder says: SentenceTransformer.encode's vectors."""
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    model = st.SentenceTransformer(minilm_path, device="cpu")
    prompt = "query: "
    texts = texts[:12]
    ids = encoder.tokenizer(texts + [prompt + t for t in texts], truncation=True,
                            max_length=encoder.pipeline.max_seq_length)["input_ids"]
    pooled = encoder.embed_tokenized(ids, prompts=[None] * len(texts) + [prompt] * len(texts))
    got = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    want = np.concatenate([model.encode(texts), model.encode(texts, prompt=prompt)])
    assert max_delta(got, want) <= FP32_TOL
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-5)


def test_a_prompt_left_out_of_the_pooling(minilm_path, tmp_path, texts):
    """include_prompt false (the Pooling config's): the prompt's tokens are left out per text, whatever prompt each
    text of the batch has, as sentence-transformers leaves them out."""
    import json
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    folder = tmp_path / "model"
    for root, _, files in os.walk(minilm_path):
        target = folder / os.path.relpath(root, minilm_path)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            (target / name).symlink_to(os.path.join(root, name))
    pooling = folder / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    pooling.unlink()
    pooling.write_text(json.dumps({**config, "include_prompt": False}))
    encoder = fastbert.SentenceEncoder.from_pretrained(folder, device="cpu", kernels="torch")
    prompts = ["query: ", "passage: a longer prompt of several words: "]
    batch = [(t, prompts[i % 2]) for i, t in enumerate(texts[:8])]
    ids = encoder.tokenizer([p + t for t, p in batch], truncation=True,
                            max_length=encoder.pipeline.max_seq_length)["input_ids"]
    got = torch.nn.functional.normalize(encoder.embed_tokenized(ids, prompts=[p for _, p in batch]), dim=-1).numpy()
    model = st.SentenceTransformer(str(folder), device="cpu")
    want = np.stack([model.encode([t], prompt=p)[0] for t, p in batch])
    assert max_delta(got, want) <= FP32_TOL


def test_a_task_for_a_model_without_task_adapters_is_refused(encoder):
    ids = encoder.tokenizer(["a text"])["input_ids"]
    with pytest.raises(ValueError, match="task 'retrieval.query': this model has no task adapters"):
        encoder.embed_tokenized(ids, tasks=["retrieval.query"])
    assert encoder.embed_tokenized(ids, tasks=[None]).shape == (1, 384)


def test_a_vector_against_what_shares_its_batch_on_the_cpu_twins(encoder, minilm_path, texts):
    """Each of 16 texts alone, then in 5 batches of 2..16 random texts at random places (real texts of 5..256 tokens):
    the normalised vectors against each other and against an fp64 reference (transformers' model in float64, mean
    pooling and normalisation in float64). What the CPU twins give, measured here (docs/serve.md): not always
    bit-identical (the fp32 GEMMs may round differently for different token counts): 24 of the 44 batched vectors
    were, and the others differed from the text alone by at most 1.4e-7; every vector, alone or batched, lay within
    1.45e-7 of fp64, as transformers' own fp32 vectors of the texts alone did. Asserted: within 2x transformers'
    error of fp64, and within 1e-6 of the text alone."""
    import transformers
    ids = encoder.tokenizer(texts[:16], truncation=True, max_length=encoder.pipeline.max_seq_length)["input_ids"]

    def unit(v):
        v = v.double()
        return v / v.norm(dim=-1, keepdim=True)

    alone = torch.cat([unit(encoder.embed_tokenized([x])) for x in ids])
    rng, deltas = random.Random(0), {}
    batched = []
    for _ in range(5):
        order = list(range(len(ids)))
        rng.shuffle(order)
        chosen = order[:rng.randint(2, len(ids))]
        out = unit(encoder.embed_tokenized([ids[i] for i in chosen]))
        for row, i in enumerate(chosen):
            deltas.setdefault(i, []).append((out[row] - alone[i]).abs().max().item())
            batched.append((i, out[row]))
    hf = {dtype: transformers.AutoModel.from_pretrained(minilm_path, dtype=dtype).eval()
          for dtype in (torch.float64, torch.float32)}
    with torch.no_grad():
        ref = {dtype: torch.stack([unit(m(input_ids=torch.tensor([x])).last_hidden_state[0].mean(0))
                                   for x in ids]) for dtype, m in hf.items()}
    hf_error = (ref[torch.float32] - ref[torch.float64]).abs().max().item()
    served_error = max([(alone - ref[torch.float64]).abs().max().item()]
                       + [(v - ref[torch.float64][i]).abs().max().item() for i, v in batched])
    worst = max(d for ds in deltas.values() for d in ds)
    assert served_error <= 2 * hf_error, (served_error, hf_error)
    assert worst <= 1e-6, worst  # measured: 1.4e-7 (a unit vector of 384 fp32 components)


def test_a_cpu_batch_runs_in_forwards_of_the_cpu_budget(encoder, minilm_path, texts, monkeypatch):
    """On a CPU the server's batch is cut into forwards of encode's CPU budget (past it a CPU forward is slower per
    token): each input still gets sentence-transformers' vector, or its own token vectors, in input order, however
    the batch was cut."""
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    import sys

    from fastbert.serve.models import Embedder
    model = st.SentenceTransformer(minilm_path, device="cpu")
    embedder = Embedder(encoder)
    payloads = embedder.prepare(texts, "", None, True, "right", "inputs")
    payloads[3] = payloads[3]._replace(tokens=True)  # one input asks for its token vectors (/embed_all)
    whole = embedder.run(payloads)  # 24 texts: under 4,096 tokens, one forward
    calls = []
    forward = embedder._forward
    monkeypatch.setattr(embedder, "_forward", lambda chunk: calls.append(len(chunk)) or forward(chunk))
    monkeypatch.setattr(sys.modules["fastbert.encode"], "CPU_MAX_TOKENS_PER_BATCH", 200)
    cut = embedder.run(payloads)
    assert len(calls) > 2 and sum(calls) == len(texts)
    want = model.encode(texts)  # the folder normalises; the worker's vectors come before Normalize
    tokens = model.encode(texts[3:4], output_value="token_embeddings")[0].numpy()
    unit = (lambda v: v / np.linalg.norm(v)) if embedder.normalize else (lambda v: v)  # noqa: E731
    for i, (a, b) in enumerate(zip(whole, cut)):
        reference = tokens if i == 3 else want[i]
        a, b = (a, b) if i == 3 else (unit(a), unit(b))
        assert a.shape == b.shape == reference.shape
        assert max_delta(b, reference) <= FP32_TOL and max_delta(a, reference) <= FP32_TOL
