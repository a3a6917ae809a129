"""Fails when a rule that lives in one place (docs/ARCHITECTURE.md, "Where each rule lives")
gains a second copy in the library's code: a file name in a string outside format's names (as a
whole literal, or inside a message), a switch over torch's ScalarType or a safetensors dtype name
outside the generated dtype maps, the update's lerp (its formula or its one-half threshold)
outside kernels/update_types.h, the dim-0 row rule outside format's rows, the checksum's text
form outside format's checksum, an alignment constant that mirrors one of the ops in the Python
front (which asks the op: gather_alignment), or a tuple of torch dtypes in the Python front
(which reads the table through the `dtypes` op).

Comments are not code: C++ `//` comments and Python `#` comments are skipped (docstrings are
prose too, and the Python check matches only code shapes). Run by scripts/lint.sh.
"""
import re
import sys

from lint_common import report, tracked, verdict

CXX = ("format/", "ops/", "kernels/", "registration/", "include/", "tools/")
NAMES = {"format/core/names.cpp", "format/include/fsdp_ema/format/names.h"}


def cxx(f):
    return f.startswith(CXX) and f.endswith((".cpp", ".h", ".cu", ".cuh"))


RULES = [
    # (what, file filter, pattern, files allowed to hold it)
    ("a file-name literal (names live in format/names)",
     cxx,
     re.compile(r'"[A-Za-z0-9_.*<>-]*\.safetensors"|"shard-'),
     NAMES),
    ("a file name inside a message (say it with format/names' constant: kIndexFileName, ...)",
     cxx,
     re.compile(r'"[^"]*(index\.json|\.safetensors|\.metadata\b|\.distcp)[^"]*"'),
     NAMES),
    ("the update's lerp, its threshold or formula (kernels/update_types.h: lerp_from_ema, "
     "lerp_two_sided)",
     lambda f: cxx(f) and f.startswith(("kernels/", "ops/")),
     re.compile(r"[<>]=?\s*(\w+\s*\()?0\.5f?\b|\bfmadd\s*\(|"
                r"\w+\s*-\s*\(\s*\w+\s*-\s*\w+\s*\)\s*\*|"
                r"\w+\s*\+\s*\w+\s*\*\s*\(\s*\w+\s*-\s*\w+\s*\)"),
     {"kernels/update_types.h", "kernels/update_cpu_impl.h"}),
    ("the dim-0 row rule (fsdp_ema/format/rows.h: chunk_rows, tensor_rows)",
     cxx,
     re.compile(r"%\s*world\w*\s*!=\s*0|\+\s*world\w*\s*-\s*1\s*\)\s*/\s*world"),
     {"format/core/rows.cpp"}),
    ("the checksum's text form (fsdp_ema/format/checksum.h: format_checksum, "
     "checksum_form_text)",
     cxx,
     re.compile(r'"xxh3-64|lowercase hex digits'),
     {"format/core/checksum.cpp", "format/include/fsdp_ema/format/checksum.h"}),
    ("an alignment the ops decide, mirrored in Python (ask the op: gather_alignment())",
     lambda f: f.startswith("python/fsdp_ema/") and f.endswith(".py"),
     re.compile(r"^\s*_?[A-Z_]*ALIGN[A-Z_]*\s*=\s*\d"),
     # Until _full_state.py reads torch.ops.fsdp_ema.gather_alignment() (the Python half of
     # issue 35); then remove this entry.
     {"python/fsdp_ema/_full_state.py"}),
    ("a switch over ScalarType (the maps are generated from format's dtype table)",
     lambda f: f.startswith(CXX),
     re.compile(r"case\s+(at|c10|torch)::(k[A-Z]|ScalarType::)"),
     {"ops/common/format_bridge.cpp"}),
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
]


def code_lines(path):
    comment = "#" if path.endswith(".py") else "//"
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            yield n, line.split(comment, 1)[0] if comment in line else line


def main():
    files = tracked()
    found = 0
    for what, wanted, pattern, allowed in RULES:
        for path in files:
            if not wanted(path) or path in allowed:
                continue
            for n, code in code_lines(path):
                if pattern.search(code):
                    report(f"{path}:{n}: {what}: {code.strip()}")
                    found += 1
    return verdict("rules_once", found, f"{found} second cop{'y' if found == 1 else 'ies'} of a "
                   "rule (docs/ARCHITECTURE.md says where each rule lives)")


if __name__ == "__main__":
    sys.exit(main())
