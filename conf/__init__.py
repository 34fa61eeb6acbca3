"""kdexp's Hydra config groups (shipped in the wheel). Importing this package registers what the YAML refers to:
the typed schema ``kdexp_schema`` and the resolvers ``kdexp_stamp``, ``kdexp_uid``, ``kdexp_site_dir`` and
``kdexp_help`` (the --help page)."""
import kdexp.config  # noqa: F401
import kdexp.config.help  # noqa: F401
import kdexp.track.rundir  # noqa: F401
import kdexp.track.sweep  # noqa: F401
