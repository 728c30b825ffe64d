"""The peers table's SFT rows: a few AdamW steps on the bundled chats padded to max_seq_length (upstream
MiniMind's way), flattened into padding-free rows (`--padding_free`), and padded under torch.compile (the
Trainer's `--torch_compile`); real tokens per second and each step's loss."""

import time

import torch

from bench.workloads import PeerRow
from modeling_minimind import MiniMindForCausalLM


def sft_batches(ctx, padded):
    """The first batches of the bundled SFT chats, in file order, either padded to max_seq_length (upstream
    MiniMind's way) or flattened into one padding-free row."""
    from minimind.data import build_dataset, collator

    max_len = 512
    batch, steps = ctx.sizes["sft_batch"], ctx.sizes["sft_steps"]
    dataset = build_dataset("sft", ctx.sft_data, ctx.tokenizer, max_len).select(range(batch * steps))
    if padded:
        from transformers import DataCollatorForSeq2Seq

        from minimind.data import IGNORE_INDEX

        collate = DataCollatorForSeq2Seq(
            ctx.tokenizer,
            padding="max_length",
            max_length=max_len,
            label_pad_token_id=IGNORE_INDEX,
            return_tensors="pt",
        )
    else:
        collate = collator("sft", ctx.tokenizer, padding_free=True)
    rows = [dataset[i] for i in range(len(dataset))]
    return [collate(rows[i : i + batch]) for i in range(0, len(rows), batch)]


def measure_sft(w, ctx):
    """A few AdamW steps from the same initial weights on the same examples; real tokens per second (pads not
    counted) and each step's loss, which padding-free packing must reproduce."""
    padded = w.weights.startswith("padded")
    batches = sft_batches(ctx, padded)
    model = MiniMindForCausalLM.from_pretrained(
        ctx.model_dir, dtype=torch.float32, attn_implementation=ctx.settings.attn_implementation
    ).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = w.weights.endswith("-compiled")
    forward = torch.compile(model) if compiled else model  # what the Trainer's --torch_compile does
    row = PeerRow(
        w,
        shape=f"{ctx.sizes['sft_batch']} x 512"
        if padded
        else f"1 x {'/'.join(str(b['input_ids'].shape[1]) for b in batches)}",
    )
    real = []
    for batch in batches:
        inputs = {
            key: value
            for key, value in batch.items()
            if key in ("input_ids", "labels", "attention_mask", "position_ids")
        }
        start = time.perf_counter()
        loss = forward(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        row.seconds.append(time.perf_counter() - start)
        row.losses.append(loss.item())
        real.append(int(batch["attention_mask"].sum()) if padded else batch["input_ids"].numel())
    row.tokens = sum(real)
    # The first step pays for allocation (activations, AdamW state) and, compiled, for compilation: throughput
    # counts the later steps.
    first = 1 if len(batches) > 1 else 0
    row_first_seconds = row.seconds[0]
    row.seconds, row.timed_tokens = row.seconds[first:], sum(real[first:])
    total = sum(b["input_ids"].numel() for b in batches)
    row.note = (
        f"{row.tokens:,} real tokens of {total:,} ({100 * row.tokens / total:.0f}%), "
        f"{len(batches)} steps, loss {' / '.join(f'{x:.4f}' for x in row.losses)}"
    )
    if compiled:
        row.note += f"; torch.compile, first step (compilation) {row_first_seconds:.0f} s"
    ctx.log(f"{w.row_id}: {row.tokens_per_second:.1f} real tok/s")
    return row
