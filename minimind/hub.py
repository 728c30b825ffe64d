"""Publish a MiniMind model directory on the Hugging Face Hub, with a generated model card.

The directory is what `save_pretrained` (plus `minimind.tokenizer.save_tokenizer`) writes. Only the files a
user needs are uploaded (weights, config, the two code files, tokenizer, generation config) and training
leftovers (optimizer state, intermediate checkpoints) stay home. The upload is one commit made with
huggingface_hub's `HfApi.create_repo` + `create_commit`.
"""

import json
from pathlib import Path

from minimind.errors import InputError
from minimind.export import TOKENIZER_FILES
from minimind.training.curves import LOSS_PLOT

DEFAULT_LICENSE = "apache-2.0"
# eval_results.* only where minimind-eval wrote them: its table also goes into the card; likewise the loss plot
# a training command leaves.
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "eval_results.json",
    "eval_results.md",
    LOSS_PLOT,
)
# Shown in the card's configuration table, in this order.
_CARD_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_theta",
    "qk_norm",
    "tie_word_embeddings",
    "use_moe",
)
_CARD_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
)
# Training facts read from the files transformers' Trainer leaves in its output directory.
_TRAINER_STATE_FIELDS = ("global_step", "epoch", "max_steps", "num_train_epochs", "train_batch_size")
_TRAINING_ARGS_FIELDS = (
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "lr_scheduler_type",
    "warmup_ratio",
    "weight_decay",
    "bf16",
    "fp16",
    "seed",
)


def _read_json(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------------------------------------
# What gets uploaded
# ----------------------------------------------------------------------------------------------------------


def files_to_upload(model_dir, tokenizer_dir=None):
    """{path in repo: local path} for a publishable model directory; an InputError listing every problem."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(f"no such directory: {model_dir}")
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else model_dir
    problems = []
    files = {name: model_dir / name for name in _MODEL_FILES if (model_dir / name).is_file()}
    files.update({path.name: path for path in sorted(model_dir.glob("*.safetensors"))})
    files.update({path.name: path for path in sorted(model_dir.glob("*.py"))})
    files.update({name: tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()})

    if "config.json" not in files:
        problems.append(f"no config.json in {model_dir} (save the model with save_pretrained)")
    else:
        auto_map = _read_json(files["config.json"]).get("auto_map") or {}
        for auto_class in ("AutoConfig", "AutoModelForCausalLM"):
            if auto_class not in auto_map:
                problems.append(f"config.json has no auto_map[{auto_class!r}], so trust_remote_code cannot load it")
        named_by_file = {}  # one line per missing module file, however many classes name it
        for reference in (ref for ref in auto_map.values() if isinstance(ref, str)):
            module_file = reference.split("--")[-1].rsplit(".", 1)[0] + ".py"
            named_by_file.setdefault(module_file, []).append(reference.split("--")[-1].rsplit(".", 1)[1])
        for module_file, classes in named_by_file.items():
            if module_file not in files:
                problems.append(f"auto_map names {', '.join(classes)} but {module_file} is not in {model_dir}")
    if not any(name.endswith(".safetensors") for name in files):
        problems.append(
            f"no *.safetensors weights in {model_dir} (pytorch_model.bin is not published; re-save "
            f"with save_pretrained, which writes safetensors)"
        )
    if "generation_config.json" not in files:
        problems.append("no generation_config.json (save_pretrained of the model writes it)")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if name not in files:
            problems.append(
                f"no {name} in {tokenizer_dir} (pass --tokenizer_name_or_path tokenizer/ or save the "
                f"tokenizer into the model directory)"
            )
    if (
        "tokenizer_config.json" in files
        and "chat_template.jinja" not in files
        and not _read_json(files["tokenizer_config.json"]).get("chat_template")
    ):
        problems.append("the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)")
    if problems:
        raise InputError("Cannot publish " + str(model_dir) + ":\n- " + "\n- ".join(problems))
    return files


# ----------------------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------------------


def count_parameters(model_dir):
    """Parameters stored in the safetensors files, read from their headers (tied weights are stored once)."""
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                numel = 1
                for size in f.get_slice(name).get_shape():
                    numel *= size
                total += numel
    return total


def _markdown_table(rows, header=("field", "value")):
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| `{key}` | {value} |" for key, value in rows]
    return "\n".join(lines)


def describe_training(model_dir):
    """Markdown on how the model was trained, from trainer_state.json / training_args.json if present."""
    model_dir = Path(model_dir)
    rows = []
    if (model_dir / "trainer_state.json").is_file():
        state = _read_json(model_dir / "trainer_state.json")
        rows += [(key, state[key]) for key in _TRAINER_STATE_FIELDS if state.get(key) is not None]
        losses = [entry["loss"] for entry in state.get("log_history", []) if "loss" in entry]
        eval_losses = [entry["eval_loss"] for entry in state.get("log_history", []) if "eval_loss" in entry]
        if losses:
            rows.append(("final training loss", round(losses[-1], 4)))
        if eval_losses:
            rows.append(("final eval loss", round(eval_losses[-1], 4)))
    if (model_dir / "training_args.json").is_file():
        args = _read_json(model_dir / "training_args.json")
        rows += [(key, args[key]) for key in _TRAINING_ARGS_FIELDS if args.get(key) is not None]
    if not rows:
        return (
            "Unknown: the published directory has no `trainer_state.json` or `training_args.json` "
            "recording how it was trained."
        )
    plot = f"\n\n![Training and eval loss against steps]({LOSS_PLOT})" if (model_dir / LOSS_PLOT).is_file() else ""
    return "Trained with the transformers `Trainer`:\n\n" + _markdown_table(rows) + plot


def describe_evaluation(model_dir):
    """The table `minimind-eval` wrote into the directory (eval_results.md), or None when it was not run."""
    from minimind.evaluate import RESULTS_MARKDOWN

    path = Path(model_dir) / RESULTS_MARKDOWN
    if not path.is_file():
        return None
    return (
        "Measured with `minimind-eval` (lm-evaluation-harness tasks; `tool_calling` is the share of the "
        "bundled tool-use prompts whose greedy reply makes the right call):\n\n"
        + path.read_text(encoding="utf-8").strip()
    )


def card_eval_results(model_dir):
    """eval_results.json as huggingface_hub `EvalResult`s, the card metadata (model-index) the Hub shows in its
    evaluation panel; [] when `minimind-eval` was not run."""
    from huggingface_hub import EvalResult

    from minimind.evaluate import RESULTS_JSON

    path = Path(model_dir) / RESULTS_JSON
    if not path.is_file():
        return []
    return [
        EvalResult(
            task_type="text-generation",
            dataset_type=row["task"],
            dataset_name=row["task"],
            metric_type=row["metric"],
            metric_value=row["value"],
        )
        for row in _read_json(path)["results"]
    ]


def _usage_snippet(repo_id):
    return f'''```python
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

tokenizer = AutoTokenizer.from_pretrained("{repo_id}", trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)
messages = [{{"role": "user", "content": "Hello! Who are you?"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                       return_dict=True)
output = model.generate(**inputs, max_new_tokens=64)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))

# or, with chat messages straight into a pipeline
chat = pipeline("text-generation", model="{repo_id}", trust_remote_code=True)
print(chat(messages, max_new_tokens=64)[0]["generated_text"][-1]["content"])
```'''


def build_model_card(model_dir, repo_id, license=DEFAULT_LICENSE):
    """A huggingface_hub ModelCard: YAML metadata, configuration table, parameter count, training, usage."""
    from huggingface_hub import ModelCard, ModelCardData

    config = _read_json(Path(model_dir) / "config.json")
    tags = ["minimind", "qwen3", "custom_code", "text-generation"] + (["moe"] if config.get("use_moe") else [])
    eval_results = card_eval_results(model_dir)
    metadata = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        tags=tags,
        eval_results=eval_results or None,
        model_name=repo_id.split("/")[-1] if eval_results else None,
    )
    fields = _CARD_CONFIG_FIELDS + (_CARD_MOE_FIELDS if config.get("use_moe") else ())
    rows = [(key, config[key]) for key in fields if key in config]
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        rows.append(("rope_parameters", json.dumps(rope)))
    parameters = count_parameters(model_dir)
    name = repo_id.split("/")[-1]
    evaluation = describe_evaluation(model_dir)
    evaluation = f"## Evaluation\n\n{evaluation}\n\n" if evaluation else ""
    body = f"""# {name}

A MiniMind model: a small decoder-only language model of the Llama/Qwen3 family
({"mixture of experts" if config.get("use_moe") else "dense"}). The modeling code ships in this repository
(`configuration_minimind.py`, `modeling_minimind.py`), so load it with `trust_remote_code=True`.

**Parameters:** {parameters:,} ({parameters / 1e6:.1f}M; a tied embedding/LM head counted once).

## Configuration

{_markdown_table(rows)}

## Training

{describe_training(model_dir)}

{evaluation}## Usage

{_usage_snippet(repo_id)}
"""
    return ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n{body}")


# ----------------------------------------------------------------------------------------------------------
# Upload
# ----------------------------------------------------------------------------------------------------------


def upload_plan(model_dir, repo_id, tokenizer_dir=None, license=DEFAULT_LICENSE) -> dict[str, bytes | Path]:
    """{path in repo: local file, or the model card's bytes for README.md}: what a push would upload."""
    files = dict(files_to_upload(model_dir, tokenizer_dir))
    files["README.md"] = str(build_model_card(model_dir, repo_id, license=license)).encode("utf-8")
    return files


def describe_plan(plan: dict[str, bytes | Path]) -> list[str]:
    """One line per file of an upload plan: its path in the repository and its size."""
    sizes = {
        name: len(source) if isinstance(source, bytes) else source.stat().st_size for name, source in plan.items()
    }
    width = max(map(len, plan))
    return [f"  {name:<{width}}  {sizes[name]:>12,} bytes" for name in plan] + [
        f"  {len(plan)} files, {sum(sizes.values()):,} bytes"
    ]


def push_model_dir(
    model_dir,
    repo_id,
    tokenizer_dir=None,
    private=None,
    token=None,
    license=DEFAULT_LICENSE,
    commit_message="Upload MiniMind model",
):
    """Create (or reuse) `repo_id` and upload the model directory plus its card in one commit. A Hub that cannot
    be reached (offline, refused, no rights) is an InputError in one line; nothing is uploaded then."""
    from huggingface_hub import CommitOperationAdd, HfApi

    plan = upload_plan(model_dir, repo_id, tokenizer_dir, license=license)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=source if isinstance(source, bytes) else str(source))
        for name, source in plan.items()
    ]
    api = HfApi()
    try:
        repo = api.create_repo(repo_id, private=private, token=token, exist_ok=True)
        return api.create_commit(repo.repo_id, operations, commit_message=commit_message, token=token)
    except Exception as error:  # the network's and the Hub's errors alike: the user's fix is the same
        cause = type(error).__name__ + (f": {str(error).strip().splitlines()[0]}" if str(error).strip() else "")
        raise InputError(
            f"could not publish to {repo_id} on the Hub ({cause}). Fix: check the network, "
            "HF_HUB_OFFLINE and your token (hf auth login); --dry_run shows what would be uploaded"
        ) from None
