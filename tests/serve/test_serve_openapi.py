"""/openapi.json read by a machine: schemathesis generates requests from the document the server publishes (every
route, its declared request body) and sends them to a live `python -m fastbert serve` on 127.0.0.1, one per kind
with routes of its own (the bundled embedding model; a random-weight cross-encoder; a random-weight SPLADE model).
Every answer must be no 5xx, a status the document declares for the route, in its declared content type and
matching its declared schema. Examples are bounded (a few per route), so the run costs seconds."""
import pytest
from helpers import LiveServer, optional, reranker_folder, splade_folder

httpx = optional("httpx", "httpx is a test extra")
optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")
schemathesis = optional("schemathesis", "schemathesis is a test extra")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


COMMON = {"POST /tokenize", "GET /info", "GET /health", "GET /metrics", "GET /v1/models"}
ROUTES = {"embedding": COMMON | {"POST /embed", "POST /v1/embeddings", "POST /", "POST /similarity",
                                 "POST /embed_all", "POST /v2/embed"},
          "reranker": COMMON | {"POST /rerank", "POST /predict", "POST /", "POST /v2/rerank", "POST /v1/rerank"},
          "sparse": COMMON | {"POST /embed_sparse"}}
FOLDERS = {"embedding": lambda minilm, root: str(minilm), "reranker": reranker_folder, "sparse": splade_folder}


@pytest.fixture(scope="module", params=sorted(ROUTES))
def server(request, tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp(f"openapi-{request.param}")
    folder = FOLDERS[request.param](minilm_path, root)
    live = LiveServer(["-m", "fastbert", "serve", folder, "--port", "0", "--max-client-batch-size", "8"],
                      root / "server.log")
    live.kind = request.param
    yield live
    code = live.stop()
    assert code == 0, live.output()


def test_every_route_declares_its_body_and_answers(server):
    document = httpx.get(server.url + "/openapi.json").json()
    routes = {f"{method.upper()} {path}" for path, operations in document["paths"].items() for method in operations}
    assert routes == ROUTES[server.kind]
    for route in routes:
        method, path = route.split(" ")
        if method != "POST":
            continue
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        for ref in [body] if "$ref" in body else body["anyOf"]:
            assert ref["$ref"].split("/")[-1] in document["components"]["schemas"], path
        assert {"200", "413", "422", "429", "503"} <= set(operation["responses"]), path
    assert set(document["paths"]["/health"]["get"]["responses"]["200"].get("content", {})) == set()  # no body
    assert httpx.get(server.url + "/health").content == b""


def test_schemathesis_finds_nothing(server):
    """Each operation the document lists, with a few generated requests of its own (schemathesis' strategies under
    hypothesis, driven here rather than by its pytest plugin)."""
    from hypothesis import given
    document = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ran = []
    for result in document.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def answers_as_documented(case):
            response = case.call(timeout=120)
            case.validate_response(response, checks=CHECKS)
        answers_as_documented()
        ran.append(f"{operation.method.upper()} {operation.path}")
    assert set(ran) == ROUTES[server.kind]
