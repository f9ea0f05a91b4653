"""Fixtures of the Python module's tests: the bundled model, one engine over it, and the oryx command beside the
module, whose JSON the module's results are checked against.

ctest runs these with PYTHONPATH at the built module (build/python) and ORYX_BIN at build/bin/oryx; run by hand:
    PYTHONPATH=build/python python3 -m pytest tests/python
"""
import json
import os
import pathlib
import subprocess

import pytest

import oryx

SOURCE_DIR = pathlib.Path(os.environ.get("ORYX_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
MODEL_DIR = str(SOURCE_DIR / "models" / "default")
ORYX_BIN = os.environ.get("ORYX_BIN", str(SOURCE_DIR / "build" / "bin" / "oryx"))


@pytest.fixture(scope="session")
def engine():
    return oryx.Engine(MODEL_DIR)


def run_oryx(*args):
    """Runs the oryx command and returns its stdout; a failure shows its stderr."""
    done = subprocess.run([ORYX_BIN, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"oryx {' '.join(args)} failed:\n{done.stderr}"
    return done.stdout


def cli_generate(prompt, policy, max_tokens, *flags):
    """`oryx generate --json` on the bundled model: the object it prints."""
    return json.loads(run_oryx("generate", "--model", MODEL_DIR, "--prompt", prompt, "--policy", policy,
                               "--max-tokens", str(max_tokens), "--json", *flags))
