"""The shared lower layer: plumbing that the store and weight sync both stand on.

Imports only :mod:`ulstore.codec` and :mod:`ulstore.errors`.  Modules::

    objects.py       ObjectStore: keyed bytes over fsspec (get, put, conditional create, list, delete)
    object_writer.py ObjectWriter: one new object streamed in bounded memory (open_writer)
    local_disk.py    local-disk primitives: durable staged files, directory fsyncs, safe range reads
    backends.py      fsspec backend quirks: object-store protocols, s3fs, caching wrappers' lock
    sealed.py        canonical JSON, checksums, blake2b content addresses
    safetensors.py   the safetensors header parser; files as bytes
    dtypes.py        the one table of storable dtypes (names, safetensors codes, raw-bit carriers)
    torch.py         the public torch bridge: numpy <-> torch, zero-copy and bit-exact
    formatting.py    human-readable sizes and counts for reports and the CLI; the closest names to a missing one
    caller.py        warn_at_caller: a warning attributed to the user's line, however deep in ulstore it arises
    install.py       the pip command that adds an extra to this install (editable source or index)
"""

__all__: list[str] = []
