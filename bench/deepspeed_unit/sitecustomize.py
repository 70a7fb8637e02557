"""Installs zerotrain's ``deepspeed`` switch in every Python process of a DeepSpeed test run.

DeepSpeed's test harness starts its ranks from a forkserver pool; each rank imports the
test module (and so ``deepspeed``) afresh. Python imports ``sitecustomize`` at start-up
when it is on ``PYTHONPATH``, so placing this folder there (``run.sh`` does) gives every
process, the pytest parent and each rank, the switch before any test code runs. Nothing
happens unless ``ZEROTRAIN_AS_DEEPSPEED=1``.
"""
import os

if os.environ.get("ZEROTRAIN_AS_DEEPSPEED") == "1":
    import zerotrain.as_deepspeed

    zerotrain.as_deepspeed.install()
