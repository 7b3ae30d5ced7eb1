"""What the DCP writer and reader share: the step a ``checkpoint_id`` names, the step files that
hold non-tensor leaves, and ``dcp/metadata.json``."""

from __future__ import annotations

import json
import warnings
from urllib.parse import quote

from ..errors import InvalidInputError
from ..store import Trajectory
from ..store import open as open_trajectory

__all__ = [
    "step_of",
    "object_file",
    "METADATA_FILE",
    "encode_metadata",
    "decode_metadata",
    "FORMAT",
    "TrajectoryEndpoint",
]

#: the step file describing what DCP saved besides tensors (sorted JSON, identical from step to step)
METADATA_FILE = "dcp/metadata.json"
#: version of ``dcp/metadata.json``
FORMAT = 1


def step_of(checkpoint_id) -> int:
    """The step a DCP ``checkpoint_id`` names: an int, or a string of digits."""
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int | str):
        raise InvalidInputError(f"checkpoint_id must be a step number, got {checkpoint_id!r}")
    if isinstance(checkpoint_id, str):
        if not checkpoint_id.isascii() or not checkpoint_id.isdigit():
            raise InvalidInputError(f"checkpoint_id must be a step number, got {checkpoint_id!r}")
        checkpoint_id = int(checkpoint_id)
    if checkpoint_id < 0:
        raise InvalidInputError(f"a step is a non-negative integer, got {checkpoint_id}")
    return checkpoint_id


class TrajectoryEndpoint:
    """What a DCP writer and reader share: a step, and a trajectory opened lazily from a url.

    The url (not an open trajectory) is what travels when the object is pickled,
    so it reopens on the worker it lands on.  Subclasses set ``_mode`` ("a" to
    write, "r" to read), ``url``, ``open_options`` and ``_traj``.
    """

    _mode = "r"
    url: object
    open_options: dict
    _traj: Trajectory | None

    def __getstate__(self) -> dict:
        if self.url is None:
            raise InvalidInputError(
                f"a {type(self).__name__} made from an open Trajectory cannot be pickled; pass the url"
            )
        return {**self.__dict__, "_traj": None}  # reopened where it lands (without the kept parent)

    @property
    def trajectory(self) -> Trajectory:
        """The trajectory saved into or read (opened on first use, then kept)."""
        if self._traj is None:
            self._traj = open_trajectory(self.url, mode=self._mode, **self.open_options)
        return self._traj

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        try:
            step_of(checkpoint_id)
        except InvalidInputError:
            return False
        return True


def object_file(fqn: str) -> str:
    """The step file holding the non-tensor leaf ``fqn`` (its ``torch.save`` bytes): ``dcp/objects/<quoted>``."""
    name = quote(fqn, safe="")
    if name in (".", ".."):
        name = name.replace(".", "%2E")
    return f"dcp/objects/{name}"


def encode_metadata(planner_data, objects: dict[str, str]) -> bytes:
    """``dcp/metadata.json``: the planner's flatten mapping (fqn -> path), the leaf files, the torch version."""
    import torch

    doc = {"format": FORMAT, "objects": dict(sorted(objects.items())), "torch": torch.__version__}
    if planner_data is not None:
        try:
            doc["planner_data"] = {k: list(v) for k, v in planner_data.items()}
            json.dumps(doc["planner_data"])
        except (AttributeError, TypeError, ValueError):
            warnings.warn(
                "the save planner's planner_data is not a JSON mapping of fqn to path; it is not stored "
                "(loading works; rebuilding a nested state dict from the step alone does not)",
                stacklevel=3,
            )
            doc.pop("planner_data", None)
    return json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def decode_metadata(raw: bytes, *, step: int) -> tuple[dict | None, dict[str, str]]:
    """(planner_data with tuple paths or None, fqn -> file) from ``dcp/metadata.json``."""
    try:
        doc = json.loads(raw)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
        objects = {str(k): str(v) for k, v in doc["objects"].items()}
        pd = doc.get("planner_data")
        planner_data = None if pd is None else {str(k): tuple(v) for k, v in pd.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidInputError(f"{METADATA_FILE} of step {step} is not DCP metadata: {e}", step=step) from None
    return planner_data, objects
