"""Every Python snippet of README.md runs as written (each in a fresh interpreter, from the
repository root, on this machine's device). A snippet that loads a pretrained Hugging Face model
is skipped (it needs a model download), one that uses transformers needs it installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_snippets():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


SNIPPETS = readme_snippets()


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index):
    code = SNIPPETS[index]
    if "from_pretrained(" in code:
        pytest.skip("README snippet loads a pretrained model (transformers + download)")
    if "transformers" in code:
        pytest.importorskip("transformers", reason="README snippet needs transformers")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"README snippet {index} failed:\n{code}\n{result.stderr[-3000:]}"
