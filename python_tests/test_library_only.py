"""The operators with nothing but ``torch.ops.load_library``: no ``import fsdp_ema`` anywhere.

Each check runs library_only_program.py in a fresh interpreter, so no Python-side registration of
the package can help: fake kernels, side-effect marks and schemas must all come from the library.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fsdp_ema

_PROGRAM = Path(__file__).resolve().parent / "library_only_program.py"


def run_check(name: str, tmp_path: Path) -> None:
    env = dict(os.environ)
    # The package must not even be importable by accident.
    env["PYTHONPATH"] = ""
    proc = subprocess.run([sys.executable, str(_PROGRAM), fsdp_ema.library_path(), name,
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert f"ok {name}" in proc.stdout


def test_compiled_update_save_commit_load_is_one_graph_with_the_library_alone(tmp_path):
    run_check("compiled_save_commit_load", tmp_path)


def test_torchscript_keeps_an_unused_save_with_the_library_alone(tmp_path):
    run_check("torchscript_keeps_unused_save", tmp_path)


def test_tracing_reads_headers_and_index_but_no_tensor_data(tmp_path):
    run_check("trace_reads_no_tensor_data", tmp_path)


def test_opcheck_passes_for_every_op_with_the_library_alone(tmp_path):
    run_check("opcheck_every_op", tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_opcheck_cuda_kernels_with_the_library_alone(tmp_path):
    run_check("opcheck_cuda", tmp_path)
