"""minimind.hardware: the CPU's maker and features read from its own report, and the precision `--dtype auto` picks
from them."""

import pytest
import torch

from minimind import hardware

ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx f16c avx2 fma\n"
ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: avx2 f16c avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "vendor_id\t: GenuineIntel\nflags\t\t: avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd fphp asimdhp bf16 sve\n"


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """Write a /proc/cpuinfo for the hardware module to read instead of this machine's."""

    def write(text):
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        monkeypatch.setattr(hardware, "CPUINFO", path)
        hardware.cpu_features.cache_clear()

    yield write
    hardware.cpu_features.cache_clear()


@pytest.mark.parametrize(
    ("report", "bf16", "fp16"),
    [(ZEN3, False, False), (ZEN4, True, False), (SAPPHIRE_RAPIDS, True, True), (GRAVITON3, True, True)],
)
def test_native_16_bit_arithmetic_from_cpu_features(cpuinfo, report, bf16, fp16):
    cpuinfo(report)
    assert hardware.cpu_computes_natively(torch.bfloat16) is bf16
    assert hardware.cpu_computes_natively(torch.float16) is fp16
    assert hardware.cpu_computes_natively(torch.float32) is True


def test_features_unknown_without_a_report(cpuinfo, tmp_path, monkeypatch):
    cpuinfo("processor\t: 0\n")  # no flags line
    assert hardware.cpu_features() is None and hardware.cpu_computes_natively(torch.bfloat16) is None
    monkeypatch.setattr(hardware, "CPUINFO", tmp_path / "missing")
    hardware.cpu_features.cache_clear()
    assert hardware.cpu_features() is None and hardware.cpu_computes_natively(torch.float32) is True


@pytest.mark.parametrize(
    ("report", "picked"),
    [
        (ZEN4, ("bfloat16", "this CPU computes bfloat16 natively: avx512_bf16")),
        (SAPPHIRE_RAPIDS, ("bfloat16", "this CPU computes bfloat16 natively: amx_bf16, avx512_bf16")),
        (ZEN3, ("bfloat16", "16-bit weights halve the bytes each decoded token reads")),
        ("processor\t: 0\n", ("float32", "this CPU's features could not be read")),
    ],
)
def test_auto_precision_on_a_cpu(cpuinfo, report, picked):
    cpuinfo(report)
    assert hardware.pick_dtype("cpu") == picked


@pytest.mark.parametrize(
    ("bf16", "picked"),
    [(True, ("bfloat16", "this GPU computes bfloat16")), (False, ("float16", "this GPU has no bfloat16"))],
)
def test_auto_precision_on_a_gpu(monkeypatch, bf16, picked):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    assert hardware.pick_dtype("cuda") == picked
    assert hardware.pick_dtype("cuda:1") == picked
    assert hardware.pick_dtype("mps") == ("float32", "no 16-bit measurements on mps")


def test_cpu_vendor_from_cpuinfo_then_platform(cpuinfo, tmp_path, monkeypatch):
    cpuinfo(ZEN3)
    assert hardware.cpu_vendor() == "AuthenticAMD"
    monkeypatch.setattr(hardware, "CPUINFO", tmp_path / "missing")
    monkeypatch.setattr(hardware.platform, "processor", lambda: "Intel64 Family 6 Model 85 Stepping 7, GenuineIntel")
    assert hardware.cpu_vendor() == "GenuineIntel"
    monkeypatch.setattr(hardware.platform, "processor", lambda: "arm")
    assert hardware.cpu_vendor() == ""


def test_cpu_caps_are_the_variables_set(monkeypatch):
    for name in hardware.CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert hardware.cpu_caps() == {}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "")  # set but empty: no cap
    assert hardware.cpu_caps() == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_torch_kernels_avx512_follows_torchs_capability_and_its_cap():
    """Whether torch's kernels run on AVX-512: what torch itself reports, which ATEN_CPU_CAPABILITY holds down."""
    import os
    import subprocess
    import sys

    assert hardware.torch_kernels_avx512() == torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    code = (
        "import torch; from minimind.hardware import torch_kernels_avx512; "
        "print(torch_kernels_avx512(), torch.backends.cpu.get_cpu_capability())"
    )
    capped = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert capped.stdout.split() == ["False", "AVX2"]


@pytest.mark.parametrize(
    ("caps", "bf16", "int8"),
    [
        ({}, True, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False, False),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core_vnni"}, False, True),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True, True),
        ({"ATEN_CPU_CAPABILITY": "avx2"}, False, False),
        ({"ATEN_CPU_CAPABILITY": "avx512"}, True, True),
    ],
)
def test_kernel_caps_leave_out_what_the_cpu_has(cpuinfo, monkeypatch, caps, bf16, int8):
    """ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY imitate an older CPU: what they leave out is not native."""
    cpuinfo(ZEN4)
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in caps.items():
        monkeypatch.setenv(name, value)
    assert hardware.cpu_computes_natively(torch.bfloat16) is bf16
    assert hardware.cpu_computes_natively(torch.int8) is int8
    assert hardware.native_features(torch.bfloat16) == ("avx512_bf16" if bf16 else "")
    assert hardware.cpu_features() >= {"avx512_bf16", "avx512_vnni"}  # the CPU's own report is unchanged
    zen4_picks = "this CPU computes bfloat16 natively: avx512_bf16"
    assert hardware.pick_dtype("cpu")[1] == (
        zen4_picks if bf16 else "16-bit weights halve the bytes each decoded token reads"
    )
