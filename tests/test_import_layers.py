"""The five parts import only downwards: Engine <- SDK <- Integrations <- Recipes <- CLI; and the
turn decoder (`_decode`) never imports the model (`model` imports it: no circle).

import-linter checks the contracts in pyproject.toml. It finds modules by walking the package's
folder, and the installed layout is spread over several folders (`package-dir` maps engine/,
integrations/ and recipes/ into `freetoken_agents`), so the check runs on a copy laid out as the
installed package is. Lazy (function-level) and TYPE_CHECKING imports count.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def installed_layout(dest: Path) -> Path:
    """Copy every package's .py files to where `pip install` puts them; returns `dest`."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools["package-dir"]
    for package in setuptools["packages"]:
        parts = package.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in mapping:
                source = REPO / mapping[prefix] / Path(*parts[n:])
                break
        else:
            source = REPO / Path(*parts)
        target = dest.joinpath(*parts)
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, target / module.name)
    return dest


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    beside_python = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    script = beside_python or shutil.which("lint-imports")
    if script is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[dev]' installs import-linter")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [script, "--no-cache", str(REPO / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_five_parts_import_only_downwards(tmp_path):
    result = lint_imports(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract_even_when_lazy_or_type_checking(tmp_path):
    root = installed_layout(tmp_path)
    spec = root / "freetoken_agents" / "engine" / "spec.py"
    spec.write_text(
        spec.read_text()
        + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        + "    from freetoken_agents.model import FreeTokenModel\n\n\n"
        + "def _lazy():\n    from freetoken_agents.cli import main\n"
    )
    recipe = root / "freetoken_agents" / "recipes" / "tool_loop.py"
    recipe.write_text(recipe.read_text() + "\n\ndef _cli():\n    from freetoken_agents.cli import main\n")
    result = lint_imports(root)
    assert result.returncode != 0
    out = result.stdout
    assert "freetoken_agents.engine.spec -> freetoken_agents.model" in out
    assert "freetoken_agents.engine.spec -> freetoken_agents.cli" in out
    assert "freetoken_agents.recipes.tool_loop -> freetoken_agents.cli" in out


def test_the_turn_decoder_importing_the_model_breaks_the_contract(tmp_path):
    """model.py imports _decode.py; the way back (even TYPE_CHECKING) would close a circle."""
    root = installed_layout(tmp_path)
    decode = root / "freetoken_agents" / "_decode.py"
    decode.write_text(
        decode.read_text()
        + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        + "    from .model import FreeTokenModel\n"
    )
    result = lint_imports(root)
    assert result.returncode != 0
    assert "freetoken_agents._decode -> freetoken_agents.model" in result.stdout


@pytest.mark.parametrize(
    ("module", "back_to", "how"),
    [
        # the loop the Engine used to close: loading a model importing the engine it builds
        ("engine/loading/convert.py", "freetoken_agents.engine.engine", "lazy"),
        # the anchor store reaching for the whole Engine instead of its AnchorHost
        ("engine/anchors/store.py", "freetoken_agents.engine.engine", "type_checking"),
        # core compute pulling in the file-format package that uses it
        ("engine/ftw/reader.py", "freetoken_agents.engine.loading.cache", "lazy"),
        ("integrations/prefix_cache.py", "freetoken_agents.integrations.openai_server", "lazy"),
    ],
)
def test_an_import_circle_inside_a_package_breaks_the_contract(tmp_path, module, back_to, how):
    """No circle among the modules (or sub-packages) of any package, lazy or TYPE_CHECKING imports
    included: the seams that would need one are declared where they are used instead."""
    root = installed_layout(tmp_path)
    part, *rest = module.split("/")
    folder = {"engine": ["freetoken_agents", "engine"], "integrations": ["freetoken_agents", "integrations"]}
    path = root.joinpath(*folder[part], *rest)
    if how == "lazy":
        extra = f"\n\ndef _back():\n    import {back_to}  # noqa\n"
    else:
        extra = f"\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import {back_to}\n"
    path.write_text(path.read_text() + extra)
    result = lint_imports(root)
    assert result.returncode != 0
    assert "No import circle" in result.stdout and "BROKEN" in result.stdout, result.stdout
