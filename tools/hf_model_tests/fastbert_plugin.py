"""pytest plugin: run transformers' own model tests of every family fastbert claims with fastbert inside, and check
each fastbert forward against the transformers encoder it replaced.

    python -m pytest -p no:cacheprovider tests/models/bert/test_modeling_bert.py --fastbert [--fastbert-padding-free]

With --fastbert, every model of these families (fastbert/families.py MODEL_TYPES: BERT, RoBERTa, XLM-RoBERTa,
CamemBERT, ELECTRA, DistilBERT, MPNet, ModernBERT, DeBERTa-v2) that a test builds runs its encoder through fastbert:

- a head (BertForMaskedLM(config), ...): built as transformers builds it, then `fastbert.optimize(model,
  kernels="torch", padding_free=..., cuda_graphs=False)` swaps the encoder inside it, in place; the test holds the
  same head object;
- a bare encoder (BertModel(config), DebertaV2Model(...), ...): the test gets what optimize returns for it,
  fastbert's own module (its `__new__` builds the HF model, then hands back optimize's result);
- `from_pretrained` / `_from_config` of either: transformers loads or builds the model as usual, then optimize runs
  on the result (what a user does: optimize(from_pretrained(...))).

Only the outermost construction is swapped: the encoder a head builds inside its own __init__ stays HF's until the
head is finished, and a model built inside from_pretrained is optimized once, after loading.

fastbert refuses some configs by name (NotImplementedError: is_decoder, add_cross_attention, other position
embeddings) and any model that generates (ValueError: "... generates text, with a key/value cache"). Such a model
is left stock and the refusal is recorded; any other error from optimize propagates and fails the test.

The forward check. optimize keeps the transformers encoder it replaced aside (its `_hf_encoder`, sharing every
weight with the fastbert module). After each fastbert forward in eval mode, on fp32 weights, the plugin runs that
encoder on the same arguments (under no_grad, in eval mode, with the test's own forward hooks set aside so that
nothing a test counts fires twice) and compares every output tensor: last_hidden_state, pooler_output, each hidden
state and attention map. In padding-free mode positions the 2-D attention mask pads are left out (fastbert returns
0 there by design, docs/padding-free.md). A difference above --fastbert-atol (1e-4: tests' tiny random configs give
outputs of order 1) is a mismatch. Train-mode forwards (dropout draws differ), other dtypes, packed input and
arguments transformers' encoder does not take are counted as unchecked, by reason.

A mismatch is recorded, not raised, by default (--fastbert-check=record): the test's outcome stays what
transformers' own assertions make of fastbert, so the stock-vs-fastbert outcome comparison keeps meaning one thing,
and the forward check is a column of its own. --fastbert-check=fail makes a test that otherwise passed fail on a
mismatch.

Per test, what was swapped and refused, how many fastbert forwards ran, and the checks (counts, the largest
difference and where) are written to --fastbert-log (JSON lines).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import threading

import pytest
import torch

# arguments transformers' encoders take through **kwargs (TransformersKwargs) rather than by name
_PASSED_AS_KWARGS = ("output_attentions", "output_hidden_states", "return_dict")
# arguments of fastbert's forward that mean packed input: transformers' padded encoder has no counterpart
_PACKED = ("cu_seqlens", "max_seqlen", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def families() -> dict:
    """transformers' modeling module -> its encoder class, for every model_type fastbert claims."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from fastbert import families as fb_families

    found = {}
    for model_type, (_, encoder) in fb_families.MODEL_TYPES.items():
        # transformers' own folder for the model_type: deberta-v2 -> deberta_v2, gemma3_text -> gemma3 (whose module
        # holds Gemma3TextModel); a folder named after the model_type alone does not import for gemma3_text
        folder = model_type_to_module_name(model_type)
        found[f"transformers.models.{folder}.modeling_{folder}"] = encoder
    return found


_state = threading.local()
_events: dict = {"swapped": [], "refused": [], "forwards": 0, "checks": []}
_settings = {"padding_free": False, "atol": 1e-4, "check": "record"}


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
    except ValueError as e:  # a model that generates (a causal-LM head): optimize refuses it by name, it stays stock
        if "generates text" not in str(e):
            raise
        _events["refused"].append(f"{type(model).__name__}: {e}")
        return model
    _events["swapped"].append(type(model).__name__)
    return out


def _wrap_init(cls, is_encoder: bool):
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        if self.__dict__.pop("_fastbert_plugin_built", False):
            return  # built by __new__ below already, fastbert refused it: Python calls __init__ once more
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
        out = _optimize(obj)  # fastbert's module, not an instance of klass: Python does not run __init__ again
        if out is obj:  # refused: obj is returned as built, and its second __init__ (which would draw new random
            obj.__dict__["_fastbert_plugin_built"] = True  # weights) does nothing
        return out

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
    for module_name, encoder_name in families().items():
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


def keep_transformers_probes_stock() -> None:
    """fastbert asks the installed transformers what its encoders do (fastbert/installed.py: whether they read packed
    sequences from position_ids, what a return_dict=False tuple holds) by building tiny encoders of its own, in a thread
    of its own. Those encoders must stay transformers': swapped, they would ask fastbert itself, from inside the probe
    (which waits on the lock its caller holds: the test hangs)."""
    try:
        from fastbert import installed
    except ImportError:  # a fastbert from before the probes
        return
    original = installed._in_a_thread

    @functools.wraps(original)
    def in_a_thread(question, model_type, what):
        def stock(model_type):
            with _inside():  # (the depth is per thread: this runs in the probe's thread)
                return question(model_type)

        stock.__qualname__ = question.__qualname__
        return original(stock, model_type, what)

    installed._in_a_thread = in_a_thread


# ---- the forward check -------------------------------------------------------------------------------------------

def install_forward_check() -> None:
    """Every fastbert forward optimize swapped in (OptimizedBertModel) is followed by the check."""
    from fastbert.patch import OptimizedBertModel

    original = OptimizedBertModel.forward
    signature = inspect.signature(original)

    @functools.wraps(original)  # the signature transformers and Trainer inspect stays fastbert's
    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if getattr(_state, "checking", False):
            return out
        _events["forwards"] += 1
        _state.checking = True
        try:
            _events["checks"].append(check_forward(self, signature, args, kwargs, out))
        except Exception as e:  # the check's own trouble is recorded, never the test's
            _events["checks"].append({"unchecked": f"error: {type(e).__name__}: {e}"[:300]})
        finally:
            _state.checking = False
        return out

    OptimizedBertModel.forward = forward


def _arguments(signature, fb, args, kwargs) -> dict:
    bound = signature.bind(fb, *args, **kwargs).arguments
    bound.pop("self", None)
    extra = bound.pop("kwargs", {})
    return {**bound, **extra}


def _hf_arguments(hf, given: dict):
    """The keyword arguments for transformers' encoder, or (None, why) when it cannot be called on them."""
    names = set(inspect.signature(hf.forward).parameters) - {"self", "kwargs"}
    call = {}
    for name, value in given.items():
        if value is None:
            continue
        if name in _PACKED:
            return None, "packed input"
        if name in names or name in _PASSED_AS_KWARGS:
            call[name] = value
        elif isinstance(value, torch.Tensor):
            return None, f"argument {name} transformers' encoder does not take"
    return call, None


def _sync_replaced_leaves(fb, hf) -> None:
    """A module the fastbert side replaced since optimize (resize_token_embeddings, ...) goes into the HF encoder
    too, as restore would put it there."""
    from fastbert.loading import shared_leaves

    for name, module in shared_leaves(fb):
        parent, _, leaf = name.rpartition(".")
        holder = hf.get_submodule(parent)
        if holder._modules.get(leaf) is not module:
            holder._modules[leaf] = module


def _bring_buffers(hf, fb) -> None:
    """The HF encoder's own buffers (position_ids, ...) to the weights' device, filled where a meta-device build left
    them empty: what restore does (fastbert/patch.py), so the encoder runs as restore would give it back."""
    from fastbert import patch

    bring = getattr(patch, "_bring_buffers", None)
    if bring is not None:
        bring(hf, fb.device)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def _stock_run(hf):
    """hf in eval mode, with every hook not transformers' own set aside (a test's hooks must not fire twice);
    everything put back afterwards."""
    modules = list(hf.modules())
    training = [m.training for m in modules]
    saved = []
    for m in modules:
        for attr in _HOOK_DICTS:
            hooks = getattr(m, attr, None)
            if not hooks:
                continue
            saved.append((m, attr, dict(hooks)))
            for key, hook in list(hooks.items()):
                if not getattr(hook, "__module__", "").startswith("transformers"):
                    del hooks[key]
    hf.eval()
    try:
        yield
    finally:
        for m, flag in zip(modules, training):
            m.training = flag
        for m, attr, hooks in saved:
            current = getattr(m, attr)
            current.clear()
            current.update(hooks)


def _tensors(out, prefix=""):
    """name -> tensor (None kept) of a ModelOutput or (nested) tuple."""
    if isinstance(out, torch.Tensor) or out is None:
        return {prefix or "output": out}
    items = out.items() if hasattr(out, "items") else ((f"[{i}]", v) for i, v in enumerate(out))
    found = {}
    for name, value in items:
        key = f"{prefix}.{name}" if prefix and not name.startswith("[") else f"{prefix}{name}"
        if isinstance(value, (tuple, list)):
            found.update(_tensors(value, key))
        elif value is None or isinstance(value, torch.Tensor):
            found[key] = value
    return found


def _keep_real(a, b, mask):
    """Padding-free: zero both at positions the [B, S] key mask pads (fastbert's 0 there is by design)."""
    if mask is None or mask.dim() != 2 or bool(mask.bool().all()):
        return a, b
    B, S = mask.shape
    pad = ~mask.bool()
    if a.dim() >= 2 and a.shape[:2] == (B, S):  # [B, S, H]
        where = pad.reshape(B, S, *([1] * (a.dim() - 2)))
    elif a.dim() == 4 and a.shape[0] == B and a.shape[2] == S:  # attentions [B, heads, S, S]: padded query rows
        where = pad[:, None, :, None]
    elif a.dim() == 2 and a.shape[0] == B:  # pooler [B, H]: read at the first position
        where = pad[:, :1]
    else:
        return a, b
    zero = torch.zeros((), dtype=a.dtype)
    return a.masked_fill(where, zero), b.masked_fill(where, zero)


def _difference(a, b) -> float:
    if a.shape != b.shape:
        return math.inf
    a, b = a.detach().double(), b.detach().double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    d = (a - b).abs().masked_fill(both_nan, 0)
    return float(torch.nan_to_num(d, nan=math.inf).max()) if d.numel() else 0.0


def check_forward(fb, signature, args, kwargs, out) -> dict:
    """One fastbert forward against transformers' encoder it replaced: {"max_diff", "worst", "ok"} or
    {"unchecked": why}."""
    hf = fb.__dict__.get("_hf_encoder")
    if hf is None:
        return {"unchecked": "no transformers encoder kept"}
    if fb.training:
        return {"unchecked": "train mode"}
    params = list(fb.parameters())
    if any(p.is_meta for p in params):
        return {"unchecked": "meta device"}
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in params):
        return {"unchecked": "not fp32"}
    given = _arguments(signature, fb, args, kwargs)
    call, why = _hf_arguments(hf, given)
    if call is None:
        return {"unchecked": why}
    inputs_embeds = given.get("inputs_embeds")
    if inputs_embeds is not None and inputs_embeds.dtype != torch.float32:
        return {"unchecked": "not fp32"}
    _sync_replaced_leaves(fb, hf)
    _bring_buffers(hf, fb)
    if any(t.is_meta for t in (*hf.parameters(), *hf.buffers())):  # it would compute from whatever memory holds
        return {"unchecked": "transformers' encoder holds meta tensors"}
    with _stock_run(hf), torch.no_grad():
        ref = hf(**call)
    mine, theirs = _tensors(out), _tensors(ref)
    missing = [n for n, t in theirs.items() if t is not None and mine.get(n) is None]
    if missing:
        return {"max_diff": math.inf, "worst": f"transformers returns {', '.join(missing)}, fastbert does not",
                "ok": False}
    # fastbert may return more than transformers' encoder does (attentions where transformers' sdpa gives none):
    # noted, not a mismatch
    extra = [n for n, t in mine.items() if t is not None and theirs.get(n) is None]
    mask = given.get("attention_mask") if _settings["padding_free"] else None
    worst, largest = None, 0.0
    for name, a in mine.items():
        b = theirs.get(name)
        if a is None or b is None:
            continue
        if a.is_floating_point() and mask is not None:
            a, b = _keep_real(a, b, mask)
        d = _difference(a, b) if a.is_floating_point() else float(not torch.equal(a, b))
        if d > largest or worst is None:
            worst, largest = name, d
    if extra:
        return {"max_diff": largest, "worst": worst, "ok": largest <= _settings["atol"], "only_fastbert": extra}
    return {"max_diff": largest, "worst": worst, "ok": largest <= _settings["atol"]}


def _summary(checks: list) -> dict:
    done = [c for c in checks if "unchecked" not in c]
    bad = [c for c in done if not c["ok"]]
    unchecked = {}
    for c in checks:
        if "unchecked" in c:
            unchecked[c["unchecked"]] = unchecked.get(c["unchecked"], 0) + 1
    top = max(done, key=lambda c: c["max_diff"], default=None)
    return {"checked": len(done), "mismatches": len(bad), "max_diff": None if top is None else top["max_diff"],
            "worst": None if top is None else top["worst"], "unchecked": unchecked}


# ---- pytest ------------------------------------------------------------------------------------------------------

def pytest_addoption(parser):
    group = parser.getgroup("fastbert")
    group.addoption("--fastbert", action="store_true",
                    help="run every model of the families fastbert claims through fastbert")
    group.addoption("--fastbert-padding-free", action="store_true",
                    help="optimize with padding_free=True (default: padding_free=False, HF's padded execution)")
    group.addoption("--fastbert-log", default=None,
                    help="JSON lines: per test, the models swapped and refused, forwards run, forward checks")
    group.addoption("--fastbert-atol", type=float, default=1e-4,
                    help="the forward check's tolerance: largest absolute difference from transformers' encoder")
    group.addoption("--fastbert-check", choices=("record", "fail", "off"), default="record",
                    help="a forward-check mismatch is recorded in the log (default), also fails the test, or no "
                         "check runs")


_log = None


def pytest_configure(config):
    global _log
    if not config.getoption("--fastbert"):
        return
    _settings["padding_free"] = bool(config.getoption("--fastbert-padding-free"))
    _settings["atol"] = config.getoption("--fastbert-atol")
    _settings["check"] = config.getoption("--fastbert-check")
    patched = patch_families()
    keep_transformers_probes_stock()
    if _settings["check"] != "off":
        install_forward_check()
    path = config.getoption("--fastbert-log")
    _log = open(path, "w") if path else None
    config._fastbert_patched = patched


def pytest_report_header(config):
    patched = getattr(config, "_fastbert_patched", None)
    if patched is None:
        return "fastbert: off (stock transformers)"
    import fastbert
    return (f"fastbert: on ({fastbert.__file__}), padding_free={_settings['padding_free']}, kernels='torch'; "
            f"forward check: {_settings['check']}, atol {_settings['atol']:g}; patched {len(patched)} "
            f"classes: {', '.join(patched)}")


def pytest_runtest_setup(item):
    _events["swapped"].clear()
    _events["refused"].clear()
    _events["checks"].clear()
    _events["forwards"] = 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    if _settings["check"] != "fail" or outcome.excinfo is not None:
        return
    summary = _summary(_events["checks"])
    if summary["mismatches"]:
        outcome.force_exception(AssertionError(
            f"fastbert's forward differs from transformers' encoder in {summary['mismatches']} of "
            f"{summary['checked']} checked forwards: up to {summary['max_diff']:.3g} at {summary['worst']}"))


def pytest_runtest_teardown(item):
    if _log is not None:
        _log.write(json.dumps({"nodeid": item.nodeid, "swapped": sorted(set(_events["swapped"])),
                               "refused": sorted(set(_events["refused"])), "forwards": _events["forwards"],
                               "check": _summary(_events["checks"])}) + "\n")
        _log.flush()
