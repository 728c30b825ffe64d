"""minimind.decode.widened: 16-bit weights multiplied in float32 for products of many rows, on a CPU without 16-bit
arithmetic of its own; and the precision line the inference commands print."""

import pytest
import torch
import torch.nn.functional as F

from conftest import model_dir, tiny_model
from minimind import chat as engine
from minimind.decode import WIDEN_MIN_ROWS, WidenedLinear, widen_products, widened


@pytest.fixture
def no_16_bit_arithmetic(monkeypatch):
    monkeypatch.setattr(widened, "cpu_computes_natively", lambda dtype: dtype == torch.float32)


def _linear(dtype, bias=True):
    torch.manual_seed(0)
    return torch.nn.Linear(64, 48, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_rows_are_multiplied_in_float32(dtype):
    plain = _linear(dtype)
    wide = _linear(dtype)
    wide.__class__ = WidenedLinear
    prompt = torch.randn(2, WIDEN_MIN_ROWS // 2, 64).to(dtype)  # [B, T, D]: B * T rows reach the threshold
    expected = F.linear(prompt.float(), plain.weight.float(), plain.bias.float()).to(dtype)
    assert torch.equal(wide(prompt), expected) and wide(prompt).dtype == dtype
    # fewer rows (a decode step, a batch of them) stay in the weights' own dtype
    for rows in (1, 8, WIDEN_MIN_ROWS - 1):
        step = torch.randn(rows, 1, 64).to(dtype)
        assert torch.equal(wide(step), plain(step))


def test_compiled_graphs_keep_the_plain_product(monkeypatch):
    wide = _linear(torch.bfloat16)
    wide.__class__ = WidenedLinear
    products = []  # the dtype each product of the module runs in
    linear = F.linear  # nn.Linear's product and the widened one both go through it
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: products.append(x.dtype) or linear(x, w, b))
    prompt = torch.randn(WIDEN_MIN_ROWS, 64).to(torch.bfloat16)
    wide(prompt)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    wide(prompt)
    assert products == [torch.float32, torch.bfloat16]


def test_widening_swaps_only_plain_16_bit_linears(no_16_bit_arithmetic):
    model = tiny_model().to(torch.float16)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert widen_products(model) == len(linears) == 7 * model.config.num_hidden_layers + 1  # + the LM head
    assert all(type(m) is WidenedLinear for m in linears)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert widen_products(model) == 0  # already widened
    assert widen_products(tiny_model()) == 0  # float32


def test_no_widening_where_the_cpu_has_the_arithmetic(monkeypatch):
    monkeypatch.setattr(widened, "cpu_computes_natively", lambda dtype: True)
    assert widen_products(tiny_model().to(torch.bfloat16)) == 0
    monkeypatch.setattr(widened, "cpu_computes_natively", lambda dtype: None)  # features unknown: left as it is
    assert widen_products(tiny_model().to(torch.bfloat16)) == 0


def test_int8_weights_are_left_to_their_kernel(no_16_bit_arithmetic):
    pytest.importorskip("torchao")
    from minimind.decode import quantize_weights_int8

    model = quantize_weights_int8(tiny_model().to(torch.bfloat16))
    assert widen_products(model) == 0  # the decoder layers and the LM head hold int8 tensors
    assert not any(isinstance(module, WidenedLinear) for module in model.modules())
    assert widen_products(tiny_model().to(torch.bfloat16)) == 7 * model.config.num_hidden_layers + 1


def test_widened_model_decodes_as_before(no_16_bit_arithmetic):
    """A prompt of many rows changes only by the rounding of its products; every decode step after it is the plain
    model's, so greedy tokens from the same cache agree."""
    plain = tiny_model(std=0.3).to(torch.float16)
    wide = tiny_model(std=0.3).to(torch.float16)
    widen_products(wide)
    prompt = torch.randint(0, plain.config.vocab_size, (1, WIDEN_MIN_ROWS + 8))
    with torch.no_grad():
        reference = tiny_model(std=0.3)(prompt).logits  # float32 weights, float32 arithmetic
        wide_logits, plain_logits = wide(prompt).logits.float(), plain(prompt).logits.float()
        assert (wide_logits - reference).abs().max() < 0.05 and (plain_logits - reference).abs().max() < 0.05
        step = prompt[:, :1]
        assert torch.equal(wide(step).logits, plain(step).logits)


def test_load_says_the_precision(tmp_path, monkeypatch, no_16_bit_arithmetic):
    model_dir(tmp_path)
    lines = []
    model, _ = engine.load_model_and_tokenizer(str(tmp_path), "cpu", "float16", announce=lines.append)
    assert model.dtype == torch.float16 and isinstance(model.lm_head, WidenedLinear)
    assert lines == [
        "precision: float16; prompts multiplied in float32 (this CPU has no float16 arithmetic of its own)"
    ]

    from minimind import hardware

    monkeypatch.setattr(hardware, "pick_dtype", lambda device: ("bfloat16", "a reason"))
    model, _ = engine.load_model_and_tokenizer(str(tmp_path), "cpu", "auto", announce=lines.append)
    assert model.dtype == torch.bfloat16
    assert lines[-1] == (
        "precision: bfloat16; prompts multiplied in float32 (this CPU has no bfloat16 arithmetic of its own) "
        "(a reason)"
    )
    model, _ = engine.load_model_and_tokenizer(str(tmp_path), "cpu", "float32", announce=lines.append)
    assert model.dtype == torch.float32 and lines[-1] == "precision: float32"
