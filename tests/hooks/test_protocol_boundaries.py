"""Engines reach hooks only through the declared protocol; hooks reach engines only publicly.

Read from the source: the training engine (strategy, run loop, checkpoints, validation)
never looks up a hook member with ``getattr``/``hasattr`` (only through
:func:`nvalchemi.hooks.protocol.member`, whose names are all declared), and no hook uses a
private attribute of the strategy (``ctx.workflow._x``, ``strategy._x``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import nvalchemi
from nvalchemi.hooks import protocol

PACKAGE = Path(nvalchemi.__file__).parent
ENGINE = [
    PACKAGE / "training" / "strategy.py",
    PACKAGE / "training" / "_run.py",
    PACKAGE / "training" / "validation.py",
    *sorted((PACKAGE / "training" / "checkpoint").glob("*.py")),
]
HOOKS = [
    *sorted((PACKAGE / "training" / "hooks").glob("*.py")),
    *sorted((PACKAGE / "hooks").rglob("*.py")),
]
HOOK_NAMES = {"hook", "h", "child", "children", "existing", "candidate"}


def _calls(path: Path, name: str) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


@pytest.mark.parametrize("path", ENGINE, ids=lambda p: p.name)
def test_the_engine_never_looks_up_hook_members_by_getattr(path):
    offending = [
        f"{path.name}:{call.lineno}"
        for name in ("getattr", "hasattr")
        for call in _calls(path, name)
        if call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in HOOK_NAMES
    ]
    assert not offending, f"use nvalchemi.hooks.protocol.member instead: {offending}"


def test_every_member_looked_up_is_declared_in_the_protocol():
    used = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "member"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "protocol"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
            ):
                used.add(node.args[1].value)
    assert used and used <= protocol.OPTIONAL_MEMBERS, used - protocol.OPTIONAL_MEMBERS
    with pytest.raises(ValueError, match="not an optional hook member"):
        protocol.member(object(), "_plan")


@pytest.mark.parametrize("path", HOOKS, ids=lambda p: p.name)
def test_hooks_use_only_public_members_of_the_strategy(path):
    offending = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "workflow") or (
                isinstance(owner, ast.Name) and owner.id in {"strategy", "workflow"}
            ):
                offending.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
        ):
            args = node.args
            private = (
                len(args) >= 2
                and isinstance(args[1], ast.Constant)
                and str(args[1].value).startswith("_")
            )
            on_strategy = args and (
                (isinstance(args[0], ast.Attribute) and args[0].attr == "workflow")
                or (isinstance(args[0], ast.Name) and args[0].id in {"strategy", "workflow"})
            )
            if private and on_strategy:
                offending.append(f"{path.name}:{node.lineno}: getattr(..., {args[1].value!r})")
    assert not offending, offending
