#!/usr/bin/env python3
"""The reference model's corpus: the Python documentation (reStructuredText) and stdlib docstrings.

Sources, all under the PSF license:
  docs/...    the reST sources Debian's python3.X-doc ships under /usr/share/doc/python3.X/html/_sources
  stdlib/...  docstrings of this interpreter's standard-library modules (tests and idlelib left out)
  src/...     the same modules' whole source (only when asked for: the long-context model's extra text)

Documents are keyed by a machine-independent path, and the split is a hash of that path, so every
machine that reads the same corpus splits it the same way: ~3% held out (reported figures), ~1.5%
validation (the trainer keeps its best checkpoint on it), the rest for training. A packed corpus (JSON lines, xz)
carries it to machines without the sources (the GPU machine):

  python tools/reference_corpus.py pack .corpus/reference-corpus.jsonl.xz
  python tools/reference_corpus.py pack .corpus/reference-corpus-long.jsonl.xz --sources docs,stdlib,src
  python tools/reference_corpus.py pack --held-out   # only the held-out documents (~120 kB): for benchmarks
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import inspect
import json
import lzma
import os
import re
import sys
import sysconfig

HELD_OUT_PER_MILLE = 30  # buckets [0, 30) of 1000, by path hash: held out (reported)
VALID_PER_MILLE = 15  # buckets [30, 45): validation (checkpoint selection)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PACK = os.path.join(REPO, ".corpus", "reference-corpus.jsonl.xz")
SKIP_DIRS = {"test", "tests", "idle_test", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}

# Sphinx roles read as their visible text: :func:`~json.dumps` -> dumps(), :mod:`json` -> json
_ROLE = re.compile(r":(?:py:)?([a-z]+):`([^`]+)`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`__?")


def _role_text(match: re.Match) -> str:
    role, body = match.group(1), match.group(2)
    body = re.sub(r"\s*<[^>]+>$", "", body).lstrip("!")
    if body.startswith("~"):
        body = body[1:].rsplit(".", 1)[-1]
    if role in ("rfc", "pep"):
        return f"{role.upper()} {body}"
    if role in ("func", "meth") and not body.endswith(")"):
        body += "()"
    return body


def clean_rst(text: str) -> str:
    """reST with roles and hyperlinks reduced to what a reader of the rendered page sees."""
    return _LINK.sub(r"\1", _ROLE.sub(_role_text, text))


def docs_dir() -> str | None:
    """The newest installed Python documentation reST tree, if any."""
    found = sorted(glob.glob("/usr/share/doc/python3*/html/_sources"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", p)])
    return found[-1] if found else None


def read_docs(root: str) -> dict[str, str]:
    """docs/<page>.rst -> cleaned text."""
    docs = {}
    for path in sorted(glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True)):
        rel = os.path.relpath(path, root).removesuffix(".txt")
        with open(path, encoding="utf-8") as fh:
            docs["docs/" + rel] = clean_rst(fh.read())
    return docs


def module_docstrings(source: str, module: str) -> str:
    """Each documented module, class and function as 'qualified name' then its docstring."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []

    def visit(node, prefix):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            parts.append(f"{prefix}\n{clean_rst(inspect.cleandoc(doc))}\n")
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and not child.name.startswith("_"):
                visit(child, f"{prefix}.{child.name}")

    visit(tree, module)
    return "\n".join(parts)


def stdlib_files():
    """(path relative to the stdlib, module name, source text) of every module read, in path order."""
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(f for f in filenames if f.endswith(".py")):
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            module = rel.removesuffix(".py").removesuffix("/__init__").replace(os.sep, ".")
            with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as fh:
                yield rel, module, fh.read()


def read_stdlib() -> dict[str, str]:
    """stdlib/<module path> -> that module's docstrings."""
    docs = {}
    for rel, module, source in stdlib_files():
        text = module_docstrings(source, module)
        if text:
            docs["stdlib/" + rel] = text
    return docs


def read_source() -> dict[str, str]:
    """src/<module path> -> that module's whole source."""
    return {"src/" + rel: source for rel, _, source in stdlib_files() if source.strip()}


def collect(sources: tuple[str, ...] = ("docs", "stdlib")) -> dict[str, str]:
    """Documents from this machine's own files; docs are required when asked for."""
    docs = {}
    if "docs" in sources:
        root = docs_dir()
        if root is None:
            raise SystemExit("no Python documentation sources found: apt-get install python3.11-doc, "
                             "or pass a packed corpus with --data")
        docs.update(read_docs(root))
    if "stdlib" in sources:
        docs.update(read_stdlib())
    if "src" in sources:
        docs.update(read_source())
    return docs


def bucket(path: str) -> int:
    return int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % 1000


def split(docs: dict[str, str]) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(train, validation, held_out), each sorted by path."""
    parts = ({}, {}, {})
    for path, text in sorted(docs.items()):
        b = bucket(path)
        parts[2 if b < HELD_OUT_PER_MILLE else 1 if b < HELD_OUT_PER_MILLE + VALID_PER_MILLE else 0][path] = text
    return parts


def write_pack(docs: dict[str, str], path: str) -> str:
    """Write a corpus as xz-compressed JSON lines; returns its sha256."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as fh:
        for p, text in sorted(docs.items()):
            fh.write(json.dumps({"path": p, "text": text}, ensure_ascii=False) + "\n")
    return file_sha256(path)


def read_pack(path: str) -> dict[str, str]:
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        return {row["path"]: row["text"] for row in map(json.loads, fh)}


def load(data: str | None = None, sources: tuple[str, ...] = ("docs", "stdlib")) -> dict[str, str]:
    """The corpus from a pack (given, or the repo's default if present), else from this machine's files."""
    if data is None and os.path.exists(DEFAULT_PACK):
        data = DEFAULT_PACK
    docs = read_pack(data) if data else collect(sources)
    return {p: t for p, t in docs.items() if p.split("/", 1)[0] in sources}


def file_sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["pack", "stats"])
    ap.add_argument("path", nargs="?", default=DEFAULT_PACK)
    ap.add_argument("--sources", default="docs,stdlib", help="comma list of docs, stdlib, src")
    ap.add_argument("--held-out", action="store_true",
                    help="pack: only the held-out documents (what the benchmarks read; a small pack to carry)")
    a = ap.parse_args()
    sources = tuple(a.sources.split(","))
    docs = collect(sources) if a.command == "pack" else load(a.path, sources)
    if a.held_out:
        docs = split(docs)[2]  # the split is by path: a pack of these holds out the same documents
    for name, part in zip(("train", "validation", "held-out"), split(docs)):
        by_source = {}
        for p, t in part.items():
            by_source.setdefault(p.split("/", 1)[0], []).append(len(t))
        summary = ", ".join(f"{s}: {len(v)} docs, {sum(v) / 1e6:.2f} M chars" for s, v in sorted(by_source.items()))
        print(f"{name}: {summary}")
    if a.command == "pack":
        print(f"wrote {a.path} sha256 {write_pack(docs, a.path)}")


if __name__ == "__main__":
    sys.exit(main())
