"""The request bodies, as TEI and OpenAI define them, checked strictly: a wrong type is refused, never coerced ("1" is
not 1, 1 is not true). parse() turns any failure into a 422 whose message names the field (`inputs[3]: ...`).

Inputs hold texts or token ids: a string, a list of integers (one text's ids, special tokens included: what
/tokenize returns), or a list of either."""
from __future__ import annotations

import json
from typing import Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ServeError

TextOrIds = Union[str, List[int]]


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


class Request(BaseModel):
    # strict: no coercion between types; unknown fields are ignored (clients send fields of their own, as TEI's
    # and OpenAI's servers ignore them)
    model_config = ConfigDict(strict=True, extra="ignore")


Direction = Literal["left", "right", "Left", "Right"]


class Truncation(Request):
    truncate: Optional[bool] = None  # null: false
    truncation_direction: Direction = "right"


class EmbedRequest(Truncation):
    inputs: Any = Field(description="a string, a list of strings, or token ids (a list of integers, or a list of them)")
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
    input: Any = Field(description="a string, a list of strings, or token ids (a list of integers, or a list of them)")
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
    inputs: Any = Field(description="a string, a pair [text, text_pair], or a list of strings and pairs")
    raw_scores: bool = False

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value):
        return predict_inputs(value)


class TokenizeRequest(Request):
    inputs: Any = Field(description="a string or a list of strings")
    add_special_tokens: bool = True
    prompt_name: Optional[str] = None

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value):
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a string or a list of strings, got {_kind(value)}")
        if not value:
            raise ValueError("is an empty list (give at least one input)")
        return value


class ClassificationParameters(Request):
    top_k: Optional[int] = Field(default=None, ge=1)
    function_to_apply: Optional[Literal["softmax", "sigmoid", "none"]] = None


class TextClassificationRequest(Request):
    """The Hugging Face Inference API's text-classification body, which huggingface_hub's InferenceClient posts to
    a server's root: {"inputs": text, "parameters": {"top_k", "function_to_apply"}}."""
    inputs: Any = Field(description="a string, a pair, or a list of them")
    parameters: Optional[ClassificationParameters] = None

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value):
        return predict_inputs(value)


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
        raise ServeError(422, f"body: not valid JSON ({getattr(e, 'msg', None) or e.reason}{where})",
                         param="body") from None
    if not isinstance(data, dict):
        raise ServeError(422, f"body: expected a JSON object, got {_kind(data)}", param="body")
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
        raise ServeError(422, "; ".join(messages) + more, param=_where(errors[0]["loc"][:1])) from None


def parse(model: type[Request], body: bytes) -> Request:
    return validate(model, load_json(body))
