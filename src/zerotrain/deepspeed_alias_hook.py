"""Loaded at interpreter start by the ``deepspeed`` alias (``deepspeed_alias.py``): the first
``deepspeed`` import installs the DeepSpeed switch. Imports nothing from zerotrain until
then (every Python process of the environment runs this), and is asked only after the
ordinary path finders found no ``deepspeed``, so a real DeepSpeed installed later wins.
"""
import importlib
import sys


class LazySwitch:
    """A meta path finder that installs ``zerotrain.as_deepspeed`` when ``deepspeed`` is
    looked up, then answers from the switch's own finder."""

    busy = False

    def find_spec(self, fullname, path=None, target=None):
        if (fullname != "deepspeed" and not fullname.startswith("deepspeed.")) or self.busy:
            return None
        LazySwitch.busy = True   # install() looks deepspeed up itself
        try:
            switch = importlib.import_module("zerotrain.as_deepspeed")
            switch.install()
            if "LOCAL_RANK" in __import__("os").environ:   # started by a launcher
                switch.accelerate_on_cpu_when_imported()
            return switch._FINDER.find_spec(fullname, path, target)
        finally:
            LazySwitch.busy = False


def register():
    if not any(isinstance(f, LazySwitch) or type(f).__name__ == "LazySwitch"
               for f in sys.meta_path):
        sys.meta_path.append(LazySwitch())
