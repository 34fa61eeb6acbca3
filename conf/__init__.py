"""kdexp's Hydra config groups (shipped in the wheel). Importing this package registers what the YAML refers to:
the typed schema ``kdexp_schema`` and the resolvers ``kdexp_stamp``, ``kdexp_uid`` and ``kdexp_site_dir``."""
import kdexp.config  # noqa: F401
import kdexp.track.rundir  # noqa: F401
import kdexp.track.sweep  # noqa: F401
