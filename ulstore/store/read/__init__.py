"""The read path: chunks of any step decoded through plans, whole tensors and boxes, zarr views, change feeds, diffs."""
