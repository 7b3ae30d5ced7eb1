"""Maintenance: gc, delete, verify and sizes, and the format-1 upgrade."""
