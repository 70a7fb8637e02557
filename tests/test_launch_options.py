"""``zerotrain launch``: our options only before the script; the script's are its own."""
import pytest

from zerotrain.cli import main


@pytest.fixture
def torchrun(monkeypatch):
    import torch.distributed.run

    seen = []
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: seen.append(argv))
    for name in ("ZEROTRAIN_AUTO_RESUME", "ZEROTRAIN_AUTO_RESUME_LAUNCHER"):
        # setenv first so that teardown removes what `launch` sets in this process (a bare
        # delenv of an absent variable records nothing, and the value would leak into the
        # test processes started later, which are this process's children)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
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


def test_everything_after_the_script_is_the_scripts_verbatim(torchrun):
    """``--`` and a prefix of our options (``--a``) after the script are the script's: with
    --as-deepspeed the switch still runs it, and argparse never sees them."""
    assert main(["launch", "--as-deepspeed", "--nproc_per_node", "2", "train.py", "A", "--",
                 "B", "--a"]) == 0
    assert torchrun[-1] == ["--nproc_per_node", "2", "-m", "zerotrain.as_deepspeed",
                            "train.py", "A", "--", "B", "--a"]
    assert main(["launch", "train.py", "--a", "--as"]) == 0
    assert torchrun[-1] == ["train.py", "--a", "--as"]


def test_auto_resume_is_for_the_launchers_children_only(torchrun, monkeypatch):
    """A job the training script starts inherits the variables but is not a child of the
    launcher: it does not resume from the script's checkpoints."""
    import os

    from zerotrain.engine.resume import launched_auto_resume as _launched_auto_resume
    assert main(["launch", "--auto-resume", "ckpt", "train.py"]) == 0
    assert os.environ["ZEROTRAIN_AUTO_RESUME_LAUNCHER"] == str(os.getpid())
    monkeypatch.setenv("ZEROTRAIN_AUTO_RESUME_LAUNCHER", str(os.getppid()))
    assert _launched_auto_resume() == "ckpt"           # a torchrun worker
    monkeypatch.setenv("ZEROTRAIN_AUTO_RESUME_LAUNCHER", str(os.getppid() + 1))
    assert _launched_auto_resume() is None             # the script's own helper job
    monkeypatch.delenv("ZEROTRAIN_AUTO_RESUME_LAUNCHER")
    assert _launched_auto_resume() == "ckpt"           # set by hand: honoured


@pytest.mark.parametrize("given", [[], ["--auto-resume", "fresh"]])
def test_a_stale_auto_resume_from_the_shell_never_reaches_the_workers(torchrun, monkeypatch,
                                                                      capsys, given):
    """An earlier job's ZEROTRAIN_AUTO_RESUME (and its launcher pid) left exported: without
    --auto-resume the launch clears them, with it this command's directory replaces them."""
    import os

    from zerotrain.engine.resume import launched_auto_resume
    monkeypatch.setenv("ZEROTRAIN_AUTO_RESUME", "old_job_ckpt")
    monkeypatch.setenv("ZEROTRAIN_AUTO_RESUME_LAUNCHER", "12345")
    seen = {}
    import torch.distributed.run
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: seen.update(
        {k: os.environ.get(k) for k in ("ZEROTRAIN_AUTO_RESUME",
                                         "ZEROTRAIN_AUTO_RESUME_LAUNCHER")}))
    assert main(["launch", "--nproc_per_node", "2", *given, "train.py"]) == 0
    if given:
        assert seen == {"ZEROTRAIN_AUTO_RESUME": "fresh",
                        "ZEROTRAIN_AUTO_RESUME_LAUNCHER": str(os.getpid())}
    else:
        assert seen == {"ZEROTRAIN_AUTO_RESUME": None, "ZEROTRAIN_AUTO_RESUME_LAUNCHER": None}
        assert launched_auto_resume() is None
        assert "not passing ZEROTRAIN_AUTO_RESUME=old_job_ckpt" in capsys.readouterr().err
