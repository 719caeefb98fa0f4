"""sentence-transformers' ONNX and OpenVINO backends as benchmark peers.

optimum and optimum-intel pin older transformers releases than fastbert uses, so
the peers live in a virtualenv of their own.  The benchmark side (fastbert's
venv) only needs the standard library and numpy: `encode` runs this same file
with the peer venv's python and reads the vectors and timings back.

    python bench/peers.py install           # create the peer venv
    python bench/peers.py check MODEL_PATH  # every engine on 40 texts vs ST torch fp32
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ENGINES = ("st-onnx", "st-onnx-int8", "st-openvino", "st-openvino-int8")
# Plain ST on torch fp32, run in the peer venv: the reference for `check`.
REFERENCE = "st-torch"

# What the peer venv gets.  Only torch is pinned, to the CPU wheel (an unpinned
# torch pulls a multi-GB CUDA build).  The rest is left to pip: optimum-onnx and
# optimum-intel cap transformers below 4.58, so pip settles on the newest
# sentence-transformers 5.x rather than fastbert's 6.x.  `datasets` is in neither
# extra, but ST's static OpenVINO quantization needs it for the calibration set.
REQUIREMENTS = ("torch==2.13.0", "sentence-transformers[onnx,openvino]", "datasets")
PROBE_MODULES = ("sentence_transformers", "onnxruntime", "optimum", "openvino")
INSTALL_HINT = "python bench/peers.py install"
CALIBRATION_TEXTS = 300


def venv_dir() -> pathlib.Path:
    env = os.environ.get("FASTBERT_PEERS_VENV")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "fastbert" / "peers-venv"


def _venv_python() -> pathlib.Path:
    return venv_dir() / "bin" / "python"


def _child_env(workdir: pathlib.Path | None = None) -> dict:
    """Environment for the peer python: offline, and nothing leaking in from fastbert's venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if workdir is not None:
        # The OpenVINO calibration set goes through `datasets`, which caches under the
        # Hugging Face home; keep that inside workdir rather than in ~/.cache/huggingface.
        env["HF_HOME"] = str(workdir / "hf-home")
    return env


def unavailable() -> str | None:
    """None when the peer venv is usable, else a one-line reason (probed once per process and venv)."""
    return _probe(venv_dir())


@functools.lru_cache(maxsize=None)
def _probe(venv: pathlib.Path) -> str | None:
    py = venv / "bin" / "python"
    if not py.exists():
        return f"no peer venv at {venv}; run `{INSTALL_HINT}`"
    probe = "import " + ", ".join(PROBE_MODULES)
    try:
        r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=300, env=_child_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"peer venv {venv} does not run ({e}); run `{INSTALL_HINT}`"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"peer venv {venv} cannot import its backends ({last}); run `{INSTALL_HINT}`"
    return None


def encode(engine: str, model_path: str, texts: list[str], rounds: int, workdir: pathlib.Path) -> dict:
    """Encode `texts` `rounds` times with a peer engine, in the peer venv.

    Exported / quantized models are cached under `workdir`; `model_path` is never
    written to.  Each call is a fresh process: load, one untimed warm-up pass over
    all texts, then the timed rounds.  Returns {"vectors": float32 [n, d] from the
    first timed round (rounds 0: the warm-up's, nothing timed), "seconds": per-round wall seconds, "versions": {package:
    version}, "notes": str}.  Raises RuntimeError with the child's stderr tail.
    """
    if engine not in ENGINES + (REFERENCE,):
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    if rounds < 0:
        raise ValueError("rounds must be >= 0")
    workdir = pathlib.Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir, prefix="call-") as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "texts.json").write_text(json.dumps(list(texts)), encoding="utf-8")
        cmd = [str(_venv_python()), str(pathlib.Path(__file__).resolve()), "_child", engine,
               str(pathlib.Path(model_path).resolve()), str(tmp), str(rounds), str(workdir)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(workdir))
        if r.returncode != 0 or not (tmp / "result.json").exists():
            tail = "\n".join(r.stderr.strip().splitlines()[-30:])
            raise RuntimeError(f"{engine} failed (exit {r.returncode}):\n{tail}")
        result = json.loads((tmp / "result.json").read_text(encoding="utf-8"))
        result["vectors"] = np.load(tmp / "vectors.npy").astype(np.float32, copy=False)
    return result


# ---------------------------------------------------------------------------
# Everything below runs inside the peer venv.


def _model_copy(model_path: pathlib.Path, workdir: pathlib.Path) -> pathlib.Path:
    """A private copy of the model folder under workdir; exports are saved into it."""
    key = hashlib.sha1(str(model_path).encode()).hexdigest()[:10]
    dest = workdir / "models" / f"{model_path.name}-{key}"
    if not model_path.is_dir():
        raise FileNotFoundError(f"no model folder at {model_path}")
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(dir=dest.parent, prefix=".copy-"))
        shutil.copytree(model_path, staging, dirs_exist_ok=True)
        try:
            staging.rename(dest)
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _load_engine(engine: str, folder: pathlib.Path, texts: list[str]):
    """Load (exporting and caching on first use) the SentenceTransformer for an engine; returns (model, notes)."""
    from sentence_transformers import SentenceTransformer

    def load(backend: str, file_name: str | None = None):
        kwargs = {"file_name": file_name} if file_name else {}
        if backend == "onnx":
            # ST would take onnxruntime's first provider, which may be a non-CPU one (e.g. Azure).
            kwargs["provider"] = "CPUExecutionProvider"
        return SentenceTransformer(str(folder), backend=backend, device="cpu", model_kwargs=kwargs or None)

    if engine == REFERENCE:
        return load("torch"), "sentence-transformers torch fp32"

    if engine in ("st-onnx", "st-onnx-int8"):
        if not (folder / "onnx" / "model.onnx").exists():
            load("onnx").save_pretrained(str(folder))  # exports with optimum, saves onnx/model.onnx
        if engine == "st-onnx":
            model = load("onnx", "onnx/model.onnx")
            return model, f"onnxruntime fp32, {_ort_providers(model)}"
        # Dynamic int8 quantization, tuned for the widest int8 dot-product ISA this CPU has.
        from optimum.onnxruntime.configuration import AutoQuantizationConfig

        config = "avx512_vnni" if "avx512_vnni" in _cpu_flags() else "avx2"
        # ST names the file after the config's weight type (avx2 quantizes weights to uint8).
        weights = getattr(AutoQuantizationConfig, config)(is_static=False).weights_dtype.name.lower()
        file_name = f"onnx/model_{weights}_{config}.onnx"
        if not (folder / file_name).exists():
            from sentence_transformers import export_dynamic_quantized_onnx_model
            export_dynamic_quantized_onnx_model(load("onnx", "onnx/model.onnx"), config, str(folder))
        model = load("onnx", file_name)
        return model, (f"onnxruntime dynamic int8, AutoQuantizationConfig.{config}(is_static=False) "
                       f"({weights} weights), {file_name}, {_ort_providers(model)}")

    if not (folder / "openvino" / "openvino_model.xml").exists():
        load("openvino").save_pretrained(str(folder))  # exports with optimum-intel
    if engine == "st-openvino":
        model = load("openvino", "openvino/openvino_model.xml")
        return model, "OpenVINO CPU, default precision"
    file_name = "openvino/openvino_model_qint8_quantized.xml"
    # Which texts calibrated the cached file: it may come from an earlier call.
    record = folder / "openvino" / "calibration.json"
    if not (folder / file_name).exists():
        calibration = texts[:CALIBRATION_TEXTS]
        _static_quantize_openvino(load("openvino", "openvino/openvino_model.xml"), folder, calibration)
        digest = hashlib.sha1(json.dumps(calibration).encode()).hexdigest()[:10]
        record.write_text(json.dumps({"texts": len(calibration), "sha1": digest}), encoding="utf-8")
    calib = json.loads(record.read_text(encoding="utf-8")) if record.exists() else {"texts": "?", "sha1": "?"}
    model = load("openvino", file_name)
    return model, (f"OpenVINO CPU static int8 (NNCF, OVQuantizationConfig defaults), {file_name}, "
                   f"calibrated locally (not on the Hub's glue/sst2) on the first {calib['texts']} texts "
                   f"passed when it was built (sha1 {calib['sha1']})")


def _ort_providers(model) -> str:
    try:
        return "providers=" + ",".join(model.transformers_model.model.get_providers())
    except Exception:  # the attribute layout differs between optimum releases
        return "providers=?"


def _ov_precision(model) -> str:
    """The compiled model's precision hint, and what its matrix multiplies actually run in."""
    try:
        compiled = model.transformers_model.request
        hint = compiled.get_property("INFERENCE_PRECISION_HINT")
        hint = getattr(hint, "get_type_name", lambda: hint)()
        kernels: dict[str, int] = {}
        for op in compiled.get_runtime_model().get_ops():
            info = op.get_rt_info()
            if info["layerType"].astype(str) in ("FullyConnected", "MatMul"):
                precision = info["runtimePrecision"].astype(str)
                kernels[precision] = kernels.get(precision, 0) + 1
        used = " ".join(f"{k}:{v}" for k, v in sorted(kernels.items()))
        return f"INFERENCE_PRECISION_HINT={hint}, matmul runtime precisions {used}"
    except Exception as e:  # not reachable in every openvino / optimum-intel release
        return f"precision not reachable ({type(e).__name__}: {e})"


def _static_quantize_openvino(model, folder: pathlib.Path, calibration: list[str]) -> None:
    """ST's static int8 OpenVINO export, calibrated on local texts instead of its default Hub dataset.

    The dataset arguments go to `datasets.load_dataset`, which also accepts a local
    folder of data files: a folder holding train.jsonl with a "text" column stands
    in for glue/sst2 ("default" is the config name datasets gives such a folder).
    """
    from sentence_transformers import export_static_quantized_openvino_model

    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".calibration-") as data_dir:
        with open(pathlib.Path(data_dir) / "train.jsonl", "w", encoding="utf-8") as f:
            for text in calibration:
                f.write(json.dumps({"text": text}) + "\n")
        export_static_quantized_openvino_model(
            model, None, str(folder), dataset_name=data_dir, dataset_config_name="default",
            dataset_split="train", column_name="text")


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("sentence-transformers", "transformers", "torch", "onnxruntime", "optimum", "optimum-onnx",
                 "optimum-intel", "openvino", "nncf", "datasets", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _child(engine: str, model_path: str, tmp: str, rounds: str, workdir: str) -> None:
    tmp = pathlib.Path(tmp)
    texts = json.loads((tmp / "texts.json").read_text(encoding="utf-8"))
    # The torch reference reads the original folder; the others work on a copy they export into.
    folder = pathlib.Path(model_path)
    if engine != REFERENCE:
        folder = _model_copy(folder, pathlib.Path(workdir))
    model, notes = _load_engine(engine, folder, texts)
    warm = model.encode(texts)  # warm-up: one untimed pass over every batch shape
    if engine.startswith("st-openvino"):
        notes += f", {_ov_precision(model)}"  # what the compiled model actually runs in
    seconds, vectors = [], None
    for _ in range(int(rounds)):
        start = time.perf_counter()
        out = model.encode(texts)  # ST defaults: batch_size 32, numpy output
        seconds.append(time.perf_counter() - start)
        if vectors is None:
            vectors = out
    np.save(tmp / "vectors.npy", np.asarray(warm if vectors is None else vectors, dtype=np.float32))
    result = {"seconds": seconds, "versions": _versions(), "notes": notes}
    (tmp / "result.json").write_text(json.dumps(result), encoding="utf-8")


# ---------------------------------------------------------------------------
# Command line.


def _install() -> None:
    target = venv_dir()
    start = time.time()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
    pip = [str(_venv_python()), "-m", "pip", "install", "--upgrade"]
    subprocess.run(pip + ["pip"], check=True)
    subprocess.run(pip + list(REQUIREMENTS), check=True)
    print(f"peer venv ready at {target} in {time.time() - start:.0f} s")
    _probe.cache_clear()
    reason = unavailable()
    if reason:
        sys.exit(reason)


def _sample_texts(n: int) -> list[str]:
    """Real prose: the GPL-3 text split into paragraphs."""
    raw = pathlib.Path("/usr/share/common-licenses/GPL-3").read_text(encoding="utf-8")
    paragraphs = [" ".join(p.split()) for p in raw.split("\n\n")]
    paragraphs = [p for p in paragraphs if len(p) > 40]
    return (paragraphs * (n // max(len(paragraphs), 1) + 1))[:n]


def _check(model_path: str, rounds: int, n: int) -> None:
    reason = unavailable()
    if reason:
        sys.exit(reason)
    texts = _sample_texts(n)
    with tempfile.TemporaryDirectory(prefix="fastbert-peers-") as workdir:
        workdir = pathlib.Path(workdir)
        ref = encode(REFERENCE, model_path, texts, rounds, workdir)
        ref_unit = ref["vectors"] / np.linalg.norm(ref["vectors"], axis=1, keepdims=True)
        print(f"{n} texts, batch_size 32, median of {rounds} timed rounds after one warm-up; "
              f"{_cpu_name()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
        print(" ".join(f"{k}={v}" for k, v in ref["versions"].items()))
        print(f"{'engine':<18}{'texts/s':>10}{'min cos':>10}  notes")
        failed = 0
        for engine in (REFERENCE,) + ENGINES:
            try:
                res = ref if engine == REFERENCE else encode(engine, model_path, texts, rounds, workdir)
            except RuntimeError as e:
                failed += 1
                print(f"{engine:<18}{'failed':>10}{'':>10}  {str(e).splitlines()[-1]}")
                continue
            vec = res["vectors"] / np.linalg.norm(res["vectors"], axis=1, keepdims=True)
            cos = float((vec * ref_unit).sum(axis=1).min())
            rate = n / float(np.median(res["seconds"]))
            print(f"{engine:<18}{rate:>10.1f}{cos:>10.5f}  {res['notes']}")
    if failed:
        sys.exit(f"{failed} engine(s) failed")


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help=f"create the peer venv at {venv_dir()}")
    check = sub.add_parser("check", help="encode sample texts with every engine, compare with ST torch fp32")
    check.add_argument("model_path")
    check.add_argument("--texts", type=int, default=40)
    check.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.command == "install":
        _install()
    else:
        _check(args.model_path, args.rounds, args.texts)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:  # hidden: how encode() runs an engine in the peer venv
        _child(*sys.argv[2:])
    else:
        main()
