"""The README's install (`.ci/run` runs the same line) is right on a machine without a GPU (issue
65): torch is PyTorch's CPU build and nothing brings Triton or the NVIDIA libraries, while the
`cuda` extra still brings Triton where it runs.

- Offline: the install line's shape, the requirements pyproject declares (walked through the
  installed packages' metadata), and xgrammar's CPU path with Triton missing (xgrammar is
  installed with --no-deps because every 0.2 release requires triton on Linux x86_64).
- Online: the install line resolved by pip as on a bare machine (no pip config, no local wheel
  folder, no extra indexes: `--isolated`, `PIP_CONFIG_FILE=/dev/null`), `--dry-run --report`;
  skipped with the reason when an index it names cannot be reached.
"""

from __future__ import annotations

import json
import os
import shlex
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parents[1]
CI_RUN = ROOT / ".ci" / "run"
PYPI = "https://pypi.org/simple"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
GPU_ONLY_PREFIXES = ("triton", "pytorch-triton", "nvidia-", "cuda-")
"""Distributions only a GPU uses: Triton (and PyTorch's build of it), the CUDA libraries."""


def gpu_only(names: set[str] | list[str]) -> list[str]:
    return sorted(n for n in names if canonicalize_name(n).startswith(GPU_ONLY_PREFIXES))


def install_steps() -> list[list[str]]:
    """The `pip install` commands of `.ci/run`'s install line, in order, as argument lists
    (what follows `pip install`)."""
    for line in CI_RUN.read_text().splitlines():
        if line.startswith("pip install"):
            steps = [shlex.split(part) for part in line.split("&&")]
            assert all(s[:2] == ["pip", "install"] for s in steps), line
            return [s[2:] for s in steps]
    raise AssertionError(f"no `pip install` line in {CI_RUN}")


def option(args: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in `args`, None without it."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


# ---- offline --------------------------------------------------------------------------------------


def test_the_install_line_takes_torch_from_pytorchs_cpu_index_and_xgrammar_without_triton() -> None:
    steps = install_steps()
    torch_step = next(s for s in steps if any(a.startswith("torch==") for a in s))
    # --no-deps: only torch comes from PyTorch's index (its requirements from PyPI in the next
    # step), so an unreachable PyTorch index costs one request, not one per package
    assert option(torch_step, "--index-url") == PYTORCH_CPU_INDEX and "--no-deps" in torch_step
    assert steps.index(torch_step) == 0, "torch must be installed before the project asks for it"
    xgrammar_steps = [s for s in steps if any(a.startswith("xgrammar") for a in s)]
    assert xgrammar_steps and all("--no-deps" in s for s in xgrammar_steps), xgrammar_steps
    project_step = next(s for s in steps if "-e" in s)
    # xgrammar last: installed before the project, pip would resolve its triton requirement
    assert steps.index(project_step) < steps.index(xgrammar_steps[0])


def requirement_closure(roots: list[str], skip: set[str]) -> dict[str, list[str]]:
    """Every distribution `roots` lead to through the installed packages' metadata (markers
    evaluated for this machine, extras followed), each with the chain that reached it. Names in
    `skip` are not entered; a requirement whose distribution is not installed ends its chain."""
    reached: dict[str, list[str]] = {}
    todo: list[tuple[Requirement, list[str]]] = [(Requirement(r), []) for r in roots]
    while todo:
        req, chain = todo.pop()
        name = canonicalize_name(req.name)
        if name in reached or name in skip:
            continue
        reached[name] = [*chain, name]
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            sub = Requirement(text)
            extras = {""} | set(req.extras)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append((sub, reached[name]))
    return reached


def declared(extra: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"][extra]]


def test_the_declared_requirements_bring_no_triton_but_the_cuda_extra_does() -> None:
    """torch is left out: which build it is depends on the index (the online test checks it)."""
    cpu = requirement_closure(declared("dev"), skip={"torch"})
    # tokenizers comes only through transformers' metadata: the walk did go through what is installed
    assert "tokenizers" in cpu and "pydantic-core" in cpu, sorted(cpu)
    assert gpu_only(set(cpu)) == [], [cpu[n] for n in gpu_only(set(cpu))]
    cuda = declared("cuda")
    assert {canonicalize_name(Requirement(r).name) for r in cuda} >= {"xgrammar", "triton"}


BLOCKED_TRITON_DECODE = """
import sys
sys.modules["triton"] = None  # as on an install without it: `import triton` raises ImportError
sys.path.insert(0, {tests!r})
import json, torch
from tiny_models import make_tiny_tokenizer
from freetoken_agents.constrained import ConstrainedDecode, GrammarFactory
from freetoken_agents.engine import SamplingParams
from freetoken_agents.engine.runtime.generate import Sampler

class Prefers:  # next-token scores fixed on the specials and "a": the mask decides the rest
    def __init__(self, scores): self.scores, self.appended = scores, []
    def next_logits(self): return self.scores.clone()
    def decode(self, token_id): self.appended.append(token_id)
    def prefill(self, token_ids): self.appended.extend(token_ids)

tok = make_tiny_tokenizer()
scores = torch.zeros(512)
scores[sorted(set(tok.all_special_ids))] = 100.0
scores[tok.convert_tokens_to_ids("a")] = 50.0
schema = {{"type": "object", "properties": {{"s": {{"type": "string"}}}}, "required": ["s"]}}
factory = GrammarFactory(tok, 512, (tok.eos_token_id,))
run = ConstrainedDecode(Prefers(scores), factory.json_schema(schema), budget=12,
                        sampler=Sampler(SamplingParams(temperature=0.0)), tokenizer=tok)
text = "".join(run)
assert json.loads(text)["s"].startswith("a"), text
assert [m for m in sys.modules if m.split(".")[0] == "triton"] == ["triton"] and sys.modules["triton"] is None
print("ok", text)
"""


def test_constrained_decoding_on_cpu_runs_without_triton() -> None:
    """Why xgrammar may go in with --no-deps: its CPU mask kernel never imports Triton."""
    pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar")
    script = BLOCKED_TRITON_DECODE.format(tests=str(ROOT / "tests"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok ")


# ---- online: pip resolves the install line as on a bare machine -----------------------------------


def unreachable(url: str) -> str | None:
    """Why `url` cannot be reached in 5 s, or None when it answers."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=5):
            return None
    except (urllib.error.URLError, OSError) as e:
        return f"{url} unreachable ({getattr(e, 'reason', e)})"


def bare_pip(args: list[str]) -> dict:
    """`pip install ARGS --dry-run --report -` for this interpreter, as on a machine with no pip
    configuration (no local wheel folder, extra index or constraint), ignoring what is installed;
    the report's JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no configuration file at all
    cafile = ssl.get_default_verify_paths().cafile  # the CAs the reachability probe trusted
    cert = ["--cert", cafile] if cafile and os.path.exists(cafile) else []
    command = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "install",
               "--dry-run", "--ignore-installed", "--report", "-", "--quiet", "--timeout", "20",
               "--retries", "2", *cert, *args]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{shlex.join(args)}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)


def resolve_install(steps: list[list[str]]) -> list[dict[str, str]]:
    """Each step's `{name: version}` as pip resolves it after the steps before it. A dry run
    installs nothing, so a later step is offered what an earlier one installed as a pin to the
    exact version it chose, through that step's index (where pip would find it installed): a
    step that cannot keep it fails to resolve, where pip would replace it."""
    resolved, pins, indexes = [], [], []
    for args in steps:
        # a --no-deps step resolves nothing, so what is installed already plays no part in it
        offered = [a for url in indexes for a in ("--extra-index-url", url)]
        earlier = [] if "--no-deps" in args else [*pins, *offered]
        report = bare_pip([*args, *earlier])
        got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
        resolved.append(got)
        named = {canonicalize_name(Requirement(a).name) for a in args if "==" in a}
        pins += [f"{name}=={got[name]}" for name in sorted(named) if name in got]
        index = option(args, "--index-url")
        if index is not None:
            indexes.append(index)
    return resolved


def test_the_install_line_resolves_to_cpu_torch_and_no_triton_on_a_bare_machine() -> None:
    steps = install_steps()
    urls = {PYPI, *(option(s, "--index-url") or PYPI for s in steps)}
    why = [w for w in map(unreachable, sorted(urls)) if w is not None]
    if why:
        pytest.skip("; ".join(why))
    resolved = resolve_install(steps)
    torch_versions = {r["torch"] for r in resolved if "torch" in r}
    assert torch_versions and all(v.endswith("+cpu") for v in torch_versions), resolved
    for args, got in zip(steps, resolved, strict=True):
        assert gpu_only(set(got)) == [], (shlex.join(args), gpu_only(set(got)))
        if "--no-deps" in args:
            assert len(got) == 1, (shlex.join(args), got)
    project = next(r for r in resolved if "freetoken-agents" in r)
    assert project["torch"] in torch_versions  # the project's `torch>=2.4` keeps the CPU build
