"""The one exception type of checkpoint loading and saving."""


class CheckpointError(ValueError):
  """A checkpoint file, directory or config that cannot be loaded as it stands."""
