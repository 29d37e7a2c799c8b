"""The README's Python API example runs as written (with its output directory moved to a temporary one)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_api_example_runs(tmp_path):
    text = README.read_text()
    section = text[text.index("## Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("/tmp/gptlab-hf-demo", str(tmp_path / "hf"))
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - our own README
    assert scope["out"].shape == (2, 12)
    assert scope["logits"].shape == (2, 16, 50257)
    assert (tmp_path / "hf" / "config.json").is_file()
