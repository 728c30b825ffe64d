"""Fully sharded (FSDP2) training on CPU processes.

`accelerate launch --config_file configs/accelerate_fsdp.yaml ... --use_cpu` and the Trainer's `--fsdp` both hand
the sharding to accelerate, and accelerate 1.15 switches its FSDP plugin on only for accelerator process groups:
`AcceleratorState` turns MULTI_GPU / MULTI_XPU / MULTI_NPU / ... into FSDP, never MULTI_CPU, so on CPU processes
the plugin is dropped without a word and the Trainer wraps the model in DDP. transformers 5.x can shard a model
itself while loading it (`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))`: FSDP2
`fully_shard` on every decoder layer, the embedding and the final norm, on a gloo mesh for CPU), and its Trainer
then leaves the gradient reduction to FSDP2 instead of adding DDP. `shard_for_cpu_fsdp` takes that route when
FSDP was asked for and the processes are CPU ones; on GPUs accelerate's own FSDP plugin runs as configured.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def fsdp_requested(training_args):
    """FSDP asked for by the launcher's config (accelerate exports ACCELERATE_USE_FSDP) or by `--fsdp`."""
    from_launcher = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")
    return from_launcher or bool(training_args.fsdp)


def accelerate_drops_fsdp(training_args):
    """True where accelerate would ignore an FSDP request: several CPU processes (DistributedType.MULTI_CPU)."""
    from accelerate.utils import DistributedType

    state = training_args.distributed_state
    return state is not None and state.distributed_type == DistributedType.MULTI_CPU


def shard_counts(model):
    """(parameter elements this rank holds, parameter elements of the full model)."""
    from torch.distributed.tensor import DTensor

    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return local, sum(p.numel() for p in model.parameters())


def shard_for_cpu_fsdp(model, training_args):
    """The model FSDP2-sharded by transformers over all processes when FSDP was requested on CPU processes;
    otherwise `model` unchanged (single process, DDP, or GPUs, where accelerate applies its FSDP plugin)."""
    if not (fsdp_requested(training_args) and accelerate_drops_fsdp(training_args)):
        return model
    # Older Trainers (5.17) would wrap the sharded model in DDP as well; refuse instead of training wrong.
    if not hasattr(model, "is_distributed_loading_by_transformers"):
        raise RuntimeError(
            "FSDP on CPU processes needs a transformers whose Trainer accepts models sharded at load time "
            "(5.24 does, 5.17 does not). Fix: upgrade transformers, or drop the FSDP config / --fsdp to train "
            "with DDP."
        )
    if training_args.save_strategy != "no" and not training_args.save_only_model:
        raise ValueError(
            "FSDP on CPU shards the model at load time, and transformers cannot checkpoint the optimizer of such a "
            "model (so there is no resuming). Fix: add --save_only_model (checkpoints then hold full weights only) "
            "or --save_strategy no."
        )
    from transformers import DistributedConfig

    world = training_args.world_size
    # The weights go through from_pretrained's sharded loading: every rank built the same seeded init (or read
    # the same checkpoint) and keeps only its shard of each tensor.
    sharded = type(model).from_pretrained(
        None,
        config=model.config,
        state_dict=model.state_dict(),
        dtype=model.dtype,
        distributed_config=DistributedConfig(fsdp_size=world),
    )
    sharded.generation_config = model.generation_config
    local, full = shard_counts(sharded)
    held = [None] * world
    torch.distributed.all_gather_object(held, local)
    if training_args.process_index == 0:
        # A warning, so that it shows at the default log level: the FSDP config is realised differently here.
        logger.warning(
            "FSDP2 over %d CPU processes (transformers' sharding; accelerate shards on GPUs only): %s of "
            "%s parameter elements",
            world,
            ", ".join(f"rank {rank} holds {n:,}" for rank, n in enumerate(held)),
            f"{full:,}",
        )
    return sharded


def restore_model_code(model, output_dir):
    """Put the model's own code back into a directory saved from an FSDP2-sharded model.

    `fully_shard` re-classes the model as `FSDP<Name>`, a subclass that torch defines in its own module. For a model
    with remote code, transformers' save_pretrained then copies that torch module (`_fsdp_init.py` and its relative
    imports) as the model's code and writes `_fsdp_init.FSDP<Name>` into auto_map, so the directory no longer loads
    with trust_remote_code (transformers 5.24; accelerate's FSDP2 on GPUs saves through the same call). Here the
    torch files go, the model's own file comes back and auto_map names the model's class again."""
    from torch.distributed.fsdp import FSDPModule
    from transformers.dynamic_module_utils import get_relative_import_files

    if not isinstance(model, FSDPModule) or getattr(model, "_auto_class", None) is None:
        return
    wrapper = type(model)
    own = next(cls for cls in wrapper.__mro__ if not issubclass(cls, FSDPModule))
    output_dir = Path(output_dir)

    def with_relative_imports(module_name):
        source = Path(sys.modules[module_name].__file__)
        return [source, *map(Path, get_relative_import_files(str(source)))]

    for path in with_relative_imports(wrapper.__module__):
        (output_dir / path.name).unlink(missing_ok=True)
    for path in with_relative_imports(own.__module__):
        shutil.copyfile(path, output_dir / path.name)
    model.config.auto_map[own._auto_class] = f"{own.__module__.rsplit('.', 1)[-1]}.{own.__name__}"
    model.config.save_pretrained(output_dir)
