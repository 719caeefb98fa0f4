"""fastbert.encode / SentenceEncoder with Jina-Embeddings-v3's task adapters, on a sentence-transformers folder laid
out as the Hub ships jina-embeddings-v3 (random weights, shrunk: Jina's custom_st.Transformer, mean Pooling,
Normalize, the tasks' prompts), against sentence-transformers' own pipeline over transformers' JinaEmbeddingsV3Model
holding the task's merged weights (W + s B_t A_t, merged in float64), encoding with the task's prompt. Per-text tasks
in one batch (SentenceEncoder.adapter_mask) against the same references, and the refusals."""
import numpy as np
import pytest
import torch
from helpers import (
    JINA_PROMPTS,
    JINA_TASKS,
    family_st_folder,
    has_rotary_post_norm,
    jina_task_references,
)

import fastbert
from fastbert.encode import embed, padded

pytestmark = pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no Jina-v3 (5.24+)")

TEXTS = ["A man is eating food.", "Two dogs are playing in the snow while children build a snowman.", "Hi",
         "The quick brown fox jumps over the lazy dog, again and again."]


@pytest.fixture(scope="module")
def jina(tmp_path_factory, minilm_path):
    """(the folder, {task: sentence-transformers over the task's merged weights}, the tokenizer)."""
    return jina_task_references(tmp_path_factory.mktemp("jina"), minilm_path)


def assert_same_vectors(got, want, tol=1e-5):
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tol


@pytest.mark.parametrize("task", JINA_TASKS)
def test_each_task_as_sentence_transformers_with_its_prompt(jina, task):
    folder, references, _ = jina
    want = references[task].encode(TEXTS, prompt=JINA_PROMPTS[task])
    assert_same_vectors(fastbert.encode(folder, TEXTS, task=task, kernels="torch", device="cpu"), want)
    encoder = fastbert.SentenceEncoder.from_pretrained(folder, kernels="torch", device="cpu", task=task)
    assert_same_vectors(encoder.encode(TEXTS, batch_size=2), want)  # the encoder's task, across batches


def test_no_task_is_the_base_model_and_an_explicit_prompt_wins(jina):
    folder, references, _ = jina
    encoder = fastbert.SentenceEncoder.from_pretrained(folder, kernels="torch", device="cpu")
    assert_same_vectors(encoder.encode(TEXTS), references[None].encode(TEXTS))
    want = references["retrieval.query"].encode(TEXTS, prompt="query: ")
    assert_same_vectors(encoder.encode(TEXTS, task="retrieval.query", prompt="query: "), want)


def test_texts_of_different_tasks_in_one_batch(jina):
    """The lower-level path a server takes: texts tokenized by the caller (each behind its task's prompt), batched
    together whatever their tasks, one task per text (None: the base model)."""
    folder, references, tok = jina
    encoder = fastbert.SentenceEncoder.from_pretrained(folder, kernels="torch", device="cpu")
    tasks = ["retrieval.query", None, "retrieval.passage", "text-matching"]
    texts = [(encoder.task_prompt(t) if t else "") + text for t, text in zip(tasks, TEXTS)]
    ids = tok(texts, truncation=True, max_length=encoder.pipeline.max_seq_length)["input_ids"]
    input_ids, attention_mask = padded(ids, tok.pad_token_id)
    with torch.inference_mode():
        got = embed(encoder.model, encoder.pipeline, input_ids, attention_mask,
                    adapter_mask=encoder.adapter_mask(tasks)).numpy()
    for i, (task, text) in enumerate(zip(tasks, TEXTS)):
        prompt = JINA_PROMPTS[task] if task else None
        assert_same_vectors(got[i:i + 1], references[task].encode([text], prompt=prompt))


def test_unknown_tasks_and_models_without_adapters_are_refused(jina, minilm_path, tmp_path):
    folder, _, _ = jina
    encoder = fastbert.SentenceEncoder.from_pretrained(folder, kernels="torch", device="cpu")
    with pytest.raises(ValueError, match="unknown task 'query'; this model's tasks are 'retrieval.query', "
                                         "'retrieval.passage', 'separation', 'classification', 'text-matching'"):
        encoder.encode(TEXTS, task="query")
    with pytest.raises(ValueError, match="unknown task 'query'"):
        encoder.adapter_mask(["query"])
    plain = family_st_folder("jina_embeddings_v3", minilm_path, tmp_path)  # transformers' layout, no adapters
    with pytest.raises(ValueError, match="task 'retrieval.query': this model has no task adapters"):
        fastbert.encode(plain, TEXTS, task="retrieval.query", kernels="torch", device="cpu")
    assert fastbert.SentenceEncoder.from_pretrained(plain, kernels="torch").adapter_mask([None, None]) is None
