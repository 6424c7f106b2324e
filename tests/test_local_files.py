"""nano_eval.local_files: the rule for files outside a checkpoint (output folders, sweep state, data, task files)."""

import os
import threading

import pytest

from nano_eval.local_files import (LocalFileError, append_text, atomic_write_bytes, printable, read_json, read_text,
                                   real_dir, remove_file)


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "results.json"
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(LocalFileError, read_json, fifo)), daemon=True)
    t.start()
    t.join(5)
    assert done, "reading a FIFO blocked"
    assert "FIFO" in str(done[0].value)
    with pytest.raises(LocalFileError, match="FIFO"):
        append_text(fifo, "x\n")


def test_symlinked_folder_below_root_is_refused(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep.jsonl").write_text("precious\n")
    (out / "details").symlink_to(elsewhere)
    with pytest.raises(LocalFileError, match="symlink, not a folder"):
        atomic_write_bytes(out / "details" / "task.jsonl", b"{}", root=out)
    with pytest.raises(LocalFileError, match="symlink"):
        remove_file(out / "details" / "keep.jsonl", root=out)
    assert (elsewhere / "keep.jsonl").read_text() == "precious\n" and sorted(os.listdir(elsewhere)) == ["keep.jsonl"]
    # the root itself may be a link the user chose
    link_root = tmp_path / "link_out"
    link_root.symlink_to(out)
    atomic_write_bytes(link_root / "results.json", b"{}", root=link_root)
    assert (out / "results.json").read_bytes() == b"{}"


def test_symlinked_file_is_replaced_not_followed(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.json").symlink_to(target)
    with pytest.raises(LocalFileError, match="symlink"):
        read_text(tmp_path / "out" / "results.json")
    atomic_write_bytes(tmp_path / "out" / "results.json", b"new", root=tmp_path / "out")
    assert target.read_text() == "precious" and (tmp_path / "out" / "results.json").read_bytes() == b"new"
    remove_file(tmp_path / "out" / "results.json")
    (tmp_path / "out" / "r2").symlink_to(target)
    remove_file(tmp_path / "out" / "r2")
    assert target.read_text() == "precious"


def test_bounds_and_types(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # sparse: 8 GiB declared, nothing read
        f.truncate(8 << 30)
    with pytest.raises(LocalFileError, match="more than nano_eval"):
        read_json(big)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(LocalFileError, match="not the dict"):
        read_json(tmp_path / "list.json")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LocalFileError, match="deeper"):
        read_json(tmp_path / "deep.json", expect=None)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(LocalFileError, match="not UTF-8"):
        read_text(tmp_path / "latin1.txt")
    (tmp_path / "dir_in_the_way").mkdir()
    with pytest.raises(LocalFileError, match="folder"):
        atomic_write_bytes(tmp_path / "dir_in_the_way", b"x")
    with pytest.raises(LocalFileError, match="folder"):
        remove_file(tmp_path / "dir_in_the_way")


def test_real_dir_creates_only_real_folders(tmp_path):
    real_dir(tmp_path / "a" / "b", root=tmp_path, create=True)
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "a" / "file").write_text("")
    with pytest.raises(LocalFileError, match="regular file, not a folder"):
        real_dir(tmp_path / "a" / "file" / "c", root=tmp_path, create=True)
    with pytest.raises(LocalFileError, match="not inside"):
        real_dir(tmp_path.parent, root=tmp_path)


def test_printable_escapes_control_characters():
    forged = "ckpt\x1b[2K\rnano_eval: error: all good\n"
    shown = printable(forged)
    assert "\x1b" not in shown and "\n" not in shown and "\r" not in shown
    assert shown == "ckpt\\x1b[2K\\rnano_eval: error: all good\\n"
    assert printable("step_100 ünïcode") == "step_100 ünïcode"
    assert printable("a\u2028b\x85") == "a\\u2028b\\x85"
