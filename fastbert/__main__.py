"""python -m fastbert: the parity-and-speed check on a real model; python -m fastbert encode: sentence embeddings.

    python -m fastbert [--model PATH_OR_ID] [--device cpu|cuda] [--dtype float32|float16|bfloat16]
                       [--batch-size N] [--kernels auto|torch|triton|op=backend,...] [--no-cuda-graphs]
    python -m fastbert encode --input FILE.txt|FILE.jsonl|- --output FILE.npy [options]   (encode --help lists them)
    python -m fastbert encode --ray [ADDRESS] --input FILE_OR_FOLDER --output FOLDER [options]
    python -m fastbert serve [MODEL] [--host 127.0.0.1] [--port 8080] [options]   (serve --help lists them)
    python -m fastbert serve [MODEL] --ray [ADDRESS] [--replicas N | --min-replicas A --max-replicas B] [options]
    python -m fastbert quality [MODEL] --quantize bf16|int8 [--quality-texts FILE] [--pairs FILE.tsv]

The first loads the model (the bundled all-MiniLM-L6-v2 by default), encodes a fixed set of real sentences with
Hugging Face's BertModel and with fastbert on every backend available here (on a GPU through CUDA graphs, as users
run it, unless --no-cuda-graphs), prints one table, and exits 1 when fastbert misses the parity bar (fp32:
max |delta| <= 1e-5 on real tokens; fp16/bf16: <= 2x HF's own error in that dtype against fp32). The second embeds
a corpus exactly as sentence-transformers would (fastbert/encode.py); with --ray, a corpus bigger than one process,
on a Ray cluster (fastbert/distributed). The third serves a model over HTTP (fastbert/serve: TEI's and OpenAI's
APIs); with --ray, as replicas of a Ray Serve deployment (fastbert/serve/ray.py). Each command lives in its own
module (fastbert/cli/main_job.py, fastbert/cli/encode.py, fastbert/cli/serve.py); this one picks the command.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the default model is bundled; never reach for a hub implicitly

from .cli.common import USER_ERRORS  # noqa: E402
from .cli.encode import encode, encode_parser  # noqa: E402
from .cli.main_job import check, check_parser  # noqa: E402
from .cli.quality import quality_command, quality_parser  # noqa: E402
from .cli.serve import serve, serve_parser  # noqa: E402

COMMANDS = {"encode": (encode_parser, encode), "serve": (serve_parser, serve),
            "quality": (quality_parser, quality_command)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv[:1] and argv[0] in COMMANDS else "check"
    make_parser, run = COMMANDS.get(command, (check_parser, check))
    parser = make_parser()
    args = parser.parse_args(argv[1:] if command in COMMANDS else argv)
    if command == "encode" and (not args.input or not args.output):
        parser.error("encode needs --input FILE.txt and --output FILE.npy" if args.ray is None else
                     "encode --ray needs --input FILE_OR_FOLDER and --output FOLDER")
    try:
        return run(args)
    except USER_ERRORS as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
