"""Shared test set-up: offline Hub, the repo root importable, tiny configs."""

import contextlib
import os
import sys
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Remote-code modules are copied here on load; keep them out of the user's cache.
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="minimind-hf-modules-"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (`make test` runs PYTEST_WORKERS=2 workers) the workers share the cores: OpenMP threads beyond a
# worker's share would spin against the other workers' tests.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // _WORKERS)))


@contextlib.contextmanager
def torch_threads(count):
    """A block with `count` intra-op threads. Tiny models gain nothing from a second thread, and on a loaded 2-core
    machine OpenMP threads spinning against other jobs make each step many times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: costs more than 30 s on 2 CPU cores; deselect with -m 'not slow'")


# The modules that take longest (50-150 s each on 2 cores, more with a cold inductor cache: compiled decoding and its
# kernels, every documented command, the browser, the peers' table) start first, so that `make test`'s workers, which
# take one module at a time in collection order, finish together instead of one starting a long module last.
LONGEST_MODULES = (
    "test_decode.py",
    "test_decode_kernels.py",
    "test_docs.py",
    "test_web.py",
    "test_benchmark_peers.py",
)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONGEST_MODULES)  # stable: the order within stays


def tiny_config(**overrides):
    """A ~100k-parameter MiniMind config: fast on 2 cores, every code path present (GQA, q/k norm)."""
    from configuration_minimind import MiniMindConfig

    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    base.update(overrides)
    return MiniMindConfig(**base)


def tiny_model(seed=0, std=None, **overrides):
    """A tiny model in eval mode; a larger init `std` makes logits sharp, so cache or mask bugs change the
    greedy tokens instead of hiding in near-uniform distributions."""
    from modeling_minimind import MiniMindForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(**({"initializer_range": std} if std else {}), **overrides)
    return MiniMindForCausalLM(config).eval()


TOKENIZER_DIR = os.path.join(ROOT, "tokenizer")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def model_dir(path, std=None, with_tokenizer=True, **overrides):
    """Save a tiny model to `path` as a complete model directory: with the shipped tokenizer (so the vocabulary
    grows to its 6400 tokens), or without one (vocab 97). Returns the model."""
    import shutil

    model = tiny_model(std=std, **({"vocab_size": 6400} if with_tokenizer else {}), **overrides)
    model.save_pretrained(path)
    if with_tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copy(os.path.join(TOKENIZER_DIR, name), path)
    return model


def decode_uncompiled(monkeypatch):
    """Every `CompiledDecoder` made from here on runs its loop uncompiled: for tests of the commands around it,
    where each compilation would cost seconds (tests/test_decode.py covers the compiled step)."""
    from minimind.decode import CompiledDecoder

    init = CompiledDecoder.__init__
    monkeypatch.setattr(CompiledDecoder, "__init__", lambda self, model, compile=True: init(self, model, False))


def load_script(name):
    """A module object for scripts/<name>.py, so tests call its main(argv) in-process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def repo_root():
    return ROOT


def plant_code_dir(path, model_type="planted", marker=None):
    """A directory that asks for code of its own: config.json names `model_type` and, through `auto_map`, classes in
    a module beside it; tokenizer_config.json does the same for its tokenizer. Importing that module writes
    `marker` (default: path/RAN), so a test sees whether anything ran it. Returns the marker's path."""
    import json
    from pathlib import Path

    path, marker = Path(path), Path(marker or Path(path) / "RAN")
    path.mkdir(parents=True, exist_ok=True)
    (path / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig, PreTrainedModel\n"
        "class PlantedConfig(PretrainedConfig):\n"
        f"    model_type = {model_type!r}\n"
        "class PlantedModel(PreTrainedModel):\n"
        "    config_class = PlantedConfig\n"
    )
    auto_map = {"AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"}
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "auto_map": auto_map}))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PlantedTokenizer", "auto_map": {"AutoTokenizer": ["planted.PlantedTokenizer", None]}}
        )
    )
    return marker
