"""Fails when a rule that lives in one place (docs/ARCHITECTURE.md, "Where each rule lives")
gains a second copy in the library's code: a file-name literal outside format's names, a switch
over torch's ScalarType or a safetensors dtype name outside the generated dtype maps, or a tuple
of torch dtypes in the Python front (which reads the table through the `dtypes` op).

Comments are not code: C++ `//` comments and Python `#` comments are skipped; a rule marked
`code_only` also skips Python string literals (docstrings are prose). Run by scripts/lint.sh.
"""
import io
import re
import subprocess
import sys
import tokenize

CXX = ("format/", "ops/", "kernels/", "registration/", "include/", "tools/")
PY_FRONT = "python/fsdp_ema/"
RULES = [
    # (what, file filter, pattern, files allowed to hold it[, code_only])
    ("a file-name literal (names live in format/names)",
     lambda f: f.startswith(CXX) and f.endswith((".cpp", ".h", ".cu", ".cuh")),
     re.compile(r'"[A-Za-z0-9_.*<>-]*\.safetensors"|"shard-'),
     {"format/names.cpp", "format/include/fsdp_ema/format/names.h"}),
    ("a switch over ScalarType (the maps are generated from format's dtype table)",
     lambda f: f.startswith(CXX),
     re.compile(r"case\s+(at|c10|torch)::(k[A-Z]|ScalarType::)"),
     {"ops/format_bridge.cpp"}),
    ("a safetensors dtype name (format/include/fsdp_ema/format/dtype_table.h holds them)",
     lambda f: f.startswith(CXX) or f.startswith("python/fsdp_ema/"),
     re.compile(r'"(F64|F32|F16|BF16|F8_E4M3|F8_E5M2|I64|I32|I16|I8|U8|BOOL)"'),
     {"format/include/fsdp_ema/format/dtype_table.h"}),
    ("a tuple or list of torch dtypes (read the table: fsdp_ema._dtypes)",
     lambda f: f.startswith("python/fsdp_ema/") and f.endswith(".py"),
     re.compile(r"torch\.(float32|float64|bfloat16|float16|half|double|float)\s*,\s*torch\."),
     set()),
    ("a dtype looked up by name (fsdp_ema._dtypes.from_name is the one place)",
     lambda f: f.startswith("python/fsdp_ema/") and f.endswith(".py"),
     re.compile(r"getattr\(torch,"),
     {"python/fsdp_ema/_dtypes.py"}),
    ("a direct call of the library's ops (python/fsdp_ema/_ops.py is the one door)",
     lambda f: f.startswith(PY_FRONT) and f.endswith(".py"),
     re.compile(r"torch\s*\.\s*(ops|classes)\s*\.\s*fsdp_ema\b|\bops\s*\.\s*fsdp_ema\b"),
     {"python/fsdp_ema/_ops.py"}, True),
]


def python_code(path):
    """Python source with comments and string literals blanked (a string becomes blanks), line
    numbers kept."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines(keepends=True)
    out = [list(line) for line in lines]
    skip = {tokenize.COMMENT, tokenize.STRING}
    skip |= {getattr(tokenize, n) for n in ("FSTRING_MIDDLE",) if hasattr(tokenize, n)}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0, r1 + 1):
            row = out[r - 1]
            begin = c0 if r == r0 else 0
            end = c1 if r == r1 else len(row) - (1 if row and row[-1] == "\n" else 0)
            row[begin:end] = " " * (end - begin)
    for n, row in enumerate(out, 1):
        yield n, "".join(row)


def code_lines(path, code_only=False):
    if code_only and path.endswith(".py"):
        yield from python_code(path)
        return
    comment = "#" if path.endswith(".py") else "//"
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            yield n, line.split(comment, 1)[0] if comment in line else line


def main():
    files = subprocess.run(["git", "ls-files"], check=True, capture_output=True,
                           text=True).stdout.split()
    found = 0
    for what, wanted, pattern, allowed, *code_only in RULES:
        for path in files:
            if not wanted(path) or path in allowed:
                continue
            for n, code in code_lines(path, bool(code_only and code_only[0])):
                if pattern.search(code):
                    print(f"{path}:{n}: {what}: {code.strip()}", file=sys.stderr)
                    found += 1
    if found:
        print(f"rules_once: {found} second cop{'y' if found == 1 else 'ies'} of a rule "
              "(docs/ARCHITECTURE.md says where each rule lives)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
