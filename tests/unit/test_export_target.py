"""Where an export writes (``checkpoint/export_target.py``): what a killed export left is
tidied by the next one, and a failed one publishes nothing."""
import os

import pytest

from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.export_target import replacing_folder


def _owned(name: str) -> bool:
    return name.endswith(".bin")


def _write(folder, text):
    with open(os.path.join(folder, "w.bin"), "w") as f:
        f.write(text)


def test_a_killed_exports_leftovers_are_tidied_and_an_old_copy_put_back(tmp_path):
    source = tmp_path / "ckpt" / "global_step1"
    source.mkdir(parents=True)
    tmp, old = tmp_path / ".tmp-out-0123456789ab", tmp_path / ".old-out-ba9876543210"
    tmp.mkdir()
    old.mkdir()                      # killed between moving "out" aside and moving in the new
    _write(old, "earlier")
    (tmp_path / ".tmp-outer-0123456789ab").mkdir()      # another target's: not touched
    with pytest.raises(RuntimeError):
        with replacing_folder(str(source), str(tmp_path / "out"), _owned, "test") as folder:
            _write(folder, "half")
            raise RuntimeError("killed")
    assert sorted(os.listdir(tmp_path)) == [".tmp-outer-0123456789ab", "ckpt", "out"]
    assert (tmp_path / "out" / "w.bin").read_text() == "earlier"   # put back, then kept
    with replacing_folder(str(source), str(tmp_path / "out"), _owned, "test") as folder:
        _write(folder, "new")
    assert sorted(os.listdir(tmp_path)) == [".tmp-outer-0123456789ab", "ckpt", "out"]
    assert os.listdir(tmp_path / "out") == ["w.bin"]
    assert (tmp_path / "out" / "w.bin").read_text() == "new"


def test_an_output_that_is_a_file_or_holds_other_files_is_refused(tmp_path):
    source = tmp_path / "ckpt"
    source.mkdir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a folder"):
        with replacing_folder(str(source), str(tmp_path / "file"), _owned, "test"):
            pass
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="holds 'notes.txt', which a test export"):
        with replacing_folder(str(source), str(tmp_path / "out"), _owned, "test"):
            pass
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
