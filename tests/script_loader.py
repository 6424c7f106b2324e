"""Load a repository script (scripts/*.py, examples/*.py: files, not a package) as a module, by its path."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str, module_name: str):
    """The module `module_name` executed from REPO / relative_path; registered in sys.modules first, since
    dataclasses look their module up while the file executes."""
    spec = importlib.util.spec_from_file_location(module_name, REPO / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
