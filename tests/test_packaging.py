"""What pyproject.toml declares about Python holds for the code: every module parses with Python 3.10's grammar
(requires-python >= 3.10; the machines here run the tests on 3.11 only, the version the classifiers list)."""

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_requires_python_and_classifiers_match_what_is_tested():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"
    versions = [c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: "
                                                                                         "Python :: 3.")]
    assert versions == ["3.11"]


def test_the_package_keeps_to_python_310_grammar():
    """A 3.11+ construct (except*, PEP 695 generics, ...) would make requires-python a lie: refused here."""
    bad = []
    for path in sorted((REPO / "nano_eval").rglob("*.py")):
        try:
            ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
        except SyntaxError as e:
            bad.append(f"{path.relative_to(REPO)}:{e.lineno}: {e.msg}")
    assert not bad, bad
    try:  # the check itself can fail: a 3.11 construct is refused under 3.10's grammar
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
    except SyntaxError:
        pass
    else:
        raise AssertionError("ast accepted except* under Python 3.10's grammar")
