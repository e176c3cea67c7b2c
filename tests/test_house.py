"""The shape of the code: layers, short functions, configs that hold only what changes a
result, one copy of each shared rule, and a command reference that is never stale."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from oakemu_rl import PPOModel, PPOModelConfiguration
from oakemu_rl.agents.play import EvalConfig
from oakemu_rl.bootstrap.bc import BCConfig
from oakemu_rl.bootstrap.calibrate import CalibrateConfig
from oakemu_rl.finetune.ppo import PPOConfig

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "oakemu_rl"

# Each stage's modules; a stage may import only from lower layers, never another stage.
STAGES = {
    "bc": {"oakemu_rl.bootstrap.bc", "oakemu_rl.bootstrap.dagger"},
    "calibrate": {"oakemu_rl.bootstrap.calibrate"},
    "ppo": {"oakemu_rl.finetune.ppo"},
    "test": {"oakemu_rl.tester"},
    "export": {"oakemu_rl.export"},
}
ORCHESTRATION = {"oakemu_rl.cli", "oakemu_rl.pipeline", "oakemu_rl.clidoc", "oakemu_rl.options"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every oakemu_rl module a source file imports, at any depth in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("oakemu_rl")}


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_stage_imports_another_stage_and_nothing_below_imports_a_stage() -> None:
    owner = {module: stage for stage, modules in STAGES.items() for module in modules}
    problems = []
    for path in _sources():
        name = _module_name(path)
        if name in ORCHESTRATION:
            continue
        for imported in _imports(path):
            stage = owner.get(imported)
            if stage is not None and owner.get(name) != stage:
                problems.append(f"{name} imports {imported} (stage {stage})")
    assert problems == []


def test_the_lower_layers_never_import_upwards() -> None:
    lower = {"oakemu_rl.model", "oakemu_rl.errors", "oakemu_rl.configs", "oakemu_rl.runtime",
             "oakemu_rl.checkpoint", "oakemu_rl.fsutil", "oakemu_rl.metrics", "oakemu_rl.runs",
             "oakemu_rl.plots", "oakemu_rl.demos.reader", "oakemu_rl.demos.writer",
             "oakemu_rl.demos.schema", "oakemu_rl.demos.dataset", "oakemu_rl.envs.spec",
             "oakemu_rl.envs.ale"}
    upper = ("oakemu_rl.agents", "oakemu_rl.rl", "oakemu_rl.bootstrap", "oakemu_rl.finetune",
             "oakemu_rl.tester", "oakemu_rl.export", "oakemu_rl.pipeline", "oakemu_rl.cli")
    problems = [f"{_module_name(p)} imports {m}" for p in _sources()
                if _module_name(p) in lower for m in _imports(p) if m.startswith(upper)]
    assert problems == []


def test_nothing_outside_model_py_touches_a_private_member_of_the_model() -> None:
    private = {node.name for node in ast.walk(ast.parse((SRC / "model.py").read_text()))
               if isinstance(node, ast.FunctionDef) and node.name.startswith("_")
               and not node.name.startswith("__")}
    assert private == set() or all(
        f".{name}(" not in p.read_text() for p in _sources() if p.name != "model.py"
        for name in private)
    for path in _sources():
        if path.name != "model.py":
            assert "._features(" not in path.read_text(), path


def test_the_model_has_a_public_trunk() -> None:
    config = PPOModelConfiguration(conv_layers=((8, 8, 4),), fc_hidden=(16,))
    model = PPOModel((4, 84, 84), 3, config)
    x = torch.randint(0, 255, (2, 4, 84, 84), dtype=torch.uint8)
    features = model.features(x)
    assert features.shape == (2, 16)
    torch.testing.assert_close(model.policy_head(features), model.get_logits(x))
    torch.testing.assert_close(model.value_head(features).squeeze(-1), model.get_value(x))


def test_no_function_in_src_is_longer_than_80_lines() -> None:
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {length}")
    assert long == []


@pytest.mark.parametrize("config", [BCConfig, CalibrateConfig, PPOConfig, EvalConfig])
def test_stage_configs_hold_what_changes_the_result_not_places(config: type) -> None:
    """Input files, run directory, resume, device and progress are arguments of the stage
    function, not fields of its config (so a pipeline section is the config itself)."""
    places = {"run_dir", "checkpoint", "resume", "device", "progress", "demos", "bc_demos",
              "video"}
    assert places.isdisjoint(f.name for f in dataclasses.fields(config))


def test_one_definition_of_each_shared_rule() -> None:
    """The spec check, masked log-softmax, divergence guard and option checks are written
    once; the stages call them."""
    text = {p: p.read_text() for p in _sources()}
    for needle, home in (("same_frames_as(", "envs/spec.py"),
                         ("torch.log_softmax(", "model.py"),
                         ("became {number} at", "errors.py"),
                         ("is out of range: ", "configs.py"),
                         ("def coerce(", "configs.py"),
                         ("def field_docs(", "configs.py"),
                         ("isinstance(m, bool) for m in mask", "envs/spec.py")):
        users = sorted(str(p.relative_to(SRC)) for p, body in text.items() if needle in body)
        assert users == [home], (needle, users)


def test_the_command_reference_is_current() -> None:
    from oakemu_rl.clidoc import render

    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == render(), ("docs/cli.md is stale: run .venv/bin/python -m "
                                   "oakemu_rl.clidoc > docs/cli.md")


def test_the_command_reference_has_every_stage_option() -> None:
    from oakemu_rl.clidoc import render
    from oakemu_rl.configs import field_docs, flag

    page = render()
    for config in (BCConfig, CalibrateConfig, PPOConfig):
        for name, doc in field_docs(config).items():
            assert f"`{flag(name)}" in page, name
            assert doc.split(".")[0] in page, name
