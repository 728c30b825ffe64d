"""Multi-process parallelism on CPU (gloo), launched the way users launch it: tensor parallelism from the model's
own plans under `torchrun` (MiniMind dense and MoE, with transformers' Qwen3 / Qwen3-MoE as the reference), and
FSDP2 training under `accelerate launch --config_file configs/accelerate_fsdp.yaml`."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, PreTrainedModel

from conftest import ROOT, load_script, model_dir

pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not available in this torch build",
    ),
    pytest.mark.usefixtures("one_thread"),
]

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
IDS = torch.tensor([[1, 5, 17, 33, 60, 90, 2, 44, 71, 12]])


def launch_env():
    # One thread per process: 2 shared cores; gloo runs the collectives on the same cores.
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def run(command, timeout=300):
    result = subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    # torch's pytree warnings (two per process and import) would fill the tail that shows why a rank failed
    stderr = "\n".join(line for line in result.stderr.splitlines() if "_pytree.py" not in line)
    assert result.returncode == 0, f"exit code {result.returncode}\n{result.stdout[-2000:]}\n{stderr[-6000:]}"
    return result


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


# --------------------------------------------------------------------------------------------------------------
# Tensor parallelism: from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto")) on 2 processes
# --------------------------------------------------------------------------------------------------------------

# Each rank loads every model sharded by its TP plan and records, for each, the placement and local shape of
# every parameter, the logits without autograd (transformers' local-tensor inference path) and with it (the
# DTensor path training takes), the gathered gradient of every parameter for the LM loss, and a greedy generation
# (each rank caches the keys and values of its own heads).
TP_WORKER = r"""
import sys
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, DistributedConfig

out, ids, paths = sys.argv[1], torch.tensor(eval(sys.argv[2])), sys.argv[3:]
results = {}
for path in paths:
    # DistributedConfig(tp_plan="auto") is the current spelling of from_pretrained(path, tp_plan="auto").
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"),
                                                 trust_remote_code=True, dtype=torch.float32).eval()
    shards = {name: (str(p.placements) if isinstance(p, DTensor) else None,
                     tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape))
              for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for name, p in model.named_parameters()}  # every rank joins each gather, in the same order
    generated = model.generate(ids[:, :5], max_new_tokens=8, do_sample=False)  # KV cache of the local heads
    # The all-reduces of one forward without autograd (row-parallel projections and the experts' sum).
    reductions, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: reductions.append(1) or all_reduce(*args, **kwargs)
    with torch.no_grad():
        model(input_ids=ids)
    dist.all_reduce = all_reduce
    kernels = {}  # transformers' expert kernels on each rank's shards of the experts
    for kernel in ("batched_mm", "grouped_mm") if any(".mlp.experts." in name for name in shards) else ():
        model.set_experts_implementation(kernel)
        with torch.no_grad():
            kernels[kernel] = model(input_ids=ids).logits
    results[path] = dict(shards=shards, logits=logits, train_logits=output.logits.detach(), loss=output.loss.detach(),
                         grads=grads, generated=generated, reductions=len(reductions), kernels=kernels)
torch.save(results, f"{out}.rank{dist.get_rank()}")
# Both ranks are done before either closes its process group: a rank that exits with the group open can take
# its peer down with it (gloo raises "connection closed by peer" in the peer's I/O thread, which aborts it).
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    """Dense and MoE MiniMind directories and their exact Qwen3 / Qwen3-MoE exports.

    Vocabulary 96, not conftest's 97: transformers 5.17 refuses a `colwise_gather_output` LM head whose width does
    not divide by the TP size (5.24 allows it); the real vocabulary, 6400, divides by any power of two up to 256."""
    from minimind.export import export_qwen3

    base = tmp_path_factory.mktemp("tp")
    dirs = {}
    moe = dict(use_moe=True, num_experts=4, num_experts_per_tok=2)
    for kind, extra in (("dense", {}), ("moe", moe), ("moe-shared", dict(moe, n_shared_experts=1))):
        # A wider init (std 0.1) spreads the logits over a few units, so a wrong shard would show.
        model_dir(str(base / kind), std=0.1, with_tokenizer=False, vocab_size=96, **TINY, **extra)
        dirs[kind] = str(base / kind)
        if kind != "moe-shared":  # Qwen3-MoE has no shared experts
            dirs[f"qwen3-{kind}"] = str(export_qwen3(dirs[kind], base / f"qwen3-{kind}"))
    return dirs


@pytest.fixture(scope="module")
def tp_run(tp_models, tmp_path_factory):
    """One `torchrun --nproc_per_node 2` over all four models (one launch: each costs seconds on 2 cores)."""
    work = tmp_path_factory.mktemp("tp-run")
    worker = work / "tp_worker.py"
    worker.write_text(TP_WORKER, encoding="utf-8")
    out = work / "results"
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(worker),
            str(out),
            str(IDS.tolist()),
            *tp_models.values(),
        ]
    )
    return [torch.load(f"{out}.rank{rank}") for rank in (0, 1)]


@pytest.mark.parametrize("kind", ["dense", "moe", "moe-shared", "qwen3-dense", "qwen3-moe"])
def test_tensor_parallel_matches_one_process(kind, tp_models, tp_run):
    """Two TP ranks give one process's logits, its gradients for the LM loss and its greedy tokens (cached decoding
    with each rank's share of the heads): the column/row split only reorders the sums. Measured: logits (magnitude
    ~3) <= 1.5e-6 apart on both paths, loss <= 5e-7, gradients <= 6e-7 (of ~0.8). The gradients catch what logits
    cannot: with the q/k norms merely replicated instead of `replicated_with_grad_allreduce`, logits still match
    but their gradients are 0.09-0.15 off. Qwen3 / Qwen3-MoE are the reference TP implementations; MiniMind's plan
    must do the same on the same weights."""
    path = tp_models[kind]
    reference = load(path)
    with torch.no_grad():
        expected = reference(input_ids=IDS).logits
        greedy = reference.generate(IDS[:, :5], max_new_tokens=8, do_sample=False)
    output = reference(input_ids=IDS, labels=IDS)
    output.loss.backward()
    assert expected.abs().max() > 2.0  # spread enough for a wrong head or expert split to move them
    for rank, result in enumerate(tp_run):
        got = result[path]
        torch.testing.assert_close(got["logits"], expected, atol=1e-5, rtol=0, msg=f"rank {rank}, no autograd")
        torch.testing.assert_close(
            got["train_logits"], output.logits.detach(), atol=1e-5, rtol=0, msg=f"rank {rank}, with autograd"
        )
        torch.testing.assert_close(got["loss"], output.loss.detach(), atol=1e-5, rtol=0)
        for name, param in reference.named_parameters():
            torch.testing.assert_close(
                got["grads"][name], param.grad, atol=1e-5, rtol=0, msg=f"rank {rank}, gradient of {name}"
            )
        assert got["generated"].tolist() == greedy.tolist(), rank
        for kernel, logits in got["kernels"].items():  # transformers' expert kernels on the sharded experts
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0, msg=f"rank {rank}, {kernel}")
        assert len(got["kernels"]) == (0 if kind.endswith("dense") else 2)


def test_tensor_parallel_plan_shards_all(tp_run, tp_models):
    """The plan's `layers.*.mlp.experts.*.gate_proj` patterns match the ModuleList names (`experts.3.gate_proj`):
    transformers replaces every `.N.` of a name by `.*.` before looking it up. Each rank holds half the query rows,
    half the vocabulary of the (tied) embedding, and half of every expert; router and norms are replicated."""
    half = {
        "q_proj": (32, 64),
        "k_proj": (16, 64),
        "v_proj": (16, 64),
        "o_proj": (64, 32),
        "gate_proj": (48, 64),
        "up_proj": (48, 64),
        "down_proj": (64, 48),
    }
    for rank, result in enumerate(tp_run):
        for kind in ("dense", "moe", "moe-shared"):
            shards = result[tp_models[kind]]["shards"]
            assert shards["model.embed_tokens.weight"] == ("(Shard(dim=0),)", (48, 64))
            for name, (placement, shape) in shards.items():
                projection = name.split(".")[-2]
                if projection in half:
                    dim = 1 if projection in ("o_proj", "down_proj") else 0
                    assert (placement, shape) == (f"(Shard(dim={dim}),)", half[projection]), (rank, name)
                elif name != "model.embed_tokens.weight":
                    assert placement is None, (rank, name)  # norms, and the MoE router mlp.gate
            experts = [name for name in shards if ".mlp.experts." in name]
            assert len(experts) == (0 if kind == "dense" else 2 * 4 * 3)
            shared = [name for name in shards if ".mlp.shared_experts." in name]
            assert len(shared) == (2 * 3 if kind == "moe-shared" else 0)
            local = sum(torch.Size(shape).numel() for _, shape in shards.values())
            full = sum(p.numel() for p in load(tp_models[kind]).parameters())
            replicated = sum(torch.Size(shape).numel() for placement, shape in shards.values() if placement is None)
            assert local == (full - replicated) // 2 + replicated, (kind, local, full)


def test_tensor_parallel_experts_reduce_once(tp_run, tp_models):
    """MiniMind's plan splits every expert's intermediate width and sums the experts' partial outputs once per
    layer: one forward all-reduces twice per layer (o_proj and experts; a shared expert's down projection adds
    one). Qwen3-MoE's plan does the same where it shards experts (5.24); from 5.25 it leaves experts to its
    expert-parallel plan, replicated under tensor parallelism, and reduces once per layer (o_proj)."""
    if "moe_tp_experts" not in load(tp_models["moe"]).config.base_model_tp_plan.values():
        pytest.skip("this transformers has no `local_params` TP style (5.17): each expert's down projection reduces")
    qwen3_shards_experts = any(".experts" in key for key in load(tp_models["qwen3-moe"]).config.base_model_tp_plan)
    for rank, result in enumerate(tp_run):
        assert result[tp_models["qwen3-moe"]]["reductions"] == 2 * (2 if qwen3_shards_experts else 1), rank
        assert result[tp_models["moe"]]["reductions"] == 2 * 2, rank
        assert result[tp_models["moe-shared"]]["reductions"] == 2 * 3, rank


# --------------------------------------------------------------------------------------------------------------
# FSDP2: accelerate launch --config_file configs/accelerate_fsdp.yaml on 2 CPU processes
# --------------------------------------------------------------------------------------------------------------

TINY_FLAGS = [f"--{key}={value}" for key, value in TINY.items()]
TRAIN = [
    "--report_to",
    "none",
    "--max_seq_length",
    "32",
    "--logging_steps",
    "1",
    "--disable_tqdm",
    "true",
    "--seed",
    "0",
    "--max_steps",
    "3",
    "--learning_rate",
    "3e-3",
    "--eval_fraction",
    "0",
    *TINY_FLAGS,
]
SHARD_LOG = re.compile(
    r"FSDP2 over 2 CPU processes .*: rank 0 holds ([\d,]+), rank 1 holds ([\d,]+) of ([\d,]+) "
    r"parameter elements"
)


def losses(log_history):
    return [entry["loss"] for entry in log_history if "loss" in entry]


@pytest.mark.skipif(
    not hasattr(PreTrainedModel, "is_distributed_loading_by_transformers"),
    reason="this transformers' Trainer cannot train a model sharded at load time (5.17 cannot; "
    "5.24 can), and accelerate shards with FSDP on GPUs only",
)
def test_fsdp2_matches_one_process_and_saves(tmp_path):
    """2 processes x batch 2 under FSDP2 and 1 process x batch 4 see the same global batches and average the same
    gradients, so the losses agree up to summation order. Measured: identical over 3 steps (one process with batch
    2 is 0.02, 0.08, 0.14 off, so 1e-4 catches a wrong split or loss scale); each rank holds 235,712 of 471,424
    parameter elements; the saved directory and checkpoint-3 are plain full-size models whose logits are 5e-6 from
    the one-process model's (their weights differ by <= 2e-6 after 3 Adam steps summed in another order).

    Dense only: with MoE the load-balancing loss is computed per rank, on half the batch, and it is not linear in
    the batch, so any data parallelism (DDP gives FSDP's numbers to 1e-6) differs from one process by ~1e-3."""
    data = tmp_path / "pretrain.jsonl"
    data.write_text(
        "".join(Path(ROOT, "data", "pretrain.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:150]),
        encoding="utf-8",
    )
    fsdp_out = tmp_path / "fsdp"
    # The documented command. --mixed_precision no overrides the config's bf16 (GPU setting) for an fp32
    # comparison; checkpoints are weights-only, as transformers requires for models sharded at load time.
    result = run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            os.path.join(ROOT, "configs", "accelerate_fsdp.yaml"),
            "--num_processes",
            "2",
            "--mixed_precision",
            "no",
            os.path.join(ROOT, "scripts", "pretrain.py"),
            "--use_cpu",
            "--ddp_backend",
            "gloo",
            "--data_path",
            str(data),
            "--output_dir",
            str(fsdp_out),
            "--per_device_train_batch_size",
            "2",
            "--save_strategy",
            "steps",
            "--save_steps",
            "3",
            "--save_only_model",
            *TRAIN,
        ]
    )
    shard = SHARD_LOG.search(result.stdout + result.stderr)
    assert shard, (result.stdout[-3000:], result.stderr[-3000:])
    rank0, rank1, full = (int(group.replace(",", "")) for group in shard.groups())
    assert rank0 + rank1 == full and abs(rank0 - rank1) < 0.01 * full, (rank0, rank1, full)

    one, _ = load_script("pretrain").main(
        [
            "--use_cpu",
            "--data_path",
            str(data),
            "--output_dir",
            str(tmp_path / "one"),
            "--per_device_train_batch_size",
            "4",
            "--save_strategy",
            "no",
            *TRAIN,
        ]
    )
    fsdp_losses = losses(json.loads((fsdp_out / "trainer_state.json").read_text())["log_history"])
    assert len(fsdp_losses) == 3
    assert fsdp_losses == pytest.approx(losses(one.state.log_history), abs=1e-4)

    from safetensors import safe_open

    trained = one.model.eval()
    expected_shapes = {name: tuple(t.shape) for name, t in trained.state_dict().items() if name != "lm_head.weight"}
    assert sum(torch.Size(s).numel() for s in expected_shapes.values()) == full
    with torch.no_grad():
        expected = trained(input_ids=IDS).logits
    for saved in (fsdp_out, fsdp_out / "checkpoint-3"):
        files = set(os.listdir(saved))
        assert {
            "config.json",
            "model.safetensors",
            "configuration_minimind.py",
            "modeling_minimind.py",
            "tokenizer.json",
        } <= files
        # FSDP2 re-classes the model as torch's FSDPMiniMindForCausalLM; its source must not be saved as ours.
        assert not any(name.startswith("_fsdp") for name in files), files
        auto_map = json.loads((saved / "config.json").read_text())["auto_map"]
        assert auto_map["AutoModelForCausalLM"] == "modeling_minimind.MiniMindForCausalLM"
        with safe_open(str(saved / "model.safetensors"), "pt") as weights:
            shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
            # transformers 5.24 gathers the shards into separate CPU tensors, so its tied-weight dedup (by storage)
            # misses the tied head and writes it too: an exact copy of the embedding, harmless on reload.
            if "lm_head.weight" in shapes:
                embedding = weights.get_tensor("model.embed_tokens.weight")
                assert torch.equal(weights.get_tensor("lm_head.weight"), embedding)
                del shapes["lm_head.weight"]
            assert shapes == expected_shapes
        reloaded = load(saved)
        assert type(reloaded).__name__ == "MiniMindForCausalLM"
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=IDS).logits, expected, atol=1e-4, rtol=0)
