#!/usr/bin/env python3
"""Export a MiniMind model directory to a native transformers Qwen3 checkpoint or to GGUF (llama.cpp).

    python scripts/export.py --to qwen3 --model_name_or_path runs/sft --output_dir runs/sft-qwen3
    python scripts/export.py --to gguf  --model_name_or_path runs/sft --output_dir runs/gguf --outtype f16

The tokenizer is taken from the model directory unless --tokenizer_name_or_path says otherwise.
Settings the target cannot reproduce exactly (e.g. qk_norm=False) stop the export with a ValueError.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minimind.export import GGUF_OUTTYPES, export_gguf, export_qwen3  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description="Export a MiniMind model directory.")
    parser.add_argument("--to", required=True, choices=("qwen3", "gguf"),
                        help="qwen3: transformers Qwen3ForCausalLM / Qwen3MoeForCausalLM; gguf: llama.cpp file")
    parser.add_argument("--model_name_or_path", required=True, help="MiniMind directory (save_pretrained)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--tokenizer_name_or_path", default=None)
    parser.add_argument("--outtype", choices=GGUF_OUTTYPES, default="f16", help="gguf only: tensor precision")
    parser.add_argument("--outfile", default=None,
                        help="gguf only: file name inside --output_dir (default: <model dir name>-<outtype>.gguf)")
    args = parser.parse_args(argv)

    if args.to == "qwen3":
        written = export_qwen3(args.model_name_or_path, args.output_dir, args.tokenizer_name_or_path)
    else:
        name = args.outfile or f"{Path(args.model_name_or_path).resolve().name}-{args.outtype}.gguf"
        written = export_gguf(args.model_name_or_path, Path(args.output_dir) / name,
                              args.tokenizer_name_or_path, outtype=args.outtype)
    print(f"wrote {written}")
    return written


if __name__ == "__main__":
    main()
