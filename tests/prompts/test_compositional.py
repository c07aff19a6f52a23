import importlib.util
import re
from pathlib import Path

import pytest

from flowrl import prompts


ROOT = Path(__file__).resolve().parents[2]
NUMBER = {"two": 2, "three": 3, "four": 4}


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("script", "files"),
    [("make_compositional_prompts", ("train.jsonl", "test.jsonl")), ("make_ocr_prompts", ("train.txt", "test.txt"))],
)
def test_scripts_are_deterministic_and_match_the_shipped_files(tmp_path, script, files):
    module = _script(script)
    assert module.main(["--out", str(tmp_path)]) == 0
    shipped = ROOT / "prompts" / ("compositional" if "compositional" in script else "ocr")
    for name in files:
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), f"regenerate prompts/{name}"


def test_metadata_describes_each_prompt():
    train, test = prompts.load("compositional/train"), prompts.load("compositional/test")
    assert not {p.text for p in train} & {p.text for p in test}
    tags = {p.metadata["tag"] for p in train + test}
    assert tags == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    for p in train + test:
        include, tag = p.metadata["include"], p.metadata["tag"]
        for obj in include:
            assert obj["class"] in p.text or tag == "counting", p
            assert obj.get("color", "") in p.text
        if tag == "counting":
            (obj,) = include
            word = p.text.split()[3]  # "a photo of <number> <plural>"
            assert obj["count"] == NUMBER[word] and p.metadata["exclude"] == [
                {"class": obj["class"], "count": obj["count"] + 1}
            ]
        if tag == "position":
            anchor, target = include
            relation, index = target["position"]
            assert index == 0 and relation in ("left of", "right of", "above", "below")
            words = {"left of": "to the left of", "right of": "to the right of"}.get(relation, relation)
            assert re.search(rf"an? {target['class']} {words} an? {anchor['class']}$", p.text), p
        if tag in ("two_object", "color_attr"):
            assert len(include) == 2 and include[0]["class"] != include[1]["class"]
