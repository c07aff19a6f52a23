"""The docs must stay true to the code: every registered name and default appears in them."""

import ast
import re
from pathlib import Path

import pytest

from flowrl.core import ADVANTAGES, KL_ESTIMATORS, STEP_SELECTIONS, STEP_WEIGHTINGS, get_objective, list_objectives


DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_objectives_doc_lists_every_objective_with_its_defaults():
    text = (DOCS / "objectives.md").read_text()
    for name in list_objectives():
        match = re.search(rf"^### {name}\n(.*?)(?=^### |\Z)", text, flags=re.S | re.M)
        assert match, f"docs/objectives.md has no section for {name}"
        section = match.group(1)
        objective = get_objective(name)
        hparams = re.search(r"Hyper-parameters:(.*?)Default `agg", section, flags=re.S)
        listed = hparams.group(1) if hparams else ""
        assert f"agg = {objective.agg}" in section, name
        for key, value in objective.hparams.items():
            documented = re.search(rf"`{key} = ([^`]+)`", listed)
            assert documented, f"docs/objectives.md does not give {name}'s default {key}"
            assert ast.literal_eval(documented.group(1)) == value, f"{name}: {key} documented {documented.group(1)}"
        for key in objective.required:
            assert f"`{key}` (required" in listed, f"{name}: {key}"
        image = re.search(r"Image defaults: (.*?)\n", section)
        assert image, f"docs/objectives.md gives no image defaults for {name}"
        for key, value in objective.image_hparams.items():
            documented = re.search(rf"`{key} = ([^`]+)`", image.group(1))
            assert documented, f"docs/objectives.md does not give {name}'s image default {key}"
            assert ast.literal_eval(documented.group(1)) == pytest.approx(value), f"{name}: image {key}"


def test_core_doc_lists_every_registered_piece():
    text = (DOCS / "core.md").read_text()
    for registry in (ADVANTAGES, KL_ESTIMATORS, STEP_SELECTIONS, STEP_WEIGHTINGS):
        for name in registry:
            assert f"`{name}`" in text, f"docs/core.md does not mention {name}"


def test_readme_example_runs():
    readme = (DOCS.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, flags=re.S).group(1)
    exec(compile(code, "README.md", "exec"), {"print": lambda *a, **k: None})


def test_readme_opens_with_the_two_setup_commands():
    lines = (DOCS.parent / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
    assert all("pip install torch==2.13.0" in line for line in block)
    assert block[0].rstrip().endswith("# main job") and "python -m pytest" in block[1]


def test_every_config_field_is_documented():
    """Shared fields in docs/training.md; a trainer's own fields there or in docs/algorithms/<trainer>.md."""
    import dataclasses

    from flowrl.trainers import TRAINERS

    training = (DOCS / "training.md").read_text()

    def walk(cls, text):
        for field in dataclasses.fields(cls):
            assert f"`{field.name}`" in text, f"{field.name} of {cls.__name__} is not documented"
            value = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            for item in value if isinstance(value, list) else [value]:
                if dataclasses.is_dataclass(item):
                    walk(type(item), text)

    for name in TRAINERS:
        own = DOCS / "algorithms" / f"{name}.md"
        walk(TRAINERS.get(name).config_class, training + (own.read_text() if own.is_file() else ""))
        assert f"`{name}`" in training, f"docs/training.md does not list the trainer {name}"


def test_the_registries_page_is_what_flowrl_list_prints():
    from flowrl.cli import _catalog, markdown_catalog

    assert all(_catalog().values()), "a registry section of `flowrl list` is empty"
    current = (DOCS / "registries.md").read_text()
    assert current == markdown_catalog(), "docs/registries.md is stale: flowrl list --markdown > docs/registries.md"


def test_the_diffusers_lines_in_training_md_are_what_flowrl_sample_prints():
    """docs/training.md's python block is what `flowrl sample runs/sd35m-grpo_guard-pickscore --prompts "a photo of
    a cat"` prints for the SD3.5-Medium recipe at its last checkpoint: its model, LoRA folder, size, evaluation
    steps and guidance. A tiny SD3 pipeline stands in for the real one (the lines depend on the family, its
    scheduler and options, not the network's size)."""
    from flowrl.export import diffusers_lines
    from flowrl.models.families import MODEL_FAMILIES
    from flowrl.policies import DiffusionPolicy
    from flowrl.trainers import load_config

    config = load_config(DOCS.parent / "configs" / "sd35m" / "grpo_guard_pickscore.yaml")
    policy = DiffusionPolicy.from_pipeline(MODEL_FAMILIES.get("sd3").tiny(seed=0), options=config.model.options)
    s, run = config.sampling, config.run
    lora = Path(run.output_dir, "samples", f"epoch_{run.epochs}", "lora")
    lines = diffusers_lines(
        policy,
        config.model.name,
        weights=lora,
        prompt="a photo of a cat",
        steps=config.eval.num_steps,
        guidance=s.guidance_scale,
        height=s.height,
        width=s.width,
        seed=0,
        sampler="ode",
    )
    text = (DOCS / "training.md").read_text()
    block = re.search(r"## Sampling from a run\n.*?```python\n(.*?)```", text, flags=re.S).group(1)
    assert block == "\n".join(lines) + "\n"
