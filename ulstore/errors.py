"""The one exception tree of ulstore.

Errors are grouped by what a handler would do about them::

    UlstoreError                      everything ulstore raises on purpose
    ├── InvalidInputError (ValueError)         the caller passed something unusable
    │   └── DtypeError (TypeError)             not a supported floating-point dtype
    ├── IntegrityError (ValueError)            stored bytes are not what was written
    │   ├── CorruptBlobError                   a blob fails its checks (truncated, flipped, bad table)
    │   │   ├── UnsupportedVersionError        a blob written by a newer format version
    │   │   └── PackMissingError               a pack a step names is gone
    │   ├── ReferenceMismatchError             a delta blob decoded against the wrong reference
    │   └── CorruptManifestError               a step manifest or metadata object is damaged
    ├── NotFoundError (KeyError, FileNotFoundError)
    │   ├── StepNotFoundError
    │   └── TensorNotFoundError
    ├── ConflictError                          someone else already wrote that name
    │   ├── StepExistsError
    │   ├── RefMovedError                      a branch/tag moved since it was read: re-read, retry
    │   └── StaleParentError                   the parent was replaced since it was read: re-open, retry
    ├── OutcomeUnknownError (OSError)          a write failed and whether it landed cannot be known: retry it
    ├── StorageAccessError (OSError)           the storage cannot be used: no credentials, access denied, unreachable
    ├── FormatError                            an older on-storage format: convert it (``ulstore upgrade``)
    └── ReadOnlyError (PermissionError)        the trajectory was opened for reading

Errors carry the ``step``, ``tensor`` and ``key`` they are about when known.

One warning lives here too, because the store and the io layer both give it:
``FewSharedNamesWarning`` (part of a step cannot be delta-coded against its
parent: other names, or another dtype or shape).
"""

from __future__ import annotations

__all__ = [
    "UlstoreError",
    "InvalidInputError",
    "DtypeError",
    "IntegrityError",
    "CorruptBlobError",
    "UnsupportedVersionError",
    "PackMissingError",
    "ReferenceMismatchError",
    "CorruptManifestError",
    "NotFoundError",
    "StepNotFoundError",
    "TensorNotFoundError",
    "ConflictError",
    "StepExistsError",
    "RefMovedError",
    "StaleParentError",
    "OutcomeUnknownError",
    "StorageAccessError",
    "FormatError",
    "ReadOnlyError",
    "FewSharedNamesWarning",
]


class UlstoreError(Exception):
    """Root of every error ulstore raises on purpose.

    Parameters
    ----------
    message : str
        What went wrong and, where possible, how to fix it.
    step, tensor, key : optional
        The step, tensor name and storage key the error is about.
    """

    def __init__(self, message: str = "", *, step=None, tensor=None, key=None):
        self.step = step
        self.tensor = tensor
        self.key = key
        where = []
        if step is not None:
            where.append(f"step {step}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if key is not None:
            where.append(f"key {key!r}")
        if where:
            message = f"{message} ({', '.join(where)})"
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.message


class InvalidInputError(UlstoreError, ValueError):
    """The caller passed something ulstore cannot store or decode as asked."""


class DtypeError(InvalidInputError, TypeError):
    """The array's dtype is not one the operation supports."""


class IntegrityError(UlstoreError, ValueError):
    """Stored bytes are not what was written: nothing is returned from them."""


class CorruptBlobError(IntegrityError):
    """A ULPack blob is truncated, altered or internally inconsistent."""


class UnsupportedVersionError(CorruptBlobError):
    """A blob declares a format version this ulstore cannot read."""


class PackMissingError(CorruptBlobError):
    """A pack that a step document names is missing.

    Damage, or (for a document read a while ago) another process deleted a step
    and collected its packs since: readers read the documents anew once before
    they report it.
    """


class ReferenceMismatchError(IntegrityError):
    """A delta blob was decoded against a reference other than its own."""


class CorruptManifestError(IntegrityError):
    """A step manifest, ref or metadata object is damaged or malformed."""


class NotFoundError(UlstoreError, KeyError, FileNotFoundError):
    """Something named does not exist."""


class StepNotFoundError(NotFoundError):
    """No step of that name in the trajectory."""


class TensorNotFoundError(NotFoundError):
    """No tensor of that name in the step."""


class ConflictError(UlstoreError):
    """Another writer already created the object this write needed to create."""


class StepExistsError(ConflictError):
    """The step already exists; steps are immutable."""


class RefMovedError(ConflictError):
    """A branch or tag moved (or was created or deleted) since it was read: nothing was moved.

    ``head`` is the step the ref points at now (None if it does not exist);
    re-read it and retry on that head.
    """

    def __init__(self, message: str = "", *, head=None, step=None, tensor=None, key=None):
        super().__init__(message, step=step, tensor=tensor, key=key)
        self.head = head


class OutcomeUnknownError(UlstoreError, OSError):
    """A write failed (its answer was lost) and reading its object back failed too.

    The write may or may not have landed.  Retrying the same call is safe: every
    write ulstore retries is idempotent (a create that finds its own bytes
    succeeds; a commit of the same content completes the step).
    """


class StorageAccessError(UlstoreError, OSError):
    """The storage behind a URL cannot be used: no credentials, access denied, or the endpoint unreachable.

    The message names the URL (credentials redacted), what is wrong and how to fix it (for S3: set AWS
    credentials, pass ``storage_options={"key": ..., "secret": ...}``, or ``anon=True`` for a public
    bucket); the backend's own exception is chained as ``__cause__``.
    :class:`~ulstore.sync.BucketAccessError` is one.
    """


class StaleParentError(ConflictError):
    """A commit's parent was deleted and committed again (other content) since this process read it.

    Nothing was committed: the commit's deltas were coded against values the
    parent no longer holds.  Commit again (the parent is read anew).
    """


class FormatError(UlstoreError):
    """The trajectory is stored in an older format; the message names the command that converts it."""


class ReadOnlyError(UlstoreError, PermissionError):
    """A write was attempted on a trajectory opened read-only."""


class FewSharedNamesWarning(UserWarning):
    """Part of a step cannot be delta-coded against its parent step, so it is stored whole.

    Given by :meth:`Trajectory.commit` when tensors the parent holds under the same name
    have another dtype or shape now (a delta needs its parent's dtype and shape), and by
    :func:`ulstore.io.import_checkpoint` when a checkpoint shares few tensor names with its
    parent.  Attributes: ``shared`` (fraction of the parent's bytes matched by name, shape
    and dtype; 0.0 when not measured), ``parent`` (the step), ``suggestion`` (a
    ``rename_prefix`` mapping, or ``{}``), ``suggested_shared`` (the fraction it would
    match) and ``changed`` (tensors the parent holds under the same name with another dtype
    or shape: name -> ((parent shape, dtype), (shape, dtype)); when these are the reason,
    renaming would not help: the dtype or shape did).
    """

    def __init__(
        self, message: str, *, shared: float = 0.0, parent=None, suggestion=None, suggested_shared=0.0, changed=None
    ):
        super().__init__(message)
        self.shared = shared
        self.parent = parent
        self.suggestion = dict(suggestion or {})
        self.suggested_shared = suggested_shared
        self.changed = dict(changed or {})
