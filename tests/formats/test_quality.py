"""The format's cost shown: the quality report fastbert measures when a model loads in bf16 or int8 (fastbert/
quality.py), on the bundled all-MiniLM-L6-v2 and the built-in sample. Its figures are checked against an independent
computation (sentence-transformers' fp32 vectors and the format's own encode), a format broken on purpose (one
weight scale off by a factor) must fall under the bar and warn, and every surface carries the report: SentenceEncoder,
BertModel.from_pretrained, encode, optimize, the server's /info and `python -m fastbert quality`. CPU, the PyTorch
path."""
import warnings

import numpy as np
import pytest
import torch
from helpers import optional, serving

import fastbert
from fastbert import formats, quality


@pytest.fixture(scope="module")
def sample():
    return quality.sample_texts()


@pytest.fixture(scope="module")
def st_vectors(minilm_path, sample):
    """sentence-transformers' own fp32 vectors of the sample: the reference the report's fp32 side must equal."""
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    model = st.SentenceTransformer(minilm_path, device="cpu")
    return torch.from_numpy(model.encode(sample, batch_size=64, convert_to_numpy=True))


def test_the_sample_is_varied_text(sample):
    """320 distinct texts, with the questions a reranker's report pairs with passages."""
    assert len(sample) == len(set(sample)) == 320
    assert sum(t.endswith("?") for t in sample) >= 30
    assert min(map(len, sample)) >= 2 and max(map(len, sample)) >= 300


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_the_report_on_load_is_the_formats_real_cost(fmt, minilm_path, sample, st_vectors):
    """SentenceEncoder.from_pretrained(quantize=...) measures the format on load; its figures equal min cos and
    neighbour agreement computed here from the format's own encode and sentence-transformers' fp32 vectors, and they
    clear the format's bars."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", quality.FormatQualityWarning)
        encoder = fastbert.SentenceEncoder.from_pretrained(minilm_path, device="cpu", kernels="torch", quantize=fmt)
    report = encoder.format_quality
    assert report.format == fmt and report.kind == "embedding" and report.texts == 320
    assert report.source == "built-in sample"
    got = torch.from_numpy(encoder.encode(sample, progress=False))
    assert abs(report.min_cos - quality.min_cos(st_vectors, got)) <= 1e-5
    assert abs(report.neighbours - quality.neighbours(st_vectors, got)) <= 2e-3  # one neighbour in 3,200 may flip
    assert report.min_cos < 1.0 - 1e-7  # the format ran
    assert report.below_bar() == {}, report
    if fmt == "int8":
        # the load calibrated the outlier channels: per-token int8 without them loses far more on the same texts
        assert encoder.model.number_format.calibrated
        encoder.model.set_format("int8")  # a fresh format, not calibrated
        plain = torch.from_numpy(encoder.encode(sample, progress=False))
        assert quality.min_cos(st_vectors, plain) < report.min_cos - 0.01
        assert quality.neighbours(st_vectors, plain) < report.neighbours - 0.01


def test_a_broken_scale_falls_under_the_bar_and_warns(minilm_path, monkeypatch):
    """int8 with every weight's per-channel scale doubled for one GEMM in three (a bug the format could have): the
    report measures it under its bars and says so in a FormatQualityWarning."""
    quantize_rows, calls = formats.quantize_rows, [0]

    def wrong_scale(t, levels=127):
        q, scale = quantize_rows(t, levels)
        calls[0] += 1
        return q, scale * 2 if calls[0] % 3 == 0 else scale

    monkeypatch.setattr(formats, "quantize_rows", wrong_scale)
    with pytest.warns(quality.FormatQualityWarning, match="int8 format measures under its bar"):
        encoder = fastbert.SentenceEncoder.from_pretrained(minilm_path, device="cpu", kernels="torch",
                                                           quantize="int8")
    below = encoder.format_quality.below_bar()
    assert {"min_cos", "neighbours"} <= below.keys(), encoder.format_quality


def test_the_users_texts_and_every_loading_surface(minilm_path, sample, tmp_path):
    """quality_texts= a file or a list; BertModel.from_pretrained and optimize of transformers' model carry the
    report too; set_format back to fp32 drops it."""
    path = tmp_path / "mine.txt"
    path.write_text("\n".join(sample[:40]) + "\n", encoding="utf-8")
    encoder = fastbert.SentenceEncoder.from_pretrained(minilm_path, device="cpu", kernels="torch",
                                                       quantize="bf16", quality_texts=str(path))
    assert (encoder.format_quality.texts, encoder.format_quality.source) == (40, str(path))
    model = fastbert.BertModel.from_pretrained(minilm_path, kernels="torch", quantize="int8",
                                               quality_texts=sample[:30])
    assert model.quantize == "int8" and model.format_quality.texts == 30
    assert model.format_quality.min_cos < 1.0 - 1e-7
    model.set_format("fp32")
    assert model.quantize == "fp32" and model.format_quality is None
    import transformers
    hf = transformers.AutoModel.from_pretrained(minilm_path).eval()
    optimized = fastbert.optimize(hf, kernels="torch", quantize="int8", quality_texts=sample[:30])
    inner = next(m for m in optimized.modules() if isinstance(m, fastbert.BertModel))
    assert inner.quantize == "int8" and inner.format_quality.kind == "embedding"
    with pytest.raises(ValueError, match="leave dtype unset"):
        fastbert.BertModel.from_pretrained(minilm_path, quantize="int8", dtype=torch.bfloat16)


def test_encode_takes_the_format(minilm_path, sample):
    """fastbert.encode(..., quantize="int8") equals the int8 SentenceEncoder's vectors bit for bit."""
    texts = sample[:24]
    encoder = fastbert.SentenceEncoder.from_pretrained(minilm_path, device="cpu", kernels="torch",
                                                       quantize="int8", quality_texts=sample[:20])
    got = fastbert.encode(minilm_path, texts, device="cpu", kernels="torch", quantize="int8", quality_texts=sample[:20],
                          progress=False)
    np.testing.assert_array_equal(got, encoder.encode(texts, progress=False))


def test_the_server_shows_the_format_and_its_cost(minilm_path, sample, st_vectors):
    """serve with quantize="int8": /info names the format and its figures; /embed answers the int8 vectors."""
    serve = optional("fastbert.serve", "the serve extra (fastapi, uvicorn, prometheus-client) is a test extra")
    with serving(serve.app(minilm_path, device="cpu", kernels="torch", quantize="int8")) as client:
        info = client.get("/info").json()
        vectors = np.asarray(client.post("/embed", json={"inputs": sample[:16]}).json())
    assert info["quantize"] == "int8"
    figures = info["format_quality"]
    assert figures["format"] == "int8" and figures["texts"] == 320 and figures["below_bar"] == []
    assert 0.95 <= figures["min_cos"] < 1.0 - 1e-7
    cos = (vectors * st_vectors[:16].numpy()).sum(1)
    assert figures["min_cos"] - 1e-6 <= cos.min() < 1.0 - 1e-7  # the int8 vectors: as far from fp32 as reported


def test_the_quality_command(minilm_path, sample, tmp_path, capsys):
    """python -m fastbert quality --quantize int8 --pairs: min cos, neighbours and MRR@10 in fp32 and in int8; the
    int8 it measures is the calibrated one every loading surface gives (the same min cos as that encoder's vectors
    against fp32's on the same texts)."""
    from fastbert.cli.quality import quality_command, quality_parser
    pairs = tmp_path / "pairs.tsv"
    questions = [t for t in sample if t.endswith("?")][:12]
    answers = [t for t in sample if not t.endswith("?") and len(t) > 80][:12]
    pairs.write_text("".join(f"{q}\t{a}\n" for q, a in zip(questions, answers)), encoding="utf-8")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(sample[:50]), encoding="utf-8")
    args = quality_parser().parse_args([minilm_path, "--quantize", "int8", "--quality-texts", str(texts),
                                        "--pairs", str(pairs), "--device", "cpu", "--kernels", "torch"])
    assert quality_command(args) == 0
    out = capsys.readouterr().out
    assert "texts: 50" in out and "MRR@10 fp32" in out
    row = out.splitlines()[2].split()
    assert 0.99 <= float(row[0]) < 1.0 and 0.8 <= float(row[1]) <= 1.0 and row[2] == "ok"
    fp32 = fastbert.SentenceEncoder.from_pretrained(minilm_path, device="cpu", kernels="torch")
    int8 = fastbert.SentenceEncoder.from_pretrained(minilm_path, device="cpu", kernels="torch", quantize="int8",
                                                    quality_texts=sample[:12])
    rows = sample[:50]
    cos = quality.min_cos(torch.from_numpy(fp32.encode(rows, progress=False)),
                          torch.from_numpy(int8.encode(rows, progress=False)))
    assert abs(float(row[0]) - cos) <= 2e-6


@pytest.mark.parametrize("labels", [1, 3], ids=["reranker", "classifier"])
def test_heads_report_order_and_labels(labels, minilm_path, sample):
    """optimize of a sequence-classification head in int8: one label is a reranker (top-1 and pair order over each
    sample question's passages), more a classifier (argmax labels); the figures equal those computed here from
    transformers' own fp32 head and the optimized int8 one (a pair whose fp32 scores tie within 1e-5 may flip)."""
    import transformers
    texts = sample[:64]
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    torch.manual_seed(0)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=labels).eval()
    pairs, queries = quality.reranker_pairs(texts)

    def scores(model):
        with torch.inference_mode():
            if labels == 1:
                batch = tokenizer([q for q, _ in pairs], [p for _, p in pairs], padding=True, truncation=True,
                                  max_length=256, return_tensors="pt")
                return model(**batch).logits.view(queries, -1)
            return model(**tokenizer(texts, padding=True, truncation=True, max_length=256,
                                     return_tensors="pt")).logits
    want = scores(hf)
    model = fastbert.optimize(hf, kernels="torch", quantize="int8", quality_texts=texts, tokenizer=tokenizer)
    report = next(m for m in model.modules() if isinstance(m, fastbert.BertModel)).format_quality
    got = scores(model)
    if labels == 1:
        assert report.kind == "ranking" and queries >= 4
        assert abs(report.top1 - float((want.argmax(1) == got.argmax(1)).double().mean())) <= 1 / queries
        assert abs(report.order - quality.order_agreement(want, got)) <= 0.01
        assert 0.5 < report.order < 1.0  # int8 reorders some close pairs, and keeps most
    else:
        assert report.kind == "classification"
        assert abs(report.labels - float((want.argmax(1) == got.argmax(1)).double().mean())) <= 1 / len(texts)
