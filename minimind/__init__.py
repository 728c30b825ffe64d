"""MiniMind beyond the model files: data, training, hub, export, serving.

Importing the package registers MiniMind with transformers' Auto classes, so `AutoConfig`,
`AutoModel` and `AutoModelForCausalLM` build and load MiniMind locally without remote code.
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

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

from configuration_minimind import MiniMindConfig  # noqa: E402
from modeling_minimind import MiniMindForCausalLM, MiniMindModel  # noqa: E402

AutoConfig.register(MiniMindConfig.model_type, MiniMindConfig, exist_ok=True)
AutoModel.register(MiniMindConfig, MiniMindModel, exist_ok=True)
AutoModelForCausalLM.register(MiniMindConfig, MiniMindForCausalLM, exist_ok=True)

__all__ = ["MiniMindConfig", "MiniMindModel", "MiniMindForCausalLM"]
