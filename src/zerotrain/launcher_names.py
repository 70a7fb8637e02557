"""``deepspeed.launcher.runner``'s module constants, with DeepSpeed's values.

Accelerate's ``accelerate launch --use_deepspeed`` imports ``DEEPSPEED_ENVIRONMENT_NAME``
from there (the file of exported variables its multi-node launch appends to). zerotrain has
no launcher of its own (``zerotrain launch`` is torchrun): only the names are provided.
"""
import os

DLTS_HOSTFILE = "/job/hostfile"
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
PDSH_MAX_FAN_OUT = 1024
