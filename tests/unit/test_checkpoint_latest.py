"""``latest`` is read with limits: a regular file of at most a few KB, never a FIFO or a
device, by zerotrain's loader and by the DeepSpeed-checkpoint finder alike."""
import os
import threading

import pytest

from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.deepspeed.files import find_tag_dir
from zerotrain.checkpoint.fs import read_latest


def _bounded(fn, seconds=20.0):
    """fn()'s result or exception, or "hung" when it has not returned in time."""
    out = ["hung"]

    def run():
        try:
            out[0] = fn()
        except BaseException as exc:  # noqa: BLE001 - returned for the assertion
            out[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return out[0]


def _hostile_latest(tmp_path, kind):
    latest = tmp_path / "latest"
    if kind == "fifo":
        os.mkfifo(latest)
    elif kind == "device":
        os.symlink("/dev/zero", latest)
    elif kind == "huge":
        latest.write_bytes(b"g" * 10_000_000)
    elif kind == "directory":
        latest.mkdir()
    return str(tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "device", "huge", "directory"])
def test_a_hostile_latest_is_refused_by_name_without_hanging(tmp_path, kind):
    directory = _hostile_latest(tmp_path, kind)
    result = _bounded(lambda: read_latest(directory))
    assert isinstance(result, CheckpointError), result
    assert "latest" in str(result) and ("regular file" in str(result) or "4096" in str(result))
    assert _bounded(lambda: find_tag_dir(directory)) is None


def test_a_plain_latest_still_names_its_tag(tmp_path):
    (tmp_path / "latest").write_text("global_step7\n")
    assert read_latest(str(tmp_path)) == "global_step7"
    assert read_latest(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("text", ["", "\n", "../elsewhere"])
def test_a_latest_naming_no_plain_tag_names_the_latest_file(tmp_path, text):
    (tmp_path / "latest").write_text(text)
    with pytest.raises(CheckpointError) as info:
        read_latest(str(tmp_path))
    assert str(tmp_path / "latest") in str(info.value), info.value
    assert "not a plain directory name" in str(info.value), info.value
