"""Bridges between checkpoint files and trajectory steps: import, export, size reports.

:mod:`ulstore.io.checkpoints` reads and writes the files (exactly, bit for bit);
:class:`~ulstore.Trajectory` stores the tensors.  This module joins the two and
keeps what a file holds besides its tensors, so that an export gives back what
was imported:

* file metadata (safetensors ``__metadata__``, a sharded index's ``metadata``),
* tied-tensor aliases (``lm_head.weight`` sharing ``embed_tokens.weight``'s
  storage in a torch state dict): the tensor is stored once, the alias by name,
* the tensors' order in the file, and a sharded checkpoint's index (so that an
  export writes the same shard files holding the same tensors, and the index
  byte for byte),
* the file's own tensor names when ``rename_prefix=`` stored them under others.

They travel in the step's metadata under the key ``"checkpoint"``
(:data:`CHECKPOINT_KEY`)::

    {"checkpoint": {"format": "safetensors" | "sharded" | "torch" | "npz",
                    "source": "step_001200.safetensors",
                    "metadata": {"format": "pt"},          # file metadata, str -> str
                    "aliases": {"lm_head.weight": "model.embed_tokens.weight"},
                    "order": ["b", "a"],                   # only when not sorted
                    "renamed": {"encoder.w": "bert.encoder.w"},  # rename_prefix=: stored -> file name
                    "index": "{\n  \"metadata\": ..."},     # sharded: the index file's text
                    # a directory (_dirstate.py): the rest of it
                    "files": ["config.json", "tokenizer.json", ...],  # kept as step files, byte for byte
                    "state": {"optimizer.pt": {"skeleton": "_state/optimizer.json", "tensors": 24}},
                    "not_kept": {"huge.bin": 123456789}}}   # too large, not weights: add warned

A directory's small files are the step's files (``traj.files(step)``); a torch
state file (``optimizer.pt``) is flattened: its tensors are the step's tensors
under ``_state/`` (:data:`STATE_DIR`; Adam's moments are delta-coded like
weights), its skeleton the file ``_state/optimizer.json``.  A directory export
writes the files back and rebuilds each state file (``torch.load`` of it equals
the original's).

Exports
    A step can be written as one ``.safetensors`` file, a sharded Hugging Face
    directory (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``),
    a torch state dict (``.pt``/``.pth``/``.bin``, tied tensors share storage
    again) or an ``.npz``; or handed over in memory as numpy arrays
    (:func:`to_numpy`) or torch tensors (:func:`to_torch`).  Tensor bytes are
    always identical to the imported ones.  safetensors cannot express shared
    storage, so an alias is written there as a copy (two names, equal bytes),
    as ``safetensors.torch.save_file`` would require.

Every export is atomic: a file is written under a hidden temporary name and
renamed; a directory is assembled under a hidden temporary name and renamed.
A failed export leaves nothing under the output name.

Examples
--------
>>> import tempfile, numpy as np, ulstore
>>> from ulstore import io
    >>> from ulstore.io import checkpoints
>>> tmp = tempfile.mkdtemp()
>>> checkpoints.save_safetensors({"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
...                              f"{tmp}/step_000100.safetensors", {"format": "pt"})
>>> traj = ulstore.open(f"{tmp}/traj", mode="w")
>>> io.import_checkpoint(traj, f"{tmp}/step_000100.safetensors")
100
>>> out = io.export_checkpoint(traj, 100, f"{tmp}/out.safetensors")
>>> ck = checkpoints.load(f"{tmp}/out.safetensors")
>>> ck.metadata, ck.tensors["w"].tobytes() == np.arange(6, dtype=np.float32).tobytes()
({'format': 'pt'}, True)
"""

from . import checkpoints as checkpoints  # the file formats: ulstore.io.checkpoints
from ._dirstate import STATE_DIR, is_state_tensor
from ._export import export_checkpoint, read_checkpoint, to_numpy, to_torch
from ._import import import_checkpoint
from ._names import CHECKPOINT_KEY, FORMATS, checkpoint_format, output_format, step_from_path
from ._rename import FewSharedNamesWarning, name_overlap, suggest_prefixes
from ._report import storage_report

__all__ = [
    "CHECKPOINT_KEY",
    "FORMATS",
    "STATE_DIR",
    "is_state_tensor",
    "import_checkpoint",
    "read_checkpoint",
    "export_checkpoint",
    "to_numpy",
    "to_torch",
    "checkpoint_format",
    "output_format",
    "step_from_path",
    "storage_report",
    "FewSharedNamesWarning",
    "name_overlap",
    "suggest_prefixes",
]
