"""Hub publishing without network: huggingface_hub's HfApi is faked at its boundary (create_repo /
create_commit / upload_folder), and the fake reads every file of the commit while it still exists."""

import json
import os
import types
from unittest import mock

import huggingface_hub
import pytest
from huggingface_hub import ModelCard

from conftest import ROOT, TOKENIZER_DIR, load_script, model_dir, tiny_model

CODE_FILES = {"configuration_minimind.py", "modeling_minimind.py"}


class FakeHub:
    """Records create_repo calls and the content of every committed file."""

    def __init__(self):
        self.repos, self.commits = [], []

    def patches(self):
        hub = self

        def create_repo(api, repo_id, **kwargs):
            hub.repos.append((repo_id, kwargs))
            return types.SimpleNamespace(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

        def create_commit(api, repo_id, operations, **kwargs):
            files = {}
            for op in operations:
                with op.as_file() as f:
                    files[op.path_in_repo] = f.read()
            hub.commits.append({"repo_id": repo_id, "files": files, **kwargs})
            return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0", oid="0")

        def upload_folder(api, **kwargs):
            raise AssertionError("expected a single create_commit, not upload_folder")

        return [
            mock.patch.object(huggingface_hub.HfApi, "create_repo", create_repo),
            mock.patch.object(huggingface_hub.HfApi, "create_commit", create_commit),
            mock.patch.object(huggingface_hub.HfApi, "upload_folder", upload_folder),
        ]

    def __enter__(self):
        self._active = self.patches()
        for patch in self._active:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in reversed(self._active):
            patch.stop()


def _trained_model_dir(path):
    """A model directory as a Trainer run leaves it: model + tokenizer + training records + leftovers."""
    model = model_dir(path)
    (path / "trainer_state.json").write_text(
        json.dumps(
            {
                "global_step": 120,
                "epoch": 2.0,
                "max_steps": 120,
                "num_train_epochs": 2,
                "train_batch_size": 8,
                "log_history": [
                    {"loss": 5.25, "step": 60},
                    {"loss": 3.14159, "step": 120},
                    {"eval_loss": 3.5, "step": 120},
                ],
            }
        )
    )
    (path / "training_args.json").write_text(json.dumps({"learning_rate": 0.0005, "gradient_accumulation_steps": 2}))
    (path / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n a plot")
    (path / "optimizer.pt").write_bytes(b"not for the hub")
    (path / "checkpoint-60").mkdir()
    (path / "checkpoint-60" / "model.safetensors").write_bytes(b"intermediate")
    return model


def test_push_uploads_exact_files_and_card(tmp_path):
    """Push script uploads exact file set and model card."""
    model = _trained_model_dir(tmp_path / "run")
    with FakeHub() as hub:
        load_script("push_to_hub").main(
            ["--model_name_or_path", str(tmp_path / "run"), "--repo_id", "someone/minimind-tiny", "--private"]
        )

    assert [repo for repo, _ in hub.repos] == ["someone/minimind-tiny"]
    assert hub.repos[0][1]["private"] is True and hub.repos[0][1]["exist_ok"] is True
    (commit,) = hub.commits
    files = commit["files"]
    assert (
        set(files)
        == {
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "loss_curve.png",
            "README.md",
        }
        | CODE_FILES
    )
    assert files["loss_curve.png"] == (tmp_path / "run" / "loss_curve.png").read_bytes()
    config = json.loads(files["config.json"])
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_minimind.MiniMindForCausalLM"
    assert files["modeling_minimind.py"] == open(os.path.join(ROOT, "modeling_minimind.py"), "rb").read()
    assert "<|im_start|>" in files["chat_template.jinja"].decode()

    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.license == "apache-2.0"
    assert card.data.tags == ["minimind", "qwen3", "custom_code", "text-generation"]
    assert "(dense)" in card.text and "(mixture of experts)" not in card.text
    text = card.text
    assert "| `hidden_size` | 64 |" in text and "| `num_hidden_layers` | 2 |" in text
    parameters = sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once
    assert f"**Parameters:** {parameters:,}" in text
    assert "| `global_step` | 120 |" in text and "| `final training loss` | 3.1416 |" in text
    assert "| `final eval loss` | 3.5 |" in text and "| `learning_rate` | 0.0005 |" in text
    assert "![Training and eval loss against steps](loss_curve.png)" in text
    assert 'AutoModelForCausalLM.from_pretrained("someone/minimind-tiny", trust_remote_code=True)' in text


def test_push_separate_tokenizer_and_unknowns(tmp_path):
    """Push with separate tokenizer and unknown training."""
    tiny_model(vocab_size=6400).save_pretrained(tmp_path / "bare")
    with FakeHub() as hub:
        load_script("push_to_hub").main(
            [
                "--model_name_or_path",
                str(tmp_path / "bare"),
                "--repo_id",
                "a/b",
                "--tokenizer_name_or_path",
                TOKENIZER_DIR,
                "--license",
                "mit",
            ]
        )
    files = hub.commits[0]["files"]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(files)
    card = ModelCard(files["README.md"].decode())
    assert card.data.license == "mit"
    assert "## Training\n\nUnknown" in card.text


def test_push_refuses_incomplete_directory(tmp_path, capsys):
    """Push refuses incomplete directory listing every problem."""
    tiny_model().save_pretrained(tmp_path / "m")
    os.remove(tmp_path / "m" / "generation_config.json")
    os.remove(tmp_path / "m" / "modeling_minimind.py")
    capsys.readouterr()
    with FakeHub() as hub, pytest.raises(SystemExit) as exited:
        load_script("push_to_hub").main(["--model_name_or_path", str(tmp_path / "m"), "--repo_id", "a/b"])
    assert exited.value.code == 2
    d = tmp_path / "m"
    tokenizer_fix = "(pass --tokenizer_name_or_path tokenizer/ or save the tokenizer into the model directory)"
    assert (
        capsys.readouterr().err
        == "error: "
        + "\n- ".join(
            [
                f"Cannot publish {d}:",
                "auto_map names MiniMindModel, MiniMindForCausalLM, MiniMindForQuestionAnswering, "
                "MiniMindForSequenceClassification, MiniMindForTokenClassification "
                f"but modeling_minimind.py is not in {d}",
                "no generation_config.json (save_pretrained of the model writes it)",
                f"no tokenizer.json in {d} {tokenizer_fix}",
                f"no tokenizer_config.json in {d} {tokenizer_fix}",
            ]
        )
        + "\n"
    )
    assert not hub.repos and not hub.commits  # nothing created before the check


def test_push_dry_run_sends_nothing(tmp_path, capsys):
    """Push dry run lists every file and sends nothing."""
    _trained_model_dir(tmp_path / "run")
    with FakeHub() as hub:
        plan = load_script("push_to_hub").main(
            ["--model_name_or_path", str(tmp_path / "run"), "--repo_id", "someone/minimind-tiny", "--dry_run"]
        )
    assert not hub.repos and not hub.commits
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "loss_curve.png",
        "README.md",
    } | CODE_FILES
    assert set(plan) == expected
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "would upload to someone/minimind-tiny (nothing sent):"
    assert {line.split()[0] for line in lines[1:-1]} == expected
    sizes = {line.split()[0]: line.split()[1] for line in lines[1:-1]}
    assert sizes["model.safetensors"] == f"{(tmp_path / 'run' / 'model.safetensors').stat().st_size:,}"
    total = sum(len(v) if isinstance(v, bytes) else v.stat().st_size for v in plan.values())
    assert lines[-1] == f"  {len(expected)} files, {total:,} bytes"
    assert b"someone/minimind-tiny" in plan["README.md"]


@pytest.mark.parametrize("path", ["runs/missing", "{tmp}/missing"])
def test_push_of_a_missing_directory_is_one_line(tmp_path, capsys, path):
    path = path.format(tmp=tmp_path)
    with FakeHub() as hub, pytest.raises(SystemExit) as exited:
        load_script("push_to_hub").main(["--model_name_or_path", path, "--repo_id", "a/b"])
    assert (exited.value.code, capsys.readouterr().err) == (2, f"error: no such directory: {path}\n")
    assert not hub.repos


def test_push_offline_fails_in_one_line(tmp_path, capsys, monkeypatch):
    """Push offline fails in one line naming the repo."""
    _trained_model_dir(tmp_path / "run")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        load_script("push_to_hub").main(
            ["--model_name_or_path", str(tmp_path / "run"), "--repo_id", "a/b", "--token", "hf_fake"]
        )
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: could not publish to a/b on the Hub (")
    assert err.endswith(
        "). Fix: check the network, HF_HUB_OFFLINE and your token (hf auth login); --dry_run shows "
        "what would be uploaded\n"
    )


def test_push_passes_token_and_message(tmp_path):
    """Push passes the token and commit message and cards MoE models."""
    model_dir(tmp_path / "moe", use_moe=True, num_experts=4, num_experts_per_tok=2)
    with FakeHub() as hub:
        load_script("push_to_hub").main(
            ["--model_name_or_path", str(tmp_path / "moe"), "--repo_id", "a/moe", "--token", "hf_test_token"]
        )
    ((repo_id, repo_kwargs),) = hub.repos
    (commit,) = hub.commits
    assert (repo_id, repo_kwargs["token"]) == ("a/moe", "hf_test_token")
    assert (commit["commit_message"], commit["token"]) == ("Upload MiniMind model", "hf_test_token")
    card = ModelCard(commit["files"]["README.md"].decode())
    assert card.data.tags == ["minimind", "qwen3", "custom_code", "text-generation", "moe"]
    assert "(mixture of experts)" in card.text and "(dense)" not in card.text


def test_model_push_to_hub_commits_all():
    """model.push_to_hub commits code, config and safetensors."""
    model = tiny_model()
    with (
        FakeHub() as hub,
        mock.patch(
            "transformers.utils.hub.create_and_tag_model_card",
            return_value=ModelCard("---\nlibrary_name: transformers\n---\n"),
        ),
    ):
        model.push_to_hub("someone/tiny")
    (commit,) = hub.commits
    assert commit["repo_id"] == "someone/tiny"
    assert {"config.json", "model.safetensors"} | CODE_FILES <= set(commit["files"])
    auto_map = json.loads(commit["files"]["config.json"])["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_minimind.MiniMindConfig"
    assert auto_map["AutoModelForCausalLM"] == "modeling_minimind.MiniMindForCausalLM"


def test_model_card_title_and_scaled_rope(tmp_path):
    """Model card is titled by the repo name and lists a scaled rope."""
    from minimind.hub import build_model_card

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    model_dir(tmp_path / "m", rope_parameters=rope)
    card = build_model_card(tmp_path / "m", "someone/my-minimind")
    assert card.text.lstrip().startswith("# my-minimind\n")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())["rope_parameters"]
    assert f"| `rope_parameters` | {json.dumps(saved)} |" in card.text
    model_dir(tmp_path / "plain")
    assert "rope_parameters" not in build_model_card(tmp_path / "plain", "someone/plain").text
