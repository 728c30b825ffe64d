"""llama.cpp in the peers table: llama-cpp-python running the project's own GGUF export, greedy decoding one
sequence or a batch of them token by token, and prefill."""

from bench.measure import amx_int8


def llama_cpp_missing():
    """Why llama.cpp rows cannot run here, or "" when they can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama_cpp not installed ({error}); pip install llama-cpp-python"
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        return f"gguf not installed ({error}); pip install gguf"
    return ""


def llama_cpp_version():
    """The version, and the CPU extensions its library was built for (`llama_print_system_info`): a library built
    for AVX2 alone (GGML_NATIVE=OFF, GGML_AVX512=OFF) and loaded through LLAMA_CPP_LIB_PATH stands for an AVX2-only
    CPU beside torch held to AVX2."""
    try:
        import llama_cpp
    except ImportError:
        return "not installed"
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    # "CPU : SSE3 = 1 | AVX2 = 1 | ... | OPENMP = 1 |": the vector extensions switched on
    built = [field.split("=")[0].split(":")[-1].strip() for field in info.split("|") if field.strip().endswith("= 1")]
    vectors = [name for name in built if name.startswith(("AVX", "AMX", "F16C", "FMA", "NEON", "SVE"))]
    return llama_cpp.__version__ + (f" (CPU kernels: {', '.join(vectors)})" if vectors else "")


def gguf_matrix_bytes(path):
    """Bytes of the 2-D tensors stored in a GGUF file, read back from the file itself."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)


class LlamaCpp:
    """One GGUF model in llama.cpp, driven token by token so that greedy decoding ignores eos exactly as
    generate(min_new_tokens=N) does."""

    def __init__(self, path, n_ctx, threads, extra_buffer_types=True):
        import llama_cpp
        import llama_cpp.llama

        # `Llama` does not expose llama.cpp's `use_extra_bufts` (the CPU backend's AMX and repacked layouts),
        # so the default parameters it starts from are adjusted for the one call.
        defaults = llama_cpp.llama.llama_cpp.llama_model_default_params

        def model_params():
            params = defaults()
            params.use_extra_bufts = extra_buffer_types
            return params

        llama_cpp.llama.llama_cpp.llama_model_default_params = model_params
        try:
            self.llama = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=512,
                n_ubatch=512,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        finally:
            llama_cpp.llama.llama_cpp.llama_model_default_params = defaults
        self.vocab = self.llama.n_vocab()
        self._batch_context = self._batch = None

    def _next_token(self):
        import numpy

        logits = numpy.ctypeslib.as_array(self.llama._ctx.get_logits(), shape=(self.vocab,))
        return int(logits.argmax())

    def greedy(self, ids, new_tokens):
        self.llama.reset()
        self.llama.eval(ids)
        out = []
        for step in range(new_tokens):
            out.append(self._next_token())
            if step + 1 < new_tokens:  # the last token is never fed back, as in generate
                self.llama.eval([out[-1]])
        return out

    def greedy_batch(self, prompts, new_tokens):
        """Greedy decoding of several sequences together: each step is one llama_decode over one new token of
        every sequence (llama.cpp's batched decoding, as its llama-batched example and server do)."""
        import llama_cpp
        import numpy

        if self._batch_context is None:
            params = llama_cpp.llama_context_params.from_buffer_copy(self.llama.context_params)
            params.n_seq_max, params.kv_unified = len(prompts), True
            params.n_ctx = len(prompts) * self.llama.n_ctx()
            params.n_batch = params.n_ubatch = max(params.n_batch, sum(map(len, prompts)))  # all prompts at once
            self._batch_context = llama_cpp.llama_init_from_model(self.llama._model.model, params)
            self._batch = llama_cpp.llama_batch_init(sum(map(len, prompts)), 0, len(prompts))
        context, batch = self._batch_context, self._batch
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)

        def decode(entries):  # (sequence, position, token, wants logits)
            batch.n_tokens = len(entries)
            for i, (sequence, position, token, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
                batch.seq_id[i][0] = sequence
            if llama_cpp.llama_decode(context, batch) != 0:
                raise RuntimeError("llama_decode failed on the batched decode")
            return [
                int(numpy.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context, i), shape=(self.vocab,)).argmax())
                for i, entry in enumerate(entries)
                if entry[3]
            ]

        next_tokens = decode(
            [(s, p, t, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        )
        out = [[token] for token in next_tokens]
        for step in range(1, new_tokens):
            next_tokens = decode([(s, len(prompts[s]) + step - 1, seq[-1], True) for s, seq in enumerate(out)])
            for seq, token in zip(out, next_tokens):
                seq.append(token)
        return out

    def prefill(self, ids):
        self.llama.reset()
        self.llama.eval(ids)

    def close(self):
        import llama_cpp

        if self._batch_context is not None:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._batch_context)
        self.llama.close()


def llama_cpp_row(w, ctx):
    """A llama.cpp decode or prefill row (`w`) on the peers' shared model (`ctx`, a `bench.peers.PeerContext`):
    (run, its note, close). Its GGUF file is exported on first use."""
    sizes = ctx.sizes
    new, prompt = sizes["new_tokens"], len(ctx.prompt_ids)
    # llama.cpp's AMX-INT8 kernels for q8_0 segfault (ggml-org/llama.cpp#20824): on such a CPU q8_0 runs
    # with the CPU backend's extra buffer types off, on its AVX-512 kernels.
    plain_buffers = w.weights == "q8_0" and amx_int8()
    engine = LlamaCpp(
        ctx.gguf(w.weights),
        n_ctx=max(prompt + new, sizes["prefill"]) + 16,
        threads=ctx.threads,
        extra_buffer_types=not plain_buffers,
    )
    if w.kind == "prefill":
        run = lambda: engine.prefill(ctx.prefill_ids)  # noqa: E731
    elif w.batch == 1:
        run = lambda: [engine.greedy(ctx.prompt_ids, new)]  # noqa: E731
    else:
        prompts = ctx.prompts(w.batch)
        run = lambda: engine.greedy_batch(prompts, new)  # noqa: E731
    note = f"n_threads {ctx.threads}" + (
        "; extra buffer types off (AMX-INT8 q8_0 kernels segfault: ggml-org/llama.cpp#20824)" if plain_buffers else ""
    )
    return run, note, engine.close
