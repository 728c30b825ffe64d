"""Moving a checkpoint: export to Qwen3 or GGUF, publish to the Hub, import a reference-project checkpoint."""

from __future__ import annotations

from minimind.cli.base import command, make_parser


@command
def export(argv=None):
    """Export a MiniMind model directory to a native transformers Qwen3 checkpoint, to GGUF (llama.cpp) or to
    ONNX with a KV cache (ONNX Runtime, optimum).

    minimind-export --to qwen3 --model_name_or_path runs/sft --output_dir runs/sft-qwen3
    minimind-export --to gguf  --model_name_or_path runs/sft --output_dir runs/gguf --outtype f16
    minimind-export --to onnx  --model_name_or_path runs/sft --output_dir runs/onnx

    The tokenizer is taken from the model directory unless --tokenizer_name_or_path says otherwise.
    Settings the target cannot reproduce exactly (e.g. qk_norm=False) stop the export with a ValueError.
    """
    from pathlib import Path

    from minimind.export import GGUF_OUTTYPES, export_gguf, export_onnx, export_qwen3

    parser = make_parser(export.__doc__)
    parser.add_argument(
        "--to",
        required=True,
        choices=("qwen3", "gguf", "onnx"),
        help="qwen3: transformers Qwen3ForCausalLM / Qwen3MoeForCausalLM; gguf: llama.cpp file; "
        "onnx: model.onnx with KV-cache inputs/outputs (pip install 'minimind[onnx]')",
    )
    parser.add_argument("--model_name_or_path", required=True, help="MiniMind directory (save_pretrained)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--tokenizer_name_or_path", default=None)
    parser.add_argument("--outtype", choices=GGUF_OUTTYPES, default="f16", help="gguf only: tensor precision")
    parser.add_argument(
        "--outfile",
        default=None,
        help="gguf only: file name inside --output_dir (default: <model dir name>-<outtype>.gguf)",
    )
    args = parser.parse_args(argv)
    if args.to == "qwen3":
        written = export_qwen3(args.model_name_or_path, args.output_dir, args.tokenizer_name_or_path)
    elif args.to == "onnx":
        written = export_onnx(args.model_name_or_path, args.output_dir, args.tokenizer_name_or_path)
    else:
        name = args.outfile or f"{Path(args.model_name_or_path).resolve().name}-{args.outtype}.gguf"
        written = export_gguf(
            args.model_name_or_path, Path(args.output_dir) / name, args.tokenizer_name_or_path, outtype=args.outtype
        )
    print(f"wrote {written}")
    return written


@command
def push_to_hub(argv=None):
    """Publish a MiniMind model directory on the Hugging Face Hub with a generated model card.

    minimind-push --model_name_or_path runs/sft --repo_id you/minimind-sft
    minimind-push --model_name_or_path runs/sft --repo_id you/minimind-sft --tokenizer_name_or_path tokenizer --private

    minimind-push --model_name_or_path runs/sft --repo_id you/minimind-sft --dry_run   # list, upload nothing

    Log in first (`hf auth login`) or pass --token / set HF_TOKEN.
    """
    from minimind.hub import DEFAULT_LICENSE, describe_plan, push_model_dir, upload_plan

    parser = make_parser(push_to_hub.__doc__)
    parser.add_argument("--model_name_or_path", required=True, help="directory written by save_pretrained")
    parser.add_argument("--repo_id", required=True, help="USER/NAME on the Hub")
    parser.add_argument(
        "--tokenizer_name_or_path",
        default=None,
        help="tokenizer directory, if the model directory has no tokenizer files",
    )
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    parser.add_argument("--license", default=DEFAULT_LICENSE, help="license id for the model card")
    parser.add_argument("--commit_message", default="Upload MiniMind model")
    parser.add_argument("--dry_run", action="store_true", help="list the files and the model card, upload nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        plan = upload_plan(args.model_name_or_path, args.repo_id, args.tokenizer_name_or_path, license=args.license)
        print("\n".join([f"would upload to {args.repo_id} (nothing sent):", *describe_plan(plan)]))
        return plan
    commit = push_model_dir(
        args.model_name_or_path,
        args.repo_id,
        tokenizer_dir=args.tokenizer_name_or_path,
        private=args.private or None,
        token=args.token,
        license=args.license,
        commit_message=args.commit_message,
    )
    print(f"published {args.model_name_or_path} to {args.repo_id}: {getattr(commit, 'commit_url', commit)}")
    return commit


_CONVERT_INT_FLAGS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
)
_CONVERT_FLOAT_FLAGS = ("rope_theta", "rms_norm_eps")
_CONVERT_BOOL_FLAGS = ("use_moe", "qk_norm", "tie_word_embeddings", "norm_topk_prob", "inference_rope_scaling")


@command
def convert(argv=None):
    """Import an upstream MiniMind checkpoint (a .pth, or a transformers-format directory) into a MiniMind
    Hugging Face directory.

    minimind-convert --pth full_sft_768.pth --output_dir runs/upstream-768 \\
        --hidden_size 768 --num_hidden_layers 8 --tokenizer_name_or_path tokenizer
    minimind-convert --pth full_sft_640_moe.pth --config_json upstream_config.json --output_dir runs/upstream-moe
    minimind-convert --from upstream-hf --model_name_or_path MiniMind2 --output_dir runs/minimind2

    With --from upstream-hf the directory's config.json and tensors give the settings (the flags still override)
    and its tokenizer is copied along unless --tokenizer_name_or_path names another.

    Settings come from --config_json (upstream names such as n_routed_experts are accepted), then the flags
    below override them; anything unset takes MiniMindConfig's default. Keys that do not match are listed by
    name. The result loads with AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True).
    """
    from minimind.convert import (
        config_from_upstream_settings,
        convert_upstream_checkpoint,
        convert_upstream_directory,
        read_settings_json,
    )

    parser = make_parser(convert.__doc__)
    # --model_name_or_path like every other command: here the model to import is the upstream .pth file.
    parser.add_argument(
        "--pth",
        "--model_name_or_path",
        dest="pth",
        required=True,
        help="upstream state dict saved with torch.save, or with --from upstream-hf the upstream "
        "directory (the model to import)",
    )
    parser.add_argument(
        "--from",
        dest="source",
        choices=("pth", "upstream-hf"),
        default="pth",
        help="upstream-hf: a directory upstream's save_pretrained wrote (config.json, safetensors)",
    )
    parser.add_argument("--output_dir", required=True, help="MiniMind model directory to write")
    parser.add_argument("--config_json", default=None, help="JSON object of upstream/MiniMind config settings")
    parser.add_argument("--tokenizer_name_or_path", default=None, help="tokenizer directory to copy along")
    for name in _CONVERT_INT_FLAGS:
        parser.add_argument(f"--{name}", type=int, default=None)
    for name in _CONVERT_FLOAT_FLAGS:
        parser.add_argument(f"--{name}", type=float, default=None)
    for name in _CONVERT_BOOL_FLAGS:  # --use_moe / --no_use_moe; unset = from the JSON or MiniMindConfig's default
        switch = parser.add_mutually_exclusive_group()
        switch.add_argument(f"--{name}", dest=name, action="store_true", default=None)
        switch.add_argument(f"--no_{name}", dest=name, action="store_false", default=None)
    args = parser.parse_args(argv)
    settings = read_settings_json(args.config_json) if args.config_json else {}
    settings.update(
        {
            name: getattr(args, name)
            for name in _CONVERT_INT_FLAGS + _CONVERT_FLOAT_FLAGS + _CONVERT_BOOL_FLAGS
            if getattr(args, name) is not None
        }
    )
    if args.source == "upstream-hf":
        model = convert_upstream_directory(args.pth, args.output_dir, args.tokenizer_name_or_path, settings)
    else:
        model = convert_upstream_checkpoint(
            args.pth, config_from_upstream_settings(settings), args.output_dir, args.tokenizer_name_or_path
        )
    print(f"wrote {args.output_dir}: {sum(p.numel() for p in model.parameters()):,} parameters, dtype {model.dtype}")
    return model
