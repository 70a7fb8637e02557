"""``zerotrain launch``: our options only before the script; the script's are its own."""
import pytest

from zerotrain.cli import main


@pytest.fixture
def torchrun(monkeypatch):
    import torch.distributed.run

    seen = []
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: seen.append(argv))
    monkeypatch.delenv("ZEROTRAIN_AUTO_RESUME", raising=False)
    return seen


def test_the_scripts_own_auto_resume_option_is_left_to_the_script(torchrun):
    import os
    argv = ["--nproc_per_node", "2", "train.py", "--auto-resume", "mine", "--no_local_rank"]
    assert main(["launch", *argv]) == 0
    assert torchrun == [argv]
    assert "ZEROTRAIN_AUTO_RESUME" not in os.environ


@pytest.mark.parametrize("given", [["--auto-resume", "ckpt"], ["--auto-resume=ckpt"]])
def test_auto_resume_before_the_script_is_ours_in_both_spellings(torchrun, given):
    import os
    assert main(["launch", "--nproc_per_node", "2", *given, "train.py", "--steps", "3"]) == 0
    assert torchrun == [["--nproc_per_node", "2", "train.py", "--steps", "3"]]
    assert os.environ["ZEROTRAIN_AUTO_RESUME"] == "ckpt"


def test_auto_resume_without_a_directory_is_an_error(torchrun, capsys):
    assert main(["launch", "train.py", "--auto-resume"]) == 0   # the script's: fine
    assert main(["launch", "--auto-resume=", "train.py"]) == 2
    assert "--auto-resume needs a checkpoint directory" in capsys.readouterr().err
    assert main(["launch", "--nproc_per_node", "2", "--auto-resume"]) == 2
    assert torchrun == [["train.py", "--auto-resume"]]
