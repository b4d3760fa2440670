"""``pydocstrings``: a corpus of short, human-written texts that ships with Python: the
docstrings of its standard library.

Each docstring (``ast.get_docstring``: dedented, stripped) of every function, class and
method of the chosen packages is one text, labelled with its package; empty ones are left
out. The packages and their files are `pystdlib`'s (`pystdlib.package_files`), in the same
sorted path order, each file's docstrings in source order: the same corpus on every run of
one Python, with a content identity from its files. Where ``pystdlib`` gives long texts
(whole definitions, up to thousands of tokens), this gives short ones, prose more than code:
a sequence benchmark for short texts that needs no download.

Measured on CPython 3.11.7, the default packages converted with the defaults
(``--tokenizer=bpe:8000``, trained on the train split; seed 0): 2,802 texts, per class
asyncio 346, email 286, http 140, importlib 297, logging 242, multiprocessing 210, tkinter
790, unittest 176, urllib 105, xml 210 (always guessing tkinter: 28% accuracy). BPE tokens
per text, from ``schema.json``'s per-length counts over both splits: median 19, p90 90,
max 927 (mean 40.3; 113,045 in all): none reaches the 1,024-token default cap.
"""

from __future__ import annotations

import ast

from tfspeed.convert.sources import pystdlib

CLASSES = pystdlib.CLASSES  # the same ten packages, for the same reasons
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def corpus(classes: tuple[str, ...] = CLASSES) -> tuple[list[tuple[str, str, str]], str]:
    """The docstrings of the standard library packages ``classes``, in sorted path order.

    Args:
      classes: package (or module) names under the standard library directory.

    Returns:
      ``[(name, text, class)]`` (name: ``path:line:definition``) and the content identity.
    """
    files, identity = pystdlib.package_files(classes, "pydocstrings")
    texts = [(f"{rel}:{line}:{name}", text, label)
             for label, path, rel in files for line, name, text in _docstrings(path)]
    return texts, identity


def _docstrings(path: str) -> list[tuple[int, str, str]]:
    """``[(line, name, docstring)]`` of the functions, classes and methods of the file at
    ``path`` that have a non-empty docstring, in source order."""
    _, tree = pystdlib.parse(path)
    found = [(node.lineno, node.col_offset, node.name, ast.get_docstring(node))
             for node in ast.walk(tree) if isinstance(node, _DEFINITIONS)]
    return [(line, name, text) for line, _, name, text in sorted(found) if text and text.strip()]
