"""atomic_dir (dflash_trt/atomic.py), the one home of folder writes: a reader sees the old folder or
the complete new one, never a half-written one, and no temp dir outlives the write."""

from __future__ import annotations

import os

import pytest

from dflash_trt import atomic
from dflash_trt.atomic import atomic_dir


def _siblings(dest):
    return sorted(p.name for p in dest.parent.iterdir() if p.name != dest.name)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_error_inside_leaves_no_destination_and_no_temp_dir(tmp_path, exc):
    dest = tmp_path / "sub" / "out"
    with pytest.raises(exc):
        with atomic_dir(dest) as tmp:
            assert tmp.parent == dest.parent and tmp.name.startswith(".out.tmp-")  # next to it: same filesystem
            (tmp / "half.bin").write_bytes(b"x")
            raise exc()
    assert not dest.exists() and _siblings(dest) == []


def test_existing_destination_is_replaced_only_on_success(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(ValueError):
        with atomic_dir(dest) as tmp:
            (tmp / "new.txt").write_text("new")
            raise ValueError("stage failed")
    assert sorted(p.name for p in dest.iterdir()) == ["old.txt"] and _siblings(dest) == []
    with atomic_dir(dest) as tmp:
        (tmp / "new.txt").write_text("new")
        assert (dest / "old.txt").is_file()  # readers still see the old folder while writing
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"] and _siblings(dest) == []


def test_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    real, calls = os.replace, []

    def flaky(src, dst):  # the move-aside works, the swap itself fails
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", flaky)
    with pytest.raises(OSError, match="disk full"):
        with atomic_dir(dest) as tmp:
            (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == ["old.txt"] and _siblings(dest) == []


def test_tag_names_the_temp_dir(tmp_path):
    dest = tmp_path / "out"
    with atomic_dir(dest, tag=f"build-{os.getpid()}") as tmp:
        assert tmp.name.startswith(f".out.build-{os.getpid()}-")
    assert dest.is_dir() and _siblings(dest) == []
