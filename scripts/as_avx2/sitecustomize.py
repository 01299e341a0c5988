"""Loaded by every Python process that scripts/as_avx2/run starts: torch's CPU probes report AVX2 and nothing better,
so lenext picks what it picks on an AMD EPYC with AVX2 only (fp32 by default, the bf16 warning)."""

try:
    import torch.cpu
except ImportError:  # a Python without torch (pip, venv creation): nothing to answer for
    pass
else:
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported", "_is_avx512_supported"):
        setattr(torch.cpu, probe, lambda: False)
