"""skytrain's server side: control plane, workers, inference engine and trainer."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("skytrain")
except PackageNotFoundError:  # running from a checkout that was not installed
    __version__ = "0.0.0"
