"""What the tree's lint checks share (scripts/rules_once.py, named_paths.py, long_functions.py,
include_cycles.py): the tracked files, and how a check reports what it found."""
import subprocess
import sys


def tracked(*pathspec):
    """The files git tracks (under `pathspec`, when given), as repository paths."""
    return subprocess.run(["git", "ls-files", *pathspec], check=True, capture_output=True,
                          text=True).stdout.split()


def report(message):
    """One finding, on stderr (as `path:line: what`)."""
    print(message, file=sys.stderr)


def verdict(check, found, summary):
    """The exit status of a check that found `found` problems, with its summary line if any."""
    if found:
        report(f"{check}: {summary}")
    return 1 if found else 0
