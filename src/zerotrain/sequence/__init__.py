"""Ulysses sequence parallelism (DeepSpeed's ALST) for Hugging Face models under ZeRO.

``tiled``: DeepSpeed's tiled compute along the sequence (TiledMLP, the tiled loss);
``attention``: Ulysses attention around a model's own attention function; ``registration``:
routing ``transformers``' attention through it; ``loader``: each batch cut along the
sequence; ``ulysses_sp``: DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``
names. The groups and the collectives are ``zerotrain.comm.sequence`` and
``zerotrain.comm.parallel_state_sp``.
"""
