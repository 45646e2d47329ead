"""Why a reconcile or finalize failed: the two cases of the contract's `error` variant."""


class PluginError(Exception):
    """Base of the errors a plugin raises to say why it returns no desired state."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Invalid(PluginError):
    """The spec is wrong; nothing changes until it does.

    The host applies nothing, prunes nothing, sets ``Ready=False`` with this message,
    posts a Warning event and waits for a new generation of the parent.
    """


class Retry(PluginError):
    """A transient failure; the host retries with exponential backoff."""
