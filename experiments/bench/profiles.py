"""The two benchmark profiles: full (embedded SmolLM2-135M) and quick (tiny random Llama)."""

from __future__ import annotations

from pathlib import Path

from .engines import Config
from .env import CACHE_ROOT
from .workload import MultiStepWorkload, Profile, Workload

FULL = Profile(
    name="full",
    model="embedded",
    # fp32 compute: this CPU has no AVX512-bf16, so a bf16 engine runs much slower and its timing noise
    # from that dominates (the study and the tests use fp32 for the same reason).
    model_dtype="float32",
    layers=(8, 16, 24, 30),
    workload=Workload(num_prompts=32, n=4, max_tokens=64),
    multistep=MultiStepWorkload(num_questions=4, candidates=4, steps=3, max_step_tokens=24),
    modes=("compiled", "eager"),
    reps=2,
    memory_subprocess=True,
    engine=dict(block_size=32, kv_cache_memory_bytes=1 << 30, max_model_len=1024,
                max_num_seqs=128, seed=0, enable_prefix_caching=True),
)

QUICK = Profile(
    name="quick",
    model="tiny",
    model_dtype="float32",
    layers=(1, 2, 4),
    workload=Workload(num_prompts=4, n=2, max_tokens=16),
    multistep=MultiStepWorkload(num_questions=2, candidates=2, steps=2, max_step_tokens=12),
    modes=("eager",),
    reps=1,
    memory_subprocess=False,
    engine=dict(block_size=32, kv_cache_memory_bytes=64 << 20, max_model_len=512,
                max_num_seqs=16, seed=0, enable_prefix_caching=True),
)


def configs(profile: Profile) -> list[Config]:
    """Timed configurations; the order is reversed on every other repeat to cancel drift."""
    out: list[Config] = []
    for mode in profile.modes:
        out += [Config("plain", mode), Config("ours", mode, "float32")]
    # bf16 storage timed in eager mode only: one compiled engine fewer to build (30-90 s each).
    out += [Config("ours", "eager", "bfloat16"), Config("common", "eager")]
    return out


def memory_configs(with_common: bool = False) -> list[Config]:
    out = [Config("plain", "eager"), Config("ours", "eager", "float32"), Config("ours", "eager", "bfloat16")]
    return out + [Config("common", "eager")] if with_common else out


def model_path(profile: Profile) -> Path:
    if profile.model == "embedded":
        from uhead_vllm.models import embedded_model_path

        return embedded_model_path()  # the cache the CLI and scripts/setup.sh use
    from uhead_vllm._testing import TINY_MODEL_VERSION, build_tiny_model

    return build_tiny_model(CACHE_ROOT / "tiny_models" / f"llama-v{TINY_MODEL_VERSION}", "llama")
