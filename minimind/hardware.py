"""What this machine computes natively, read once from the CPU's own report, and the precision the inference
commands take from it (`--dtype auto`, `pick_dtype`)."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")  # where Linux reports the CPU's maker and features

# The CPU features that give a 16-bit type its own arithmetic (x86 and Arm names as /proc/cpuinfo spells them).
# Without them PyTorch converts every element of a 16-bit product in software: one-row products (decoding) stay
# fast because they are bound by the bytes they read, products over many rows (prompts, training) fall far behind
# float32. int8's are the dot products that add 8-bit pairs into 32 bits (VNNI); without them oneDNN adds pairs
# in 16 bits, where full-range int8 values can overflow.
NATIVE_CPU_FEATURES = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16", "bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16", "asimdhp"}),
    torch.int8: frozenset({"avx512_vnni", "avx_vnni", "amx_int8"}),
}


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo, by name ({} where it cannot be read)."""
    fields = {}
    try:
        text = CPUINFO.read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip() and fields:  # the first processor's block ends here; the others repeat it
            break
        key, colon, value = line.partition(":")
        if colon and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


@functools.cache
def cpu_features() -> frozenset[str] | None:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); None where they cannot be read."""
    fields = cpuinfo()
    flags = fields.get("flags", fields.get("Features"))
    return None if flags is None else frozenset(flags.split())


# The caps that make PyTorch's own kernels (`ATEN_CPU_CAPABILITY`) or oneDNN's (`ONEDNN_MAX_CPU_ISA`) leave out
# instructions the CPU has, as on an older CPU: each cap lists the features of NATIVE_CPU_FEATURES it keeps. A product
# that relies on a feature left out would run without it (8-bit products then add pairs in 16 bits and can overflow).
_VNNI, _BF16, _FP16, _AMX = {"avx_vnni", "avx512_vnni"}, {"avx512_bf16"}, {"avx512_fp16"}, {"amx_int8", "amx_bf16"}
CAPPED_FEATURES = _VNNI | _BF16 | _FP16 | _AMX | {"amx_fp16"}  # x86's: Arm's are not capped by these
ONEDNN_ISA_KEEPS = {
    "SSE41": set(),
    "AVX": set(),
    "AVX2": set(),
    "AVX2_VNNI": {"avx_vnni"},
    "AVX2_VNNI_2": {"avx_vnni"},
    "AVX512_CORE": {"avx_vnni"},
    "AVX512_CORE_VNNI": _VNNI,
    "AVX512_CORE_BF16": _VNNI | _BF16,
    "AVX512_CORE_FP16": _VNNI | _BF16 | _FP16,
    "AVX10_1_512": _VNNI | _BF16 | _FP16,
    "AVX512_CORE_AMX": _VNNI | _BF16 | _FP16 | _AMX,
    "AVX10_1_512_AMX": _VNNI | _BF16 | _FP16 | _AMX,
}
ATEN_CAPABILITY_KEEPS = {"default": set(), "avx2": {"avx_vnni"}}
# Every variable that caps the instructions kernels use: PyTorch's own and inductor's generated code, oneDNN's, MKL's,
# fbgemm's.
CAP_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "FBGEMM_ENABLE_INSTRUCTIONS",
)


def cpu_caps() -> dict[str, str]:
    """The caps the environment sets (`CAP_VARIABLES`), by variable: {} on a CPU used as it is."""
    return {name: os.environ[name] for name in CAP_VARIABLES if os.environ.get(name)}


def usable_cpu_features() -> frozenset[str] | None:
    """`cpu_features` less those the environment's caps on PyTorch's and oneDNN's kernels leave out (how a CPU
    without them is imitated on one that has them); None where the CPU's features cannot be read."""
    features = cpu_features()
    if features is None:
        return None
    left_out = set()
    for keeps, cap in (
        (ONEDNN_ISA_KEEPS, os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()),
        (ATEN_CAPABILITY_KEEPS, os.environ.get("ATEN_CPU_CAPABILITY", "").lower()),
    ):
        if cap in keeps:
            left_out |= CAPPED_FEATURES - keeps[cap]
    return features - left_out


def torch_kernels_avx512() -> bool:
    """Whether torch's CPU kernels run on AVX-512 here: the CPU has it and `ATEN_CPU_CAPABILITY` does not hold
    torch below it."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def cpu_vendor() -> str:
    """The CPU's maker as it reports itself ("GenuineIntel", "AuthenticAMD"); "" where it cannot be read."""
    return cpuinfo().get("vendor_id") or next(
        (vendor for vendor in ("GenuineIntel", "AuthenticAMD") if vendor in platform.processor()), ""
    )


def cpu_computes_natively(dtype: torch.dtype) -> bool | None:
    """Whether this CPU has arithmetic of its own for `dtype` (float32 always) that the kernels may use
    (`usable_cpu_features`); None where its features are unknown."""
    if dtype not in NATIVE_CPU_FEATURES:
        return True
    features = usable_cpu_features()
    return None if features is None else bool(features & NATIVE_CPU_FEATURES[dtype])


def native_features(dtype: torch.dtype) -> str:
    """This CPU's features that compute `dtype` natively, as the one-line reports name them ("" for none)."""
    return ", ".join(sorted((usable_cpu_features() or frozenset()) & NATIVE_CPU_FEATURES.get(dtype, frozenset())))


def pick_dtype(device: str) -> tuple[str, str]:
    """The precision `--dtype auto` loads a model in on `device`, and why, for the command to say. Decoding reads
    every weight once per token, so 16-bit weights decode faster than float32 on every CPU measured, with or without
    16-bit arithmetic (docs/performance.md); where the CPU has none, prompts are multiplied in float32
    (`minimind.decode.widen_products`). A GPU takes bfloat16 where it computes it, else float16."""
    kind = torch.device(device).type
    if kind == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "this GPU computes bfloat16"
        return "float16", "this GPU has no bfloat16"
    if kind != "cpu":
        return "float32", f"no 16-bit measurements on {kind}"
    native = cpu_computes_natively(torch.bfloat16)
    if native:
        return "bfloat16", f"this CPU computes bfloat16 natively: {native_features(torch.bfloat16)}"
    if native is None:
        return "float32", "this CPU's features could not be read"
    return "bfloat16", "16-bit weights halve the bytes each decoded token reads"
