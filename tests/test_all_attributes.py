"""``__all__`` of the package and of each public module lists names that exist (anyio's idea)."""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import pytest

import trainbus

PUBLIC_MODULES = ["trainbus.events", "trainbus.commands", "trainbus.operators", "trainbus.testing"]


def check_all(module: ModuleType) -> None:
    names = module.__all__
    assert len(names) == len(set(names)), f"duplicates in {module.__name__}.__all__"
    for name in names:
        assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name!r}"


def test_package_all() -> None:
    check_all(trainbus)
    for name in trainbus.__all__:
        obj = getattr(trainbus, name)
        assert inspect.isclass(obj) or callable(obj), name
    # The package only re-exports: what it names is defined in one of its modules.
    for name in trainbus.__all__:
        module = getattr(trainbus, name).__module__
        assert module.startswith("trainbus.") and module != "trainbus", (name, module)


def test_package_exports_every_exception() -> None:
    from trainbus import _exceptions

    for name in _exceptions.__all__:
        assert name in trainbus.__all__
        assert getattr(trainbus, name) is getattr(_exceptions, name)
    assert "CommandError" in trainbus.__all__


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_public_module_all(name: str) -> None:
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    check_all(module)
    # Every public class or function the module defines is listed.
    for attr, obj in vars(module).items():
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if obj.__module__ == name:
            assert attr in module.__all__, f"{name}.{attr} is public but not in __all__"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from trainbus import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(trainbus.__all__)
