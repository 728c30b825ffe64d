"""How every MiniMind command opens a model directory (`minimind.loading`): installed classes only, never code from
the directory; a missing path, another architecture, or a config.json that disagrees with its weights refused in one
line before anything is loaded."""

import json

import pytest
import torch

from conftest import model_dir, plant_code_dir
from minimind import cli
from minimind.chat import load_model_and_tokenizer
from minimind.errors import InputError
from minimind.loading import load_model, model_directory


def edit_config(path, **settings):
    config = json.loads((path / "config.json").read_text())
    config.update(settings)
    (path / "config.json").write_text(json.dumps(config))


def test_other_model_type_is_refused(tmp_path):
    """A directory of another model type is refused and its code never runs."""
    marker = plant_code_dir(tmp_path)
    with pytest.raises(InputError) as raised:
        load_model_and_tokenizer(str(tmp_path), device="cpu")
    assert str(raised.value) == (
        f"{tmp_path} is not a MiniMind checkpoint: its config.json says model_type 'planted', not 'minimind' and "
        "names code of its own (auto_map), which MiniMind commands never run. Fix: pass a directory written by "
        "MiniMind, or import other checkpoints with minimind-convert"
    )
    assert not marker.exists()


def test_auto_map_in_directory_is_ignored(tmp_path):
    """auto_map in a MiniMind directory is ignored: the installed classes load."""
    from modeling_minimind import MiniMindForCausalLM

    reference = model_dir(tmp_path)
    marker = plant_code_dir(tmp_path / "code")
    (tmp_path / "planted.py").write_text((tmp_path / "code" / "planted.py").read_text())
    edit_config(
        tmp_path, auto_map={"AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"}
    )
    model, tokenizer = load_model_and_tokenizer(str(tmp_path), device="cpu")
    assert type(model) is MiniMindForCausalLM
    ids = torch.tensor([tokenizer.encode("hello world")])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    assert not marker.exists()


def test_tokenizer_needing_remote_code_is_refused(tmp_path):
    """A tokenizer that needs code from the directory is refused without running it."""
    model_dir(tmp_path)
    marker = plant_code_dir(tmp_path / "code")
    (tmp_path / "planted.py").write_text((tmp_path / "code" / "planted.py").read_text())
    (tmp_path / "tokenizer_config.json").write_text((tmp_path / "code" / "tokenizer_config.json").read_text())
    with pytest.raises(
        InputError,
        match=rf"^{tmp_path}: its tokenizer cannot be loaded without running code from "
        r"the directory, which MiniMind commands never do \(",
    ):
        load_model_and_tokenizer(str(tmp_path), device="cpu")
    assert not marker.exists()


COMMANDS = {
    "chat": lambda path, out: cli.chat(["--model_name_or_path", path, "--no-compile"]),
    "serve": lambda path, out: cli.serve(["--model_name_or_path", path]),
    "web": lambda path, out: cli.web(["--model_name_or_path", path]),
    "export": lambda path, out: cli.export(["--to", "qwen3", "--model_name_or_path", path, "--output_dir", out]),
    "eval": lambda path, out: cli.evaluate(["--model_name_or_path", path, "--no_write"]),
    "sft": lambda path, out: cli.sft(
        [
            "--model_name_or_path",
            path,
            "--data_path",
            "data/sft.jsonl",
            "--output_dir",
            out,
            "--max_steps",
            "1",
            "--use_cpu",
        ]
    ),
    "distill": lambda path, out: cli.distill(
        [
            "--teacher_name_or_path",
            path,
            "--data_path",
            "data/sft.jsonl",
            "--output_dir",
            out,
            "--max_steps",
            "1",
            "--use_cpu",
            "--hidden_size",
            "64",
            "--num_hidden_layers",
            "1",
        ]
    ),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_refuse_planted_dir_in_one_line(command, tmp_path, capsys, monkeypatch):
    """Every command refuses a planted directory in one line."""
    pytest.importorskip("gradio") if command == "web" else None
    monkeypatch.chdir(cli.__file__.rsplit("/minimind/", 1)[0])
    marker = plant_code_dir(tmp_path / "planted")
    with pytest.raises(SystemExit) as exited:
        COMMANDS[command](str(tmp_path / "planted"), str(tmp_path / "out"))
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(
        f"error: {tmp_path / 'planted'} is not a MiniMind checkpoint: its config.json says model_type 'planted'"
    )
    assert not marker.exists() and not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("command", ["chat", "serve", "export", "eval"])
def test_a_mistyped_local_path_is_named_at_once(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    with pytest.raises(SystemExit) as exited:
        COMMANDS[command]("runs/sft", str(tmp_path / "out"))
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: no such directory: runs/sft\n"


def test_a_hub_id_offline_says_the_hub_is_offline(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(InputError) as raised:
        model_directory("someone/minimind-tiny")
    assert str(raised.value) == (
        "no such directory: someone/minimind-tiny; the Hub is offline (HF_HUB_OFFLINE=1) and "
        "it is not in the local cache"
    )


def test_hub_id_downloads_model_files_only(monkeypatch, tmp_path):
    """A hub id downloads model files only and loads with the installed classes."""
    import huggingface_hub

    snapshot = tmp_path / "snapshot"
    reference = model_dir(snapshot)
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snapshot)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model, tokenizer = load_model_and_tokenizer("someone/minimind-tiny", device="cpu")
    assert [repo for repo, _ in calls] == ["someone/minimind-tiny"]  # one snapshot for model and tokenizer
    patterns = calls[0][1]["allow_patterns"]
    assert "*.safetensors" in patterns and not any(pattern.endswith(".py") for pattern in patterns)
    ids = torch.tensor([tokenizer.encode("hi")])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_a_file_given_as_model_directory_is_named(tmp_path):
    (tmp_path / "model.pth").write_bytes(b"x")
    with pytest.raises(
        InputError,
        match=r"model.pth is a file, not a model directory: pass the directory that "
        r"holds config.json and the weights$",
    ):
        load_model(tmp_path / "model.pth")


def test_a_damaged_config_json_is_named(tmp_path):
    model_dir(tmp_path, with_tokenizer=False)
    (tmp_path / "config.json").write_text('{"model_type": "minimind", ')
    with pytest.raises(InputError) as raised:
        load_model(tmp_path)
    assert str(raised.value) == (
        f"{tmp_path / 'config.json'} is not valid JSON (JSONDecodeError): the checkpoint is "
        "damaged; restore config.json from the run that wrote it"
    )


EDITS = {
    "more layers": (
        {},
        {"num_hidden_layers": 3},
        "missing model.layers.2.input_layernorm.weight, model.layers.2.mlp.down_proj.weight, "
        "model.layers.2.mlp.gate_proj.weight, model.layers.2.mlp.up_proj.weight, "
        "model.layers.2.post_attention_layernorm.weight, model.layers.2.self_attn.k_norm.weight and 5 more",
    ),
    "fewer layers": (
        {},
        {"num_hidden_layers": 1},
        "unexpected model.layers.1.input_layernorm.weight, "
        "model.layers.1.mlp.down_proj.weight, model.layers.1.mlp.gate_proj.weight, "
        "model.layers.1.mlp.up_proj.weight, model.layers.1.post_attention_layernorm.weight, "
        "model.layers.1.self_attn.k_norm.weight and 5 more",
    ),
    "untied": ({}, {"tie_word_embeddings": False}, "missing lm_head.weight"),
    "tied": (
        {"tie_word_embeddings": False},
        {"tie_word_embeddings": True},
        "config.json ties lm_head.weight to the embeddings but the weights hold a different tensor "
        "(tie_word_embeddings should be false)",
    ),
    "qk_norm off": (
        {},
        {"qk_norm": False},
        "unexpected model.layers.0.self_attn.k_norm.weight, "
        "model.layers.0.self_attn.q_norm.weight, model.layers.1.self_attn.k_norm.weight, "
        "model.layers.1.self_attn.q_norm.weight",
    ),
    "wider mlp": (
        {},
        {"intermediate_size": 128},
        "mis-shaped model.layers.0.mlp.down_proj.weight (weights [64, 96], "
        "config [64, 128]), model.layers.0.mlp.gate_proj.weight (weights [96, 64], config [128, 64]), "
        "model.layers.0.mlp.up_proj.weight (weights [96, 64], config [128, 64]), "
        "model.layers.1.mlp.down_proj.weight (weights [64, 96], config [64, 128]), "
        "model.layers.1.mlp.gate_proj.weight (weights [96, 64], config [128, 64]), "
        "model.layers.1.mlp.up_proj.weight (weights [96, 64], config [128, 64])",
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_config_weight_mismatch_lists_tensors(edit, tmp_path):
    """A config that disagrees with its weights is refused, listing the tensors."""
    saved, edited, problems = EDITS[edit]
    model_dir(tmp_path, with_tokenizer=False, **saved)
    edit_config(tmp_path, **edited)
    with pytest.raises(InputError) as raised:
        load_model(tmp_path)
    assert str(raised.value) == (
        f"{tmp_path}: config.json does not match the weights ({problems}). Fix: restore "
        "the config.json saved with these weights; a model loaded this way would be partly "
        "random"
    )


def test_moe_switched_on_by_hand_lists_both_sides(tmp_path):
    model_dir(tmp_path, with_tokenizer=False)
    edit_config(tmp_path, use_moe=True)
    with pytest.raises(
        InputError,
        match=r"\(missing model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight, .* and "
        r"\d+ more; unexpected model\.layers\.0\.mlp\.down_proj\.weight, ",
    ):
        load_model(tmp_path)


def test_mismatched_checkpoint_exports_nothing(tmp_path, capsys):
    """Export of a mismatched checkpoint writes nothing."""
    model_dir(tmp_path / "model")
    edit_config(tmp_path / "model", num_hidden_layers=3)
    with pytest.raises(SystemExit) as exited:
        cli.export(
            ["--to", "qwen3", "--model_name_or_path", str(tmp_path / "model"), "--output_dir", str(tmp_path / "out")]
        )
    assert exited.value.code == 2
    assert "config.json does not match the weights (missing model.layers.2." in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_matching_checkpoint_loads_as_saved(tmp_path):
    """A matching checkpoint loads exactly what was saved."""
    reference = model_dir(tmp_path, with_tokenizer=False, tie_word_embeddings=False, use_moe=True)
    model = load_model(tmp_path)
    assert not model.training
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("command", ["pretrain", "grpo"])
def test_training_refuses_bad_model_before_data(command, tmp_path, capsys, monkeypatch):
    """Training refuses a bad starting model before reading its data."""
    import minimind.rl
    import minimind.training.recipes

    def read_data(*args, **kwargs):
        pytest.fail("the data was read")

    monkeypatch.setattr(minimind.training.recipes, "load_datasets", read_data)
    monkeypatch.setattr(minimind.rl, "question_dataset", read_data)
    plant_code_dir(tmp_path / "planted")
    for path, error in (
        ("missing", "no such directory: missing"),
        (str(tmp_path / "planted"), f"{tmp_path / 'planted'} is not a MiniMind checkpoint"),
    ):
        with pytest.raises(SystemExit) as exited:
            getattr(cli, command)(
                [
                    "--model_name_or_path",
                    path,
                    "--data_path",
                    "data/sft.jsonl",
                    "--output_dir",
                    str(tmp_path / "out"),
                    "--use_cpu",
                ]
            )
        assert exited.value.code == 2 and capsys.readouterr().err.startswith(f"error: {error}")
