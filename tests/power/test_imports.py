import ast
from pathlib import Path

import o3edge.power

PACKAGE = Path(o3edge.power.__file__).parent


def test_power_never_imports_torch_or_the_engine():
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("torch", "o3edge.engine", "o3edge.ipc")), f"{path.name} imports {name}"
