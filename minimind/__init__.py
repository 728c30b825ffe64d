"""MiniMind beyond the model files: data, training, hub, export, serving.

Importing the package registers MiniMind with transformers' Auto classes, so `AutoConfig`,
`AutoModel` and `AutoModelForCausalLM` build and load MiniMind locally without remote code.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from configuration_minimind import MiniMindConfig
from modeling_minimind import MiniMindForCausalLM, MiniMindModel

AutoConfig.register(MiniMindConfig.model_type, MiniMindConfig, exist_ok=True)
AutoModel.register(MiniMindConfig, MiniMindModel, exist_ok=True)
AutoModelForCausalLM.register(MiniMindConfig, MiniMindForCausalLM, exist_ok=True)

__all__ = ["MiniMindConfig", "MiniMindModel", "MiniMindForCausalLM"]
