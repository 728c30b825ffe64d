"""The main table: MiniMind against transformers' own Qwen3 / Qwen3-MoE, same config, same weights, same process,
same run.

The machine this runs on is usually shared, so absolute numbers drift from run to run. What counts is the
ratio: every repeat times ours and native back to back (alternating which goes first), and a row's ratio is
the median of those paired ratios. Each row also reports achieved GFLOP/s against a matmul ceiling measured
in the same run, peak memory, and for decode rows the KV cache's bytes, checked against
2 x layers x tokens x kv_heads x head_dim x dtype bytes.
"""

import copy
import time

import torch

from bench.measure import (
    DTYPES,
    finish_details,
    machine_details,
    matmul_ceiling,
    profile_table,
    race,
    run_details,
    warm_up,
)
from bench.report import BenchmarkReport
from bench.workloads import Row, default_workloads, model_shapes, row_matches, select_workloads
from configuration_minimind import MiniMindConfig
from minimind.export import to_qwen3_model
from modeling_minimind import MiniMindForCausalLM

# ----------------------------------------------------------------------------------------------------------
# Identical models: ours and transformers' Qwen3 / Qwen3-MoE
# ----------------------------------------------------------------------------------------------------------


def build_pair(shape_overrides, device, dtype, attn_implementation, seed):
    """Ours and native with the same weights, on `device` in `dtype`, in eval mode.

    Both are new models loaded from one initialised source, built the same way. On a CPU the allocation history
    of a model's weights moves its speed by several percent: a model still holding the tensors it was
    initialised in ran slower than a copy of itself (docs/performance.md, "A bias in the harness"). Ours is
    built first, which if anything favours native.
    """
    torch.manual_seed(seed)
    config = MiniMindConfig(**shape_overrides, attn_implementation=attn_implementation)
    source = MiniMindForCausalLM(config)
    ours = MiniMindForCausalLM(config)
    ours.load_state_dict(source.state_dict())
    native = to_qwen3_model(source)  # the export's converter: strict load, experts fused for Qwen3-MoE
    native.set_attn_implementation(attn_implementation)
    del source
    return ours.to(device, dtype).eval(), native.to(device, dtype).eval()


# ----------------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------------


def matmul_params_per_token(config):
    """Weights each token multiplies through in the decoder layers (active experts only)."""
    attn = config.hidden_size * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    total = 0
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            mlp = (
                config.hidden_size * config.num_experts
                + config.num_experts_per_tok * 3 * config.hidden_size * config.moe_intermediate_size
            )
        else:
            mlp = 3 * config.hidden_size * config.intermediate_size
        total += attn + mlp
    return total


def forward_flops(config, batch, q_len, past, logit_positions):
    """FLOPs of one forward: 2 per multiply-add in the projections, the LM head on `logit_positions` positions
    per row, and causal attention (q.k and p.v over the keys each query sees)."""
    linear = 2 * batch * q_len * matmul_params_per_token(config)
    head = 2 * batch * logit_positions * config.hidden_size * config.vocab_size
    keys_seen = q_len * past + q_len * (q_len + 1) // 2  # summed over the new queries
    attention = 4 * batch * keys_seen * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    return linear + head + attention


def workload_flops(config, w):
    if w.kind == "train":  # forward + backward (twice the forward)
        return 3 * forward_flops(config, w.batch, w.seq_len, 0, w.seq_len)
    if w.kind == "prefill":
        return forward_flops(config, w.batch, w.seq_len, 0, 1)
    # decode: the prompt once, then one token per step for the remaining new tokens
    total = forward_flops(config, w.batch, w.seq_len, 0, 1)
    for step in range(1, w.new_tokens):
        total += forward_flops(config, w.batch, 1, w.seq_len + step - 1, 1)
    return total


# ----------------------------------------------------------------------------------------------------------
# The timed work
# ----------------------------------------------------------------------------------------------------------


def make_train_step(model, ids, device, dtype, moe):
    """One optimisation step (forward with labels, backward, AdamW, zero grads) as a closure."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    # Ours adds the load-balancing loss whenever labels are given; Qwen3-MoE only when asked.
    extra = {"output_router_logits": True} if moe else {}

    def step():
        with autocast:
            loss = model(input_ids=ids, labels=ids, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def make_prefill(model, ids):
    @torch.no_grad()
    def prefill():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)

    return prefill


def generation_kwargs(w, compile_forward):
    from transformers import CompileConfig

    kwargs = dict(
        max_new_tokens=w.new_tokens,
        min_new_tokens=w.new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        disable_compile=not compile_forward,
    )
    if w.cache == "static":
        kwargs["cache_implementation"] = "static"
    if compile_forward:
        config = CompileConfig(fullgraph=False, dynamic=False)
        config._compile_all_devices = True  # generate only auto-compiles on accelerators; this opts CPU in
        kwargs["compile_config"] = config
    return kwargs


def make_decode(model, ids, w, compile_forward):
    kwargs = generation_kwargs(w, compile_forward)

    @torch.no_grad()
    def decode():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)

    return decode


def kv_cache_bytes(cache):
    """Bytes held by the cache's key and value tensors, summed over layers."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def expected_kv_bytes(config, w):
    """2 (K and V) x layers x tokens x kv_heads x head_dim x dtype bytes. Tokens per row: the prompt and every
    generated token but the last, which is never fed back; generate sizes a static cache to exactly that."""
    tokens = w.batch * (w.seq_len + w.new_tokens - 1)
    element = torch.tensor([], dtype=DTYPES[w.dtype]).element_size()
    return 2 * config.num_hidden_layers * tokens * config.num_key_value_heads * config.head_dim * element


def default_repeats(kind, quick):
    """Short runs repeated often beat long ones on a noisy machine; decode runs are the long ones."""
    if quick:
        return 1
    return 2 if kind == "decode" else 4


def measure(w, shape_overrides, settings, device, log):
    """Build the pair for one workload, warm up (taking peak memory and checking the KV cache), then time."""
    compile_forward = w.compile and _compile_enabled(settings, device)
    if w.compile and not compile_forward:
        return Row(
            w,
            [],
            [],
            0,
            0.0,
            skipped=(
                "torch.compile skipped on CPU (inductor compile time exceeds the run's budget; --compile on to try it)"
                if device.type == "cpu"
                else "--compile off"
            ),
        )
    weight_dtype = DTYPES[w.dtype] if w.kind != "train" else torch.float32
    ours, native = build_pair(shape_overrides, device, weight_dtype, settings.attn_implementation, settings.seed)
    config = ours.config
    generator = torch.Generator().manual_seed(settings.seed)
    ids = torch.randint(3, config.vocab_size, (w.batch, w.seq_len), generator=generator).to(device)

    if w.kind == "train":
        fns = {
            name: make_train_step(m, ids, device, w.dtype, config.use_moe)
            for name, m in (("ours", ours), ("native", native))
        }
    elif w.kind == "prefill":
        fns = {name: make_prefill(m, ids) for name, m in (("ours", ours), ("native", native))}
    else:
        fns = {name: make_decode(m, ids, w, compile_forward) for name, m in (("ours", ours), ("native", native))}

    # Training warms up twice: the first step allocates AdamW's state, the second shows the steady peak.
    warmup = max(1, settings.warmup if settings.warmup is not None else (2 if w.kind == "train" else 1))
    peaks, outputs = warm_up(fns, warmup, device)
    times = race(fns, settings.repeats or default_repeats(w.kind, settings.quick), device)
    if row_matches(w.row_id, settings.profile):
        for name, fn in fns.items():
            log(f"profile of {w.row_id}, {name}:\n{profile_table(fn, device)}")
    row = Row(
        w,
        times["ours"],
        times["native"],
        w.batch * (w.new_tokens if w.kind == "decode" else w.seq_len),
        workload_flops(config, w),
        peak_ours=peaks["ours"],
        peak_native=peaks["native"],
    )
    if w.kind == "decode":
        out = outputs["ours"]
        assert out.sequences.shape[1] == w.seq_len + w.new_tokens
        cache = out.cache if "cache" in out else out.past_key_values  # transformers 5.x renamed the field
        row.kv_bytes, row.kv_expected = kv_cache_bytes(cache), expected_kv_bytes(config, w)
        assert row.kv_bytes == row.kv_expected, (
            f"{w.row_id}: KV cache holds {row.kv_bytes} bytes, expected {row.kv_expected} "
            f"(2 x layers x tokens x kv_heads x head_dim x dtype bytes)"
        )
    notes = []
    if w.kind == "decode":  # same length either way (min_new_tokens); same tokens says both computed alike
        same = torch.equal(outputs["ours"].sequences, outputs["native"].sequences)
        notes.append("same tokens as native" if same else "tokens differ from native (near-tie logits)")
    if config.use_moe:
        notes.append(f"native experts: {native.config._experts_implementation}")
    row.note = "; ".join(notes)
    log(
        f"{w.row_id}: ours {row.tokens_per_second(row.ours_seconds):.1f} tok/s, native "
        f"{row.tokens_per_second(row.native_seconds):.1f} tok/s, ratio {row.ratio:.3f}"
    )
    return row


def _compile_enabled(settings, device):
    return settings.compile == "on" or (settings.compile == "auto" and device.type == "cuda")


def run_main(settings, device, log, on_row):
    """Every selected row of the main table; `on_row(report)` sees the report so far after each row but the
    last."""
    started = time.perf_counter()
    workloads = select_workloads(default_workloads(settings.quick, device.type), settings.rows)
    shapes = model_shapes(settings.quick)
    machine, details = machine_details(), run_details(device)
    size = 256 if settings.quick else (8192 if device.type == "cuda" else 2048)
    ceilings = {name: matmul_ceiling(device, dtype, size) for name, dtype in DTYPES.items()}
    log("matmul ceiling: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in ceilings.items()))
    rows = []
    for w in workloads:
        rows.append(measure(w, copy.deepcopy(shapes[w.shape]), settings, device, log))
        if on_row and len(rows) < len(workloads):
            partial = dict(details, partial=f"{len(rows)} of {len(workloads)} rows")
            on_row(BenchmarkReport(partial, ceilings, list(rows), settings, machine=machine))
    # Measured again at the end and the better kept: a ceiling is the best the machine did in this run.
    ceilings = {name: max(value, matmul_ceiling(device, DTYPES[name], size)) for name, value in ceilings.items()}
    return BenchmarkReport(finish_details(details, started), ceilings, rows, settings, machine=machine)
