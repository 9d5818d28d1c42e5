"""The start-up version check and the build-time import/pin check (megatron_agent/platform/versions.py)."""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys

from megatron_agent.platform.versions import check_imports, check_versions, installed_versions

GPU_OK = {
    "torch": "2.14.0a0+5b2fe1c.nv26.07",
    "megatron-core": "0.19.2",
    "transformer-engine": "2.12.0+a1b2c3",
    "vllm": "0.33.0",
}


def test_this_machine_fits_the_cpu_table():
    versions = installed_versions()
    assert versions["torch"] == metadata.version("torch") and versions["megatron-core"] == "0.19.2"
    assert check_versions(cuda=False) == []


def test_gpu_combination_with_ngc_style_versions_fits():
    assert check_versions(GPU_OK, cuda=True, vllm_torch_pin="==2.14.0") == []


def test_megatron_core_mismatch_names_the_fix():
    messages = check_versions(
        dict(GPU_OK, **{"megatron-core": "0.17.0"}), cuda=True, vllm_torch_pin="==2.14.0"
    )
    change = [m for m in messages if "megatron-core 0.17.0" in m]
    assert change and "==0.19.*" in change[0] and "pip install --no-deps megatron-core==0.19.2" in change[0]
    assert all(m.startswith(("warning:", "error:")) for m in messages)


def test_vllm_built_for_another_torch_is_an_error():
    messages = check_versions(dict(GPU_OK, torch="2.12.0a0+x.nv26.01"), cuda=True, vllm_torch_pin="==2.14.0")
    errors = [m for m in messages if m.startswith("error:")]
    assert len(errors) == 1 and "built for torch ==2.14.0" in errors[0] and "NGC_TAG" in errors[0]


def test_missing_pieces_on_gpu():
    messages = check_versions(
        dict(GPU_OK, vllm=None, **{"transformer-engine": None}), cuda=True, vllm_torch_pin=None
    )
    assert any(m.startswith("error: vllm is not installed") for m in messages)
    assert any("transformer-engine is not installed" in m for m in messages)


def test_cpu_with_a_gpu_vllm_release_is_flagged():
    messages = check_versions(dict(installed_versions(), vllm="0.33.0"), cuda=False, vllm_torch_pin=None)
    assert any(m.startswith("warning: change vllm 0.33.0 to ==0.32.*") for m in messages)


def test_import_and_pin_check():
    torch_version = metadata.version("torch")
    packaging_version = metadata.version("packaging")
    assert (
        check_imports(["torch", "packaging"], {"torch": torch_version, "Packaging": packaging_version}) == []
    )
    errors = check_imports(["torch", "not_a_module_xyz"], {"torch": "1.0.0"})
    assert any("torch is " in e and "pinned 1.0.0" in e for e in errors)
    assert any("`import not_a_module_xyz` failed" in e for e in errors)


def test_cli_fails_on_a_wrong_pin(tmp_path):
    pins = tmp_path / "pins.txt"
    pins.write_text("ray==0.0.1\n")
    cmd = [sys.executable, "-m", "megatron_agent.platform.versions", "--platform", "cpu", "--imports", "ray"]
    result = subprocess.run([*cmd, "--pins", str(pins)], capture_output=True, text=True)
    assert result.returncode == 1 and "pinned 0.0.1" in result.stderr
    pins.write_text(f"ray=={metadata.version('ray')}\n")
    result = subprocess.run([*cmd, "--pins", str(pins)], capture_output=True, text=True)
    assert result.returncode == 0 and "versions ok" in result.stdout, result.stderr
