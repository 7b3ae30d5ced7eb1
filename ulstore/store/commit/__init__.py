"""The commit path: what a commit is given, its plan, the piece writers, the finalizer."""
