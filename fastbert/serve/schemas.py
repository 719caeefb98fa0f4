"""The request bodies, as TEI and OpenAI define them, checked strictly: a wrong type is refused, never coerced ("1" is
not 1, 1 is not true). parse() turns any failure into a 422 whose message names the field (`inputs[3]: ...`).

Inputs hold texts or token ids: a string, a list of integers (one text's ids, special tokens included: what
/tokenize returns), or a list of either."""
from __future__ import annotations

import json
from typing import Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, field_validator

from .errors import Invalid

TextOrIds = Union[str, List[int]]

# What the `inputs` fields take, for /openapi.json (their values are checked by the validators below, which name
# the field at fault; the document says the same to a client generator or a fuzzer)
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PAIR = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2}
TEXTS_OR_IDS = {"anyOf": [{"type": "string"}, _IDS,
                          {"type": "array", "items": {"anyOf": [{"type": "string"}, _IDS]}, "minItems": 1}]}
TEXTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]}
TEXTS_OR_PAIRS = {"anyOf": [{"type": "string"}, _PAIR,
                            {"type": "array", "items": {"anyOf": [{"type": "string"}, _PAIR]}, "minItems": 1}]}


def _text_or_ids(value, where: str) -> TextOrIds:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return value
    if isinstance(value, list) and not value:
        raise ValueError(f"{where} is an empty list of token ids")
    raise ValueError(f"{where} must be a string or a list of token ids (integers), got {_kind(value)}")


def _kind(value) -> str:
    if isinstance(value, list):
        return "a list holding " + ", ".join(sorted({type(v).__name__ for v in value})) if value else "an empty list"
    return {dict: "an object", bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


def texts_or_ids(value, field: str) -> List[TextOrIds]:
    """A string, one list of ids, or a non-empty list of strings and id lists -> the list of inputs."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(type(v) is int for v in value)):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"must be a string, a list of strings or token ids, got {_kind(value)}")
    if not value:
        raise ValueError("is an empty list (give at least one input)")
    return [_text_or_ids(v, f"{field}[{i}]") for i, v in enumerate(value)]


def texts(value) -> List[str]:
    """A string or a non-empty list of strings -> the list of texts."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"must be a string or a list of strings, got {_kind(value)}")
    if not value:
        raise ValueError("is an empty list (give at least one input)")
    return value


def method_of(value, pairs: bool = False):
    """te_request_count's method for a request's inputs as sent: "single" for one input (a string, one list of token
    ids; with pairs, a pair [text, text_pair]), "batch" for a list of them; None when they are neither (the request
    is refused for it)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(type(v) is int for v in value)):
        return "single"
    if pairs and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return "single"
    return "batch" if isinstance(value, list) else None


class Request(BaseModel):
    # strict: no coercion between types; unknown fields are ignored (clients send fields of their own, as TEI's
    # and OpenAI's servers ignore them)
    model_config = ConfigDict(strict=True, extra="ignore")


Direction = Literal["left", "right", "Left", "Right"]


class Truncation(Request):
    truncate: Optional[bool] = None  # null: false
    truncation_direction: Direction = "right"


class EmbedRequest(Truncation):
    inputs: Any = Field(description="a string, a list of strings, or token ids (a list of integers, or a list of them)",
                        json_schema_extra=TEXTS_OR_IDS)
    normalize: bool = True
    encoding_format: Literal["float"] = "float"  # TEI's /embed answers floats (base64: /v1/embeddings)
    prompt_name: Optional[str] = None
    dimensions: Optional[int] = Field(default=None, ge=1)
    task: Optional[str] = None  # a task adapter (Jina-Embeddings-v3's names: retrieval.query, ...)

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value):
        return texts_or_ids(value, "inputs")


class OpenAIEmbeddingRequest(Request):
    input: Any = Field(description="a string, a list of strings, or token ids (a list of integers, or a list of them)",
                       json_schema_extra=TEXTS_OR_IDS)
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, ge=1)
    user: Optional[str] = None
    prompt_name: Optional[str] = None
    task: Optional[str] = None

    @field_validator("input")
    @classmethod
    def _input(cls, value):
        return texts_or_ids(value, "input")


class RerankRequest(Truncation):
    query: str
    texts: List[str] = Field(min_length=1)
    raw_scores: bool = False
    return_text: bool = False


def _sequence(value, where: str):
    """A text, a one-element list [text] (a text again), or a pair [text, text_pair] -> str or (str, str)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) in (1, 2) and all(isinstance(v, str) for v in value):
        return value[0] if len(value) == 1 else tuple(value)
    raise ValueError(f"{where} must be a string or a pair of strings [text, text_pair], got {_kind(value)}")


def predict_inputs(value):
    """TEI's /predict inputs: a text, a pair, or a list of texts and pairs -> str, (str, str), or a list of them.
    As in TEI, a list of exactly two strings is one pair, not two texts; two single texts are [["a"], ["b"]]."""
    if isinstance(value, str) or (isinstance(value, list) and len(value) == 2
                                  and all(isinstance(v, str) for v in value)):
        return _sequence(value, "inputs")
    if not isinstance(value, list):
        raise ValueError(f"must be a string, a pair of strings or a list of them, got {_kind(value)}")
    if not value:
        raise ValueError("is an empty list (give at least one input)")
    return [_sequence(v, f"inputs[{i}]") for i, v in enumerate(value)]


class PredictRequest(Truncation):
    inputs: Any = Field(description="a string, a pair [text, text_pair], or a list of strings and pairs",
                        json_schema_extra=TEXTS_OR_PAIRS)
    raw_scores: bool = False

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value):
        return predict_inputs(value)


class TokenizeRequest(Request):
    inputs: Any = Field(description="a string or a list of strings", json_schema_extra=TEXTS)
    add_special_tokens: bool = True
    prompt_name: Optional[str] = None

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value):
        return texts(value)


class ClassificationParameters(Request):
    top_k: Optional[int] = Field(default=None, ge=1)
    function_to_apply: Optional[Literal["softmax", "sigmoid", "none"]] = None


class TextClassificationRequest(Request):
    """The Hugging Face Inference API's text-classification body, which huggingface_hub's InferenceClient posts to
    a server's root: {"inputs": text, "parameters": {"top_k", "function_to_apply"}}."""
    inputs: Any = Field(description="a string, a pair, or a list of them", json_schema_extra=TEXTS_OR_PAIRS)
    parameters: Optional[ClassificationParameters] = None

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value):
        return predict_inputs(value)


class SimilarityInputs(Request):
    source_sentence: str
    sentences: List[str] = Field(min_length=1)


class SimilarityParameters(Truncation):
    prompt_name: Optional[str] = None


class SimilarityRequest(Request):
    """TEI's /similarity (the Inference API's sentence-similarity body): the cosine of source_sentence's vector with
    each sentence's."""
    inputs: SimilarityInputs
    parameters: Optional[SimilarityParameters] = None


class EmbedAllRequest(Truncation):
    """TEI's /embed_all: every token's vector, per input."""
    inputs: Any = Field(description="a string, a list of strings, or token ids (a list of integers, or a list of them)",
                        json_schema_extra=TEXTS_OR_IDS)
    prompt_name: Optional[str] = None

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value):
        return texts_or_ids(value, "inputs")


class EmbedSparseRequest(Truncation):
    """TEI's /embed_sparse: texts (a SPLADE model's tokens are its own: token ids are not taken)."""
    inputs: Any = Field(description="a string or a list of strings", json_schema_extra=TEXTS)

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value):
        return texts(value)


CohereEmbeddingType = Literal["float", "base64", "binary", "ubinary"]


class CohereEmbedRequest(Request):
    """Cohere's v2 embed: texts (images and mixed `inputs` are not served here)."""
    model: Optional[str] = None
    texts: List[str] = Field(min_length=1)
    input_type: Optional[str] = None
    embedding_types: List[CohereEmbeddingType] = Field(default=["float"], min_length=1)
    output_dimension: Optional[int] = Field(default=None, ge=1)
    truncate: Literal["NONE", "START", "END"] = "END"


class CohereRerankRequest(Request):
    """Cohere's v2 rerank."""
    model: Optional[str] = None
    query: str
    documents: List[str] = Field(min_length=1)
    top_n: Optional[int] = Field(default=None, ge=1)


class JinaDocument(Request):
    text: str


class JinaRerankRequest(Request):
    """Jina's v1 rerank: documents as strings or {"text"} objects."""
    model: Optional[str] = None
    query: str
    documents: List[Union[str, JinaDocument]] = Field(min_length=1)
    top_n: Optional[int] = Field(default=None, ge=1)
    return_documents: bool = True


# ---- the answers, as /openapi.json declares them ---------------------------------------------------------------------
class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TEIError(Answer):
    error: str
    error_type: str


class OpenAIErrorDetail(Answer):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class OpenAIError(Answer):
    error: OpenAIErrorDetail


class Embeddings(RootModel[List[List[float]]]):
    """One vector per input."""


class OpenAIEmbedding(Answer):
    object: Literal["embedding"]
    index: int
    embedding: Union[List[float], str] = Field(description="floats, or base64 of little-endian float32")


class OpenAIUsage(Answer):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddings(Answer):
    object: Literal["list"]
    model: str
    data: List[OpenAIEmbedding]
    usage: OpenAIUsage


class Rank(Answer):
    index: int
    score: float
    text: Optional[str] = None


class Ranks(RootModel[List[Rank]]):
    """The texts, best first."""


class Prediction(Answer):
    score: float
    label: str


class Predictions(RootModel[Union[List[Prediction], List[List[Prediction]]]]):
    """Labels and scores, highest first: a list for one input, a list of them for several."""


class Token(Answer):
    id: int
    text: str
    special: bool
    start: Optional[int] = None
    stop: Optional[int] = None


class Tokens(RootModel[List[List[Token]]]):
    """Per input, its tokens."""


class ModelCard(Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Answer):
    object: Literal["list"]
    data: List[ModelCard]


class SparseValue(Answer):
    index: int
    value: float


class SparseEmbeddings(RootModel[List[List[SparseValue]]]):
    """Per input, its non-zero vocabulary weights, by index."""


class Similarities(RootModel[List[float]]):
    """The cosine of source_sentence with each sentence, in order."""


class TokenEmbeddings(RootModel[List[List[List[float]]]]):
    """Per input, one vector per token (special tokens included)."""


class CohereError(Answer):
    message: str


class CohereEmbeddingsByType(Answer):
    floats: Optional[List[List[float]]] = Field(default=None, alias="float")
    base64: Optional[List[str]] = Field(default=None, description="base64 of little-endian float32")
    binary: Optional[List[List[int]]] = None
    ubinary: Optional[List[List[int]]] = None


class CohereBilled(Answer):
    input_tokens: Optional[int] = None
    search_units: Optional[int] = None


class CohereVersion(Answer):
    version: str


class CohereMeta(Answer):
    api_version: CohereVersion
    billed_units: CohereBilled


class CohereEmbeddings(Answer):
    id: str
    response_type: Literal["embeddings_by_type"]
    embeddings: CohereEmbeddingsByType
    texts: List[str]
    meta: CohereMeta


class CohereResult(Answer):
    index: int
    relevance_score: float


class CohereRanks(Answer):
    id: str
    results: List[CohereResult]
    meta: CohereMeta


class JinaResult(Answer):
    index: int
    relevance_score: float
    document: Optional[JinaDocument] = None


class JinaUsage(Answer):
    total_tokens: int


class JinaRanks(Answer):
    model: str
    usage: JinaUsage
    results: List[JinaResult]


class Info(BaseModel):
    """The model and the server's limits (GET /info)."""
    model_config = ConfigDict(extra="allow")
    model_id: str
    model_dtype: Optional[str] = None
    max_input_length: Optional[int] = None
    max_batch_tokens: int
    max_client_batch_size: int
    max_concurrent_requests: int
    state: str
    quantize: Optional[str] = None
    format_quality: Optional[dict] = None


def _where(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def load_json(body: bytes) -> dict:
    """The JSON object of a request body, or a 422 ServeError."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise Invalid(f"body: not valid JSON ({getattr(e, 'msg', None) or e.reason}{where})",
                         param="body") from None
    if not isinstance(data, dict):
        raise Invalid(f"body: expected a JSON object, got {_kind(data)}", param="body")
    return data


def validate(model: type[Request], data: dict) -> Request:
    """A request body's object as `model`, or a 422 ServeError naming the field at fault."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        messages = []
        for error in errors[:3]:
            message = error["msg"].removeprefix("Value error, ")
            if not message.startswith(_where(error["loc"])):
                message = f"{_where(error['loc'])}: {message}"
            messages.append(message)
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise Invalid("; ".join(messages) + more, param=_where(errors[0]["loc"][:1])) from None


def parse(model: type[Request], body: bytes) -> Request:
    return validate(model, load_json(body))
