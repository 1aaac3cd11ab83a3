"""The documentation covers the public API, and the code on its pages runs.

1. Every function or class in a public `__all__` (`tfun`, `tfun.lax`, `tfun.tree`,
   `tfun.errors`, and `tfun.nn` / `tfun.kernels` when they import) has a docstring.
2. Every such name is rendered by an API page: a `::: tfun.<module>.<name>` (or
   `::: tfun.<name>`) line in some `docs/**/*.md`. Adding a public name without a docs
   entry fails here, by design, with the list of what is missing and where to add it.
3. The ```` ```python ```` blocks of each page run, top to bottom, in one namespace per
   page (blocks fenced ```` ```py ```` are shown but not run, and blocks that only
   include a file with `--8<--` are skipped: those files are run by their own tests).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MODULES = ["tfun", "tfun.lax", "tfun.tree", "tfun.errors", "tfun.nn", "tfun.kernels"]
OPTIONAL = {"tfun.nn", "tfun.kernels"}
# Where a missing entry belongs, to make the failure message actionable.
PAGE_FOR = {
    "tfun": "docs/api/transforms.md",
    "tfun.lax": "docs/api/lax.md",
    "tfun.tree": "docs/api/tree.md",
    "tfun.errors": "docs/api/errors.md",
    "tfun.nn": "docs/api/nn.md",
    "tfun.kernels": "docs/api/kernels.md",
}
DIRECTIVE = re.compile(r"^:::\s+(tfun(?:\.\w+)*)\s*$", re.M)


def _modules() -> list[tuple[str, object]]:
    out = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            if name in OPTIONAL:
                continue
            raise
        if getattr(mod, "__all__", None) is None:
            if name in OPTIONAL:
                continue  # e.g. a namespace package with nothing public yet
            raise AssertionError(f"{name} has no __all__")
        out.append((name, mod))
    return out


def _public_api() -> list[tuple[str, str, object]]:
    """(module, name, object) for every function or class in a public `__all__`."""
    api = []
    for modname, mod in _modules():
        for name in mod.__all__:  # type: ignore[attr-defined]
            obj = getattr(mod, name, None)
            if obj is None:
                raise AssertionError(f"{modname}.__all__ lists {name!r}, which it does not define")
            if inspect.ismodule(obj) or not (inspect.isroutine(obj) or inspect.isclass(obj) or callable(obj)):
                continue  # submodules, __version__, and plain objects
            api.append((modname, name, obj))
    return api


def _documented() -> set[str]:
    found: set[str] = set()
    for md in DOCS.rglob("*.md"):
        found.update(DIRECTIVE.findall(md.read_text(encoding="utf-8")))
    return found


def test_public_names_have_docstrings() -> None:
    missing = [f"{m}.{n}" for m, n, obj in _public_api() if not (inspect.getdoc(obj) or "").strip()]
    assert not missing, "public names without a docstring:\n  " + "\n  ".join(missing)


def test_public_names_are_in_the_api_reference() -> None:
    documented = _documented()
    missing = [(m, n) for m, n, _ in _public_api() if f"{m}.{n}" not in documented]
    if missing:
        lines = [f"  {m}.{n}  ->  add `::: {m}.{n}` to {PAGE_FOR.get(m, 'docs/api/')}" for m, n in missing]
        pytest.fail("public names missing from the docs' API reference:\n" + "\n".join(lines))


def test_api_directives_name_real_objects() -> None:
    """A `:::` line for a name that does not exist breaks `mkdocs build --strict`; say which."""
    bad = []
    for name in sorted(_documented()):
        modname, _, attr = name.rpartition(".")
        try:
            obj = importlib.import_module(name)
        except ImportError:
            try:
                obj = getattr(importlib.import_module(modname), attr)
            except (ImportError, AttributeError):
                bad.append(name)
    assert not bad, "docs reference names that do not exist: " + ", ".join(bad)


FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def _python_blocks(md: Path) -> list[tuple[int, str]]:
    text = md.read_text(encoding="utf-8")
    blocks = []
    for m in FENCE.finditer(text):
        info = m.group("info").strip().split()
        if not info or info[0] != "python" or "--8<--" in m.group("body"):
            continue
        body = "\n".join(line[len(m.group("indent")):] for line in m.group("body").splitlines())
        blocks.append((text[: m.start()].count("\n") + 1, body))
    return blocks


PAGES = sorted(p for p in DOCS.rglob("*.md") if _python_blocks(p))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_runs(page: Path) -> None:
    # the blocks run in a module of their own, registered while they run: Dynamo (tfun.jit)
    # looks a traced function's globals up by their module's name, as it finds a script's
    module = types.ModuleType(f"docs_{page.stem}")
    ns: dict[str, object] = module.__dict__
    sys.modules[module.__name__] = module
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for line, code in _python_blocks(page):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), ns)
            except Exception as e:  # noqa: BLE001 - report which block failed
                pytest.fail(f"{page.relative_to(ROOT)}, code block at line {line} raised {type(e).__name__}: {e}")
    finally:
        os.chdir(cwd)
        sys.modules.pop(module.__name__, None)
