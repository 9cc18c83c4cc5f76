"""moekit: Mixture-of-Experts expert layers through interchangeable backends (DESIGN §1, §9).

`import moekit` stays light: no torch, and the C library loads on first use, so that tools that only read
the version (packaging, pip) work without it. The torch op lives in `moekit.torch`.
"""

from ._version import __version__


class Error(RuntimeError):
    """An error reported by the moekit library: the message names what was wrong."""


def backend_names():
    """The registered experts backend names, in registration order."""
    from . import _capi  # the C library loads here, on first use

    return _capi.backend_names()


__all__ = ["Error", "__version__", "backend_names"]
