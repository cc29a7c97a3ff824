"""`numerics: portable`: the kernel pins, where they reach, and the reader's bit check."""

import json
import os
import subprocess
import sys

import pytest
import torch

from reprorl.core import config as configuration
from reprorl.core import numerics
from reprorl.core.errors import ConfigError, ReproError
from reprorl.pipeline import bitcheck, uncertainty


def _python(code: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in numerics.PORTABLE and k != numerics.MODE_VARIABLE}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                          capture_output=True, text=True, timeout=120, check=False)


PINNED = """
import json, os, subprocess, sys
from reprorl.core import numerics
numerics.pin("portable")
import torch
numerics.check()
child = subprocess.run([sys.executable, "-c", "import torch, os; print(torch.backends.cpu."
                        "get_cpu_capability(), os.environ['MKL_CBWR'])"],
                       capture_output=True, text=True, check=True).stdout.split()
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "child": child}))
"""


def test_portable_pins_torch_here_and_in_every_child():
    result = _python(PINNED)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"capability": "AVX2", "child": ["AVX2", "COMPATIBLE,STRICT"]}


def test_an_override_after_the_pins_is_refused_by_name():
    result = _python(PINNED.replace('numerics.check()', 'os.environ["MKL_CBWR"] = "AVX2"\n'
                                    'numerics.check()'))
    assert result.returncode != 0
    assert "MKL_CBWR" in result.stderr and "unset those variables" in result.stderr


def test_pins_come_before_torch_or_not_at_all():
    assert "torch" in sys.modules  # this process imported it
    with pytest.raises(ReproError, match="before torch is imported"):
        numerics.pin("portable")
    numerics.pin("native")  # nothing to pin


def test_a_process_born_portable_refuses_to_run_native():
    result = _python("from reprorl.core import numerics; numerics.pin('native')",
                     REPRORL_NUMERICS="portable")
    assert result.returncode != 0 and "inherited numerics: portable" in result.stderr


def test_portable_threads_are_the_declared_count():
    assert numerics.threads(2, 1, "portable") == 2  # Snakemake lowered the rule to --cores 1
    assert numerics.threads(2, 1, "native") == 1
    assert numerics.threads(2, None, "native") == 2


def test_portable_on_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="model.device is 'cuda'.*numerics: native"):
        configuration.validate({"numerics": "portable", "model": {"device": "cuda"}})
    with pytest.raises(ConfigError, match="numerics"):
        configuration.validate({"numerics": "fast"})


def test_manifests_hash_the_pins_not_the_cpu_type_in_portable_mode(monkeypatch):
    from reprorl.core.manifest import cpu_features

    hashed, machine = cpu_features()
    assert machine == {} and hashed["numerics"] == "native" and "vendor" in hashed
    monkeypatch.setenv(numerics.MODE_VARIABLE, "portable")
    hashed, machine = cpu_features()
    assert hashed["numerics"] == "portable" and "vendor" in machine
    assert not {"vendor", "model_name", "family_model", "flags"} & set(hashed)


def _digests(tensor_value: float = 1.0, machine: str = "AMD EPYC", numerics_mode="portable",
             torch_version="2.13.0") -> dict:
    """Two stages, `a` writing x.pt.gz and `b` reading it and writing y.csv."""
    stage = {"kernels": {"numerics": numerics_mode, "torch_capability": "AVX2"},
             "libraries": {"torch": torch_version}}
    tensors = {"assets/x.pt.gz": {"/w": f"{tensor_value}"}}
    return {"format": bitcheck.FORMAT, "commit": "abc", "numerics": numerics_mode,
            "machine": {"model_name": machine, "family_model": "1/1",
                        "torch_capability": "AVX2"},
            "stages": {"b": {**stage, "view": "v",
                             "inputs": {"assets/x.pt.gz": f"{tensor_value}"},
                             "outputs": {"y.csv": f"y{tensor_value}"}},
                       "a": {**stage, "view": "v", "inputs": {},
                             "outputs": {"assets/x.pt.gz": f"{tensor_value}"}}},
            "tensors": tensors, "results_rows": f"r{tensor_value}"}


def test_the_check_names_the_first_stage_in_dag_order_and_why():
    same = bitcheck.compare(_digests(), _digests())
    assert same["same_bits"] and same["explanation"] is None
    other = bitcheck.compare(_digests(), _digests(2.0))
    assert not other["same_bits"]
    assert other["first_stage"]["stage"] == "a" and other["first_stage"]["inputs_same"]
    assert other["first_stage"]["tensors"] == ["assets/x.pt.gz/w"]
    assert other["explanation"].startswith("not explained")  # same pins, same libraries
    assert "first stage that differs: a" in bitcheck.verdict(other, "there.json")
    native = bitcheck.compare(_digests(numerics_mode="native"),
                              _digests(2.0, "Intel Xeon", numerics_mode="native"))
    assert native["explanation"].startswith("explained: native numerics on another CPU type")
    libraries = bitcheck.compare(_digests(), _digests(2.0, torch_version="2.9.1"))
    assert libraries["explanation"].startswith("explained: other library versions (torch)")
    older = {**_digests(2.0), "commit": "0be08ed"}  # e.g. before a change of the numerics
    assert bitcheck.compare(_digests(), older)["explanation"].startswith(
        "perhaps explained: other code (commit abc here, 0be08ed there)")


def test_the_check_refuses_what_is_not_a_digest_file(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ReproError, match="not a digest file of format"):
        bitcheck.load(tmp_path / "x.json")
    with pytest.raises(ReproError, match="neither a digest file nor a run's folder"):
        bitcheck.load(tmp_path / "absent.json")


def test_a_file_with_tensors_is_digested_by_its_tensors_and_json_without_code(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors", metadata={"code": "other"})
    assert (bitcheck.content_digest(tmp_path / "a.safetensors")
            == bitcheck.content_digest(tmp_path / "b.safetensors"))
    (tmp_path / "a.json").write_text(json.dumps({"x": 1, "id": {"code_sha256": "1"}}))
    (tmp_path / "b.json").write_text(json.dumps({"x": 1, "id": {"code_sha256": "2"}}))
    (tmp_path / "c.json").write_text(json.dumps({"x": 2, "id": {"code_sha256": "2"}}))
    digest = bitcheck.content_digest
    assert digest(tmp_path / "a.json") == digest(tmp_path / "b.json") != digest(
        tmp_path / "c.json")


def _rows(successes: int, total: int = 10) -> list[dict]:
    return [{"prompt": f"p{i}", "row": 1, "rubric_success": i < successes, "recognized": True,
             "relevant": True, "unsupported_certainty": False, "learned_score": float(i),
             "logratio_per_token": 0.0} for i in range(total)]


def test_the_interval_over_seeds_covers_what_training_moves():
    steady = uncertainty.over_seeds([_rows(5), _rows(5), _rows(5)])["rubric_success_rate"]
    spread = uncertainty.over_seeds([_rows(1), _rows(5), _rows(9)])["rubric_success_rate"]
    assert steady["mean"] == spread["mean"] == 0.5
    assert spread["per_seed"] == [0.1, 0.5, 0.9]
    width = lambda s: s["interval_95"][1] - s["interval_95"][0]  # noqa: E731
    assert width(spread) > width(steady)  # prompts alone give the steady one's width
    assert spread["interval_95"][0] < 0.3 and spread["interval_95"][1] > 0.7
    paired = uncertainty.over_seeds([_rows(6), _rows(8)], [_rows(5), _rows(5)])
    assert paired["rubric_success_rate"]["mean"] == pytest.approx(0.2)
    assert paired["rubric_success_rate"]["per_seed"] == pytest.approx([0.1, 0.3])


def test_a_server_started_past_the_cli_cannot_be_pinned_late():
    result = _python("import sys; from reprorl.serve.server import main; "
                     "sys.exit(main(['--model', 'absent', '--numerics', 'portable']))")
    assert result.returncode == 2
    assert "start the server as `reprorl serve --numerics portable`" in result.stderr
