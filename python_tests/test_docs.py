"""Docs that run: every ```python block of README.md and docs/*.md runs (in a fresh process, in an
empty directory; ``<!-- doc: ranks=2 -->`` ones under torchrun with 2 gloo ranks) and every
```cpp block compiles against the public headers (include/, format/include/ and torch's), each
as its own translation unit. See doc_blocks.py for the hidden directives a block may carry."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from functools import cache

import pytest
import torch
from doc_blocks import ROOT, all_blocks, cpp_translation_unit

BLOCKS = all_blocks()
LIBRARY = ROOT / "build" / "lib" / "libfsdp_ema.so"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "python")
    e["FSDP_EMA_LIBRARY"] = str(LIBRARY)  # what a block that loads the library alone reads
    e["OMP_NUM_THREADS"] = "1"
    e.pop("FSDP_EMA_TEST_DEVICE", None)
    return e


def describe(out: subprocess.CompletedProcess, program: str) -> str:
    numbered = "\n".join(f"{n:4d}  {line}" for n, line in enumerate(program.splitlines(), 1))
    return (f"exit {out.returncode}\n--- program\n{numbered}\n--- stdout\n{out.stdout[-4000:]}"
            f"\n--- stderr\n{out.stderr[-6000:]}")


PY = [b for b in BLOCKS if b.lang == "python"]
CPP = [b for b in BLOCKS if b.lang == "cpp"]


def test_the_docs_have_blocks_and_every_directive_is_known():
    # parse() raised already for an unknown option; here: the corpus is what we think it is.
    assert len(PY) >= 10 and len(CPP) >= 3
    assert {b.path.name for b in PY} >= {"README.md", "SHARDED_EMA.md"}


@pytest.mark.parametrize("block", PY, ids=[b.id for b in PY])
def test_python_block_runs(block, tmp_path):
    if block.options.get("needs") == "cuda" and not torch.cuda.is_available():
        pytest.skip("the block needs a GPU")
    program = block.program()
    script = tmp_path / "block.py"
    script.write_text(program)
    ranks = int(block.options.get("ranks", "1"))
    timeout = int(block.options.get("timeout", "240"))
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    out = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{block.id} failed:\n" + describe(out, program)


@cache
def compile_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    # USE_C10D_GLOO: what a C++ program that makes a ProcessGroupGloo defines (docs/CPP.md).
    flags = ["-std=c++20", "-fsyntax-only", "-w", "-DUSE_C10D_GLOO",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-I{ROOT / 'include'}", f"-I{ROOT / 'format' / 'include'}",
             f"-I{sysconfig.get_paths()['include']}"]
    return flags + [f"-I{p}" for p in include_paths()]


@pytest.mark.parametrize("block", CPP, ids=[b.id for b in CPP])
def test_cpp_block_compiles(block, tmp_path):
    source = tmp_path / "block.cpp"
    source.write_text(cpp_translation_unit(block))
    out = subprocess.run(["g++", *compile_flags(), str(source)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, (f"{block.id} does not compile:\n{out.stderr[-6000:]}\n--- as "
                                 f"compiled\n{source.read_text()}")


# --- docs/OPERATORS.md against the registered schemas -------------------------------------------

def _normalize(schema: str) -> str:
    return " ".join(schema.replace("( ", "(").split()).replace("( ", "(").replace(" )", ")")


def _documented_schemas() -> list[str]:
    """The schema lines of the reference's plain code blocks (continuation lines joined)."""
    import re

    text = (ROOT / "docs" / "OPERATORS.md").read_text(encoding="utf-8")
    reference = text[text.index("\n## Reference"):]
    out = []
    for block in re.findall(r"^```\n(.*?)^```", reference, flags=re.S | re.M):
        joined: list[str] = []
        for line in block.splitlines():
            line = line.split("#", 1)[0].rstrip()
            if not line:
                continue
            if line[0].isspace() and joined:
                joined[-1] += " " + line.strip()
            else:
                joined.append(line)
        out += [_normalize(ln) for ln in joined
                if re.match(r"^[a-z_]+(\.[A-Za-z_]+)?\(.*\) -> \S", ln)]
    return out


def test_operator_reference_matches_the_registered_schemas():
    registered = {_normalize(str(s)[len("fsdp_ema::"):]) for s in torch._C._jit_get_all_schemas()
                  if s.name.startswith("fsdp_ema::")}
    documented = _documented_schemas()
    assert len(documented) == len(set(documented)), "a schema is documented twice"
    assert sorted(registered - set(documented)) == [], "registered but not in docs/OPERATORS.md"
    assert sorted(set(documented) - registered) == [], "in docs/OPERATORS.md but not registered"


def test_operator_reference_names_only_methods_the_classes_have(tmp_path):
    import re

    from fsdp_ema import checkpoint as ckpt

    text = (ROOT / "docs" / "OPERATORS.md").read_text(encoding="utf-8")
    ckpt.save(tmp_path / "c", {"w": torch.zeros(2)})
    instances = {
        "OpenCheckpoint": torch.classes.fsdp_ema.OpenCheckpoint(str(tmp_path / "c")),
        "ExportWriter": torch.classes.fsdp_ema.ExportWriter(str(tmp_path / "e"), [], [], None, 0,
                                                            False, True),
    }
    for name, obj in instances.items():
        start = text.index(f"torch.classes.fsdp_ema.{name}(")
        end = text.find("torch.classes.fsdp_ema.", start + 1)
        section = text[start:end if end > 0 else text.index("```", start)]
        methods = set(re.findall(r"^\s+\.(\w+)\(|\s{2,}\.(\w+)\(", section, flags=re.M))
        methods = {m for pair in methods for m in pair if m}
        assert methods, name
        for m in methods:
            assert hasattr(obj, m), f"docs/OPERATORS.md lists {name}.{m}, which does not exist"
