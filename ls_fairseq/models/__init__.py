from . import ls_transformer  # noqa: F401  (registers the ls_transformer model and ls_ archs)
