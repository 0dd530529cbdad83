"""Keep secrets out of logs: passwords in URLs (``redis://user:pass@host``) and known secret
values such as the gateway's API key.

`redact_url` is for code that logs a URL on purpose; `RedactingFilter`, which `setup_logging`
puts on every handler, catches what reaches a log by other ways (an exception's text, a
library's message).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from common.logs import STRUCTURED

REDACTED = "***"
# Query parameters that carry a secret (redis-py reads ``?password=`` too).
_SECRET_QUERY = re.compile(
    r"([?&;](?:sentinel_password|password|passwd|pass|secret|token|access_token|api_key|apikey|auth)=)[^&;#\s]*", re.IGNORECASE
)
# "host:8000/path/@name": the "@" is in the path, after a port; not a password.
_PORT_THEN_PATH = re.compile(r"\d*/.*", re.DOTALL)
# A URL inside free text: a scheme, "://", then anything up to whitespace or a quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``: in the user info (``redis://user:***@host``,
    ``rediss://:***@host``, ``unix://user:***@/path``) and in a ``password=`` query parameter.

    The user info runs to the last ``@``, so a password holding ``@``, ``/``, ``?`` or ``#``
    (unencoded) is still hidden whole; when in doubt, more is hidden rather than less. A user
    name alone (no ``:``) is kept.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, host = rest.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        if colon and not _PORT_THEN_PATH.fullmatch(password):
            rest = f"{user}:{REDACTED}@{host}"
    return _SECRET_QUERY.sub(rf"\g<1>{REDACTED}", f"{scheme}://{rest}")


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL in it passed through `redact_url` and every one of ``secrets`` replaced."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


class RedactingFilter(logging.Filter):
    """A handler filter that redacts each record's message, exception and stack text, and the
    string fields of a structured record (`common.logs.log_event`), which JSON logs show as such."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        super().__init__()
        # Longest first: a secret that contains another is replaced whole.
        self.secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True  # a broken format string: the handler reports it as such
        clean = redact_text(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            # Formatted here, so that the text every handler prints is the redacted one.
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text, self.secrets)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info, self.secrets)
        structured = getattr(record, STRUCTURED, None)
        if structured:
            event, fields = structured
            # A new dict: the record's own may be shared with other handlers (or the caller).
            setattr(
                record,
                STRUCTURED,
                (event, {k: redact_text(v, self.secrets) if isinstance(v, str) else v for k, v in fields.items()}),
            )
        return True
