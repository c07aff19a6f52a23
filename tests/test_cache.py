"""The cache folder's atomic file write (`flowrl.cache.write_file_atomic`): the plan cache, the text store and the
VLM judge's answer cache all write through it."""

import os

import pytest

from flowrl.cache import write_file_atomic


def test_a_write_replaces_the_file_whole_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "deep" / "plan.json"  # the folder is made
    assert write_file_atomic(target, lambda tmp: tmp.write_text("one")) == target
    write_file_atomic(target, lambda tmp: tmp.write_text("two"))
    assert target.read_text() == "two"
    assert os.listdir(target.parent) == ["plan.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    target = tmp_path / "answer.json"
    target.write_text("old")

    def half(tmp):
        tmp.write_text("half a fi")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file_atomic(target, half)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["answer.json"]


def test_each_write_has_a_temporary_of_its_own(tmp_path):
    # two writers of one name (two processes of a launch): neither writes into the other's temporary file
    target, seen = tmp_path / "key.safetensors", []

    def outer(tmp):
        seen.append(tmp)
        write_file_atomic(target, lambda inner: (seen.append(inner), inner.write_text("inner")))
        tmp.write_text("outer")

    write_file_atomic(target, outer)
    assert seen[0] != seen[1] and target.read_text() == "outer"
    assert os.listdir(tmp_path) == ["key.safetensors"]


def test_under_a_process_group_only_rank_0_builds_and_the_others_wait_for_it(tmp_path, monkeypatch):
    # transformers' save_pretrained writes weights on rank 0 only: a rank 1 that took the build's lock first kept a
    # folder without weights (a text run on two processes with a fresh cache, 2026-11-28)
    import threading

    import torch.distributed as dist

    from flowrl.cache import build_once

    target, built = tmp_path / "arith", []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    rank_0 = threading.Timer(0.5, lambda: (target.mkdir(), (target / "build.json").write_text("{}")))
    rank_0.start()
    assert build_once(target, False, built.append, marker="build.json") == target
    assert built == [] and (target / "build.json").is_file()  # rank 1 waited, built nothing

    with pytest.raises(TimeoutError, match=r"rank 0 did not build it within 0 s"):
        build_once(tmp_path / "never", False, built.append, timeout=0.3)
    assert built == []

    monkeypatch.setattr(dist, "get_rank", lambda: 0)  # rank 0 builds, under the lock
    build_once(tmp_path / "digits", False, built.append)
    assert built == [tmp_path / "digits"]
