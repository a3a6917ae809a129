"""Fails when the docs or a code comment name a file of this repository that does not exist.

Read: docs/*.md, the README files, and the comments of the C++/CUDA, Python, CMake and shell
files (`//`, `/* */` and `#` comments; Python docstrings too). A word is taken for a repository
path when it starts with one of the repository's top-level folders
(`format/read/read_plan.cpp`, `python/fsdp_ema/store/checkpoint.py`), is an include path
(`fsdp_ema/format/names.h`, looked up under the include roots), or is a bare file name with a
source extension (`shard_file.cpp`, looked up by name anywhere in the tree); it must then name a
tracked file or folder. Names of other projects' files, and files the build or a run makes, are
in ELSEWHERE. Run by scripts/lint.sh.
"""
import os
import re
import sys

from lint_common import report, tracked, verdict

# Other projects' files the docs cite, and what builds and runs write (not in the tree).
ELSEWHERE = {
    # pytorch/extension-cpp, vLLM, torchao, flash-attention, apex, torchtitan, PyTorch
    "extension_cpp/csrc/muladd.cpp", "csrc/cuda/muladd.cu", "test/test_extension.py",
    "csrc/torch_bindings.cpp", "csrc/ops.h", "torchao/csrc/README.md", "hopper/flash_api.cpp",
    "csrc/multi_tensor_apply.cuh", "MultiTensorApply.cuh", "components/ema.py", "type_shim.h",
    # diffusers' training script (docs/INTEGRATIONS.md, examples/diffusers_ema.py)
    "examples/text_to_image/train_text_to_image.py", "train_text_to_image.py",
    "muladd.cpp", "muladd.cu", "flash_api.cpp", "torch_bindings.cpp", "ops.py",
    # torch's and the C++ examples' headers
    "ProcessGroupGloo.hpp", "hf_storage.py",
    # the user's own scripts in the docs' examples
    "example.py", "lightning_ema.py", "hf_ema.py", "accelerate_ema.py", "async.py", "full.py",
    "lora.py", "tp.py",
    # written by builds, installs and runs
    "fsdp_ema_build.json", "model.safetensors", "compile_commands.json", "summary.txt",
    "machine.txt", "build.log", "ctest.log", "pytest.log", "bench_kernels.log", "bench_io.log",
    "bench_update.json", "fsdp_emaConfig.cmake", "fsdp_emaTargets.cmake", "trace.txt", "NAME.txt",
    "tests/fuzz/corpus/regressions/",
}
# Prefixes of paths outside the tree: build folders, installs, other projects' include trees.
ELSEWHERE_PREFIXES = (
    "build", "gpu-deps/", "dist/", "site-packages/", "torch/", "c10/", "ATen/", "c10d/",
    "cuda/", "CLI/", "nlohmann/", "gtest/", "gmock/", "torchao/", "shared_kernels/",
    "torch_free_kernels/", "config/", "extension_cpp/", "csrc/", "hopper/", "fsdp_ema/lib/",
    "fsdp_ema/include/", "lib/", "bin/",
)
EXTENSIONS = (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh", ".py", ".sh", ".md", ".cmake", ".txt",
              ".toml", ".in", ".ini")
INCLUDE_ROOTS = ("format/include/", "include/", "python/")
WORD = re.compile(r"(?<![\w./*<>-])([A-Za-z0-9_][\w.+-]*(?:/[\w.+-]+)*/?)(?![\w*<])")
CODE_EXTENSIONS = {".cpp": "c", ".cc": "c", ".h": "c", ".hpp": "c", ".cu": "c", ".cuh": "c",
                   ".py": "py", ".sh": "sh", ".cmake": "sh", ".in": "sh", ".txt": "sh"}


def comments(path, text):
    """The comment text of a source file (a list of (line, text))."""
    kind = CODE_EXTENSIONS.get(os.path.splitext(path)[1])
    if path.endswith("CMakeLists.txt"):
        kind = "sh"
    if kind is None:
        return []
    out = []
    if kind == "c":
        for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
            out.append((text.count("\n", 0, m.start()) + 1, m.group()))
    else:
        for n, line in enumerate(text.split("\n"), 1):
            m = re.search(r"(^|\s)#(?!include|!)(.*)$", line)
            if m:
                out.append((n, m.group(2)))
        if kind == "py":
            for m in re.finditer(r'"""(.*?)"""', text, re.S):
                out.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def candidates(text, tops):
    for m in WORD.finditer(text):
        word = m.group(1).rstrip(".,:;)")
        word = re.sub(r"\.$", "", word)
        if not word or "//" in word or word.startswith(ELSEWHERE_PREFIXES):
            continue
        head = word.split("/", 1)[0]
        if "/" in word and head in tops:
            yield word
        elif word.startswith("fsdp_ema/") and word.endswith(EXTENSIONS):
            yield word
        elif "/" not in word and word.endswith(EXTENSIONS) and not word.startswith("."):
            yield word


def exists(word, here, in_tree, folders, names):
    if word in ELSEWHERE or word.rstrip("/") in ELSEWHERE:
        return True
    plain = word.rstrip("/")
    if "*" in plain or "<" in plain:
        return True
    options = [plain, os.path.normpath(os.path.join(here, plain))]
    options += [root + plain for root in INCLUDE_ROOTS]
    if any(o in in_tree or o in folders for o in options):
        return True
    return "/" not in plain and plain in names


def prose(path, text, docs):
    """(line, text) of what is read of a file: a doc whole, a source's comments."""
    if path in docs:
        return list(enumerate(text.split("\n"), 1))
    return comments(path, text)


def stale_paths(files):
    """(path, line, word) for every word of the docs and comments that names no tracked file."""
    in_tree = set(files)
    folders = {os.path.dirname(f) for f in files}
    folders |= {p for f in folders for p in [f.rsplit("/", k)[0] for k in range(f.count("/") + 1)]}
    names = {os.path.basename(f) for f in files}
    tops = {f.split("/", 1)[0] for f in files if "/" in f}
    docs = {f for f in files if f.endswith(".md") and (f.startswith("docs/") or
                                                       os.path.basename(f) == "README.md")}
    for path in files:
        if path.startswith(("tests/fuzz/corpus/", "tests/format/data/")):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        here = os.path.dirname(path)
        for first, chunk in prose(path, text, docs):
            lines = chunk.split("\n")
            yield from ((path, first + k, word) for k, line in enumerate(lines)
                        for word in candidates(line, tops)
                        if not exists(word, here, in_tree, folders, names))


def main():
    stale = list(stale_paths(tracked()))
    for path, line, word in stale:
        report(f"{path}:{line}: names {word}, which is not in the tree")
    return verdict("named_paths", len(stale), f"{len(stale)} stale path(s) (fix the text, or add "
                   "another project's file to ELSEWHERE in scripts/named_paths.py)")


if __name__ == "__main__":
    sys.exit(main())
