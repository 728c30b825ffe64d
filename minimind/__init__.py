"""MiniMind beyond the model files: data, training, hub, export, serving.

Importing the package registers MiniMind with transformers' Auto classes, so `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` and the task heads' Auto classes build and load MiniMind locally without remote code.
"""

import logging


class _KnownImportNoise(logging.Filter):
    """Drops two warnings every command would otherwise print before its own output, neither of which a user can
    act on: torchao's CUDA-only kernel libraries failing to load on a machine without CUDA, and torch's notice
    that torchao registers its enums with pytree the old way."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            (message.startswith("Failed to load") and "torchao" in message)
            or "is an Enum subclass and is now natively supported" in message
        )


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_KnownImportNoise())

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from configuration_minimind import MiniMindConfig  # noqa: E402
from modeling_minimind import (  # noqa: E402
    MiniMindForCausalLM,
    MiniMindForQuestionAnswering,
    MiniMindForSequenceClassification,
    MiniMindForTokenClassification,
    MiniMindModel,
)

AutoConfig.register(MiniMindConfig.model_type, MiniMindConfig, exist_ok=True)
for _auto_class, _model_class in (
    (AutoModel, MiniMindModel),
    (AutoModelForCausalLM, MiniMindForCausalLM),
    (AutoModelForSequenceClassification, MiniMindForSequenceClassification),
    (AutoModelForTokenClassification, MiniMindForTokenClassification),
    (AutoModelForQuestionAnswering, MiniMindForQuestionAnswering),
):
    _auto_class.register(MiniMindConfig, _model_class, exist_ok=True)

__all__ = [
    "MiniMindConfig",
    "MiniMindModel",
    "MiniMindForCausalLM",
    "MiniMindForSequenceClassification",
    "MiniMindForTokenClassification",
    "MiniMindForQuestionAnswering",
]
