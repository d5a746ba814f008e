"""The README's first two lines are the commands a fresh machine runs; CI must run the second."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    lines = ROOT.joinpath("README.md").read_text().splitlines()
    install_and_demo, tests = lines[0].strip(), lines[1].strip()
    assert "pathswarm demo" in install_and_demo and "pip install" in install_and_demo
    assert "pytest" in tests and "pip install" in tests
    assert tests in ROOT.joinpath(".ci", "run").read_text()
