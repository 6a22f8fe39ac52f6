"""`freetoken --help` answers at once (issue 65): building the command's parsers, printing any
help and `import freetoken_agents` load neither torch nor transformers, the lazy package tops
still give every public name, and the names the parsers offer as choices without importing
their modules match those modules. Checked by what a fresh interpreter imported, not by timing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")
LIGHT_ENGINE_MODULES = {
    "freetoken_agents.engine",
    "freetoken_agents.engine.choices",
    "freetoken_agents.engine.errors",
    "freetoken_agents.engine.flags",
    "freetoken_agents.engine.text",
    "freetoken_agents.engine.text.tokenizer_files",
}
"""The engine modules a parser may load: the package top (lazy) and constants, nothing of torch."""


def imported_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


HELP_EVERY_COMMAND = """
import argparse, contextlib, io
from freetoken_agents.cli import build_parser, main
sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
commands = sorted(sub.choices)
assert {"chat", "convert", "demo", "generate", "inspect", "serve"} <= set(commands), commands
for argv in (["--help"], *([c, "--help"] for c in commands)):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert "usage: freetoken" in out.getvalue(), argv
"""


def test_help_of_every_command_loads_no_torch_nor_transformers() -> None:
    modules = imported_after(HELP_EVERY_COMMAND)
    assert "freetoken_agents.cli" in modules
    assert heavy(modules) == []
    engine = {m for m in modules if m.startswith("freetoken_agents.engine")}
    assert engine <= LIGHT_ENGINE_MODULES, sorted(engine - LIGHT_ENGINE_MODULES)
    assert not any(m.startswith(("freetoken_agents.integrations", "freetoken_agents.model")) for m in modules)


def test_import_freetoken_agents_loads_no_torch_nor_the_engine() -> None:
    modules = imported_after("import freetoken_agents")
    assert heavy(modules) == []
    assert "freetoken_agents.engine" not in modules and "freetoken_agents.agent" not in modules


def test_tools_and_errors_import_without_torch() -> None:
    modules = imported_after("from freetoken_agents import AgentError, ModelRetry, Tool, tool")
    assert heavy(modules) == []


@pytest.mark.parametrize("package", ["freetoken_agents", "freetoken_agents.engine"])
def test_the_lazy_package_tops_give_every_public_name(package: str) -> None:
    import importlib

    module = importlib.import_module(package)
    exports = module._EXPORTS
    assert set(exports) == set(module.__all__) - {"__version__"}
    for name in module.__all__:
        assert getattr(module, name) is not None
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        module.NoSuchName  # noqa: B018


def test_from_import_gives_the_same_objects_as_the_modules() -> None:
    from freetoken_agents import Agent, FreeTokenModel, tool
    from freetoken_agents.agent import Agent as agent_agent
    from freetoken_agents.engine import PLACEMENTS, Engine, EngineError
    from freetoken_agents.engine.engine import Engine as engine_engine
    from freetoken_agents.engine.errors import EngineError as errors_error
    from freetoken_agents.model import FreeTokenModel as model_model
    from freetoken_agents.tools import tool as tools_tool

    assert (Agent, FreeTokenModel, tool) == (agent_agent, model_model, tools_tool)
    assert (Engine, EngineError) == (engine_engine, errors_error)
    assert PLACEMENTS == ("auto", "resident", "qstar", "stream")


def test_the_light_choices_match_the_modules_that_use_them() -> None:
    from freetoken_agents.cli.serve import TOOL_FORMATS
    from freetoken_agents.engine import choices, options
    from freetoken_agents.engine.ftw import codecs
    from freetoken_agents.engine.kernels import int8
    from freetoken_agents.engine.loading import convert, gguf
    from freetoken_agents.parsers import PARSERS

    assert choices.CODECS == codecs.CODECS
    assert choices.GGUF_SOURCE == gguf.SOURCE
    assert convert.QUANTS == choices.QUANTS and convert.QUANT_CODECS is choices.QUANT_CODECS
    assert int8.EXPERT_QUANTS == choices.EXPERT_QUANTS
    assert options.EngineOptions.model_fields["placement"].annotation == choices.Placement
    assert sorted(TOOL_FORMATS) == sorted(PARSERS) and len(TOOL_FORMATS) == len(PARSERS)


def test_the_simulation_policies_match_the_simulator() -> None:
    from freetoken_agents.engine.choices import SIMULATION_POLICIES
    from freetoken_agents.engine.simulate.simulator import POLICIES

    assert SIMULATION_POLICIES == POLICIES
