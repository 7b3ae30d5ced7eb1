"""The on-storage format: keys and names, step documents, chunk tables and their binary blocks, packs, chunk blobs, refs."""
