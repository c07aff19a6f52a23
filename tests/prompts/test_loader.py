import json

import pytest

from flowrl import prompts
from flowrl.prompts import Prompt


def test_txt_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "set.txt"
    path.write_text('# a comment\n\n  a cat  \n# another\na sign that says "Hi there" and "ignored"\n#tag-like line\n')
    loaded = prompts.load(path)
    assert loaded == [Prompt("a cat", {}), Prompt('a sign that says "Hi there" and "ignored"', {"text": "Hi there"})]
    assert str(loaded[0]) == "a cat"


def test_jsonl_keeps_metadata(tmp_path):
    path = tmp_path / "set.jsonl"
    records = [
        {"prompt": "two dogs", "tag": "counting", "include": [{"class": "dog", "count": 2}]},
        {"prompt": 'a mug that says "Tea"'},
        {"prompt": 'a sign "X"', "text": "given"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    loaded = prompts.load(str(path))
    assert loaded[0] == Prompt("two dogs", {"tag": "counting", "include": [{"class": "dog", "count": 2}]})
    assert loaded[1].metadata == {"text": "Tea"} and loaded[2].metadata == {"text": "given"}


def test_bad_files_are_reported_with_their_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*string 'prompt'"):
        prompts.load(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:1: not valid JSON"):
        prompts.load(tmp_path / "broken.jsonl")
    (tmp_path / "empty.txt").write_text("# only a comment\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        prompts.load(tmp_path / "empty.txt")


def test_unknown_names_list_the_shipped_sets():
    with pytest.raises(ValueError, match=r"unknown prompt set 'simple_animal'.*compositional/train.*simple_animals"):
        prompts.load("simple_animal")


def test_shipped_sets_load_by_name():
    names = prompts.list_sets()
    for name in [
        "simple_animals",
        "drawbench_style",
        "compositional/train",
        "compositional/test",
        "ocr/train",
        "ocr/test",
    ]:
        assert name in names
    for name in names:
        loaded = prompts.load(name)
        texts = [p.text for p in loaded]
        assert texts and all(t and t == t.strip() for t in texts), name
    assert prompts.load("simple_animals.txt") == prompts.load("simple_animals")
    assert "cat" in [p.text for p in prompts.load("simple_animals")]


def test_drawbench_style_covers_the_categories():
    loaded = prompts.load("drawbench_style")
    categories = {p.metadata["category"] for p in loaded}
    assert len(loaded) == 200 and len({p.text for p in loaded}) == 200
    assert categories == {
        "colors",
        "counting",
        "positional",
        "text",
        "rare_words",
        "conflicting",
        "descriptions",
        "creative",
    }
    assert all("text" in p.metadata for p in loaded if p.metadata["category"] == "text")


def test_ocr_sets_have_targets_and_disjoint_texts():
    train, test = prompts.load("ocr/train"), prompts.load("ocr/test")
    for p in train + test:
        assert p.metadata["text"] and f'"{p.metadata["text"]}"' in p.text
    assert not {p.metadata["text"] for p in train} & {p.metadata["text"] for p in test}
    assert len(train) >= 500 and len(test) >= 50
