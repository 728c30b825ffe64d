"""Behaviour that README.md and docs/*.md promise and no module's own test file pins down: the chat command's
flags (docs/ecosystem-serve.md), upstream's `flash_attn` switch (docs/model.md), the corpus generator's
determinism (scripts/make_data.py, data/README.md) and the export refusing before it writes anything
(docs/ecosystem-export.md)."""

import os

import pytest
import torch

from conftest import TOKENIZER_DIR, decode_uncompiled, load_script, model_dir, tiny_config, tiny_model
from minimind import chat as engine
from minimind import cli
from minimind.decode import CompiledDecoder
from modeling_minimind import MiniMindForCausalLM

# ------------------------------------------------------------------------------------------------------
# minimind-chat: every flag the docs show reaches generate
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat-model")
    # A large init spread makes the greedy reply a definite token sequence instead of near-ties.
    model_dir(path, std=0.3)
    return str(path)


def _run_chat(monkeypatch, capsys, argv, lines, generate_for_real=True, compile_step=False):
    """Run `minimind-chat argv` with `lines` typed at the prompt, then end of input (what a pipe gives);
    return the printed text and, per reply, the model, its generate kwargs and the generated ids.
    Without `generate_for_real` each reply is just the end-of-turn token, so default lengths cost nothing.
    The default path's decoder runs its loop uncompiled unless `compile_step`: these tests are about the
    command, and compiling costs seconds each (tests/decode/test_compiled.py covers the compiled step)."""
    calls, paths = [], []
    if not compile_step:
        decode_uncompiled(monkeypatch)
    real_load = engine.load_model_and_tokenizer
    real_decoder_generate = CompiledDecoder.generate

    def spy(model, tokenizer, real_generate, path):
        def generate(input_ids, **gen_kwargs):
            paths.append(path)
            if generate_for_real:
                ids = real_generate(input_ids, **gen_kwargs)
            else:
                gen_kwargs["streamer"].end()
                ids = torch.cat([input_ids, torch.tensor([[tokenizer.eos_token_id]])], dim=1)
            calls.append((model, input_ids, gen_kwargs, ids))
            return ids

        return generate

    def load_and_spy(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)
        model.generate = spy(model, tokenizer, model.generate, "generate")  # reached with --no-compile
        # reached by default: the compiled decoder takes generate's arguments
        monkeypatch.setattr(
            CompiledDecoder,
            "generate",
            lambda self, input_ids, **gen_kwargs: spy(
                model, tokenizer, lambda ids, **kw: real_decoder_generate(self, ids, **kw), "compiled"
            )(input_ids, **gen_kwargs),
        )
        return model, tokenizer

    typed = iter(lines)

    def read_line(prompt):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(engine, "load_model_and_tokenizer", load_and_spy)
    monkeypatch.setattr("builtins.input", read_line)
    cli.chat(argv)
    _run_chat.paths = paths
    printed = capsys.readouterr()
    _run_chat.err = printed.err
    return printed.out, calls


def _sampling(gen_kwargs):
    return {key: gen_kwargs[key] for key in ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k")}


def _special_ids(gen_kwargs):
    # The bundled tokenizer's <|endoftext|> pads and <|im_end|> ends a reply; generate gets both explicitly.
    return gen_kwargs["pad_token_id"], gen_kwargs["eos_token_id"]


def test_chat_samples_with_documented_defaults(chat_dir, monkeypatch, capsys):
    from minimind import hardware

    out, calls = _run_chat(monkeypatch, capsys, ["--model_name_or_path", chat_dir], ["Hi"], generate_for_real=False)
    [(model, input_ids, gen_kwargs, _)] = calls
    # --temperature 0.7, --top_p 0.9 and --top_k 0 (no top-k filter) unless chosen; the default 512 new tokens
    # do not fit this model's 256-token context, so the reply gets what the prompt leaves.
    room = model.config.max_position_embeddings - input_ids.shape[1]
    assert room < 512
    assert _sampling(gen_kwargs) == dict(max_new_tokens=room, do_sample=True, temperature=0.7, top_p=0.9, top_k=None)
    assert _special_ids(gen_kwargs) == (0, 2)
    assert model.dtype == engine.DTYPES[hardware.pick_dtype("cpu")[0]]  # --dtype auto
    assert model.device.type == "cpu" and not model.training
    assert out.startswith("MiniMind chat. /reset starts a new conversation, /exit (or Ctrl-D) quits.\n")
    assert _run_chat.paths == ["compiled"]  # the compiled decoder by default


def test_chat_no_compile_uses_same_generate_args(chat_dir, monkeypatch, capsys):
    argv = ["--model_name_or_path", chat_dir, "--no-do_sample", "--max_new_tokens", "4"]
    _, default = _run_chat(monkeypatch, capsys, argv, ["Hello"], compile_step=True)
    assert _run_chat.paths == ["compiled"]
    _, plain = _run_chat(monkeypatch, capsys, [*argv, "--no-compile"], ["Hello"])
    assert _run_chat.paths == ["generate"]
    assert default[0][2].keys() == plain[0][2].keys() and _sampling(default[0][2]) == _sampling(plain[0][2])
    assert torch.equal(default[0][3], plain[0][3])  # the same greedy reply


@pytest.mark.parametrize("bfloat16_arithmetic", [True, False])
def test_chat_int8_loads_int8_weights_the_rest_as_the_cpu_computes(chat_dir, monkeypatch, capsys, bfloat16_arithmetic):
    """--int8 loads int8 decoder weights and LM head, the embedding in bfloat16, or in float32 on a CPU without
    bfloat16 arithmetic, and says which."""
    pytest.importorskip("torchao")
    from minimind.decode import int8

    monkeypatch.setattr(int8, "cpu_computes_natively", lambda dtype: bfloat16_arithmetic)
    argv = ["--model_name_or_path", chat_dir, "--no-do_sample", "--max_new_tokens", "4", "--int8", "--no-compile"]
    _, [(model, _, _, reply)] = _run_chat(monkeypatch, capsys, argv, ["Hello"])
    dtype = torch.bfloat16 if bfloat16_arithmetic else torch.float32
    assert model.dtype == dtype and model.model.embed_tokens.weight.dtype == dtype
    projections = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]  # the LM head's too
    assert len(projections) == 7 * model.config.num_hidden_layers + 1
    assert all(w.qdata.dtype == torch.int8 for w in projections)
    assert reply.shape[1] > 0
    expected = (
        "precision: int8 decoder weights, the rest in bfloat16"
        if bfloat16_arithmetic
        else "precision: int8 decoder weights, the rest in float32 (this CPU has no bfloat16 arithmetic)"
    )
    assert expected in _run_chat.err.splitlines()


def test_chat_dtype_auto_loads_the_picked_precision_and_says_so(chat_dir, monkeypatch, capsys):
    """--dtype auto (the default) loads the precision picked for the device and prints which, with the reason;
    float32 says so too."""
    from minimind import hardware
    from minimind.decode import widened

    monkeypatch.setattr(hardware, "pick_dtype", lambda device: ("bfloat16", f"picked for {device}"))
    monkeypatch.setattr(widened, "cpu_computes_natively", lambda dtype: True)  # tests/decode/test_widened.py
    argv = ["--model_name_or_path", chat_dir, "--no-do_sample", "--max_new_tokens", "2", "--device", "cpu"]
    _, [(model, _, _, _)] = _run_chat(monkeypatch, capsys, [*argv, "--dtype", "auto"], ["Hi"])
    assert model.dtype == torch.bfloat16
    expected = "precision: bfloat16 (picked for cpu)"
    assert expected in _run_chat.err.splitlines()
    _, [(model, _, _, _)] = _run_chat(monkeypatch, capsys, [*argv, "--dtype", "float32"], ["Hi"])
    assert model.dtype == torch.float32 and "precision: float32" in _run_chat.err.splitlines()


def test_chat_sampling_flags_reach_generate(chat_dir, monkeypatch, capsys):
    argv = [
        "--model_name_or_path",
        chat_dir,
        "--temperature",
        "0.5",
        "--top_p",
        "0.8",
        "--top_k",
        "50",
        "--max_new_tokens",
        "3",
        "--dtype",
        "bfloat16",
        "--device",
        "cpu",
    ]
    _, calls = _run_chat(monkeypatch, capsys, argv, ["Hi"])
    [(model, input_ids, gen_kwargs, ids)] = calls
    assert _sampling(gen_kwargs) == dict(max_new_tokens=3, do_sample=True, temperature=0.5, top_p=0.8, top_k=50)
    assert model.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.bfloat16
    assert 0 < ids.shape[1] - input_ids.shape[1] <= 3


def test_chat_no_do_sample_prints_greedy_replies(chat_dir, monkeypatch, capsys):
    """`--no-do_sample` is greedy decoding: the printed replies are exactly the independently loaded model's
    greedy tokens for the whole conversation so far, and the second turn's prompt carries the first exchange."""
    from minimind.tokenizer import load_tokenizer

    argv = [
        "--model_name_or_path",
        chat_dir,
        "--no-do_sample",
        "--max_new_tokens",
        "6",
        "--system_prompt",
        "Answer in one sentence.",
        "--dtype",
        "float32",  # the reference's precision
    ]
    out, calls = _run_chat(monkeypatch, capsys, argv, ["Hello", "Who are you?"])
    assert len(calls) == 2
    tokenizer = load_tokenizer(chat_dir)
    reference = MiniMindForCausalLM.from_pretrained(chat_dir, dtype=torch.float32).eval()
    messages = [{"role": "system", "content": "Answer in one sentence."}]
    for (_, input_ids, gen_kwargs, _), question in zip(calls, ["Hello", "Who are you?"]):
        assert _sampling(gen_kwargs) == dict(
            max_new_tokens=6, do_sample=False, temperature=None, top_p=None, top_k=None
        )
        assert _special_ids(gen_kwargs) == (0, 2)
        messages.append({"role": "user", "content": question})
        prompt = engine.chat_prompt_ids(tokenizer, messages)
        assert input_ids[0].tolist() == prompt
        greedy = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        reply = tokenizer.decode(greedy[0, len(prompt) :], skip_special_tokens=True)
        assert reply.strip() and reply in out
        messages.append({"role": "assistant", "content": reply})


def test_chat_reset_keeps_only_the_system_prompt(chat_dir, monkeypatch, capsys):
    from minimind.tokenizer import load_tokenizer

    argv = [
        "--model_name_or_path",
        chat_dir,
        "--no-do_sample",
        "--max_new_tokens",
        "2",
        "--system_prompt",
        "Be brief.",
    ]
    out, calls = _run_chat(monkeypatch, capsys, argv, ["Hello", "/reset", "Hi", "/exit", "never read"])
    assert "(conversation reset)" in out and len(calls) == 2
    tokenizer = load_tokenizer(chat_dir)
    fresh = engine.chat_prompt_ids(
        tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert calls[1][1][0].tolist() == fresh


def test_chat_fills_context_exactly_and_no_more(tmp_path, monkeypatch, capsys):
    """docs/ecosystem-serve.md: the prompt gets the context minus room for the reply (max_new_tokens, at most half
    the context); a single message too long for that is refused with a note."""
    from minimind.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER_DIR)
    prompt_length = len(engine.chat_prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}]))
    for context, answered in ((prompt_length + 2, True), (prompt_length + 1, False)):
        path = tmp_path / f"context-{context}"
        model_dir(path, max_position_embeddings=context)
        out, calls = _run_chat(
            monkeypatch, capsys, ["--model_name_or_path", str(path), "--no-do_sample", "--max_new_tokens", "2"], ["Hi"]
        )
        assert len(calls) == int(answered), context
        assert (f"(message too long for the {context}-token context)" in out) is not answered


# ------------------------------------------------------------------------------------------------------
# Upstream's flash_attn switch (docs/model.md: True -> sdpa, False -> eager)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flash_attn, kernel", [(True, "sdpa"), (False, "eager")])
def test_flash_attn_kernel_survives_reload(flash_attn, kernel, tmp_path):
    """flash_attn picks the attention kernel, and the choice survives a reload."""
    model = tiny_model(std=0.1, flash_attn=flash_attn)
    assert model.config._attn_implementation == kernel
    model.save_pretrained(tmp_path)
    reloaded = MiniMindForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.flash_attn is flash_attn and reloaded.config._attn_implementation == kernel


def test_flash_attn_kernels_give_same_logits():
    """Both flash_attn kernels give the same logits, and an explicit attn_implementation wins."""
    fused, explicit = tiny_model(std=0.1, flash_attn=True), tiny_model(std=0.1, flash_attn=False)
    ids = torch.randint(0, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(
            fused(ids, attention_mask=mask).logits[1],
            explicit(ids, attention_mask=mask).logits[1],
            atol=1e-5,
            rtol=1e-5,
        )
    assert tiny_config(flash_attn=False, attn_implementation="sdpa")._attn_implementation == "sdpa"


# ------------------------------------------------------------------------------------------------------
# scripts/make_data.py: "byte-identical for a given seed and set of size options"
# ------------------------------------------------------------------------------------------------------


def _make_data(out_dir, seed):
    load_script("make_data").main(
        [
            "--out_dir",
            str(out_dir),
            "--seed",
            str(seed),
            "--pretrain_rows",
            "60",
            "--sft_rows",
            "50",
            "--dpo_rows",
            "10",
        ]
    )
    return {name: (out_dir / name).read_bytes() for name in sorted(os.listdir(out_dir))}


def test_make_data_is_byte_identical_per_seed(tmp_path):
    """make_data run twice gives byte-identical files, and another seed gives other data."""
    first, second = _make_data(tmp_path / "a", 7), _make_data(tmp_path / "b", 7)
    assert {"pretrain.jsonl", "sft.jsonl", "dpo.jsonl"} <= set(first)
    assert first == second
    assert all(first[name] for name in first)
    other = _make_data(tmp_path / "c", 8)
    assert set(other) == set(first) and other["pretrain.jsonl"] != first["pretrain.jsonl"]


# ------------------------------------------------------------------------------------------------------
# minimind-export: refused up front, so nothing half-written is left behind
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["qwen3", "gguf"])
def test_export_refusal_writes_nothing(target, tmp_path):
    source, out = tmp_path / "model", tmp_path / "exported"
    model_dir(source, qk_norm=False)
    with pytest.raises(ValueError, match=rf"^Cannot export to {target}: qk_norm=False "):
        load_script("export").main(["--to", target, "--model_name_or_path", str(source), "--output_dir", str(out)])
    assert not out.exists()


# ------------------------------------------------------------------------------------------------------
# README, Train: every run writes "a complete model directory" that from_pretrained(..., trust_remote_code=True) loads
# ------------------------------------------------------------------------------------------------------


def test_sft_output_reloads_with_remote_code(tmp_path):
    """An SFT output reloads with remote code and replies with the trained model's ids."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import ROOT

    start, out, data = tmp_path / "start", tmp_path / "sft", tmp_path / "sft.jsonl"
    model_dir(start, std=0.1)
    lines = Path(ROOT, "data", "sft.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:16]
    data.write_text("".join(lines), encoding="utf-8")
    trainer, _ = load_script("sft").main(
        [
            "--model_name_or_path",
            str(start),
            "--data_path",
            str(data),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--learning_rate",
            "1e-2",
            "--eval_fraction",
            "0.25",
            "--max_seq_length",
            "64",
            "--use_cpu",
            "--report_to",
            "none",
            "--per_device_train_batch_size",
            "4",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--seed",
            "0",
        ]
    )
    trained = trainer.model.eval()
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who are you?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        expected = trained.generate(**prompt, max_new_tokens=8, do_sample=False)
        got = reloaded.generate(**prompt, max_new_tokens=8, do_sample=False)
        untrained = MiniMindForCausalLM.from_pretrained(start).eval()
        moved = (trained.lm_head.weight - untrained.lm_head.weight).abs().max()
    assert torch.equal(got, expected)
    assert moved > 1e-3  # the reply compared is the trained model's, not the starting weights'
