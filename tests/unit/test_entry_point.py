"""Every module attribute the entry point uses exists (an end-to-end job reaches some of them
only after training; a rename must fail here, in seconds, not at the end of every job).

Run: .venv/bin/python -m pytest tests/unit/test_entry_point.py
"""

import ast
import importlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ENTRY = Path(__file__).resolve().parents[2] / "pretrain_gpt_recover.py"


def imported_modules(tree: ast.AST) -> dict[str, str]:
    """Local name -> module, for `import x.y as z`, `from pkg import module` and
    `from megatron_recover import x`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                try:
                    importlib.import_module(candidate)
                except ImportError:
                    continue
                names[alias.asname or alias.name] = candidate
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
    return names


def test_every_module_attribute_the_entry_point_uses_exists():
    tree = ast.parse(ENTRY.read_text())
    modules = imported_modules(tree)
    assert {"run", "runtime", "arguments", "collective"} <= set(modules), modules
    missing = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and modules[node.value.id].startswith(
                    "megatron_recover")):
            module = importlib.import_module(modules[node.value.id])
            if not hasattr(module, node.attr):
                missing.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    assert not missing, missing


def test_the_seams_are_megatron_lms():
    """pretrain_gpt_recover.py defines Megatron-LM's seams at top level, with its parameters,
    and hands them to `pretrain` (tests/test_user_provider.py trains a script that replaces
    them)."""
    import inspect

    import pretrain_gpt_recover as entry

    def parameters(function):
        return list(inspect.signature(function).parameters)

    assert parameters(entry.model_provider) == ["pre_process", "post_process", "vp_stage",
                                                "config"]
    assert parameters(entry.forward_step) == ["data_iterator", "model"]
    assert parameters(entry.loss_func) == ["loss_mask", "output_tensor"]
    assert parameters(entry.pretrain) == ["model_provider", "forward_step_func"]
    main = [node for node in ast.parse(ENTRY.read_text()).body if isinstance(node, ast.If)]
    assert [ast.unparse(node.body[0]) for node in main] == [
        "pretrain(model_provider, forward_step)"]
