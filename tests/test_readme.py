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


def test_readme_slurm_script_resumes_only_a_run_with_a_step_checkpoint(tmp_path):
    """The Slurm script's `$(... && echo --resume)`: a requeued job resumes when its run has a step checkpoint,
    and starts afresh when it has none, also when the run's first evaluation already wrote checkpoints/best/ (there
    --resume is refused: nothing to continue from)."""
    import subprocess

    text = README.read_text()
    script = text[text.index("#SBATCH") :]
    decide = re.search(r"(\$\([^\n]*echo --resume\))", script).group(1)
    decide = decide.replace("/shared/runs/gpt2", str(tmp_path / "run"))

    def flags() -> str:
        out = subprocess.run(["bash", "-c", f"echo {decide}"], capture_output=True, text=True, check=True)
        return out.stdout.strip()

    assert flags() == ""  # a first start
    (tmp_path / "run" / "checkpoints" / "best").mkdir(parents=True)
    assert flags() == ""  # evaluated once, no step checkpoint yet
    (tmp_path / "run" / "checkpoints" / "step-0002000").mkdir()
    assert flags() == "--resume"
