"""transformers' own common model tests run on MiniMind, with Qwen3 and Qwen3-MoE alongside as the reference.

The contract: every test of `ModelTesterMixin` (plus `ConfigTester` and `TrainingTesterMixin`'s overfit run) that
passes for Qwen3ForCausalLM passes for MiniMindForCausalLM, heads MiniMind does not have aside. The test sources
are transformers' and never enter this repository: they are fetched at test time from the sdist of the installed
transformers release (`pip download`) into `.cache/transformers-tests/` (git-ignored) and imported from there.
What is ours: the tiny tester below, the auto-class registration an in-tree model gets from transformers' tables,
and stand-ins for the three modules the sdist does not ship (`tests/exporters`, `tests/generation`,
`tests/utils`), so transformers' export and generate suites do not run here.

Opt-in: `make test-transformers-common` (40 s on 2 quiet cores, up to 6 minutes on busy ones), or
`MINIMIND_TRANSFORMERS_COMMON=1 pytest tests/model/test_transformers_common.py`. Without PyPI the module is skipped,
saying why.
"""

import contextlib
import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import unittest
from pathlib import Path
from unittest import mock

import pytest
import transformers

from conftest import ROOT

PACKAGE = "transformers_sdist_tests"  # the sdist's tests/*.py, importable under this name
VERSION = transformers.__version__

if os.environ.get("MINIMIND_TRANSFORMERS_COMMON") != "1":
    pytest.skip("opt-in (minutes on 2 cores): make test-transformers-common", allow_module_level=True)
pytest.importorskip("parameterized", reason="transformers' common tests need `pip install parameterized`")


def fetch_test_sources():
    """The directory holding `transformers_sdist_tests/` for the installed release: the sdist's top-level
    tests/*.py, downloaded once with pip and cached. Raises RuntimeError saying why it cannot."""
    cache = Path(os.environ.get("MINIMIND_TRANSFORMERS_TESTS_CACHE", Path(ROOT, ".cache", "transformers-tests")))
    root = cache / VERSION
    if (root / PACKAGE / "test_modeling_common.py").exists():
        return root
    sdist = root / f"transformers-{VERSION}.tar.gz"
    if not sdist.exists():
        root.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            "transformers",
            f"transformers=={VERSION}",
            "-d",
            str(root),
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`{' '.join(command)}` took over 300 s") from None
        if done.returncode or not sdist.exists():
            raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()[-400:]}")
    prefix = f"transformers-{VERSION}/tests/"
    with tarfile.open(sdist) as tar, tempfile.TemporaryDirectory(dir=root) as tmp:
        members = [
            m
            for m in tar.getmembers()
            if m.isfile() and m.name.startswith(prefix) and "/" not in m.name[len(prefix) :]
        ]
        if not any(m.name.endswith("/test_modeling_common.py") for m in members):
            raise RuntimeError(f"{sdist.name} has no tests/test_modeling_common.py")
        for member in members:
            member.name = member.name[len(prefix) :]
            tar.extract(member, Path(tmp) / PACKAGE, filter="data")
        (Path(tmp) / PACKAGE / "__init__.py").write_text("")
        os.replace(Path(tmp) / PACKAGE, root / PACKAGE)
    return root


def import_test_sources(root):
    """Import the sdist's test_modeling_common, test_configuration_common and test_training_mixin, with our
    stand-ins for the modules they import that the sdist leaves out."""
    stand_ins = {
        "exporters.test_export": {"ExportTesterMixin": type("ExportTesterMixin", (), {})},
        "generation.test_utils": {"GenerationTesterMixin": type("GenerationTesterMixin", (), {})},
        # ConfigTester checks that these PreTrainedConfig fields, given non-default values, stick.
        "utils.test_configuration_utils": {
            "config_common_kwargs": {
                "return_dict": False,
                "output_hidden_states": True,
                "output_attentions": True,
                "dtype": "float16",
                "chunk_size_feed_forward": 3,
                "architectures": ["SomeModel"],
                "id2label": {0: "no", 1: "yes"},
                "label2id": {"no": 0, "yes": 1},
                "problem_type": "single_label_classification",
            }
        },
    }
    sys.path.insert(0, str(root))
    for dotted, attributes in stand_ins.items():
        parent, _ = dotted.split(".")
        sys.modules.setdefault(f"{PACKAGE}.{parent}", types.ModuleType(f"{PACKAGE}.{parent}"))
        module = types.ModuleType(f"{PACKAGE}.{dotted}")
        module.__dict__.update(attributes)
        sys.modules[f"{PACKAGE}.{dotted}"] = module
    return [
        importlib.import_module(f"{PACKAGE}.{name}")
        for name in ("test_modeling_common", "test_configuration_common", "test_training_mixin")
    ]


try:
    common, config_common, training = import_test_sources(fetch_test_sources())
except Exception as error:  # offline, no sdist for this version (a dev build), a changed layout
    pytest.skip(f"transformers {VERSION}'s test sources are unavailable: {error}", allow_module_level=True)

import torch  # noqa: E402
from transformers import (  # noqa: E402
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForQuestionAnswering,
    Qwen3ForSequenceClassification,
    Qwen3ForTokenClassification,
    Qwen3Model,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3MoeForQuestionAnswering,
    Qwen3MoeForSequenceClassification,
    Qwen3MoeForTokenClassification,
    Qwen3MoeModel,
)
from transformers.models.auto import configuration_auto, modeling_auto  # noqa: E402

from configuration_minimind import MiniMindConfig  # noqa: E402
from modeling_minimind import (  # noqa: E402
    MiniMindForCausalLM,
    MiniMindForQuestionAnswering,
    MiniMindForSequenceClassification,
    MiniMindForTokenClassification,
    MiniMindModel,
)


class TinyDecoderTester:
    """The tiny config and inputs ModelTesterMixin asks its `model_tester` for; one set of sizes for every model
    here, with grouped-query attention (4 query heads, 2 key/value heads)."""

    batch_size = 13
    seq_length = 7
    is_training = True
    sizes = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=37,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )

    def __init__(self, parent, config_class, causal_lm_class, **config_kwargs):
        self.parent = parent
        self.config_class = config_class
        self.causal_lm_class = causal_lm_class  # what TrainingTesterMixin trains
        self.config_kwargs = {**self.sizes, **config_kwargs}
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            setattr(self, name, self.config_kwargs[name])

    def get_config(self):
        return self.config_class(**self.config_kwargs)

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        # Rows with 1..T attended tokens (the later rows whole): padded and unpadded rows in one batch.
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class CommonModelTests(common.ModelTesterMixin, training.TrainingTesterMixin):
    """The mixins' tests for one model family; subclasses name the classes (base model, then causal LM) and any
    config overrides."""

    config_class = None
    config_kwargs = {}
    # test-name prefix -> why the test cannot run here
    skips = {
        "test_generation_tester_mixin_inheritance": "GenerationTesterMixin (tests/generation/test_utils.py) is not "
        "in the transformers sdist"
    }

    def setUp(self):
        for prefix, reason in self.skips.items():
            if self._testMethodName.startswith(prefix):
                self.skipTest(reason)
        causal_lm_class = self.all_model_classes[-1]
        self.model_tester = TinyDecoderTester(self, self.config_class, causal_lm_class, **self.config_kwargs)

    def test_config(self):
        # The shared sizes only: Qwen3-MoE serialises `num_experts` as `num_local_experts`.
        tester = config_common.ConfigTester(self, config_class=self.config_class, **TinyDecoderTester.sizes)
        tester.run_common_tests()


class Qwen3CommonTest(CommonModelTests, unittest.TestCase):
    """The reference: Qwen3's base model, task heads and causal LM (last: the one TrainingTesterMixin trains)."""

    config_class = Qwen3Config
    all_model_classes = (
        Qwen3Model,
        Qwen3ForSequenceClassification,
        Qwen3ForTokenClassification,
        Qwen3ForQuestionAnswering,
        Qwen3ForCausalLM,
    )


class Qwen3MoeCommonTest(CommonModelTests, unittest.TestCase):
    """The reference for the mixture-of-experts variant. Expert sizes are multiples of 8 so that the grouped_mm
    kernel's 16-byte stride rule holds in half precision."""

    config_class = Qwen3MoeConfig
    all_model_classes = (
        Qwen3MoeModel,
        Qwen3MoeForSequenceClassification,
        Qwen3MoeForTokenClassification,
        Qwen3MoeForQuestionAnswering,
        Qwen3MoeForCausalLM,
    )
    config_kwargs = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@contextlib.contextmanager
def minimind_registered():
    """What an in-tree model gets from transformers' auto tables: AutoConfig/AutoModel/AutoModelForCausalLM
    resolve MiniMind, and the tables of class names that the mixin reads (is this the base model? a causal LM,
    whose labels are token ids?) list it."""
    patches = [(configuration_auto.CONFIG_MAPPING._extra_content, {"minimind": MiniMindConfig})]
    for table, model_class in (
        ("MODEL", MiniMindModel),
        ("MODEL_FOR_CAUSAL_LM", MiniMindForCausalLM),
        ("MODEL_FOR_SEQUENCE_CLASSIFICATION", MiniMindForSequenceClassification),
        ("MODEL_FOR_TOKEN_CLASSIFICATION", MiniMindForTokenClassification),
        ("MODEL_FOR_QUESTION_ANSWERING", MiniMindForQuestionAnswering),
    ):
        patches.append((getattr(modeling_auto, f"{table}_MAPPING")._extra_content, {MiniMindConfig: model_class}))
        patches.append((getattr(modeling_auto, f"{table}_MAPPING_NAMES"), {"minimind": model_class.__name__}))
    with contextlib.ExitStack() as stack:
        for table, entries in patches:
            stack.enter_context(mock.patch.dict(table, entries))
        yield


class MiniMindCommonTest(CommonModelTests, unittest.TestCase):
    config_class = MiniMindConfig
    all_model_classes = (
        MiniMindModel,
        MiniMindForSequenceClassification,
        MiniMindForTokenClassification,
        MiniMindForQuestionAnswering,
        MiniMindForCausalLM,
    )
    # The mixin decides "has experts" from the modeling file's source, which serves dense and MoE alike.
    skips = {
        **CommonModelTests.skips,
        "test_eager_matches_batched_and_grouped_inference": "transformers asks the class, which serves dense and MoE "
        "configs alike; a dense model refuses an experts kernel as dense Qwen3 does (test_contract.py), MoE runs this",
    }

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.enterClassContext(minimind_registered())


class MiniMindMoeCommonTest(MiniMindCommonTest):
    skips = CommonModelTests.skips  # experts here: the batched/grouped kernels run
    config_kwargs = dict(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
