"""Which kernels a compiled decode step runs: the fp32 products each CPU maker's table picks, inductor's merged
projections and frozen bf16 weights, int8 weights through torchao; each checked against generate's tokens.
These depend on torch and the CPU alone, so the transformers 5.17 leg leaves them to the main one."""

import gc
import weakref

import pytest
import torch
from transformers import DynamicCache

from conftest import BATCH, PROMPT, batch_reference, greedy, reference, tiny_model
from minimind.decode import CompiledDecoder, RowCache, RowDecoder, compiled, fp32_product_kernel, fp32_products
from minimind.decode.sixteen_bit_products import ROW_BLOCKS, SixteenBitProducts
from minimind.hardware import cpu_vendor, torch_kernels_avx512


@pytest.fixture(autouse=True)
def compile_in_process(monkeypatch):
    """These tests read the kernels inductor picks while torch.compile compiles the step in this process (the
    path taken where a step cannot be packaged ahead of time); the packaged path is tests/decode/test_compiled.py's."""
    monkeypatch.setattr(compiled, "_exportable", lambda model: False)


@pytest.fixture(scope="module")
def model():
    return tiny_model(std=0.3)


def greedy_gap(model, ids, prompt_length):
    """How far each generated token's logit falls below the best one, by the model's own eager full forward:
    0 everywhere for exact greedy; small where 16-bit kernels round a near tie the other way."""
    with torch.no_grad():
        logits = model(ids).logits[0, prompt_length - 1 : -1].float()  # [new, V]
    chosen = logits.gather(-1, ids[0, prompt_length:, None])[:, 0]
    return (logits.max(-1).values - chosen).max().item()


def test_16_bit_products_take_the_template_where_the_cpu_lacks_their_arithmetic(int8_model, monkeypatch):
    """16-bit weights on a CPU without 16-bit arithmetic: inductor's C++ template alone, which widens them to fp32
    in registers, and one-row steps multiply as blocked sums instead (`SixteenBitProducts`), steps of several rows
    too where torch's kernels stop at AVX2; with the arithmetic, or with int8 weights, the template and ATen's
    products autotuned, and no pass but float16's."""
    native = {torch.bfloat16: False, torch.float16: False}
    monkeypatch.setattr(compiled, "cpu_computes_natively", lambda dtype: native.get(dtype, True))
    for dtype in (torch.bfloat16, torch.float16):
        decoder = CompiledDecoder(tiny_model().to(dtype))
        for batch in (1, 8):
            settings = decoder.inductor_settings(batch)
            assert (settings["max_autotune"], settings["max_autotune_gemm_backends"]) == (True, "CPP")
        assert type(decoder.inductor_settings(1)["post_grad_custom_pre_pass"]) is SixteenBitProducts
        assert decoder.inductor_settings(8)["post_grad_custom_pre_pass"] is None
    settings = CompiledDecoder(int8_model).inductor_settings(1)
    assert (settings["max_autotune"], settings["max_autotune_gemm_backends"]) == (True, "CPP,ATEN")
    assert settings["post_grad_custom_pre_pass"] is None
    native.update({torch.bfloat16: True, torch.float16: True})
    monkeypatch.setattr(compiled, "usable_cpu_features", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    for batch in (1, 8):
        settings = CompiledDecoder(tiny_model().to(torch.bfloat16)).inductor_settings(batch)
        assert (settings["max_autotune"], settings["max_autotune_gemm_backends"]) == (True, "CPP,ATEN")
        assert settings["post_grad_custom_pre_pass"] is None
    # bfloat16 arithmetic without AMX's tiles: one row takes the template alone (oneDNN's product and the sums
    # decoded slower there), its tied head the sums over the embedding's rows; several rows are autotuned
    monkeypatch.setattr(compiled, "usable_cpu_features", lambda: frozenset({"avx512_bf16"}))
    decoder = CompiledDecoder(tiny_model().to(torch.bfloat16))
    one_row = decoder.inductor_settings(1)
    assert type(one_row["post_grad_custom_pre_pass"]) is SixteenBitProducts
    assert one_row["post_grad_custom_pre_pass"].tied_head_only and one_row["max_autotune_gemm_backends"] == "CPP"
    assert decoder.inductor_settings(8)["post_grad_custom_pre_pass"] is None
    assert decoder.inductor_settings(8)["max_autotune_gemm_backends"] == "CPP,ATEN"
    for dtype in (torch.bfloat16, torch.float16):  # sums of every product wherever they are taken
        decoder = CompiledDecoder(tiny_model().to(dtype))
        for batch in (1, 8):
            sums = decoder.inductor_settings(batch)["post_grad_custom_pre_pass"]
            assert sums is None or not sums.tied_head_only or (dtype, batch) == (torch.bfloat16, 1)
    # float16's one row takes the sums with float16 arithmetic too (oneDNN's product over it decoded slower)
    decoder = CompiledDecoder(tiny_model().to(torch.float16))
    assert type(decoder.inductor_settings(1)["post_grad_custom_pre_pass"]) is SixteenBitProducts
    assert decoder.inductor_settings(8)["post_grad_custom_pre_pass"] is None
    # where torch's kernels stop at AVX2, steps of several rows take the sums too, wherever one row does
    monkeypatch.setattr(compiled, "torch_kernels_avx512", lambda: False)
    native[torch.bfloat16] = False
    for dtype in (torch.bfloat16, torch.float16):
        decoder = CompiledDecoder(tiny_model().to(dtype))
        assert all(
            type(decoder.inductor_settings(n)["post_grad_custom_pre_pass"]) is SixteenBitProducts for n in (1, 8)
        )
    native[torch.bfloat16] = True
    assert CompiledDecoder(tiny_model().to(torch.bfloat16)).inductor_settings(8)["post_grad_custom_pre_pass"] is None
    monkeypatch.setattr(compiled, "torch_kernels_avx512", lambda: True)
    native[torch.bfloat16] = None  # features unknown: as before
    monkeypatch.setattr(compiled, "usable_cpu_features", lambda: None)
    settings = CompiledDecoder(tiny_model().to(torch.bfloat16)).inductor_settings(1)
    assert settings["max_autotune_gemm_backends"] == "CPP,ATEN" and settings["post_grad_custom_pre_pass"] is None


class RecordGraph:
    """An inductor post-grad pass that keeps each graph's (target, shape) of every call and constant."""

    def __init__(self):
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

        graphs = self.graphs = []

        class Record(CustomGraphPass):
            def __call__(self, graph):
                module = graph.owning_module
                graphs.append(
                    [
                        (str(node.target), tuple(node.meta["val"].shape))
                        if node.op == "call_function"
                        else ("constant", tuple(getattr(module, node.target).shape), getattr(module, node.target))
                        for node in graph.nodes
                        if node.op in ("call_function", "get_attr")
                    ]
                )

            def uuid(self):
                return get_hash_for_files((__file__,))

        self.graph_pass = Record()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape", [(1, 48), (1, 1, 48), (3, 48), (3, 1, 48)], ids=["[1, in]", "[1, 1, in]", "[3, in]", "[3, 1, in]"]
)
def test_16_bit_products_become_blocked_sums(dtype, shape):
    """`SixteenBitProducts` on frozen products of one row or several: each product is gone, its weight [40, 48] (then
    [16, 40]) is cut into `ROW_BLOCKS` (4) blocks of rows, each a contiguous constant of its own with exactly those
    rows, and one sum over each; the result is the fp32 product rounded once to the 16-bit type (the sum order may move
    it by one unit in the last place, never more), the second product reading the first's sums as they are laid out."""
    torch.manual_seed(0)
    first = torch.nn.Linear(48, 40, bias=False).to(dtype).eval()
    second = torch.nn.Linear(40, 16, bias=False).to(dtype).eval()
    chain = torch.nn.Sequential(first, second)
    settings = {"freezing": True, "cpp.weight_prepack": True, "post_grad_custom_pre_pass": SixteenBitProducts()}
    x = torch.randn(*shape).to(dtype)
    record = RecordGraph()
    torch._dynamo.reset()
    # fx_graph_cache off: a graph the cache holds from an earlier run would skip the pass that records it
    recorded = {**settings, "post_grad_custom_post_pass": record.graph_pass, "fx_graph_cache": False}
    with torch.no_grad(), torch._inductor.config.patch(recorded):
        out = torch.compile(chain, fullgraph=True)(x)
        middle = first(x)
    [graph] = record.graphs
    calls = [entry[0] for entry in graph if entry[0] != "constant"]
    assert [target for target in calls if "mm" in target or "linear" in target] == []
    assert calls.count("aten.sum.dim_IntList") == 2 * ROW_BLOCKS == 8
    blocks = [entry[2] for entry in graph if entry[0] == "constant"]
    assert [tuple(block.shape) for block in blocks] == [(10, 48)] * 4 + [(4, 40)] * 4
    assert all(block.is_contiguous() and block.dtype == dtype for block in blocks)
    assert torch.equal(torch.cat(blocks[:4]), first.weight.detach())
    assert torch.equal(torch.cat(blocks[4:]), second.weight.detach())
    exact = (middle.double() @ second.weight.detach().double().t()).to(dtype)  # from eager's first product
    assert out.shape == exact.shape
    ulps = (out.float() - exact.float()).abs() / torch.finfo(dtype).eps / exact.float().abs().clamp_min(1e-3)
    assert ulps.max().item() <= 1.0 + 1 / 64  # the first product's own rounding may differ by one unit too


def test_fp32_products_of_several_rows_become_blocked_sums():
    """`Fp32Products` where the table says "sums" (two rows or more where torch's kernels stop at AVX2, one to three on
    AMD): every product of a two-product chain is gone, both weights are cut into `ROW_BLOCKS` blocks, and the result
    is the product's to fp32 rounding, the second product reading the first's sums as they are laid out; one row on
    Intel keeps its kernel."""
    torch.manual_seed(0)
    chain = torch.nn.Sequential(torch.nn.Linear(48, 40, bias=False), torch.nn.Linear(40, 16, bias=False)).eval()
    for shape, intel in (((4, 48), True), ((3, 1, 48), False), ((1, 48), True), ((1, 48), False)):
        x = torch.randn(*shape)
        record = RecordGraph()
        torch._dynamo.reset()
        settings = {
            "freezing": True,
            "cpp.weight_prepack": True,
            "post_grad_custom_pre_pass": fp32_products.Fp32Products(),
            "post_grad_custom_post_pass": record.graph_pass,
            "fx_graph_cache": False,
        }
        with (
            torch.no_grad(),
            torch._inductor.config.patch(settings),
            pytest.MonkeyPatch.context() as patch,
        ):
            patch.setattr(
                fp32_products,
                "fp32_product_kernel",
                lambda rows, intel=intel: fp32_product_kernel(rows, intel=intel, avx512=False),
            )
            out = torch.compile(chain, fullgraph=True)(x)
            exact = chain.double()(x.double())
            chain.float()
        [graph] = record.graphs
        calls = [entry[0] for entry in graph if entry[0] != "constant"]
        products = [target for target in calls if "mm" in target or "linear" in target]
        if shape == (1, 48) and intel:
            assert products and "aten.sum.dim_IntList" not in calls
            continue
        assert products == [] and calls.count("aten.sum.dim_IntList") == 2 * ROW_BLOCKS == 8
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-6)


class TiedHead(torch.nn.Module):
    """An embedding lookup, a projection and an LM head sharing the embedding's table, as a tied model's step holds
    them."""

    def __init__(self, vocab=40, width=48):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.projection = torch.nn.Linear(width, width, bias=False)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):  # [B, 1] -> [B, 1, V]
        return self.head(torch.nn.functional.silu(self.projection(self.embed(ids))))


@pytest.mark.parametrize(
    ("dtype", "rows", "kernels", "head_only"),
    [
        (torch.float32, 1, {"intel": False, "avx512": True}, False),
        (torch.float32, 4, {"intel": True, "avx512": False}, False),
        (torch.bfloat16, 1, {}, False),
        (torch.bfloat16, 4, {}, False),
        (torch.bfloat16, 1, {}, True),
    ],
    ids=["fp32-template", "fp32-sums-of-rows", "bf16-row", "bf16-rows", "bf16-tied-head-only"],
)
def test_tied_head_sums_read_the_embeddings_own_rows(dtype, rows, kernels, head_only):
    """A tied LM head multiplied as blocked sums (fp32 where the table says "template" or "sums", 16-bit weights
    always) reads its `ROW_BLOCKS` (4) blocks as slices of the embedding's table, the step's one constant of the
    vocabulary's rows, and the logits are the product's to the dtype's rounding. `tied_head_only` leaves the
    projection's product alone."""
    torch.manual_seed(0)
    module = TiedHead().to(dtype).eval()
    ids = torch.randint(0, 40, (rows, 1))
    record = RecordGraph()
    torch._dynamo.reset()
    products = fp32_products.Fp32Products() if dtype == torch.float32 else SixteenBitProducts(head_only)
    settings = {
        "freezing": True,
        "cpp.weight_prepack": True,
        "post_grad_custom_pre_pass": products,
        "post_grad_custom_post_pass": record.graph_pass,
        "fx_graph_cache": False,
    }
    with torch.no_grad(), torch._inductor.config.patch(settings), pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp32_products, "fp32_product_kernel", lambda n: fp32_product_kernel(n, **kernels))
        out = torch.compile(module, fullgraph=True)(ids)
        exact = module.double()(ids)
    [graph] = record.graphs
    calls = [entry[0] for entry in graph if entry[0] != "constant"]
    products = [target for target in calls if "mm" in target or "linear" in target]
    constants = [entry[2] for entry in graph if entry[0] == "constant"]
    if head_only or (dtype == torch.float32 and rows == 1):  # the projection keeps its product
        assert len(products) == 1 and calls.count("aten.sum.dim_IntList") == ROW_BLOCKS
    else:  # the projection as sums too, its 4 blocks constants of their own
        assert products == [] and calls.count("aten.sum.dim_IntList") == 2 * ROW_BLOCKS
        assert [tuple(c.shape) for c in constants].count((12, 48)) == ROW_BLOCKS == 4
    # the head's blocks are slices of the embedding's table, the one constant of the vocabulary's rows
    assert [c.shape[0] for c in constants].count(40) == 1 and any(
        torch.equal(c, module.embed.weight) for c in constants
    )
    assert calls.count("aten.slice.Tensor") == ROW_BLOCKS
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1 / 128}[dtype]
    torch.testing.assert_close(out.double(), exact, rtol=tolerance, atol=tolerance * exact.abs().max().item())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "native", "tiles"),
    [
        (torch.bfloat16, True, True),
        (torch.bfloat16, True, False),
        (torch.bfloat16, False, False),
        (torch.float16, True, True),
    ],
    ids=["bf16-arithmetic-amx", "bf16-arithmetic", "no-bf16-arithmetic", "fp16-arithmetic"],
)
def test_16_bit_frozen_weights_decode_greedily(dtype, native, tiles, monkeypatch):
    """Compiled 16-bit frozen weights decode greedily: bf16 with AMX's tiles autotuned, with the arithmetic but
    without the tiles through the template alone (the tied head as sums), or (without bf16 arithmetic, and float16
    everywhere) as blocked sums (`SixteenBitProducts`: not one matrix product left in the step)."""
    monkeypatch.setattr(compiled, "cpu_computes_natively", lambda _: native)
    monkeypatch.setattr(compiled, "usable_cpu_features", lambda: frozenset({"amx_bf16"} if tiles else ()))
    model = tiny_model(std=0.3).to(dtype)
    decoder = CompiledDecoder(model)
    template = not native or (dtype == torch.bfloat16 and not tiles)
    assert decoder.inductor_settings(1)["max_autotune_gemm_backends"] == ("CPP" if template else "CPP,ATEN")
    assert decoder.inductor_settings(1)["cpp.weight_prepack"] is True and decoder.inductor_settings(1)["freezing"]
    sums = not native or dtype == torch.float16
    eager = CompiledDecoder(model, compile=False)
    record = RecordProducts()
    for prompt in (PROMPT, torch.tensor([[9, 9, 1, 2]])):  # the second reuses the cache: it must see its own prompt
        with torch._inductor.config.patch(post_grad_custom_post_pass=record.graph_pass, fx_graph_cache=False):
            out = decoder.generate(prompt, max_new_tokens=40, **greedy())
        plain = eager.generate(prompt, max_new_tokens=40, **greedy())
        assert torch.equal(out[:, : prompt.shape[1] + 20], plain[:, : prompt.shape[1] + 20])
        assert greedy_gap(model, out, prompt.shape[1]) <= 0.0625  # two 16-bit steps at these logits' size
    [products] = record.graphs
    assert (products == []) is sums  # else oneDNN's products (some with an add fused in)


class RecordProducts:
    """An inductor post-grad pass that records the matrix products of each graph it sees."""

    def __init__(self):
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

        products = (
            torch.ops.aten.mm.default,
            torch.ops.aten.addmm.default,
            torch.ops.mkl._mkl_linear,
            torch.ops.mkl._mkl_linear.default,
            torch.ops.mkldnn._linear_pointwise.default,
        )
        graphs = self.graphs = []

        class Record(CustomGraphPass):
            def __call__(self, graph):
                graphs.append([str(node.target) for node in graph.nodes if node.target in products])

            def uuid(self):
                return get_hash_for_files((__file__,))

        self.graph_pass = Record()


@pytest.mark.slow
def test_step_merges_projections():
    """With frozen weights inductor concatenates q/k/v and gate/up: 4 matrix products per layer (qkv, o, gate-up,
    down) and the LM head, against 7 per layer unmerged (the tied head is no product where this CPU's table says
    "template": sums over the embedding's rows). The two decoders share no dynamo cache: with one graph allowed per
    code object both compile, and their graphs, frozen weights included, go with them."""
    import gc
    import weakref

    if fp32_product_kernel(1) == "sums":
        pytest.skip("one fp32 row multiplies as blocked sums on this CPU: no matrix product left to count")
    model = tiny_model(std=0.3)
    layers = model.config.num_hidden_layers
    head = int(fp32_product_kernel(1) != "template")
    decoders = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for merged, expected in ((True, 4 * layers + head), (False, 7 * layers + head)):
            record = RecordProducts()
            decoder = CompiledDecoder(model)
            settings = decoder.inductor_settings(1) | {"cpp.enable_concat_linear": merged}
            decoder.inductor_settings = lambda batch, settings=settings: settings
            with torch._inductor.config.patch(post_grad_custom_post_pass=record.graph_pass, fx_graph_cache=False):
                out = decoder.generate(PROMPT, max_new_tokens=3, **greedy())
            assert decoder.compiled and [len(products) for products in record.graphs] == [expected]
            assert torch.equal(out, reference(model, 3, **greedy()))
            decoders.append(decoder)
    alive = weakref.ref(model)
    del model, decoder, decoders
    gc.collect()
    assert alive() is None


def test_fp32_products_take_fastest_kernel():
    """fp32 products take the kernel measured fastest for their row count on each CPU maker."""
    rows = (1, 2, 3, 4, 8, 16)
    intel = [fp32_product_kernel(n, intel=True, avx512=True) for n in rows]
    assert intel == ["plain", "mkl", "mkl", "onednn", "onednn", "onednn"]
    assert [fp32_product_kernel(n, intel=False, avx512=True) for n in rows] == ["template"] + ["onednn"] * 5
    # where torch's kernels stop at AVX2, several rows multiply as blocked sums on Intel; on AMD one to three rows,
    # four or more through oneDNN's packed product
    assert [fp32_product_kernel(n, intel=True, avx512=False) for n in rows] == ["plain"] + ["sums"] * 5
    assert [fp32_product_kernel(n, intel=False, avx512=False) for n in rows] == ["sums"] * 3 + ["onednn"] * 3
    assert fp32_products.INTEL_CPU == (cpu_vendor() in ("GenuineIntel", ""))
    assert fp32_products.AVX512_KERNELS == torch_kernels_avx512()


def use_fp32_table(monkeypatch, **table):
    """Both places that read the fp32 kernel table (the graph pass, and the compile settings, which pick the one-row
    template) read it for `table`'s CPU maker and vector width."""
    for module in (fp32_products, compiled):
        monkeypatch.setattr(module, "fp32_product_kernel", lambda rows: fp32_product_kernel(rows, **table))


def packaged_steps(model, monkeypatch, tmp_path, ids):
    """A decoder that packages its steps with AOTInductor in `tmp_path`, 6 greedy tokens of it on `ids`, and the
    matrix products of the graph it packaged."""
    monkeypatch.setattr(compiled, "_exportable", compiled.plain_weights)
    record = RecordProducts()
    decoder = CompiledDecoder(model, cache_dir=tmp_path)
    assert decoder.backend == "aoti"
    with torch._inductor.config.patch(post_grad_custom_post_pass=record.graph_pass):
        out = decoder.generate(ids, max_new_tokens=6, **greedy())
    return decoder, out, record.graphs


def fp32_products_of_steps(model, monkeypatch, intel, batch, avx512=True):
    """A decoder compiled with one CPU maker's kernel table, run for 6 tokens on PROMPT and on `batch`, each checked
    against generate: the decoder, PROMPT's output, the products of the two graphs, the first graph's code."""
    from torch._inductor.utils import run_and_get_code

    use_fp32_table(monkeypatch, intel=intel, avx512=avx512)
    record = RecordProducts()
    decoder = CompiledDecoder(model)
    with torch._inductor.config.patch(post_grad_custom_post_pass=record.graph_pass, fx_graph_cache=False):
        out, codes = run_and_get_code(decoder.generate, PROMPT, max_new_tokens=6, **greedy())
        batched = decoder.generate(batch, max_new_tokens=6, **greedy())
    assert torch.equal(out, reference(model, 6, **greedy()))
    assert torch.equal(batched, batch_reference(model, 6, batch=batch, pad_token_id=0, **greedy()))
    return decoder, out, record.graphs, codes


@pytest.mark.slow
def test_fp32_step_kernels_on_intel(model, monkeypatch):
    """The Intel table. fp32 at batch 1: every product is ATen's plain one (no packed MKL linear left) and a step
    copies nothing; at batch 4 every product is oneDNN's packed one. Tokens are generate's either way."""
    from torch.profiler import profile

    decoder, out, (single, batch), _ = fp32_products_of_steps(model, monkeypatch, True, torch.cat([BATCH, PROMPT]))
    layers = model.config.num_hidden_layers
    assert single == ["aten.mm.default"] * (4 * layers + 1)
    assert batch == ["mkldnn._linear_pointwise.default"] * (4 * layers + 1)
    # Inductor's one-row views have strides (0, 1), which ATen's product copies before multiplying; the pass
    # restrides them, so a step runs without a single copy.
    cache = decoder._fresh_cache(1, PROMPT.shape[1] + 6)
    decoder.generate(PROMPT, max_new_tokens=2, **greedy())
    position = torch.tensor([PROMPT.shape[1] + 1])
    cache_tensors = [
        tensor for layer in cache.layers for tensor in (layer.keys, layer.values, layer.cumulative_length)
    ]
    state = [tensor.clone() for tensor in cache_tensors]
    with profile() as trace, torch.no_grad():
        logits = decoder._next_logits(torch.tensor([[5]]), position, cache)
    assert decoder._compiled_for is cache
    assert [event.name for event in trace.events() if event.name == "aten::clone"] == []
    # Between steps only the guards that tell graphs apart run; an input no graph was built for (a token with
    # other strides) is caught and compiled for, instead of failing the reply.
    strided = torch.tensor([[4, 5]])[:, 1:]
    assert strided.stride() != (1, 1)
    for tensor, saved in zip(cache_tensors, state):
        tensor.copy_(saved)
    with torch.no_grad():
        assert torch.equal(decoder._next_logits(strided, position, cache), logits) and decoder.compiled
    # The compile settings and the attention switch are entered for a new cache only: a reply of 6 tokens on the
    # cache stepped last enters neither (patching them around each step cost 0.18 ms of a 64M fp32 token).
    entered = []
    for name in ("_compile_settings", "_step_kernel"):
        original = getattr(decoder, name)
        setattr(decoder, name, lambda *args, _name=name, _original=original: entered.append(_name) or _original(*args))
    assert torch.equal(decoder.generate(PROMPT, max_new_tokens=6, **greedy()), out)
    assert entered == []


@pytest.mark.slow
def test_fp32_step_kernels_on_amd(model, monkeypatch):
    """The table for other makers (AMD), where MKL runs slow. At batch 1 the layers' packed products are left for
    inductor, which compiles each into its own C++ GEMM kernel (no call out to MKL or ATen for a product), and the
    tied head is sums over the embedding's rows; at batch 2 every product is oneDNN's packed one. Tokens are
    generate's either way."""
    _, _, (single, pair), codes = fp32_products_of_steps(model, monkeypatch, False, BATCH[:2])
    layers = model.config.num_hidden_layers
    assert single == ["mkl._mkl_linear"] * (4 * layers)
    assert pair == ["mkldnn._linear_pointwise.default"] * (4 * layers + 1)
    code = "\n".join(codes)
    assert "micro_gemm" in code and "mm_out" not in code and "_mkl_linear" not in code


@pytest.mark.slow
@pytest.mark.parametrize("intel", [True, False], ids=["intel", "amd"])
def test_fp32_step_kernels_without_avx512(model, monkeypatch, intel):
    """The table where torch's kernels stop at AVX2. Intel: one row keeps the plain product, two rows multiply as
    blocked sums, not one product left in the step. AMD: one row multiplies as blocked sums, four rows by oneDNN's
    packed product, every one of them. Tokens are generate's either way."""
    rows = BATCH[:2] if intel else torch.cat([BATCH, PROMPT])
    _, _, (single, several), _ = fp32_products_of_steps(model, monkeypatch, intel, rows, avx512=False)
    products = 4 * model.config.num_hidden_layers + 1
    assert single == (["aten.mm.default"] * products if intel else [])
    assert several == ([] if intel else ["mkldnn._linear_pointwise.default"] * products)


@pytest.mark.slow
def test_fp32_several_rows_package_multiplies_as_sums(model, monkeypatch, tmp_path):
    """Under AOTInductor, where inductor packs fp32 weights for oneDNN, a two-row step whose table says "sums"
    (torch's kernels stopping at AVX2) is packaged without one product left; a second decoder loads the package,
    and both decode generate's tokens."""
    use_fp32_table(monkeypatch, avx512=False)
    decoder, out, graphs = packaged_steps(model, monkeypatch, tmp_path, BATCH[:2])
    assert graphs == [[]] and (decoder.packages.built, decoder.packages.loaded) == (1, 0)
    expected = batch_reference(model, 6, batch=BATCH[:2], pad_token_id=0, **greedy())
    later = CompiledDecoder(model, cache_dir=tmp_path)
    again = later.generate(BATCH[:2], max_new_tokens=6, **greedy())
    assert (later.packages.built, later.packages.loaded) == (0, 1)
    assert torch.equal(out, expected) and torch.equal(again, expected)


@pytest.mark.slow
@pytest.mark.parametrize("intel", [True, False], ids=["intel", "amd"])
def test_fp32_one_row_packages_keep_their_makers_kernel(model, monkeypatch, tmp_path, intel):
    """Under AOTInductor, inductor packs fp32 weights for oneDNN (opaque tensors, which only the library can hold)
    where torch.compile packs them for MKL. The one-row step's package still multiplies by its table's kernel, and
    with plain tensors its weights stay apart from the library: on Intel ATen's plain product over [in, out] weights,
    elsewhere the C++ template, which packs the layers' weights itself, and the tied head as sums over the embedding
    the lookup reads. Tokens are generate's either way."""
    import json
    import math
    import zipfile

    use_fp32_table(monkeypatch, intel=intel, avx512=True)
    decoder, out, (single,) = packaged_steps(model, monkeypatch, tmp_path, PROMPT)
    assert torch.equal(out, reference(model, 6, **greedy()))
    assert (decoder.packages.built, decoder.packages.loaded) == (1, 0)
    products = 4 * model.config.num_hidden_layers + 1
    if intel:
        assert single == ["aten.mm.default"] * products
    else:  # the layers' oneDNN products (some with the residual's add fused in), which the template takes over
        assert set(single) == {"mkldnn._linear_pointwise.default"}
    [package] = tmp_path.glob("*.pt2")
    with zipfile.ZipFile(package) as archive:
        [config] = [name for name in archive.namelist() if name.endswith("/weights_config.json")]
        recorded = json.loads(archive.read(config))
    # the tied head multiplies by the embedding the lookup reads, which the package holds once; on Intel each
    # product's weight [in, out] once besides
    head = model.lm_head.weight.numel()
    held = {file: math.prod(shape) for file, shape, _, _ in recorded.values() if len(shape) == 2}
    assert [size for size in held.values() if size == head] == [head]
    if intel:
        assert sum(held.values()) == sum(weight.numel() for weight in model.parameters() if weight.dim() == 2)
    else:  # the template's packed copies ([blocks, in, block] each), one per product of a layer and none of the head
        widths = (model.config.hidden_size, model.config.intermediate_size)
        packed = [shape for _, shape, _, _ in recorded.values() if len(shape) == 3 and shape[1] in widths]
        assert len(packed) == 4 * model.config.num_hidden_layers


@pytest.mark.slow
def test_16_bit_one_row_package_holds_each_weight_once(monkeypatch, tmp_path):
    """A one-row bf16 step on a CPU without bf16 arithmetic, packaged by AOTInductor: every product became blocked
    sums, the blocks are written as weights apart from the library, and together they hold each product's weight
    exactly once (`ROW_BLOCKS`, 4 blocks, for each of a layer's 4 products; the tied head's blocks are slices of the
    embedding the lookup reads: their elements sum to the model's 2-D weights); a second decoder loads the package and
    both decode the eager decoder's greedy tokens."""
    import json
    import math
    import zipfile

    from minimind.decode.sixteen_bit_products import ROW_BLOCKS

    monkeypatch.setattr(compiled, "_exportable", compiled.plain_weights)
    monkeypatch.setattr(compiled, "cpu_computes_natively", lambda dtype: False)
    model = tiny_model(std=0.3).to(torch.bfloat16)
    eager = CompiledDecoder(model, compile=False).generate(PROMPT, max_new_tokens=8, **greedy())
    record = RecordProducts()
    decoder = CompiledDecoder(model, cache_dir=tmp_path)
    assert decoder.backend == "aoti"
    with torch._inductor.config.patch(post_grad_custom_post_pass=record.graph_pass):
        out = decoder.generate(PROMPT, max_new_tokens=8, **greedy())
    assert record.graphs == [[]] and (decoder.packages.built, decoder.packages.loaded) == (1, 0)
    [package] = tmp_path.glob("*.pt2")
    with zipfile.ZipFile(package) as archive:
        [config] = [name for name in archive.namelist() if name.endswith("/weights_config.json")]
        recorded = json.loads(archive.read(config))
    blocks = [math.prod(shape) for _, shape, _, _ in recorded.values() if len(shape) == 2]
    config = model.config
    outputs = [(config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim, config.hidden_size]
    outputs += [2 * config.intermediate_size, config.hidden_size]  # each layer's merged q/k/v, o, gate/up, down
    # as many blocks as divide the outputs evenly, up to ROW_BLOCKS: the tiny vocabulary (97) is one block
    cuts = [next(n for n in (ROW_BLOCKS, 2, 1) if out % n == 0) for out in outputs]
    assert config.vocab_size == 97 and cuts == [ROW_BLOCKS] * 4
    assert len(blocks) == config.num_hidden_layers * sum(cuts) + 1  # and the embedding, which the head reads too
    assert sum(blocks) == sum(weight.numel() for weight in model.parameters() if weight.dim() == 2)
    later = CompiledDecoder(model, cache_dir=tmp_path)
    again = later.generate(PROMPT, max_new_tokens=8, **greedy())
    assert (later.packages.built, later.packages.loaded) == (0, 1)
    assert torch.equal(out, eager) and torch.equal(again, eager)


@pytest.fixture
def kernels_at_avx2(monkeypatch):
    """Torch's kernels said to stop at AVX2 (as on a CPU without AVX-512, or under `ATEN_CPU_CAPABILITY=avx2`), where
    steps of several rows over 16-bit weights multiply through fbgemm."""
    from minimind.decode import fbgemm

    if not fbgemm.fbgemm_products():
        pytest.skip("this torch has no fbgemm (x86 builds only)")
    monkeypatch.setattr(fbgemm, "torch_kernels_avx512", lambda: False)
    monkeypatch.setattr(compiled, "torch_kernels_avx512", lambda: False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rows_multiply_as_float16_through_fbgemm_where_kernels_stop_at_avx2(
    dtype, kernels_at_avx2, monkeypatch
):
    """Where torch's kernels stop at AVX2, steps of several rows multiply every 16-bit linear layer (the head too)
    through fbgemm: float32 rows times the weight's own values (exactly float16 values), summed in float32, rounded
    once to the weights' dtype. The model itself is untouched; a weight is packed once, found again by its values."""
    from minimind.decode import fbgemm
    from minimind.decode.fbgemm import Float16RowsProduct, float16_rows_products

    model = tiny_model(std=0.3).to(dtype)
    view = float16_rows_products(model)
    products = [m for m in view.modules() if isinstance(m, Float16RowsProduct)]
    assert len(products) == 7 * model.config.num_hidden_layers + 1 and len({p.key for p in products}) == len(products)
    assert not any(isinstance(m, Float16RowsProduct) for m in model.modules())  # the model itself untouched
    assert view.model.embed_tokens.weight is model.model.embed_tokens.weight

    linear, weight = view.model.layers[0].mlp.down_proj, model.model.layers[0].mlp.down_proj.weight
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
    exact = x.double() @ weight.double().T  # [3, out]
    sums = torch.ops.minimind.fbgemm_product(x.float(), linear.key)
    assert sums.dtype == torch.float32
    torch.testing.assert_close(sums.double(), exact, atol=1e-5, rtol=1e-6)  # float32 sums of the exact products
    out = linear(x[:, None])  # [3, 1, in]: the rows of any leading dimensions
    assert out.dtype == dtype and out.shape == (3, 1, weight.shape[0])
    assert torch.equal(out[:, 0], sums.to(dtype))

    again = [m for m in float16_rows_products(model).modules() if isinstance(m, Float16RowsProduct)]
    assert all(a._packed is p._packed for a, p in zip(again, products))  # the same values: the same packed copy
    changed = tiny_model(std=0.3).to(dtype)
    with torch.no_grad():
        changed.model.layers[0].mlp.down_proj.weight[0, 0] += 1
    keys = [m.key for m in float16_rows_products(changed).modules() if isinstance(m, Float16RowsProduct)]
    assert [k == p.key for k, p in zip(keys, products)].count(False) == 1
    with torch.no_grad():  # beyond float16's range, which fbgemm's packing would clamp to: the layer keeps its product
        changed.model.layers[0].mlp.down_proj.weight[0, 0] = 1e5
    beyond = float16_rows_products(changed)
    assert type(beyond.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert sum(isinstance(m, Float16RowsProduct) for m in beyond.modules()) == len(products) - 1

    assert float16_rows_products(tiny_model()) is None  # fp32 weights
    monkeypatch.setattr(fbgemm, "fbgemm_products", lambda: False)
    assert float16_rows_products(model) is None
    monkeypatch.setattr(fbgemm, "fbgemm_products", lambda: True)
    monkeypatch.setattr(fbgemm, "torch_kernels_avx512", lambda: True)
    assert float16_rows_products(model) is None  # torch's own kernels on AVX-512


def test_16_bit_steps_of_several_rows_take_fbgemm_where_kernels_stop_at_avx2(kernels_at_avx2):
    """A bf16 decoder's one-row step runs the model, a step of several rows the fbgemm view, built for the first prompt
    (a prompt's products are several rows too); the batch decodes greedily by the model's own logits."""
    from minimind.decode import fbgemm

    model = tiny_model(std=0.3).to(torch.bfloat16)
    gc.collect()
    packed = len(fbgemm._PACKED)
    decoder = CompiledDecoder(model, compile=False)
    decoder.generate(PROMPT[:, :1], max_new_tokens=2, **greedy())
    assert len(fbgemm._PACKED) == packed  # a prompt of one token and one-row steps pack nothing
    decoder.generate(PROMPT, max_new_tokens=2, **greedy())
    assert len(fbgemm._PACKED) - packed == 7 * model.config.num_hidden_layers + 1  # for the prompt
    out = decoder.generate(BATCH, max_new_tokens=8, **greedy())
    assert decoder.model_for(1) is model and decoder.model_for(3) is decoder.rows_model is not None
    assert decoder.prompt_model(1) is model and decoder.prompt_model(2) is decoder.rows_model
    assert len(fbgemm._PACKED) - packed == 7 * model.config.num_hidden_layers + 1  # the same copies
    for row in range(BATCH.shape[0]):
        assert greedy_gap(model, out[row : row + 1], BATCH.shape[1]) <= 0.0625


@pytest.mark.slow
def test_16_bit_several_rows_package_multiplies_through_fbgemm(kernels_at_avx2, monkeypatch, tmp_path):
    """Under AOTInductor a bf16 step of several rows calls fbgemm once per linear layer and step; a decoder in which
    every packed copy was made afresh (as in a later process) loads the package, and both decode the eager fbgemm
    step's tokens."""
    from minimind.decode import fbgemm

    calls = []

    class Counted(weakref.WeakValueDictionary):
        def __getitem__(self, key):
            calls.append(key)
            return super().__getitem__(key)

    monkeypatch.setattr(compiled, "_exportable", compiled.plain_weights)
    monkeypatch.setattr(fbgemm, "_PACKED", Counted())
    model = tiny_model(std=0.3).to(torch.bfloat16)
    eager = CompiledDecoder(model, compile=False).generate(BATCH, max_new_tokens=9, **greedy())
    decoder = CompiledDecoder(model, cache_dir=tmp_path)
    assert decoder.backend == "aoti"
    decoder.generate(BATCH, max_new_tokens=3, **greedy())  # builds the package
    calls.clear()
    out = decoder.generate(BATCH, max_new_tokens=9, **greedy())  # the prompt, then 8 steps
    linears = 7 * model.config.num_hidden_layers + 1
    assert len(calls) == 9 * linears and len(set(calls)) == linears  # the prompt's products through fbgemm too
    assert (decoder.packages.built, decoder.packages.loaded) == (1, 0)
    del decoder
    gc.collect()
    assert len(fbgemm._PACKED) == 0  # no packed copy left to find
    later = CompiledDecoder(model, cache_dir=tmp_path)
    again = later.generate(BATCH, max_new_tokens=9, **greedy())
    assert (later.packages.built, later.packages.loaded) == (0, 1)
    # inductor's fused norms round a near tie of the random tiny model the other way at times, as for int8 rows
    assert torch.equal(out, again) and torch.equal(out[:, : BATCH.shape[1] + 4], eager[:, : BATCH.shape[1] + 4])


def test_int8_quantizes_every_projection_per_row():
    """int8 weights quantize every decoder projection and the LM head per row; the embedding stays 16-bit."""
    pytest.importorskip("torchao")
    from minimind.decode import quantize_weights_int8

    model = tiny_model(std=0.3).to(torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    before = {
        name: m.weight.detach().float().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    embedding = model.model.embed_tokens.weight.detach().clone()
    quantize_weights_int8(model)
    assert len(before) == 7 * model.config.num_hidden_layers + 1
    for name, module in model.named_modules():
        if name not in before:
            continue
        weight = module.weight
        assert weight.qdata.dtype == torch.int8 and weight.qdata.shape == before[name].shape
        scale = weight.scale.float().reshape(-1, 1)  # one per output row
        assert scale.shape[0] == before[name].shape[0]
        dequantized = weight.qdata.float() * scale
        # Round-to-nearest on a symmetric per-row grid: each weight within half a step of the original.
        assert (dequantized - before[name]).abs().le(scale / 2 + 1e-2 * scale).all()
        x = torch.randn(3, before[name].shape[1], dtype=torch.bfloat16)
        torch.testing.assert_close(
            module(x).float(), torch.nn.functional.linear(x.float(), dequantized), atol=0.05, rtol=0.02
        )
    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.bfloat16 and type(embed) is torch.nn.Parameter and torch.equal(embed, embedding)


def test_int8_refuses_float64_and_needs_torchao(monkeypatch):
    """int8 weights refuse activations other than bfloat16, float16 and float32 (naming the dtype this CPU's int8
    path takes), and name torchao when it is missing."""
    from minimind.decode import int8, quantize_weights_int8

    for arithmetic, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(int8, "cpu_computes_natively", lambda _, arithmetic=arithmetic: arithmetic)
        with pytest.raises(
            ValueError,
            match=r"int8 weights pair with bfloat16, float16 or float32 activations, but the model holds "
            rf"torch.float64: load it with dtype=torch.{dtype} first",
        ):
            quantize_weights_int8(tiny_model().double())
    monkeypatch.setitem(__import__("sys").modules, "torchao.quantization", None)
    with pytest.raises(
        ImportError,
        match=r"int8 weights use torchao, which is not installed .*"
        r"pip install 'minimind\[int8\]'",
    ):
        quantize_weights_int8(tiny_model().to(torch.bfloat16))


@pytest.fixture
def int8_model(monkeypatch):
    """The tiny model with int8 weights, on a CPU said to have 8-bit dot products."""
    pytest.importorskip("torchao")
    from minimind.decode import int8, quantize_weights_int8

    monkeypatch.setattr(int8, "cpu_computes_natively", lambda dtype: dtype == torch.int8)
    return quantize_weights_int8(tiny_model(std=0.3).to(torch.bfloat16))


@pytest.fixture
def int8_model_on_dot_products(int8_model):
    """`int8_model` where this CPU's kernels do have 8-bit dot products (`usable_cpu_features`): without them, or with
    oneDNN held below them, oneDNN adds 8-bit pairs in 16 bits, where full-range values overflow."""
    from minimind.hardware import cpu_computes_natively

    if not cpu_computes_natively(torch.int8):
        pytest.skip("this CPU's kernels have no 8-bit dot products (VNNI): oneDNN would add 8-bit pairs in 16 bits")
    return int8_model


def test_int8_rows_multiply_int8_activations_over_the_same_weights(int8_model_on_dot_products, monkeypatch):
    """Several rows multiply int8 activations (one symmetric scale per row) by the model's own int8 weights; each
    row's result is the one it gets alone; a CPU without 8-bit dot products, or plain weights, get no such view."""
    from minimind.decode import int8, int8_activation_products

    int8_model = int8_model_on_dot_products
    view = int8_activation_products(int8_model)
    linears = [name for name, m in int8_model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * int8_model.config.num_hidden_layers + 1
    for name in linears:
        weight, products = int8_model.get_submodule(name).weight, view.get_submodule(name).weight
        assert weight.act_quant_kwargs is None and products.act_quant_kwargs is not None
        for tensor in ("qdata", "scale"):  # the same memory, no copy
            assert getattr(products, tensor).data_ptr() == getattr(weight, tensor).data_ptr()
    assert view.model.embed_tokens.weight is int8_model.model.embed_tokens.weight and view.config is int8_model.config

    # Rows with one large activation each: at 8 bits (a step of max / 127.5) the small ones round to zero, so the
    # product keeps the large one's column alone, where a 16-bit activation keeps them all.
    linear, weight = view.model.layers[0].mlp.down_proj, int8_model.model.layers[0].mlp.down_proj.weight
    x = torch.full((3, weight.shape[1]), 0.25, dtype=torch.bfloat16)
    x[torch.arange(3), torch.tensor([0, 5, 9])] = torch.tensor([100.0, -90.0, 80.0], dtype=torch.bfloat16)
    columns = weight.qdata.float() * weight.scale.float().reshape(-1, 1)  # [out, in], dequantized
    large = x.float().gather(1, torch.tensor([[0], [5], [9]]))  # [3, 1]
    kept = (large * 127 / 127.5) * columns[:, [0, 5, 9]].T  # the large value on its 8-bit grid, times its column
    torch.testing.assert_close(linear(x).float(), kept, atol=0.02, rtol=0.01)
    weight_only = int8_model.model.layers[0].mlp.down_proj(x).float()
    torch.testing.assert_close(weight_only, x.float() @ columns.T, atol=0.02, rtol=0.01)
    assert (weight_only - kept).abs().max() > 0.5
    rows_alone = torch.cat([linear(x[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(linear(x), rows_alone, atol=0, rtol=0)

    monkeypatch.setattr(int8, "cpu_computes_natively", lambda dtype: False)
    monkeypatch.setattr(int8, "fbgemm_products", lambda: False)
    assert int8_activation_products(int8_model) is None  # no 8-bit dot products, no fbgemm
    monkeypatch.setattr(int8, "cpu_computes_natively", lambda dtype: None)
    assert int8_activation_products(int8_model) is None  # the CPU's features unknown
    assert int8_activation_products(tiny_model()) is None
    monkeypatch.setattr(int8, "cpu_computes_natively", lambda dtype: True)
    monkeypatch.setitem(__import__("sys").modules, "torchao.quantization.quantize_.workflows.int8.int8_tensor", None)
    assert int8_activation_products(int8_model) is None  # a torchao without the activations' settings there


@pytest.fixture
def int8_model_without_dot_products(int8_model, monkeypatch):
    """The tiny int8 model on a CPU said to have no 8-bit dot products (int8 rows through fbgemm)."""
    from minimind.decode import int8

    if not int8.fbgemm_products():
        pytest.skip("this torch has no fbgemm (x86 builds only)")
    monkeypatch.setattr(int8, "cpu_computes_natively", lambda dtype: False)
    return int8_model


def test_int8_rows_without_dot_products_multiply_7_bit_activations(int8_model_without_dot_products):
    """Without 8-bit dot products several rows multiply the same int8 weights by 7-bit activations, one symmetric
    scale per row (-63..63 times the row's largest magnitude / 63): exactly that product, whatever the other rows."""
    from minimind.decode import int8_activation_products
    from minimind.decode.int8 import Int8RowsProduct

    model = int8_model_without_dot_products
    view = int8_activation_products(model)
    products = [m for m in view.modules() if isinstance(m, Int8RowsProduct)]
    assert len(products) == 7 * model.config.num_hidden_layers + 1
    assert not any(isinstance(m, Int8RowsProduct) for m in model.modules())  # the model itself untouched
    assert view.model.embed_tokens.weight is model.model.embed_tokens.weight

    linear, weight = view.model.layers[0].mlp.down_proj, model.model.layers[0].mlp.down_proj.weight
    columns = weight.qdata.float() * weight.scale.float().reshape(-1, 1)  # [out, in], dequantized
    # a row of noise, the same 30 times larger, and a row of 0.25 with one 100, whose 0.25s fall between 0 and the
    # grid's first step (100 / 63): that row keeps the 100's column alone, where a 16-bit activation keeps them all
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [[1.0], [30.0], [0]]
    )
    x[2] = 0.25
    x[2, 7] = 100.0
    x = x.to(torch.bfloat16)
    largest = x.float().abs().amax(-1, keepdim=True)
    on_grid = torch.round(x.float() * 63 / largest) * largest / 63  # [3, in], 7 bits a row
    out = linear(x)
    assert out.dtype == torch.bfloat16 and out.shape == (3, weight.shape[0])
    torch.testing.assert_close(out.float(), on_grid @ columns.T, atol=0, rtol=0.008)  # bf16's rounding alone
    torch.testing.assert_close(out[2].float(), 100 * columns[:, 7], atol=0, rtol=0.008)
    weight_only = model.model.layers[0].mlp.down_proj(x).float()
    torch.testing.assert_close(weight_only, x.float() @ columns.T, atol=0.02, rtol=0.01)
    assert (out[2].float() - weight_only[2]).abs().max() > 0.5
    rows_alone = torch.cat([linear(torch.cat([x[i : i + 1], x[i : i + 1] * 1000])[:1]) for i in range(3)])
    torch.testing.assert_close(out, rows_alone, atol=0, rtol=0)  # beside a row 1000 times larger: the same


@pytest.mark.parametrize("cpu", ["int8_model", "int8_model_without_dot_products"])
def test_int8_steps_of_several_rows_take_int8_activations(cpu, request):
    """A decoder's one-row step runs the weight-only model (its int8 values over plain tensors), a step of several
    rows the int8-activation view, which is built for the first such step (fbgemm's packed copies of the weights are
    made only where they are used)."""
    from minimind.decode.fbgemm import _PACKED

    int8_model = request.getfixturevalue(cpu)
    gc.collect()  # earlier tests' packed weights gone before counting
    packed = len(_PACKED)
    decoder = CompiledDecoder(int8_model, compile=False)
    decoder.generate(PROMPT[:, :1], max_new_tokens=2, **greedy())
    assert len(_PACKED) == packed
    assert decoder.model_for(1) is decoder.plain_model is not None and decoder.model_for(3) is decoder.rows_model
    linears = 7 * int8_model.config.num_hidden_layers + 1
    fbgemm = cpu == "int8_model_without_dot_products"
    assert len(_PACKED) - packed == (linears if fbgemm else 0)
    # a prompt of several tokens takes fbgemm's 7-bit activations as steps of several rows do; with 8-bit dot
    # products it keeps the weight-only product
    assert decoder.prompt_model(PROMPT.numel()) is (decoder.rows_model if fbgemm else int8_model)
    for rows, model in ((3, decoder.rows_model), (1, int8_model)):
        token, position = BATCH[:rows, -1:], torch.tensor([BATCH.shape[1]])
        with torch.no_grad():
            cache = decoder._fresh_cache(rows, 16)
            step = decoder._forward_one(token, position, cache)
            cache.reset()
            own = model(input_ids=token, position_ids=position[None], cache=cache, use_cache=True).logits[:, -1]
            cache.reset()
            other = (int8_model if model is not int8_model else decoder.rows_model)(
                input_ids=token, position_ids=position[None], cache=cache, use_cache=True
            ).logits[:, -1]
        assert torch.equal(step, own) and not torch.equal(step, other)
    assert CompiledDecoder(tiny_model(), compile=False).rows_model is None


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_prompts_multiply_through_fbgemm_where_steps_of_several_rows_do(
    weights, kernels_at_avx2, request, monkeypatch
):
    """Where steps of several rows multiply through fbgemm (16-bit weights where torch's kernels stop at AVX2, int8
    weights without 8-bit dot products), a prompt does too: one fbgemm call per linear layer for the whole prompt,
    the keys and values of fbgemm's products in the cache and the first token theirs; the server's prefill of several
    prompts in one forward likewise."""
    from minimind.decode import fbgemm

    if weights == "bf16":
        model = tiny_model(std=0.3).to(torch.bfloat16)
    else:
        model = request.getfixturevalue("int8_model_without_dot_products")
    calls = []

    class Counted(weakref.WeakValueDictionary):
        def __getitem__(self, key):
            calls.append(key)
            return super().__getitem__(key)

    monkeypatch.setattr(fbgemm, "_PACKED", Counted())
    linears = 7 * model.config.num_hidden_layers + 1
    decoder = CompiledDecoder(model, compile=False)
    out = decoder.generate(PROMPT, max_new_tokens=1, **greedy())
    assert len(calls) == linears and len(set(calls)) == linears
    with torch.no_grad():
        rows, own = DynamicCache(config=model.config), DynamicCache(config=model.config)
        logits = decoder.rows_model(input_ids=PROMPT, cache=rows, use_cache=True).logits[0, -1]
        model(input_ids=PROMPT, cache=own, use_cache=True)
    assert out[0, -1] == logits.argmax()
    length = PROMPT.shape[1]
    for written, by_rows in zip(decoder._cache.layers, rows.layers):
        assert torch.equal(written.keys[:, :, :length], by_rows.keys)
        assert torch.equal(written.values[:, :, :length], by_rows.values)
    if weights == "int8":  # the weight-only product, which leaves the activations unrounded, writes others
        assert any(not torch.equal(a.values, b.values) for a, b in zip(rows.layers, own.layers))

    calls.clear()
    server = RowDecoder(model, compile=False)
    prompts = [PROMPT[0].tolist(), BATCH[1, :4].tolist()]
    cache = RowCache(model.config, rows=2, length=16, dtype=torch.bfloat16, device="cpu")
    last = server.prefill(prompts, cache, [0, 1])  # [2, V]
    assert len(calls) == linears  # both prompts in one forward
    for index, ids in enumerate(prompts):
        with torch.no_grad():
            alone = server.rows_model(input_ids=torch.tensor([ids])).logits[0, -1]
        # right-padded beside the longer prompt: the same products up to fbgemm's own order of sums
        torch.testing.assert_close(last[index].float(), alone.float(), atol=0.02, rtol=0.01)


@pytest.mark.slow
def test_compiled_int8_rows_decode_as_eager_int8_rows(int8_model_on_dot_products):
    """The compiled step over several int8 rows decodes the batch as the eager int8-activation step does."""
    int8_model = int8_model_on_dot_products
    out = CompiledDecoder(int8_model).generate(BATCH, max_new_tokens=16, **greedy())
    plain = CompiledDecoder(int8_model, compile=False).generate(BATCH, max_new_tokens=16, **greedy())
    # a rounding flip of one 8-bit activation (inductor's fused quantization against torchao's eager one) can part
    # them later on
    assert torch.equal(out[:, : BATCH.shape[1] + 8], plain[:, : BATCH.shape[1] + 8])


@pytest.mark.slow
def test_compiled_int8_rows_without_dot_products_multiply_through_fbgemm(int8_model_without_dot_products, monkeypatch):
    """Without 8-bit dot products the compiled step of several rows calls fbgemm's product for every int8 weight at
    every step, and decodes the batch as the eager step does."""
    from minimind.decode import fbgemm

    model, calls = int8_model_without_dot_products, []

    class Counted(weakref.WeakValueDictionary):
        def __getitem__(self, key):
            calls.append(key)
            return super().__getitem__(key)

    monkeypatch.setattr(fbgemm, "_PACKED", Counted())
    decoder = CompiledDecoder(model)
    decoder.generate(BATCH, max_new_tokens=3, **greedy())  # compiles the step
    calls.clear()
    out = decoder.generate(BATCH, max_new_tokens=9, **greedy())  # the prompt, then 8 steps
    linears = 7 * model.config.num_hidden_layers + 1
    assert len(calls) == 9 * linears and len(set(calls)) == linears  # the prompt's products through fbgemm too
    plain = CompiledDecoder(model, compile=False).generate(BATCH, max_new_tokens=9, **greedy())
    # 7-bit activations round at steps twice 8-bit's: a flip of one (inductor's fused norms against eager ones)
    # parts the random tiny model's tokens sooner than the 8-bit rows' above
    assert torch.equal(out[:, : BATCH.shape[1] + 4], plain[:, : BATCH.shape[1] + 4])


@pytest.mark.slow
def test_compiled_int8_decodes_as_eager_int8():
    pytest.importorskip("torchao")
    from minimind.decode import quantize_weights_int8

    model = quantize_weights_int8(tiny_model(std=0.3).to(torch.bfloat16))
    out = CompiledDecoder(model).generate(PROMPT, max_new_tokens=30, **greedy())
    plain = CompiledDecoder(model, compile=False).generate(PROMPT, max_new_tokens=30, **greedy())
    assert torch.equal(out[:, : PROMPT.shape[1] + 15], plain[:, : PROMPT.shape[1] + 15])
    assert greedy_gap(model, out, PROMPT.shape[1]) <= 0.0625
