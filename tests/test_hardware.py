"""This machine: which device `--device auto` picks."""

from __future__ import annotations

import pytest
import torch

from gptlab import hardware


@pytest.mark.parametrize(("cuda", "mps", "mps_runs", "want"), [
    (True, True, True, "cuda"),
    (False, True, True, "mps"),
    (False, True, False, "cpu"),  # listed but unusable (a VM without Metal): the CPU
    (False, False, False, "cpu"),
])
def test_auto_picks_cuda_then_a_working_mps_then_the_cpu(cuda: bool, mps: bool, mps_runs: bool, want: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    real_ones = torch.ones

    def ones(*args, device=None, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202 - torch.ones, with "mps" faked
        if device == "mps":
            if not mps_runs:
                raise RuntimeError("MPS backend out of order")
            device = "cpu"
        return real_ones(*args, device=device, **kw)

    monkeypatch.setattr(torch, "ones", ones)
    assert hardware.resolve_device("auto") == want


@pytest.mark.parametrize(("name", "want"), [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                            ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce GTX 1080", None)])
def test_datasheet_peaks_by_device_name(name: str, want: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert hardware.datasheet_flops("cuda") == want
    assert hardware.datasheet_flops("cpu") is None


def test_the_run_log_reports_mfu_against_the_datasheet_where_it_knows_the_gpu(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from gptlab.train.runlog import RunLog

    monkeypatch.setattr(hardware, "peak_flops", lambda device, dtype: 500e12)
    monkeypatch.setattr(hardware, "datasheet_flops", lambda device: 1000e12 if device == "cuda" else None)
    log = RunLog(tmp_path, enabled=False, quiet=True, flops_per_token=1e9, device="cuda",
                 world_size=2, dtype="bfloat16")
    assert log.utilization(100_000) == pytest.approx({"mfu": 0.1, "mfu_datasheet": 0.05})
    cpu = RunLog(tmp_path, enabled=False, quiet=True, flops_per_token=1e9, device="cpu",
                 world_size=1, dtype="bfloat16")
    assert cpu.utilization(100_000) == pytest.approx({"mfu": 0.2})


@pytest.mark.parametrize(("capability", "want"), [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16),
                                                  ((7, 5), torch.float16), ((7, 0), torch.float16)])
def test_dtype_auto_for_inference(capability: tuple[int, int], want: torch.dtype,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a GPU with bf16 units, fp16 on one that only emulates bf16 (V100, T4), fp32 on a CPU; a named dtype
    is taken as named."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert hardware.inference_dtype("auto", "cuda:0") == want
    assert hardware.inference_dtype("auto", "cpu") == torch.float32
    assert hardware.inference_dtype("float16", "cpu") == torch.float16


def test_a_cuda_device_lets_fp32_matmuls_use_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # process-wide switches
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert hardware.resolve_device("cpu") == "cpu" and not torch.backends.cuda.matmul.allow_tf32
        assert hardware.resolve_device("cuda:0") == "cuda:0"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_auto_switches_of_a_recipe_follow_the_device() -> None:
    from gptlab.train import build_train_config
    from gptlab.train.config import resolve_device_switches

    cfg = build_train_config({"model": "tiny"})
    assert (cfg.attention_fp32, cfg.compile) == ("auto", "auto")
    cpu, gpu = resolve_device_switches(cfg, "cpu"), resolve_device_switches(cfg, "cuda")
    assert (cpu.attention_fp32, cpu.compile) == (True, False)
    assert (gpu.attention_fp32, gpu.compile) == (False, True)
    chosen = build_train_config({"model": "tiny", "attention_fp32": True, "compile": False})
    assert resolve_device_switches(chosen, "cuda") == chosen


def test_cpu_attention_runs_in_bf16_from_head_size_64_and_a_resume_keeps_its_choice() -> None:
    """CPU flash attention is faster in bf16 than in fp32 (with its casts) from 64-wide heads on (README, "Training
    speed"): GPT-2's heads run in bf16, a character model's 32-wide ones in fp32; the model's own head size (an
    init_from model's) decides over the preset's, and a resumed run keeps what its saved config recorded."""
    from gptlab.train import build_train_config
    from gptlab.train.config import BF16_ATTENTION_MIN_HEAD, resolve_device_switches

    gpt2, char = build_train_config({"model": "gpt2"}), build_train_config({"model": "speedrun-char"})
    assert resolve_device_switches(gpt2, "cpu").attention_fp32 is False
    assert resolve_device_switches(char, "cpu").attention_fp32 is True
    assert resolve_device_switches(char, "cpu", head_size=BF16_ATTENTION_MIN_HEAD).attention_fp32 is False
    # where gptlab's bf16 attention backward serves the narrow heads (the trainer asks causal_attention.serves)
    assert resolve_device_switches(char, "cpu", narrow_heads_bf16=True).attention_fp32 is False
    assert resolve_device_switches(char, "cpu", saved={"attention_fp32": True},
                                   narrow_heads_bf16=True).attention_fp32 is True
    assert resolve_device_switches(gpt2, "cpu", head_size=BF16_ATTENTION_MIN_HEAD - 1).attention_fp32 is True
    assert resolve_device_switches(gpt2, "cpu", saved={"attention_fp32": True}).attention_fp32 is True
    assert resolve_device_switches(gpt2, "cuda", saved={}).attention_fp32 is False
    with pytest.raises(Exception, match="attention_fp32"):
        build_train_config({"model": "tiny", "attention_fp32": "sometimes"})


_X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma

processor\t: 1
model name\t: another
flags\t\t: fpu
"""

_ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0x{part}
CPU revision\t: 1

processor\t: 1
Features\t: fp
"""


def test_the_cpu_is_named_and_its_flags_read_on_x86_and_on_arm64() -> None:
    x86 = hardware.parse_cpuinfo(_X86_CPUINFO)
    assert hardware.cpu_name(x86) == "AMD EPYC 7B13"
    assert hardware.cpu_flags(x86) == {"fpu", "sse2", "avx", "avx2", "fma"}  # the first processor's, not the last's
    n1, v1 = (hardware.parse_cpuinfo(_ARM_CPUINFO.format(part=part)) for part in ("d0c", "d40"))
    assert hardware.cpu_name(n1) == "Neoverse N1 r3p1" and hardware.cpu_name(v1) == "Neoverse V1 r3p1"
    assert "asimddp" in hardware.cpu_flags(n1) and "avx2" not in hardware.cpu_flags(n1)
    unknown = hardware.parse_cpuinfo(_ARM_CPUINFO.format(part="abc").replace("0x41", "0x61"))
    assert hardware.cpu_name(unknown) == "arm64 implementer 0x61 part 0xabc r3p1"
    assert hardware.cpu_name({}) and hardware.cpu_flags({}) == frozenset()


def test_two_arm_cores_have_different_cache_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = []
    for part in ("d0c", "d40"):
        info = hardware.parse_cpuinfo(_ARM_CPUINFO.format(part=part))
        monkeypatch.setattr(hardware, "_cpuinfo", lambda info=info: info)
        ids.append(hardware.cpu_id())
    assert ids[0] != ids[1] and ids[0].startswith("Neoverse N1")
