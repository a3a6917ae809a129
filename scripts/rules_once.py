"""Fails when a rule that lives in one place (docs/ARCHITECTURE.md, "Where each rule lives")
gains a second copy in the library's code: a file name in a string outside format's names (as a
whole literal, or inside a message), a switch over torch's ScalarType or a safetensors dtype name
outside the generated dtype maps, the update's lerp (its formula or its one-half threshold)
outside kernels/update_types.h, the dim-0 row rule outside format's rows, the checksum's text
form outside format's checksum, a tuple of torch dtypes in the Python front (which reads the
table through the `dtypes` op), and in the Python front: a call of the ops outside `_ops.py`, the
row rule or an alignment constant restated (the alignment is the gather_alignment op's), a
format/ file name as a literal, or another file name written in two places.

Comments are not code: C++ `//` comments and Python `#` comments are skipped; a rule marked
`code_only` also skips Python string literals (docstrings are prose). Run by scripts/lint.sh.
"""
import ast
import io
import re
import sys
import tokenize

from lint_common import report, tracked, verdict

CXX = ("format/", "ops/", "kernels/", "registration/", "include/", "tools/")
PY_FRONT = "python/fsdp_ema/"
NAMES = {"format/core/names.cpp", "format/include/fsdp_ema/format/names.h"}


def cxx(f):
    return f.startswith(CXX) and f.endswith((".cpp", ".h", ".cu", ".cuh"))


RULES = [
    # (what, file filter, pattern, files allowed to hold it[, code_only])
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
    # --- the Python front's rules (code only: docstrings may name what they describe) ----------
    ("a direct call of the library's ops (python/fsdp_ema/_ops.py is the one door)",
     lambda f: f.startswith(PY_FRONT) and f.endswith(".py"),
     re.compile(r"torch\s*\.\s*(ops|classes)\s*\.\s*fsdp_ema\b|\bops\s*\.\s*fsdp_ema\b"),
     {"python/fsdp_ema/_ops.py"}, True),
    ("a ceiling division, the row rule's shape (the rows of a rank: "
     "fsdp_ema.model.layouts.chunk_rows, the chunk_rows op)",
     lambda f: f.startswith(PY_FRONT) and f.endswith(".py"),
     re.compile(r"-\s*\(\s*-[^()]*//|math\.ceil\s*\([^()]*/"),
     set(), True),
    ("an alignment constant (gather_shards' is C++'s, through fsdp_ema._ops.gather_align)",
     lambda f: f.startswith(PY_FRONT) and f.endswith(".py"),
     re.compile(r"\b\w*ALIGN\w*\s*=\s*\d|\balign\w*\s*=\s*\d"),
     {"python/fsdp_ema/_ops.py"}, True),
]

# File names in the Python front's strings (docstrings aside): format/'s (shard files, the
# index) come from the ops, never as literals; every other name (the training state's sidecar,
# PEFT's and Hugging Face's files) is one constant, so a literal may stand in one place only.
FORMAT_NAMES = re.compile(r"^shard-|(^|/)fsdp_ema\.index\.json$")
FILE_NAME = re.compile(r"^[\w.-]+\.(json|safetensors)$")


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


def python_strings(path):
    """``(line, value)`` of every string constant of a Python file but its docstrings (f-string
    parts included)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings):
            yield node.lineno, node.value


def file_name_literals(files):
    """Problems with file-name literals in the Python front (FORMAT_NAMES, FILE_NAME)."""
    seen = {}
    for path in files:
        if not (path.startswith(PY_FRONT) and path.endswith(".py")):
            continue
        for n, value in python_strings(path):
            if FORMAT_NAMES.search(value):
                yield (f"{path}:{n}: a format/ file name as a literal (the ops give them: "
                       f"fsdp_ema._ops.shard_file_name, index_file_name): {value!r}")
            elif FILE_NAME.match(value):
                if value in seen:
                    yield (f"{path}:{n}: a file name written twice ({seen[value]} holds it; "
                           f"name its constant): {value!r}")
                else:
                    seen[value] = f"{path}:{n}"


def main():
    files = tracked()
    found = 0
    for problem in file_name_literals(files):
        print(problem, file=sys.stderr)
        found += 1
    for what, wanted, pattern, allowed, *code_only in RULES:
        for path in files:
            if not wanted(path) or path in allowed:
                continue
            for n, code in code_lines(path, bool(code_only and code_only[0])):
                if pattern.search(code):
                    report(f"{path}:{n}: {what}: {code.strip()}")
                    found += 1
    return verdict("rules_once", found, f"{found} second cop{'y' if found == 1 else 'ies'} of a "
                   "rule (docs/ARCHITECTURE.md says where each rule lives)")


if __name__ == "__main__":
    sys.exit(main())
