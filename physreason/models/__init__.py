"""Model loading, tiny random models for tests, model inputs, parallelisation and export.

Import submodules directly (`physreason.models.tiny`, `physreason.models.inputs`): this package
stays import-light so the command line starts fast.
"""
