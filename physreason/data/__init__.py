"""Data: record formats, loaders, collation, packing and synthetic intuitive-physics generators."""
