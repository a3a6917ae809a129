"""Fails on a C++ function longer than LIMIT code lines whose comment does not say why.

A unit a reader can hold fits on a screen or two: every function (its signature and body, blank
and comment lines not counted) of the C++/CUDA sources is at most LIMIT lines, unless a comment
line directly above it (or inside its signature) starts with `Long:` and gives the reason, e.g.
`// Long: the one registration table, one entry per op (reading it whole is the point).`

A small brace matcher, no parser: comments, strings and preprocessor lines are blanked, then a
`{` at namespace or class scope whose text since the previous `;`, `{` or `}` ends like a
signature (`)`, a qualifier, a trailing return type, or a constructor's initializer list) opens
a function; lambdas and local classes count toward the function around them. Run by
scripts/lint.sh.
"""
import re
import sys

from lint_common import report, tracked, verdict

LIMIT = 80
SOURCES = (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh")
# Where the rule holds: the library, its kernels, the format library, the CLI and the examples.
FOLDERS = ("format/", "ops/", "kernels/", "registration/", "include/", "tools/", "examples/")
SCOPE_WORDS = re.compile(r"\b(namespace|class|struct|union|enum)\b[^()]*$|\bextern\s*$")
SIGNATURE_END = re.compile(
    r"\)\s*(const|noexcept|override|final|mutable|&|&&|\s)*(->\s*[\w:<>,\s*&]+)?$")
INITIALIZERS = re.compile(r"\)\s*(noexcept\s*)?:(?!:)")
ASSIGNED = re.compile(r"=\s*$|=\s*\[[^\]]*\]\s*(\([^)]*\))?[^;]*$")


def blank(text):
    """The text with comments, string and char literals and preprocessor lines replaced by
    spaces (newlines kept, so positions still map to lines)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#":
            # a preprocessor line, with its continuations
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        if c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
            continue
        if c == "/" and text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c == "R" and text.startswith('R"', i):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if m:
                end = text.find(")" + m.group(1) + '"', i)
                end = n if end < 0 else end + len(m.group(1)) + 2
                out.append(re.sub(r"[^\n]", " ", text[i:end]))
                i = end
                continue
        if c in "\"'" and not (c == "'" and i > 0 and text[i - 1].isalnum()):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
            continue
        out.append(c)
        line_start = c == "\n" or (line_start and c in " \t")
        i += 1
    return "".join(out)


def functions(text):
    """(first line, last line, code lines) of every function in the C++ source `text`."""
    code = blank(text)
    lines = code.split("\n")
    line_of = []
    for n, line in enumerate(lines, 1):
        line_of.extend([n] * (len(line) + 1))
    found = []
    stack = []  # per open brace: "scope", "function", "other"
    header_start = 0
    for i, c in enumerate(code):
        if c == ";" or c == "}":
            if c == "}" and stack:
                kind, start = stack.pop()
                if kind == "function":
                    first, last = line_of[start], line_of[i]
                    nloc = sum(1 for k in range(first, last + 1) if lines[k - 1].strip())
                    found.append((first, last, nloc))
            if not stack or stack[-1][0] == "scope":
                header_start = i + 1
            continue
        if c != "{":
            continue
        if stack and stack[-1][0] != "scope":
            stack.append(("other", i))
            continue
        header = code[header_start:i]
        flat = re.sub(r"\{[^{}]*\}", "", header).strip()
        if SCOPE_WORDS.search(flat.split("(")[0]) or SCOPE_WORDS.search(flat):
            stack.append(("scope", i))
            header_start = i + 1
        elif ASSIGNED.search(flat) or not flat:
            stack.append(("other", i))
        elif SIGNATURE_END.search(flat) or (INITIALIZERS.search(flat)
                                            and header.rstrip()[-1:] in ")}"):
            start = header_start + len(header) - len(header.lstrip())
            stack.append(("function", start))
        else:
            stack.append(("other", i))  # an initializer brace inside a declaration
    return found


def has_reason(source_lines, first):
    """A `Long:` comment line directly above line `first` (1-based) or on it."""
    k = first - 1
    if "Long:" in source_lines[k]:
        return True
    k -= 1
    while k >= 0 and source_lines[k].lstrip().startswith(("//", "template", "[[")):
        if re.match(r"\s*//\s*Long:", source_lines[k]):
            return True
        k -= 1
    return False


def main():
    files = tracked(*FOLDERS)
    bad = 0
    for path in files:
        if not path.endswith(SOURCES):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        source_lines = text.split("\n")
        for first, last, nloc in functions(text):
            if nloc > LIMIT and not has_reason(source_lines, first):
                report(f"{path}:{first}: a function of {nloc} code lines (lines {first}-{last}; "
                       f"at most {LIMIT}, or a `// Long: <why>` comment above it): "
                       f"{source_lines[first - 1].strip()}")
                bad += 1
    return verdict("long_functions", bad, f"{bad} function(s) over {LIMIT} lines without a "
                   "stated reason (split them, or say why in a `// Long:` comment)")


if __name__ == "__main__":
    sys.exit(main())
