"""The code blocks of README.md and docs/*.md, for test_docs.py: every ```python block is run and
every ```cpp block is compiled, so a snippet that breaks fails the suite.

A block may be preceded (blank lines apart) by hidden HTML comments that readers do not see:

    <!-- doc: ranks=2 -->              run under torchrun with 2 gloo ranks (CPU)
    <!-- doc: continue -->             the previous python block of the file runs first, in the
                                       same process (a walkthrough split over several blocks)
    <!-- doc: needs=cuda -->           skipped without a GPU, run where there is one
    <!-- doc: timeout=300 -->          seconds (default 240)
    <!-- doc-setup
    hidden code run (python) or compiled (cpp) before the block: the names it uses
    -->

Options combine: ``<!-- doc: ranks=2 continue -->``. A cpp block is compiled as its own
translation unit: its ``#include`` lines at the top, the rest inside a function body after the
setup, unless it defines ``int main`` (then it is the whole file).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)\s*$")
OPTION = re.compile(r"^<!--\s*doc:(.*?)-->\s*$")
SETUP_START = re.compile(r"^<!--\s*doc-setup\s*$")
KNOWN = {"ranks", "continue", "needs", "timeout"}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the first code line
    lang: str
    code: str
    setup: str = ""
    options: dict[str, str] = field(default_factory=dict)
    previous: Block | None = None  # with "continue"

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def program(self) -> str:
        """Python: the hidden setup, then the block, each from its own line in the file (tracebacks
        point at the markdown lines through the marker comments)."""
        parts = [self.previous.program()] if self.previous is not None else []
        if self.setup:
            parts.append(f"# --- hidden setup of {self.id}\n{self.setup}")
        parts.append(f"# --- {self.id}\n{self.code}")
        return "\n".join(parts)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    options: dict[str, str] = {}
    setup: list[str] | None = None
    pending_setup = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if setup is not None:  # inside <!-- doc-setup ... -->
            if line.strip() == "-->":
                pending_setup, setup = "\n".join(setup), None
            else:
                setup.append(line)
            i += 1
            continue
        if (m := OPTION.match(line)) is not None:
            for word in m.group(1).split():
                key, _, value = word.partition("=")
                if key not in KNOWN:
                    raise ValueError(f"{path}:{i + 1}: unknown doc option {key!r}")
                options[key] = value or "1"
        elif SETUP_START.match(line):
            setup = []
        elif (m := FENCE.match(line)) is not None:
            lang = m.group(1)
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if lang in ("python", "cpp"):
                block = Block(path, i + 2, lang, "\n".join(lines[i + 1:end]), pending_setup,
                              options)
                if "continue" in options:
                    same = [b for b in blocks if b.lang == lang]
                    if not same:
                        raise ValueError(f"{block.id}: 'continue' with no earlier {lang} block")
                    block.previous = same[-1]
                blocks.append(block)
            options, pending_setup = {}, ""
            i = end
        elif line.strip() and not line.startswith("<!--"):
            options, pending_setup = {}, ""  # directives apply to the block right below them
        i += 1
    if setup is not None:
        raise ValueError(f"{path}: unterminated <!-- doc-setup")
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in parse(p)]


def cpp_translation_unit(block: Block) -> str:
    """The block as a file of its own, with #line directives back to the markdown."""
    rel = block.path.relative_to(ROOT)
    lines = block.code.splitlines()
    if any(re.match(r"\s*int\s+main\s*\(", ln) for ln in lines):
        return f'#line {block.line} "{rel}"\n{block.code}\n'
    includes = [(n, ln) for n, ln in enumerate(lines) if ln.lstrip().startswith("#include")]
    body = [(n, ln) for n, ln in enumerate(lines) if not ln.lstrip().startswith("#include")]
    out = [f'#line {block.line + n} "{rel}"\n{ln}' for n, ln in includes]
    out.append("void fsdp_ema_doc_block() {")
    if block.setup:
        out.append(block.setup)
    out += [f'#line {block.line + n} "{rel}"\n{ln}' for n, ln in body]
    out.append("}")
    return "\n".join(out) + "\n"
