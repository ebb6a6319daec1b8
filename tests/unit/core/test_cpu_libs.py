"""A CPU process that marks Triton absent (`without_triton`, as the engine and the trainer do
at start) loads and runs SmolLM2 without mapping `libtriton.so`, and computes the same logits
and gradients bit for bit as one that lets torch load it. Each side runs in its own
interpreter: a loaded library cannot be unloaded."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[3] / "services"

PROGRAM = """
import json, sys
sys.path.insert(0, {services!r})
if {block}:
    from flywheel.core.cpu_libs import without_triton
    assert without_triton()
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32)
ids = torch.tensor([[1, 504, 3158, 314, 216, 33, 1232, 216, 34, 47]])
logits = model(ids).logits
logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().backward()
torch.save({{"logits": logits.detach(), "grad": model.model.norm.weight.grad,
            "embed_grad": model.model.embed_tokens.weight.grad[ids[0]]}}, {out!r})
print(json.dumps({{
    "triton_module": sys.modules.get("triton") is not None,
    "libtriton_mapped": "libtriton" in open("/proc/self/maps").read(),
    "dynamo_loaded": "torch._dynamo" in sys.modules,
}}))
"""


def _run(model_dir: Path, out: Path, block: bool) -> dict:
    code = PROGRAM.format(services=str(SERVICES), block=block, model=str(model_dir), out=str(out))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_without_triton_same_logits_and_gradients_no_libtriton(smollm2_dir, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: without_triton leaves Triton alone")
    loaded = _run(smollm2_dir, tmp_path / "loaded.pt", block=False)
    absent = _run(smollm2_dir, tmp_path / "absent.pt", block=True)
    assert loaded["dynamo_loaded"] and loaded["libtriton_mapped"]  # what it saves
    assert absent["dynamo_loaded"] and not absent["libtriton_mapped"]
    assert not absent["triton_module"]
    a = torch.load(tmp_path / "loaded.pt")
    b = torch.load(tmp_path / "absent.pt")
    for key in ("logits", "grad", "embed_grad"):
        assert torch.equal(a[key], b[key]), key


def test_without_triton_leaves_an_imported_triton_alone():
    code = (
        f"import sys, types; sys.path.insert(0, {str(SERVICES)!r})\n"
        "sys.modules['triton'] = fake = types.ModuleType('triton')\n"
        "from flywheel.core.cpu_libs import without_triton\n"
        "print(without_triton(), sys.modules['triton'] is fake)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_trainer_start_marks_triton_absent_before_its_settings_check(tmp_path):
    """The trainer's settings check already imports torch._dynamo (trainer.policy,
    trainer.step): Triton must be marked absent before it, or libtriton is loaded anyway."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: without_triton leaves Triton alone")
    code = (
        f"import sys; sys.path.insert(0, {str(SERVICES)!r})\n"
        "from flywheel.trainer.main import main\n"
        "rc = main(['--check-settings'])\n"
        "print(rc, 'torch._dynamo' in sys.modules, 'libtriton' in open('/proc/self/maps').read())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        cwd=tmp_path,
    )
    assert out.stdout.split()[-3:] == ["0", "True", "False"]
