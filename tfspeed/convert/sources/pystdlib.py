"""``pystdlib``: a real text corpus that ships with Python: its standard library's source.

Each top-level function and class of the chosen packages is one text (``ast`` finds them;
`segment` cuts them out as ``ast.get_source_segment`` does), labelled with its package. Human-written code,
skewed in length like real text (from a 2-line function to classes of thousands of lines),
and nothing to download: a sequence benchmark that runs anywhere Python does.

Why these classes: the ten packages with the most top-level definitions that are present in
every CPython from 3.10 on, leaving out generated code (``encodings``: 700 near-identical codec
modules), an application (``idlelib``, ``turtledemo``) and packages removed in 3.12/3.13
(``distutils``, ``lib2to3``). On 3.11: 77 (http) to 291 (email) texts per class, ~1,650 in all.
"""

from __future__ import annotations

import ast
import io
import os
import sys
import sysconfig
import warnings

from tfspeed.convert.sources.base import content_hash
from tfspeed.errors import UsageError

CLASSES = (
    "asyncio",
    "email",
    "http",
    "importlib",
    "logging",
    "multiprocessing",
    "tkinter",
    "unittest",
    "urllib",
    "xml",
)
# Test code is not the library, and site-packages holds whatever else was installed.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_dir() -> str:
    """Where this Python's standard library source is."""
    return sysconfig.get_paths()["stdlib"]


def corpus(classes: tuple[str, ...] = CLASSES) -> tuple[list[tuple[str, str, str]], str]:
    """The texts of the standard library packages ``classes``, in sorted path order.

    Args:
      classes: package (or module) names under the standard library directory.

    Returns:
      ``[(name, text, class)]`` (name: ``path:definition``) and the content identity.
    """
    files, identity = package_files(classes)
    texts = [(f"{rel}:{name}", text, label)
             for label, path, rel in files for name, text in _definitions(path)]
    return texts, identity


def package_files(classes: tuple[str, ...], kind: str = "pystdlib"
                  ) -> tuple[list[tuple[str, str, str]], str]:
    """The ``.py`` files of the standard library packages ``classes``: class by class, each
    in sorted path order (test folders left out).

    Args:
      classes: package (or module) names under the standard library directory.
      kind: the source kind asking (``pystdlib``, ``pydocstrings``), for the error message.

    Returns:
      ``[(class, path, path relative to the library)]`` and their content identity (this
      Python's version, each file's size and mtime).
    """
    root = stdlib_dir()
    unknown = [c for c in classes if not _paths(root, c)]
    if unknown:
        raise UsageError(
            f"--source={kind}:{','.join(classes)}: {unknown[0]!r} is not a package "
            f"or module in {root}; use some of {','.join(CLASSES)}"
        )
    files, stats = [], []
    for label in classes:
        for path in _paths(root, label):
            rel = os.path.relpath(path, root)
            st = os.stat(path)
            stats.append([rel, st.st_size, st.st_mtime_ns])
            files.append((label, path, rel))
    return files, content_hash([sys.version, stats])


def parse(path: str) -> tuple[str, ast.Module]:
    """The source of the library file at ``path`` and its syntax tree."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    with warnings.catch_warnings():  # old escape sequences in the library's own strings
        warnings.simplefilter("ignore", SyntaxWarning)
        return source, ast.parse(source, path)


def _paths(root: str, name: str) -> list[str]:
    """The ``.py`` files of package or module ``name``, sorted, test folders left out."""
    module = os.path.join(root, f"{name}.py")
    if os.path.isfile(module):
        return [module]
    package = os.path.join(root, name)
    if not os.path.isdir(package):
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(package):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found)


def _definitions(path: str) -> list[tuple[str, str]]:
    """``[(name, source)]`` of the top-level functions and classes of the file at ``path``."""
    source, tree = parse(path)
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    lines = io.StringIO(source, newline="").readlines()  # \r\n, \r, \n: as ast counts lines
    return [(node.name, segment(lines, node)) for node in tree.body if isinstance(node, kinds)]


def segment(lines: list[str], node: ast.AST) -> str:
    """The source of ``node``: what ``ast.get_source_segment(source, node)`` returns.

    That function splits the whole file into lines again for every node it cuts out, which
    is quadratic in a module's size. This takes the file's lines split once.
    """
    first, last = node.lineno - 1, node.end_lineno - 1
    start, end = node.col_offset, node.end_col_offset  # offsets in UTF-8 bytes
    if first == last:
        return lines[first].encode()[start:end].decode()
    head, tail = lines[first].encode()[start:].decode(), lines[last].encode()[:end].decode()
    return "".join([head, *lines[first + 1 : last], tail])
