"""Packaging: the wheel (name, tags, contents), installs into fresh environments used from outside
the checkout, an editable install, and the refusal to load into a torch other than the build's.

One wheel build per run (``python -m build --wheel --no-isolation``) into the kept ``build-wheel/``
directory with the development build's compiler, so ccache (CCACHE_BASEDIR) reuses the objects
of ``build/``; the editable install reuses that directory too, and compiles nothing new.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from fsdp_ema import _library

ROOT = Path(__file__).resolve().parents[1]
RELEASE = str(torch.__version__).split("+")[0]
ACCEL = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
PLATFORM = sysconfig.get_platform().replace("-", "_").replace(".", "_")  # linux_x86_64


def _project_version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    return re.search(r"project\(fsdp_ema VERSION ([0-9.]+)", text).group(1)


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: nothing pointing into the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "FSDP_EMA_LIBRARY", "FSDP_EMA_BUILD")}
    env.update(extra)
    return env


def _run(cmd, *, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or _clean_env(),
                          capture_output=True, text=True, timeout=timeout)
    return proc


def _check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"{proc.args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
        f"stderr:\n{proc.stderr[-4000:]}")
    return proc


def _build_env() -> dict[str, str]:
    """The development build's compilers (scikit-build-core would take Python's sysconfig CXX, a
    different ccache key) and ccache's path rewriting relative to the checkout."""
    env = _clean_env(CCACHE_BASEDIR=str(ROOT), CCACHE_NOHASHDIR="1")
    cache = Path(os.environ.get("FSDP_EMA_BUILD", ROOT / "build")) / "CMakeCache.txt"
    text = cache.read_text() if cache.is_file() else ""
    for var, cmake_var in (("CXX", "CMAKE_CXX_COMPILER"), ("CC", "CMAKE_C_COMPILER")):
        match = re.search(rf"^{cmake_var}:[A-Z]+=(.+)$", text, re.MULTILINE)
        if match and var not in env:
            env[var] = match.group(1)
    return env


def _fresh_venv(path: Path) -> Path:
    """A new venv over the project's torch environment: ``--system-site-packages`` reaches only the
    base interpreter's packages when the running Python is itself a venv, so a .pth adds this
    environment's site-packages (torch, pip) after the new venv's own."""
    _check(_run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", path],
                cwd=path.parent))
    python = path / "bin" / "python"
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = _check(_run([python, "-c", probe], cwd=path)).stdout.strip()
    Path(purelib, "_fsdp_ema_test_base_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _check(_run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, ROOT],
                cwd=ROOT, env=_build_env(), timeout=1200))
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed by pip (offline: torch comes from the base env)."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    python = _fresh_venv(venv)
    _check(_run([python, "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
                 wheel], cwd=venv))
    return venv


def _site_packages(venv: Path) -> Path:
    (path,) = venv.glob("lib/python3*/site-packages")
    return path


def test_wheel_name_metadata_and_contents_name_the_torch_it_needs(wheel):
    version = f"{_project_version()}+torch{RELEASE}.{ACCEL}"
    assert wheel.name == f"fsdp_ema-{version}-py3-none-{PLATFORM}.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(f"fsdp_ema-{version}.dist-info/METADATA").decode()
        record = json.loads(z.read("fsdp_ema/lib/fsdp_ema_build.json"))
        wheel_info = z.read(f"fsdp_ema-{version}.dist-info/WHEEL").decode()
    assert f"Version: {version}\n" in metadata
    assert f"Requires-Dist: torch=={RELEASE}\n" in metadata
    # The trainer integrations' extras (fsdp_ema.integrations): pip install "fsdp-ema[lightning]".
    assert "Provides-Extra: lightning\n" in metadata and 'extra == "lightning"' in metadata
    assert "Provides-Extra: transformers\n" in metadata and 'extra == "transformers"' in metadata
    assert "Provides-Extra: diffusers\n" in metadata and 'extra == "diffusers"' in metadata
    assert f"Tag: py3-none-{PLATFORM}\n" in wheel_info
    assert record["torch_version"] == str(torch.__version__)
    assert record["torch_cuda"] == torch.version.cuda
    for name in ("fsdp_ema/__init__.py", "fsdp_ema/_library.py",
                 "fsdp_ema/integrations/lightning.py", "fsdp_ema/integrations/transformers.py",
                 "fsdp_ema/integrations/diffusers.py", "fsdp_ema/integrations/diffusers_files.py",
                 "fsdp_ema/integrations/diffusers_schedule.py",
                 "fsdp_ema/lib/libfsdp_ema.so",
                 "fsdp_ema/include/fsdp_ema/ops.h",
                 "fsdp_ema/lib/cmake/fsdp_ema/fsdp_emaConfig.cmake",
                 f"fsdp_ema-{version}.data/scripts/fsdp-ema"):
        assert name in names, f"{name} missing from {wheel.name}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_installed_library_rpath_is_origin_relative(installed):
    lib = _site_packages(installed) / "fsdp_ema" / "lib" / "libfsdp_ema.so"
    dynamic = _check(_run(["readelf", "-d", lib], cwd=installed)).stdout
    entries = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", dynamic)
    assert entries, dynamic
    dirs = [d for e in entries for d in e.split(":")]
    assert all(d.startswith("$ORIGIN") for d in dirs), dirs
    # The layout it was made for: torch's libraries beside the package in site-packages.
    assert "$ORIGIN/../../torch/lib" in dirs


def test_installed_wheel_works_from_outside_the_checkout(installed, tmp_path):
    python = installed / "bin" / "python"
    script = tmp_path / "use_it.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        import torch
        import fsdp_ema
        from fsdp_ema import checkpoint as ckpt

        torch.manual_seed(0)
        ema = [torch.randn(1000), torch.randn(3, 5, dtype=torch.float64)]
        model = [torch.randn(1000, dtype=torch.bfloat16), torch.randn(3, 5)]
        want = [torch.lerp(e, m.to(e.dtype), 0.25) for e, m in zip(ema, model)]
        fsdp_ema.update_(ema, model, 0.75)
        update_err = max((e - w).abs().max().item() for e, w in zip(ema, want))

        ckpt.save(sys.argv[1], {"w": ema[0], "b": ema[1]})
        back = ckpt.load(sys.argv[1])
        print(json.dumps({
            "package": fsdp_ema.__file__,
            "library": fsdp_ema.load_library(),
            "update_err": update_err,
            "loaded": sorted(back),
            "equal": bool(torch.equal(back["w"], ema[0]) and torch.equal(back["b"], ema[1])),
        }))
    """))
    ck = tmp_path / "ckpt"
    proc = _check(_run([python, script, ck], cwd=tmp_path))
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    site = _site_packages(installed)
    assert Path(got["package"]).is_relative_to(site), got
    assert Path(got["library"]) == site / "fsdp_ema" / "lib" / "libfsdp_ema.so"
    assert not Path(got["package"]).is_relative_to(ROOT)
    assert got["update_err"] < 1e-6
    assert got["loaded"] == ["b", "w"] and got["equal"]

    cli = installed / "bin" / "fsdp-ema"
    help_text = _check(_run([cli, "--help"], cwd=tmp_path)).stdout
    for sub in ("inspect", "verify", "export"):
        assert sub in help_text
    verify = _check(_run([cli, "verify", ck], cwd=tmp_path))
    assert verify.stdout.startswith("OK: 2 tensors"), verify.stdout
    # verify really reads the data: one flipped byte in the shard's payload fails it.
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    (shard,) = bad.glob("shard-*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40
    shard.write_bytes(bytes(data))
    assert _run([cli, "verify", bad], cwd=tmp_path).returncode == 1


def test_editable_install_runs_the_checkout_python_with_the_built_library(wheel, tmp_path):
    # After the wheel fixture: the same kept build directory, so nothing is compiled again.
    python = _fresh_venv(tmp_path / "env")
    _check(_run([python, "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
                 "--no-build-isolation", "-e", ROOT], cwd=tmp_path, env=_build_env(),
                timeout=1200))
    proc = _check(_run([python, "-c", textwrap.dedent("""
        import json, torch, fsdp_ema
        e = [torch.zeros(4)]
        fsdp_ema.update_(e, [torch.ones(4)], 0.75)
        print(json.dumps({"package": fsdp_ema.__file__, "library": fsdp_ema.load_library(),
                          "sum": e[0].sum().item()}))
    """)], cwd=tmp_path))
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["package"]) == ROOT / "python" / "fsdp_ema" / "__init__.py"
    assert Path(got["library"]) == _site_packages(tmp_path / "env") / "fsdp_ema" / "lib" / \
        "libfsdp_ema.so"
    assert got["sum"] == 1.0
    assert "verify" in _check(_run([tmp_path / "env" / "bin" / "fsdp-ema", "--help"],
                                   cwd=tmp_path)).stdout


def test_cxx_project_builds_against_the_cmake_package_in_the_wheel(installed, tmp_path):
    # tests/consumer (find_package(fsdp_ema) and one op call) against site-packages/fsdp_ema, a
    # package built elsewhere (build-wheel/, a temporary wheel root) and installed by pip.
    torch_prefix = _check(_run([sys.executable, "-c",
                                "import torch.utils; print(torch.utils.cmake_prefix_path)"],
                               cwd=tmp_path)).stdout.strip()
    package = _site_packages(installed) / "fsdp_ema"
    build = tmp_path / "build"
    _check(_run(["cmake", "-S", ROOT / "tests" / "consumer", "-B", build, "-G", "Ninja",
                 "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_PREFIX_PATH={package};{torch_prefix}"],
                cwd=tmp_path, env=_build_env()))
    _check(_run(["cmake", "--build", build], cwd=tmp_path, env=_build_env()))
    cache = (build / "CMakeCache.txt").read_text()
    assert f"fsdp_ema_DIR:PATH={package}/lib/cmake/fsdp_ema" in cache
    assert "sum after update = 1.0000" in _check(_run([build / "consumer"], cwd=tmp_path)).stdout


# ids without "cuda": the GPU run selects tests with -k cuda (scripts/gpu_check.sh).
@pytest.mark.parametrize("field,value", [("torch_version", "2.13.0+cu128"),
                                         ("torch_cuda", "12.8")], ids=["release", "accelerator"])
def test_import_refuses_a_torch_other_than_the_build_one(installed, tmp_path, field, value):
    copy = tmp_path / "pkg" / "fsdp_ema"
    shutil.copytree(_site_packages(installed) / "fsdp_ema", copy)
    record_path = copy / "lib" / "fsdp_ema_build.json"
    record = json.loads(record_path.read_text())
    record[field] = value
    record_path.write_text(json.dumps(record))
    proc = _run([sys.executable, "-c", "import fsdp_ema"], cwd=tmp_path,
                env=_clean_env(PYTHONPATH=str(tmp_path / "pkg")))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fsdp_ema._library.TorchMismatchError: "), proc.stderr[-2000:]
    assert str(copy / "lib" / "libfsdp_ema.so") in last
    assert f"built against torch {record['torch_version']} (CUDA {record['torch_cuda']})" in last
    assert f"runs torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})" in last
    assert "pip install --no-build-isolation" in last
    assert "undefined symbol" not in proc.stderr


def test_check_torch_accepts_the_build_torch_and_names_a_bad_record(tmp_path):
    lib = tmp_path / "libfsdp_ema.so"
    lib.write_bytes(b"")
    _library.check_torch(str(lib))  # no record: a hand-copied library is not checked
    record = tmp_path / "fsdp_ema_build.json"
    record.write_text(json.dumps({"torch_version": str(torch.__version__),
                                  "torch_cuda": torch.version.cuda}))
    _library.check_torch(str(lib))
    record.write_text(json.dumps({"torch_version": "2.0.0", "torch_cuda": torch.version.cuda}))
    with pytest.raises(_library.TorchMismatchError, match=r"built against torch 2\.0\.0 "):
        _library.check_torch(str(lib))
    # Same release, another accelerator (a +cpu build against a +cu130 one, say).
    other = "11.8" if torch.version.cuda else "13.0"
    record.write_text(json.dumps({"torch_version": str(torch.__version__), "torch_cuda": other}))
    with pytest.raises(_library.TorchMismatchError, match=rf"\(CUDA {re.escape(other)}\), but"):
        _library.check_torch(str(lib))
    record.write_text("{not json")
    with pytest.raises(ImportError, match=re.escape(str(record))):
        _library.check_torch(str(lib))


def _configure(build: Path, *args: str) -> subprocess.CompletedProcess:
    return _check(_run(["cmake", "-S", ROOT, "-B", build, "-G", "Ninja",
                        f"-DPython3_EXECUTABLE={sys.executable}",
                        "-DFSDP_EMA_BUILD_TESTS=OFF", "-DFSDP_EMA_BUILD_BENCH=OFF",
                        "-DFSDP_EMA_BUILD_TOOLS=OFF", "-DFSDP_EMA_BUILD_PACKAGING_TESTS=OFF",
                        *args], cwd=ROOT, env=_build_env(), timeout=300))


def test_the_cpu_only_switch_the_readme_names_leaves_the_gpu_kernels_out(tmp_path):
    """README's `-Ccmake.define.FSDP_EMA_CUDA=OFF` (scikit-build-core passes it to CMake as
    -DFSDP_EMA_CUDA=OFF): the configure leaves the CUDA kernels out even where a toolkit and a
    CUDA torch are found, which AUTO (the default) compiles."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install --no-build-isolation -Ccmake.define.FSDP_EMA_CUDA=OFF ." in readme
    off = _configure(tmp_path / "off", "-DFSDP_EMA_CUDA=OFF")
    assert re.search(r"fsdp_ema: torch \S+, CUDA kernels: OFF", off.stdout), off.stdout
    ninja = (tmp_path / "off" / "build.ninja").read_text()
    assert "nvcc" not in ninja and "_cuda.cu" not in ninja
    # AUTO, the default: the development build's, when it was configured so, else a new one.
    toolkit = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
    want = "ON" if toolkit and torch.version.cuda else "OFF"
    auto = Path(os.environ.get("FSDP_EMA_BUILD", ROOT / "build"))
    cache = auto / "CMakeCache.txt"
    if not (cache.is_file() and "FSDP_EMA_CUDA:STRING=AUTO" in cache.read_text()
            and (auto / "build.ninja").is_file()):
        auto = tmp_path / "auto"
        configured = _configure(auto)
        assert re.search(rf"fsdp_ema: torch \S+, CUDA kernels: {want}", configured.stdout)
    assert ("_cuda.cu" in (auto / "build.ninja").read_text()) == (want == "ON")
