"""The main job's code path (scripts/demo.py) end to end at toy size: pretrain, SFT, save, reload, chat."""

import json
import os

import torch

from conftest import load_script


def test_demo_runs_end_to_end_at_toy_size(tmp_path, capsys):
    demo = load_script("demo")
    threads = torch.get_num_threads()  # the demo sets the process-wide thread count
    try:
        demo.main(["--output_dir", str(tmp_path), "--pretrain_steps", "4", "--sft_steps", "3", "--hidden_size",
                   "32", "--num_hidden_layers", "1", "--max_seq_length", "64", "--sft_max_seq_length", "64",
                   "--logging_steps", "1", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "reloaded MiniMindForCausalLM" in out
    assert out.count("  MiniMind: ") == len(demo.QUESTIONS)
    assert "| 4 |" in out and "| 3 |" in out  # both loss tables, one row per logged step
    sft_dir = tmp_path / "sft"
    assert json.loads((sft_dir / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    assert {"model.safetensors", "modeling_minimind.py", "tokenizer.json", "loss_curve.md"} <= set(os.listdir(sft_dir))
