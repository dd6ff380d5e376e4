"""Shared by tests/python/unit and tests/python/distributed: tests/python on sys.path, so
that `from tolerance import assert_close` works however pytest is invoked
(tests/python/examples/check_example.py, run as a script, adds it itself)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
