"""README, Package layers: the daemon and the client share only what lies below them (the protocol,
the vocabulary); neither imports the other. `dflash2d --check` once imported the client's lock reader
(a review): moved to dflash2/endpointlock.py."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("layer, other", [("daemon", "dflash2.client"), ("client", "dflash2.daemon")])
def test_the_daemon_and_the_client_do_not_import_each_other(layer, other):
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, f"no modules under {layer}/"
    upward = {f"{f.relative_to(ROOT)}: {name}" for f in files for name in _imports(f)
              if name == other or name.startswith(other + ".")}
    assert not upward, f"{layer}/ imports {other}: " + "; ".join(sorted(upward))
