"""Data under several processes, launched as users launch them (`torchrun`, 2 CPU processes, gloo): the corpus is
tokenised once (by the main process, the other waits and reads the cache), and the ranks' DataLoaders share the
blocks: together one epoch covers every block once, with no block on both ranks."""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from conftest import ROOT

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

# Each rank: tokenise (or wait for the main process and read the cache) exactly as run_training does, then list the
# blocks its own Trainer DataLoader yields in one epoch.
WORKER = r"""
import json, sys
from transformers import Trainer
from minimind.data import collator
from minimind.training import (DataArguments, MiniMindTrainingArguments, ModelArguments, build_model, load_datasets,
                               load_tokenizer)

out, data, cache = sys.argv[1:4]
args = MiniMindTrainingArguments(output_dir=out, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=2,
                                 report_to="none", seed=0)
tokenizer = load_tokenizer(ModelArguments())
with args.main_process_first(desc="tokenising the data"):
    train, _ = load_datasets("pretrain", DataArguments(data_path=data, max_seq_length=16, eval_fraction=0,
                                                      data_cache_dir=cache, num_proc=2), tokenizer)
model = build_model(ModelArguments(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=64), tokenizer)
trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator("pretrain", tokenizer))
blocks = [row.tolist() for batch in trainer.get_train_dataloader() for row in batch["input_ids"]]
with open(f"{out}/rank{args.process_index}.json", "w") as f:
    json.dump({"from_cache": train.from_cache, "blocks": blocks, "rows": len(train)}, f)
"""


def test_two_processes_tokenise_once(tmp_path):
    """Two processes tokenise once and share the blocks."""
    from transformers import AutoTokenizer

    from minimind.data import build_pretrain_dataset

    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tokenizer"))
    lines = [json.dumps({"text": f"Story {i}: the cat sat on the mat and ate {i} apples."}) for i in range(60)]
    path = tmp_path / "p.jsonl"
    while True:  # a block count that 2 ranks x 2 rows divide, so no rank pads its last batch with a repeat
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        reference = build_pretrain_dataset(path, tok, 16, num_proc=1, data_cache_dir=tmp_path / "reference")
        if len(reference) % 4 == 0:
            break
        lines.append(lines[len(lines) % 60])
    (tmp_path / "worker.py").write_text(WORKER, encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(tmp_path / "worker.py"), str(tmp_path), str(path), str(tmp_path / "cache")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]

    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["from_cache"] for rank in ranks] == [False, True]  # tokenised once, by the main process
    assert [len(list((tmp_path / "cache").iterdir()))] == [1]  # one entry, no leftover temporary directory
    everything = sorted(reference["input_ids"])
    assert ranks[0]["rows"] == ranks[1]["rows"] == len(everything)
    seen = ranks[0]["blocks"] + ranks[1]["blocks"]
    assert len(ranks[0]["blocks"]) == len(ranks[1]["blocks"]) == len(everything) // 2  # each rank reads its half
    assert sorted(seen) == everything  # together: every block once, none twice
