"""pytest plugin: run transformers' own BERT / RoBERTa / ELECTRA / DistilBERT / MPNet model tests with fastbert inside.

    python -m pytest -p no:cacheprovider tests/models/bert/test_modeling_bert.py --fastbert [--fastbert-padding-free]

With --fastbert, every model of these families that a test builds runs its encoder through fastbert:

- a head (BertForMaskedLM(config), ...): built as transformers builds it, then `fastbert.optimize(model,
  kernels="torch", padding_free=..., cuda_graphs=False)` swaps the encoder inside it, in place; the test holds the
  same head object;
- a bare encoder (BertModel(config), RobertaModel(...), DistilBertModel(...), ...): the test gets what optimize
  returns for it, fastbert's own module (its `__new__` builds the HF model, then hands back optimize's result);
- `from_pretrained` / `_from_config` of either: transformers loads or builds the model as usual, then optimize runs
  on the result (what a user does: optimize(from_pretrained(...))).

Only the outermost construction is swapped: the encoder a head builds inside its own __init__ stays HF's until the
head is finished, and a model built inside from_pretrained is optimized once, after loading.

fastbert refuses some configs by name (NotImplementedError: is_decoder, add_cross_attention, other position
embeddings). Such a model is left stock and the refusal is recorded; any other error from optimize propagates and
fails the test. Per test, what was swapped and what was refused is written to --fastbert-log (JSON lines).
"""
from __future__ import annotations

import contextlib
import json
import threading

FAMILIES = {
    "transformers.models.bert.modeling_bert": "BertModel",
    "transformers.models.roberta.modeling_roberta": "RobertaModel",
    "transformers.models.electra.modeling_electra": "ElectraModel",
    "transformers.models.distilbert.modeling_distilbert": "DistilBertModel",
    "transformers.models.mpnet.modeling_mpnet": "MPNetModel",
}

_state = threading.local()
_events: dict = {"swapped": [], "refused": []}
_settings = {"padding_free": False}


def _depth() -> int:
    return getattr(_state, "depth", 0)


@contextlib.contextmanager
def _inside():
    """Constructions (and loads) inside this block are not the outermost one: nothing is swapped there."""
    _state.depth = _depth() + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _optimize(model):
    """fastbert in place of the encoder (a head: the same object back; a bare encoder: fastbert's module)."""
    import fastbert

    try:
        out = fastbert.optimize(model, kernels="torch", padding_free=_settings["padding_free"], cuda_graphs=False)
    except NotImplementedError as e:
        _events["refused"].append(f"{type(model).__name__}: {e}")
        return model
    _events["swapped"].append(type(model).__name__)
    return out


def _wrap_init(cls, is_encoder: bool):
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        outermost = _depth() == 0
        with _inside():
            original(self, *args, **kwargs)
        if outermost and not is_encoder and type(self) is cls:
            _optimize(self)  # in place: optimize swaps the encoder inside the head and returns the head

    __init__.__wrapped__ = original
    cls.__init__ = __init__


def _wrap_new(cls):
    def __new__(klass, *args, **kwargs):
        obj = object.__new__(klass)
        # no arguments: copy.deepcopy / pickle rebuilding an object; not the outermost construction: a head's encoder
        if not args and not kwargs or _depth() > 0 or klass is not cls:
            return obj
        klass.__init__(obj, *args, **kwargs)
        return _optimize(obj)  # not an instance of klass: Python does not run __init__ again

    cls.__new__ = __new__


def _wrap_classmethod(cls, name: str):
    original = getattr(cls, name).__func__

    def method(klass, *args, **kwargs):
        if _depth() > 0:
            return original(klass, *args, **kwargs)
        with _inside():
            result = original(klass, *args, **kwargs)
        if isinstance(result, tuple):  # from_pretrained(..., output_loading_info=True)
            return (_optimize(result[0]), *result[1:])
        return _optimize(result)

    setattr(cls, name, classmethod(method))


def patch_families() -> list[str]:
    import importlib

    from transformers import PreTrainedModel

    patched = []
    for module_name, encoder_name in FAMILIES.items():
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if not (isinstance(obj, type) and issubclass(obj, PreTrainedModel) and obj.__module__ == module_name):
                continue
            if obj.__name__.endswith("PreTrainedModel"):
                continue
            is_encoder = name == encoder_name
            _wrap_init(obj, is_encoder)
            if is_encoder:
                _wrap_new(obj)
            for method in ("from_pretrained", "_from_config"):
                _wrap_classmethod(obj, method)
            patched.append(name)
    return patched


def pytest_addoption(parser):
    group = parser.getgroup("fastbert")
    group.addoption("--fastbert", action="store_true",
                    help="run every BERT/RoBERTa/ELECTRA/DistilBERT/MPNet model through fastbert")
    group.addoption("--fastbert-padding-free", action="store_true",
                    help="optimize with padding_free=True (default: padding_free=False, HF's padded execution)")
    group.addoption("--fastbert-log", default=None, help="JSON lines: per test, the models swapped and refused")


_log = None


def pytest_configure(config):
    global _log
    if not config.getoption("--fastbert"):
        return
    _settings["padding_free"] = bool(config.getoption("--fastbert-padding-free"))
    patched = patch_families()
    path = config.getoption("--fastbert-log")
    _log = open(path, "w") if path else None
    config._fastbert_patched = patched


def pytest_report_header(config):
    patched = getattr(config, "_fastbert_patched", None)
    if patched is None:
        return "fastbert: off (stock transformers)"
    import fastbert
    return (f"fastbert: on ({fastbert.__file__}), padding_free={_settings['padding_free']}, kernels='torch'; "
            f"patched {len(patched)} "
            f"classes: {', '.join(patched)}")


def pytest_runtest_setup(item):
    _events["swapped"].clear()
    _events["refused"].clear()


def pytest_runtest_teardown(item):
    if _log is not None:
        _log.write(json.dumps({"nodeid": item.nodeid, "swapped": sorted(set(_events["swapped"])),
                               "refused": sorted(set(_events["refused"]))}) + "\n")
        _log.flush()
