"""The documentation stays true: every command that README.md or docs/ show (`minimind-X ...` or
`python scripts/X.py ...`) runs as written, in-process, in a scratch directory where its relative paths land.

Where the written command would run long it is made tiny instead: training commands get one step on a tiny model
and a slice of the bundled data (flags appended, so they override the written ones); upstream checkpoints to
import are tiny. Commands that need a network (the Hub) or a GPU and the five-minute demo (tests/docs/test_demo.py
runs it at toy size) are parsed and stop where the work would start; each says why. The benchmark is not an
installed command: tests/bench/test_main_table.py parses each `python -m bench ...` the docs show and runs its quick
mode.
"""

import ast
import glob
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from conftest import (
    ROOT,
    TINY_MODEL,
    TOKENIZER_DIR,
    current_config,
    decode_uncompiled,
    head,
    load_script,
    model_dir,
    tiny_model,
    torch_threads,
    upstream_dir,
)

DOCS = [
    os.path.join(ROOT, "README.md"),
    os.path.join(ROOT, "data", "README.md"),
    *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))),
]
# A command runs up to the end of its code span, a table cell or a comment. "you/minimind-sft" is a repo id.
COMMAND = re.compile(r"(?:python scripts/(\w+)\.py|(?<![\w/.-])minimind-([a-z][a-z-]*))([^`\n|#]*)")
EXAMPLES = ("quickstart", "make_data")  # scripts that are examples and tools, not installed commands


def declared_commands():
    """setup.py's COMMANDS: {installed name: minimind.cli function}."""
    tree = ast.parse(Path(ROOT, "setup.py").read_text(encoding="utf-8"))
    node = next(node for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "COMMANDS")
    return {f"minimind-{name}": function for name, function in ast.literal_eval(node.value).items()}


DECLARED = declared_commands()


def documented_commands():
    """[(program, argv)] in the order the docs show them, each distinct command once. `program` is a scripts/
    file or an installed command, as written. In a table a bare command is a name, not a command line: its argv
    is ("--help",)."""
    commands = {}
    for path in DOCS:
        text = Path(path).read_text(encoding="utf-8").replace("\\\n", " ")  # shell line continuations
        for match in COMMAND.finditer(text):
            script, installed, rest = match.groups()
            program = f"scripts/{script}.py" if script else f"minimind-{installed}"
            if program not in DECLARED and not script:
                continue  # a name such as minimind-tiny
            in_table = text[: match.start()].rpartition("\n")[2].startswith("|")
            argv = tuple(shlex.split(rest)) or (("--help",) if in_table else ())
            commands.setdefault((program, argv), None)
    return list(commands)


COMMANDS = documented_commands()


def test_every_command_is_installed_and_documented():
    """setup.py's console scripts are the installed ones, each resolves to its minimind.cli function, the scripts/
    wrappers run exactly those functions, and the docs show every command."""
    installed = {e.name: e for e in entry_points(group="console_scripts") if e.name.startswith("minimind-")}
    assert {name: e.value for name, e in installed.items()} == {
        name: f"minimind.cli:{function}" for name, function in DECLARED.items()
    }, "the installed commands are not setup.py's. Fix: pip install -e . --no-deps"
    functions = {e.load() for e in installed.values()}
    assert {f.__name__ for f in functions} == set(DECLARED.values())
    wrappers = {
        load_script(os.path.basename(p)[:-3]).main
        for p in glob.glob(os.path.join(ROOT, "scripts", "*.py"))
        if os.path.basename(p)[:-3] not in EXAMPLES
    }
    assert wrappers == functions  # the same function objects: one implementation per command
    shown = {program for program, _ in COMMANDS}
    missing = [name for name in [*DECLARED, *(f"scripts/{name}.py" for name in EXAMPLES)] if name not in shown]
    assert not missing, f"not shown in README.md or docs/: {missing}"


def test_an_installed_command_runs_as_a_program(workspace):
    """An installed command in a fresh process, called the way its console script calls it,
    `sys.exit(entry_point())`: a command that makes something exits 0 (a returned object would reach sys.exit and
    become exit status 1)."""
    console_script = (
        "import sys; from importlib.metadata import entry_points; "
        "sys.exit(next(iter(entry_points(group='console_scripts', name='minimind-export'))).load()())"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            console_script,
            "--to",
            "qwen3",
            "--model_name_or_path",
            "runs/sft",
            "--output_dir",
            "runs/sft-qwen3-process",
        ],
        cwd=workspace,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote runs/sft-qwen3-process" in result.stdout and (workspace / "runs/sft-qwen3-process").is_dir()


def command_function(program):
    """The function a documented program runs: an installed command's entry point or a scripts/ file's main."""
    if program.startswith("minimind-"):
        commands = entry_points(group="console_scripts", name=program)
        assert commands, f"{program} is not installed. Fix: pip install -e . --no-deps"
        return next(iter(commands)).load()
    return load_script(program[len("scripts/") : -len(".py")]).main


# --------------------------------------------------------------------------------------------------------------
# The scratch directory
# --------------------------------------------------------------------------------------------------------------


def upstream_pth(path, model):
    """A model saved the way upstream MiniMind saves one: a plain state dict."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)


UPSTREAM_TINY = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Where the commands run. It holds what they expect to find: a trained-model directory `runs/sft` (tiny, with
    the bundled tokenizer), `tokenizer/`, upstream checkpoints and their settings file, and data slices."""
    root = tmp_path_factory.mktemp("docs")
    for path in (
        "runs/sft",
        "runs/demo/pretrain",
        "runs/demo/sft",
        "out/pretrain",
        "out/sft",
    ):  # training overwrites out/
        model_dir(root / path, std=0.3, max_position_embeddings=4096)  # the serve command asks for 2048
    shutil.copytree(TOKENIZER_DIR, root / "tokenizer")
    dense = tiny_model(qk_norm=False)
    for name in ("full_sft_768.pth", "out/full_sft_768.pth"):
        upstream_pth(root / name, dense)
    upstream_pth(root / "out" / "full_sft_640_moe.pth", tiny_model(use_moe=True, num_experts=4))
    (root / "upstream_config.json").write_text(json.dumps({**UPSTREAM_TINY, "use_moe": True, "n_routed_experts": 4}))
    # an upstream transformers-format directory
    upstream_dir(root / "MiniMind2", tiny_model(), current_config(tiny_model()))
    slices = root / "slices"
    slices.mkdir()
    for kind, rows in (("pretrain", 60), ("sft", 24), ("dpo", 8)):
        head(os.path.join(ROOT, "data", f"{kind}.jsonl"), slices / f"{kind}.jsonl", rows)
    return root


@pytest.fixture
def in_workspace(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    with torch_threads(1):
        yield workspace


# --------------------------------------------------------------------------------------------------------------
# How each command runs
# --------------------------------------------------------------------------------------------------------------

ONE_STEP = [
    "--max_steps",
    "1",
    "--max_seq_length",
    "64",
    "--per_device_train_batch_size",
    "2",
    "--per_device_eval_batch_size",
    "2",
    "--logging_steps",
    "1",
    "--save_strategy",
    "no",
    "--report_to",
    "none",
    "--disable_tqdm",
    "true",
]
DATA_KIND = {"pretrain": "pretrain", "sft": "sft", "lora": "sft", "dpo": "dpo", "reward": "dpo", "distill": "sft"}


def run_training(main, name, argv, workspace):
    if "..." in argv:  # "the documented command, plus": the first pretraining command shown
        first = next(
            a
            for p, a in COMMANDS
            if command_function(p).__name__ == "pretrain" and "--output_dir" in a and "..." not in a
        )
        argv = [*first, *[a for a in argv if a != "..."]]
    tiny = [] if "--model_name_or_path" in argv else TINY_MODEL  # a new model: tiny
    data = ["--data_path", str(workspace / "slices" / f"{DATA_KIND[name]}.jsonl")]
    trainer, metrics = main([*argv, *ONE_STEP, *tiny, *data])
    assert trainer.state.global_step == 1 and metrics["train_runtime"] > 0
    assert (Path(trainer.args.output_dir) / ("adapter_config.json" if name == "lora" else "config.json")).is_file()


def run_command(program, argv, workspace, monkeypatch, capfd):
    main = command_function(program)
    name = main.__name__ if main.__module__.startswith("minimind.cli") else program[len("scripts/") : -len(".py")]
    if argv == ("--help",):
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        assert exit_info.value.code == 0 and "usage:" in capfd.readouterr().out
        return
    if name in DATA_KIND:
        return run_training(main, name, list(argv), workspace)
    if name == "demo":  # five minutes of training: tests/docs/test_demo.py runs it at toy size
        import minimind.demo

        settings = []
        monkeypatch.setattr(minimind.demo, "run_demo", settings.append)
        main(list(argv))
        assert settings[0].pretrain_steps > 0
    elif name == "push_to_hub":  # needs the Hub: parsed, then stopped where the upload would start
        import minimind.hub

        calls = []
        monkeypatch.setattr(minimind.hub, "push_model_dir", lambda *args, **kwargs: calls.append(args))
        result = main(list(argv))
        if "--dry_run" in argv:  # the plan is made for real; nothing would be sent
            assert not calls and "README.md" in result and "model.safetensors" in result
        else:
            assert calls[0] == (argv[argv.index("--model_name_or_path") + 1], argv[argv.index("--repo_id") + 1])
    elif name == "web":  # the page runs until stopped: built, not served
        pytest.importorskip("gradio")
        import minimind.web

        launched = []
        monkeypatch.setattr(minimind.web, "launch", lambda app, host, port, auth: launched.append((host, port)))
        main(list(argv))
        host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
        assert launched == [(host, int(argv[argv.index("--port") + 1]) if "--port" in argv else 7860)]
    elif name == "serve":  # a server runs until stopped: one request instead
        from starlette.testclient import TestClient

        import minimind.serving

        served = []
        monkeypatch.setattr(minimind.serving, "serve", lambda app, host, port: served.append((app, host, port)))
        main(list(argv))
        app, host, port = served[0]
        assert (host, port) == (
            argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1",
            int(argv[argv.index("--port") + 1]) if "--port" in argv else 8000,
        )
        model = argv[argv.index("--served_model_name") + 1] if "--served_model_name" in argv else "sft"
        key = {"Authorization": f"Bearer {argv[argv.index('--api_key') + 1]}"} if "--api_key" in argv else {}
        response = TestClient(app).post(
            "/v1/chat/completions",
            headers=key,
            json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        )
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] > 0
    elif name == "chat":  # interactive: one line on stdin, then end of input
        decode_uncompiled(monkeypatch)
        monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
        main(list(argv))
        assert "MiniMind chat." in capfd.readouterr().out
    elif name == "make_data":  # into the workspace: as written, the first rewrites the repo's data/
        out = argv[argv.index("--out_dir") + 1].strip("/").replace("/", "-") if "--out_dir" in argv else "data"
        main([*argv, "--out_dir", str(workspace / out)])
        if "--seed" not in argv:  # the default seed makes the bundled files, byte for byte
            for kind in ("pretrain", "sft", "dpo", "sft_reasoning"):
                assert (workspace / out / f"{kind}.jsonl").read_bytes() == Path(
                    ROOT, "data", f"{kind}.jsonl"
                ).read_bytes()
    elif name == "train_tokenizer":
        extra = [] if "--output_dir" in argv else ["--output_dir", "tokenizer"]  # not over the repo's own
        main([*argv, *extra])
        # The bundled tokenizer is this command's output on the bundled data, byte for byte.
        assert (workspace / "tokenizer" / "tokenizer.json").read_bytes() == Path(
            TOKENIZER_DIR, "tokenizer.json"
        ).read_bytes()
    elif name == "convert":  # the upstream checkpoints in the workspace are tiny
        from_json = "--config_json" in argv
        size = [] if from_json else [item for key, value in UPSTREAM_TINY.items() for item in (f"--{key}", str(value))]
        model = main([*argv, *size])
        assert model.config.use_moe == from_json
    elif name == "export":
        assert Path(main(list(argv))).exists()
    else:  # quickstart: exactly as written
        main(list(argv))


@pytest.mark.parametrize("program, argv", COMMANDS, ids=[f"{p} {' '.join(a)}"[:80] for p, a in COMMANDS])
def test_documented_command_runs(program, argv, in_workspace, monkeypatch, capfd):
    run_command(program, argv, in_workspace, monkeypatch, capfd)


def test_documented_model_paths_are_written_first():
    """A model directory that README.md or docs/ pass to a command is one `make demo` writes or one an earlier
    documented command writes (its --output_dir), so a reader who runs them in order finds every path."""
    import minimind.demo

    demo_dir = re.search(r"--output_dir (\S+)", Path(ROOT, "Makefile").read_text()).group(1)
    assert minimind.demo.DemoSettings().output_dir == demo_dir
    written = {f"{demo_dir}/pretrain", f"{demo_dir}/sft"}
    unwritten = []
    for program, argv in COMMANDS:
        for flag in ("--model_name_or_path", "--teacher_name_or_path"):
            if flag not in argv or (program == "minimind-convert" and "upstream-hf" in argv):
                continue  # an upstream directory to import is the reader's own
            path = argv[argv.index(flag) + 1].rstrip("/")
            if path not in written:
                unwritten.append(f"{program} {flag} {path}")
        if "--output_dir" in argv:
            written.add(argv[argv.index("--output_dir") + 1].rstrip("/"))
    assert not unwritten, f"paths that neither make demo nor an earlier documented command writes: {unwritten}"
