"""No class field in the services is typed ``object``: a structure that crosses modules names what it holds
(under TYPE_CHECKING where the module must not import it at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _object_fields(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and "object" in {n.id for n in ast.walk(item.annotation)
                                                                 if isinstance(n, ast.Name)}:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                found.append(f"{where}:{item.lineno} {node.name}.{ast.unparse(item.target)}")
    return found


def test_no_class_field_is_typed_object():
    files = [p for p in (ROOT / "services").rglob("*.py") if "rpc" not in p.parts]
    assert len(files) > 50
    assert [f for p in files for f in _object_fields(p)] == []


def test_the_check_sees_an_object_field(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("class A:\n    x: object = None\n    y: int | object\n    z: int = 0\n")
    assert [f.split(" ")[1] for f in _object_fields(probe)] == ["A.x", "A.y"]
