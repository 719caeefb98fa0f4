"""What both commands share: user errors, the options' parsers, the model folder and the device, checked before any
work."""
from __future__ import annotations

import argparse

import torch

from .. import dispatch
from ..loading import bundled_model, resolve_folder

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def add_format_options(group) -> None:
    """--quantize and --quality-texts (fastbert/formats.py, fastbert/quality.py)."""
    group.add_argument("--quantize", choices=("fp32", "bf16", "int8"), default=None,
                       help="run the GEMMs in this number format, on the float32 model; its cost against fp32 is "
                       "measured at load and printed (default: fp32)")
    group.add_argument("--quality-texts", metavar="FILE", default=None,
                       help="texts (one per line) to measure --quantize's cost on (default: a built-in sample)")


class UsageError(Exception):
    """A user's mistake (a missing file, a bad option): one line on stderr and exit code 2, never a traceback."""


# What loading a model or a file raises for a user's mistake (a bad folder, config or checkpoint) or for the machine's
# state (a full disk): reported in one line like a UsageError. Anything else is a bug and keeps its traceback.
USER_ERRORS = (UsageError, OSError, ValueError, NotImplementedError)


def default_model() -> str:
    try:
        return bundled_model()
    except FileNotFoundError as e:
        raise UsageError(f"{e}, or pass --model PATH_OR_ID") from None


def model_folder(args) -> str:
    """The model's folder, checked before any work: a local folder with config.json, or a Hub id in the cache."""
    return resolve_folder(args.model or default_model(), weights=True)


def device_of(args) -> torch.device:
    """--device, checked: a device that exists here (default: cuda when available)."""
    if args.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a device name (use cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"--device {args.device!r}: fastbert runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {args.device!r}: no CUDA device is available here")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def parse_kernels(text: str):
    """'triton' -> all ops; 'attention=torch,bias_gelu=triton' -> per op."""
    if "=" not in text:
        if text not in dispatch.BACKENDS:
            raise argparse.ArgumentTypeError(f"unknown backend {text!r}; the backends are "
                                             f"{', '.join(dispatch.BACKENDS)}")
        return text
    choice = dict(item.split("=", 1) for item in text.split(","))
    for op, backend in choice.items():
        try:
            dispatch.check_backend(op, backend)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    return choice


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_ray_address(group, doing: str) -> None:
    """The --ray [ADDRESS] option of a command that can run on a Ray cluster; `doing` opens its help."""
    group.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help=f"{doing}: on the cluster at ADDRESS (auto, HOST:6379, ray://HOST:10001), else on "
                            f"$RAY_ADDRESS, a cluster started here with `ray start`, or a new local one")


def count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
