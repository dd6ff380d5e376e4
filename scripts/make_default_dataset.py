#!/usr/bin/env python3
"""Builds the JSONL behind data/default: English prose from the docstrings of the Python
standard library (PSF License; see data/README.md). Each docstring of 80 characters or
more (modules, classes, functions, in source order) becomes one document {"text": ...}. The modules are read as source with ast (nothing
is imported), in sorted order, so a given Python version always gives the same text.

  python scripts/make_default_dataset.py --out /tmp/stdlib_docs.jsonl --max-bytes 1000000
  build/bin/megatorch-preprocess --input /tmp/stdlib_docs.jsonl \
      --output-prefix data/default/stdlib_docs --json-keys text --tokenizer-type ByteLevel --append-eod
"""
import argparse
import ast
import inspect
import json
import sys
import sysconfig
from pathlib import Path

# Packages whose docstrings are mostly tests, generated code or non-prose.
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "ensurepip", "site-packages", "turtledemo", "__phello__",
              "pydoc_data", "encodings", "config-3.11-x86_64-linux-gnu", "tkinter"}


def docstrings(tree):
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 80 and doc.isascii():
                out.append((getattr(node, "lineno", 0), doc))
    return [doc for _, doc in sorted(out, key=lambda item: item[0])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--max-bytes", type=int, default=1_000_000, help="stop after this much text")
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    docs = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for path in sorted(stdlib.rglob("*.py")):
            rel = path.relative_to(stdlib)
            if SKIP_PARTS & set(rel.parts):
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for text in docstrings(tree):
                f.write(json.dumps({"text": text, "source": str(rel)}) + "\n")
                total += len(text)
                docs += 1
            if total >= args.max_bytes:
                break
    print(f"{docs} documents, {total} bytes of text from Python {sys.version.split()[0]} -> {args.out}")


if __name__ == "__main__":
    main()
