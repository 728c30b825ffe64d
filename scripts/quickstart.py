"""Build a small MiniMind, save it, reload it through AutoModelForCausalLM (remote code) and generate."""

import argparse

import torch
from transformers import AutoModelForCausalLM

from configuration_minimind import MiniMindConfig
from modeling_minimind import MiniMindForCausalLM


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output_dir", default="runs/quickstart")
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = MiniMindConfig(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    model = MiniMindForCausalLM(config)
    print(f"built MiniMind: {sum(p.numel() for p in model.parameters()):,} parameters")
    model.save_pretrained(args.output_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(args.output_dir, trust_remote_code=True)
    prompt = torch.tensor([[config.bos_token_id, 100, 200, 300]])
    out = reloaded.generate(prompt, max_new_tokens=16, do_sample=False)
    print(f"reloaded {type(reloaded).__name__} from {args.output_dir}; greedy tokens: {out[0].tolist()}")


if __name__ == "__main__":
    main()
