#!/usr/bin/env python3
"""Import an upstream MiniMind .pth checkpoint into a MiniMind Hugging Face directory.

    python scripts/convert_minimind.py --pth full_sft_768.pth --output_dir runs/upstream-768 \
        --hidden_size 768 --num_hidden_layers 8 --tokenizer_name_or_path tokenizer
    python scripts/convert_minimind.py --pth full_sft_640_moe.pth --config_json upstream_config.json \
        --output_dir runs/upstream-moe

Settings come from --config_json (upstream names such as n_routed_experts are accepted), then the flags
below override them; anything unset takes MiniMindConfig's default. Keys that do not match are listed by
name. The result loads with AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minimind.convert import (  # noqa: E402
    config_from_upstream_settings, convert_upstream_checkpoint, read_settings_json)

_INT_FLAGS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size")
_FLOAT_FLAGS = ("rope_theta", "rms_norm_eps")
_BOOL_FLAGS = ("use_moe", "qk_norm", "tie_word_embeddings", "norm_topk_prob", "inference_rope_scaling")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Import an upstream MiniMind .pth checkpoint.")
    # --model_name_or_path like every other script: here the model to import is the upstream .pth file.
    parser.add_argument("--pth", "--model_name_or_path", dest="pth", required=True,
                        help="upstream state dict saved with torch.save (the model to import)")
    parser.add_argument("--output_dir", required=True, help="MiniMind model directory to write")
    parser.add_argument("--config_json", default=None, help="JSON object of upstream/MiniMind config settings")
    parser.add_argument("--tokenizer_name_or_path", default=None, help="tokenizer directory to copy along")
    for name in _INT_FLAGS:
        parser.add_argument(f"--{name}", type=int, default=None)
    for name in _FLOAT_FLAGS:
        parser.add_argument(f"--{name}", type=float, default=None)
    for name in _BOOL_FLAGS:  # --use_moe / --no_use_moe; unset = from the JSON or MiniMindConfig's default
        switch = parser.add_mutually_exclusive_group()
        switch.add_argument(f"--{name}", dest=name, action="store_true", default=None)
        switch.add_argument(f"--no_{name}", dest=name, action="store_false", default=None)
    args = parser.parse_args(argv)

    settings = read_settings_json(args.config_json) if args.config_json else {}
    settings.update({name: getattr(args, name) for name in _INT_FLAGS + _FLOAT_FLAGS + _BOOL_FLAGS
                     if getattr(args, name) is not None})
    model = convert_upstream_checkpoint(args.pth, config_from_upstream_settings(settings), args.output_dir,
                                        args.tokenizer_name_or_path)
    print(f"wrote {args.output_dir}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"dtype {model.dtype}")
    return model


if __name__ == "__main__":
    main()
