"""Shared test set-up: offline Hub, the repo root importable, tiny configs."""

import atexit
import contextlib
import mmap
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path


def suite_directory(variable: str, prefix: str) -> str:
    """The directory `variable` names: one set by the caller is used as it is; else a fresh temporary directory,
    removed when the process that made it exits (the pytest process; its xdist workers inherit the variable)."""
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, os.environ[variable], ignore_errors=True)
    return os.environ[variable]


os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Remote-code modules are copied here on load; keep them out of the user's cache.
suite_directory("HF_MODULES_CACHE", "minimind-hf-modules-")
# Tokenized data and compiled decode steps are cached per run of the suite, never in the user's cache.
suite_directory("MINIMIND_CACHE", "minimind-cache-")

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


@pytest.fixture(autouse=True)
def no_decode_step_left_building():
    """A command run in-process (chat, the page) may return while its decode step is still being built in a
    background thread; the next test must not trace beside it."""
    yield
    compiled = sys.modules.get("minimind.decode.compiled")  # not imported where the decoders never ran
    for thread in threading.enumerate() if compiled else ():
        if thread.name == compiled.PREPARE_THREAD:
            thread.join()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a whole module: `pytestmark = pytest.mark.usefixtures("one_thread")` there."""
    with torch_threads(1):
        yield


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: costs more than 30 s on 2 CPU cores; deselect with -m 'not slow'")


# The modules that take longest (50-150 s each on 2 cores, more with a cold inductor cache: compiled decoding and its
# kernels, every documented command, the browser, the peers' table) start first, so that `make test`'s workers, which
# take one module at a time in collection order, finish together instead of one starting a long module last. Basenames:
# each is unique across tests/.
LONGEST_MODULES = (
    "test_compiled.py",  # decode/
    "test_kernels.py",  # decode/
    "test_docs.py",  # docs/
    "test_web.py",  # chat/
    "test_peers.py",  # bench/
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


# The training commands' flags for tiny_config()'s shape (its vocabulary aside: the commands take the tokenizer's).
TINY_MODEL = [
    "--hidden_size",
    "64",
    "--num_hidden_layers",
    "2",
    "--num_attention_heads",
    "4",
    "--num_key_value_heads",
    "2",
    "--intermediate_size",
    "96",
]


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


def head(src, dst, n):
    """The first `n` lines of the file `src` written to `dst`; returns `dst` as a string."""
    lines = Path(src).read_text(encoding="utf-8").splitlines(keepends=True)[:n]
    Path(dst).write_text("".join(lines), encoding="utf-8")
    return str(dst)


def decode_uncompiled(monkeypatch):
    """Every `CompiledDecoder` made from here on runs its loop uncompiled: for tests of the commands around it,
    where each compilation would cost seconds (tests/decode/test_compiled.py covers the compiled step)."""
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


# --------------------------------------------------------------------------------------------------------------
# Upstream MiniMind's transformers-format directories (export/test_upstream.py; docs/test_docs.py makes one too)
# --------------------------------------------------------------------------------------------------------------


def current_config(model):
    """config.json as upstream's current MiniMindConfig writes it: MiniMind's field names, plus dropout and
    upstream's own auto_map and architectures."""
    c = model.config
    return {
        "architectures": ["MiniMindForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "model_minimind.MiniMindForCausalLM"},
        "model_type": "minimind",
        "dtype": "float32",
        "transformers_version": "4.57.1",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "use_moe": c.use_moe,
        "dropout": 0.0,
        "vocab_size": c.vocab_size,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "flash_attn": True,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "inference_rope_scaling": False,
        "rope_scaling": None,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size,
        "norm_topk_prob": c.norm_topk_prob,
        "router_aux_loss_coef": 5e-4,
    }


def upstream_dir(path, model, config, head_name_only=False, dtype=None, tokenizer=True):
    """Write `model` as an upstream directory: its tensors under upstream's names (MiniMind's), a tied pair stored
    once (under the embedding's name, or under the head's as transformers 4 may keep it), `config` as
    config.json, and the bundled tokenizer standing in for upstream's."""
    import json
    import shutil

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().clone().to(dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("model.embed_tokens.weight" if head_name_only else "lm_head.weight")
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copy(os.path.join(TOKENIZER_DIR, name), path)
    return path


# --------------------------------------------------------------------------------------------------------------
# Compiled decoding against `generate` (decode/test_compiled.py, decode/test_kernels.py)
# --------------------------------------------------------------------------------------------------------------

PROMPT = torch.tensor([[5, 17, 3, 42, 8, 11, 29]])
NO_EOS = 96  # an id these runs never produce, so both sides run to max_new_tokens (the tiny config's eos is 2)
BATCH = torch.tensor([[5, 17, 3, 42, 8, 11, 29], [9, 9, 1, 2, 60, 7, 7], [33, 4, 4, 81, 12, 5, 70]])


def reference(model, new, **kwargs):
    with torch.no_grad():
        return model.generate(
            PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            max_new_tokens=new,
            pad_token_id=0,
            **{"eos_token_id": NO_EOS, **kwargs},
        )


def greedy(**kwargs):
    return dict(do_sample=False, temperature=None, top_p=None, top_k=None, **{"eos_token_id": NO_EOS, **kwargs})


def batch_reference(model, new, batch=BATCH, **kwargs):
    with torch.no_grad():
        return model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new, **kwargs)


def resident_kb(tensor) -> int:
    """Resident kB of the pages under `tensor`'s storage (page by page: the kernel merges adjacent mappings, so
    /proc/self/smaps cannot tell one tensor's mapping from its neighbours')."""
    from minimind.decode.memory import resident_pages

    storage = tensor.untyped_storage()
    start = storage.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    pages = resident_pages(start, storage.data_ptr() + storage.nbytes() - start)
    if pages is None:
        raise OSError("mincore failed")
    return mmap.PAGESIZE // 1024 * sum(pages)


def mapping_holding(address: int) -> dict:
    """The /proc/self/smaps entry of the mapping that holds `address`: its kB fields as ints ("AnonHugePages") and
    its flags as a set ("VmFlags": "hg" where it was advised for huge pages)."""
    entry = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms offset dev inode [path]"
                start, end = (int(bound, 16) for bound in head.split("-"))
                entry = {} if start <= address < end else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = set(value.split()) if key == "VmFlags" else int(value.split()[0])
                if key == "VmFlags":
                    return entry
    raise LookupError(f"no mapping holds {address:#x}")


def transparent_huge_pages() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"; "" where it has none)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return setting.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return ""


def collapses_memory() -> bool:
    """Whether this kernel can move written memory into huge pages (`MADV_COLLAPSE`: Linux 6.1, huge pages on)."""
    release = tuple(int(part) for part in os.uname().release.split("-")[0].split(".")[:2])
    return release >= (6, 1) and transparent_huge_pages() not in ("", "never")


def pages_holding(tensor, positions: int) -> int:
    """How many 4 kB pages hold the first `positions` positions of every [B, heads] row of a [B, heads, L, D] cache
    tensor that starts on a page."""
    batch, heads, length, dim = tensor.shape
    row, written = length * dim * tensor.element_size(), positions * dim * tensor.element_size()
    pages = {offset // 4096 for r in range(batch * heads) for offset in range(r * row, r * row + written, 4096)}
    pages |= {(r * row + written - 1) // 4096 for r in range(batch * heads)}
    return len(pages)
