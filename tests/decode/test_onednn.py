"""fp32 prompts through oneDNN on CPUs whose maker MKL's fast code paths are not written for (`onednn_products`):
the same weights, the same logits to fp32 rounding, the decoder's tokens those of `generate`."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from conftest import BATCH, PROMPT, batch_reference, greedy, reference, tiny_model
from minimind.decode import (
    CompiledDecoder,
    OneDnnLinear,
    OneDnnSwiGLU,
    RowCache,
    RowDecoder,
    compiled,
    onednn_products,
)
from modeling_minimind import MiniMindMLP

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch is built without oneDNN")


@pytest.fixture
def not_intel(monkeypatch):
    """The decoders' choice as on an AMD CPU, wherever the tests run; the list of `OneDnnLinear` calls made."""
    monkeypatch.setattr(compiled, "onednn_products", lambda model: onednn_products(model, intel=False))
    calls, product = [], OneDnnLinear.forward
    monkeypatch.setattr(OneDnnLinear, "forward", lambda self, input: calls.append(input.shape) or product(self, input))
    return calls


# the linear layers a prompt calls through `OneDnnLinear.forward`: q, k, v, o and the MLP's down product in every
# layer (`OneDnnSwiGLU` multiplies by gate and up itself) and the LM head
def onednn_linear_calls(model):
    return 5 * model.config.num_hidden_layers + 1


def test_view_multiplies_the_models_own_weights_through_onednn():
    """Every linear layer of the view is a `OneDnnLinear` and every MLP a `OneDnnSwiGLU`, over the model's own
    tensors (no copy); the model keeps its plain modules; a prompt's logits and cache are the model's to fp32
    rounding, with gradients too."""
    model = tiny_model(std=0.3).eval()
    view = onednn_products(model, intel=False)
    linears = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    assert len(linears) == 7 * model.config.num_hidden_layers + 1
    for name in linears:
        assert type(view.get_submodule(name)) is OneDnnLinear and type(model.get_submodule(name)) is torch.nn.Linear
        assert view.get_submodule(name).weight is model.get_submodule(name).weight
    mlps = [name for name, module in model.named_modules() if type(module) is MiniMindMLP]
    assert len(mlps) == model.config.num_hidden_layers
    assert all(type(view.get_submodule(name)) is OneDnnSwiGLU for name in mlps)
    assert {name: t.data_ptr() for name, t in view.state_dict().items()} == {
        name: t.data_ptr() for name, t in model.state_dict().items()
    }
    with torch.no_grad():
        ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
        got = view(input_ids=BATCH, cache=ours, use_cache=True).logits
        want = model(input_ids=BATCH, cache=theirs, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for mine, its in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(mine.keys, its.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(mine.values, its.values, rtol=0, atol=1e-5)
    # with gradients on, the plain product (oneDNN's op has no backward): the model's own gradients
    grads = []
    for forward in (model, view):
        forward(input_ids=PROMPT).logits.square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_swiglu_does_its_activation_and_multiply_inside_onednns_products():
    """`OneDnnSwiGLU` gives the plain MLP's output to fp32 rounding over the same weights, over 3-D rows and over no
    rows (an expert that got no tokens), with no SiLU or multiply of its own: two products with the element-wise
    work inside them and the down product; an MLP with another activation stays plain."""
    model = tiny_model(std=0.3).eval()
    view = onednn_products(model, intel=False)
    plain, fused = model.model.layers[0].mlp, view.model.layers[0].mlp
    rows = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad():
        want = plain(rows)
        with OpsCalled() as ops:
            got = fused(rows)
        empty = fused(rows[0, :0])
    assert ops == [
        torch.ops.mkldnn._linear_pointwise.default,
        torch.ops.mkldnn._linear_pointwise.binary,
        torch.ops.mkldnn._linear_pointwise.default,
    ]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got.abs().max() > 0.1  # not a near-zero output that any result would match
    assert empty.shape == (0, model.config.hidden_size)
    gelu = tiny_model(hidden_act="gelu").eval()
    assert type(onednn_products(gelu, intel=False).model.layers[0].mlp) is MiniMindMLP


class OpsCalled(TorchDispatchMode, list):
    """The ATen (and oneDNN) ops called inside it, in order, views and reshapes left out."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func._schema.name.startswith(("aten::view", "aten::reshape", "aten::_unsafe_view")):
            self.append(func)
        return func(*args, **(kwargs or {}))


def test_view_only_where_mkl_runs_slow_over_plain_fp32_weights(monkeypatch):
    model = tiny_model()
    assert onednn_products(model, intel=True) is None  # MKL's own maker
    assert onednn_products(tiny_model().to(torch.bfloat16), intel=False) is None
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert onednn_products(model, intel=False) is None


def test_decoder_prompts_of_several_tokens_take_the_view(not_intel):
    """One token runs the model; a prompt of several tokens the view, built once, each of its linear layers called
    once per prompt (the steps run the model); the decoder's greedy tokens are `generate`'s, one prompt and a batch
    of them."""
    model = tiny_model(std=0.3).eval()
    decoder = CompiledDecoder(model, compile=False)
    assert decoder.prompt_model(1) is model
    view = decoder.prompt_model(PROMPT.numel())
    assert view is not model and decoder.prompt_model(2) is view
    assert any(isinstance(module, OneDnnLinear) for module in view.modules())
    assert torch.equal(decoder.generate(PROMPT, max_new_tokens=12, **greedy()), reference(model, 12, **greedy()))
    linears = onednn_linear_calls(model)
    assert len(not_intel) == linears and not_intel[0] == (1, PROMPT.shape[1], model.config.hidden_size)
    batch = decoder.generate(BATCH, max_new_tokens=6, **greedy())
    assert torch.equal(batch, batch_reference(model, 6, **greedy())) and len(not_intel) == 2 * linears


def test_decoder_on_intel_keeps_the_models_products(monkeypatch):
    monkeypatch.setattr(compiled, "onednn_products", lambda model: onednn_products(model, intel=True))
    model = tiny_model().eval()
    assert CompiledDecoder(model, compile=False).prompt_model(PROMPT.numel()) is model


def test_server_prompts_go_through_the_view(not_intel):
    """The server's decoder (`RowDecoder`) prefills prompts of different lengths through the view, once per linear
    layer, each prompt's last logits the model's own to fp32 rounding."""
    model = tiny_model(std=0.3).eval()
    decoder = RowDecoder(model, compile=False)
    cache = RowCache(model.config, rows=2, length=32, dtype=torch.float32, device="cpu")
    prompts = [PROMPT[0].tolist(), BATCH[1, :4].tolist()]
    logits = decoder.prefill(prompts, cache, [0, 1])
    assert len(not_intel) == onednn_linear_calls(model)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[row], want, rtol=0, atol=1e-5)
