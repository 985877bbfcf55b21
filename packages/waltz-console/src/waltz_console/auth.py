"""Who may act: read-only for everyone who reaches the page, actions for whoever logs in
with the console's token.

The token is given (``--token-file``, or ``WALTZ_CONSOLE_TOKEN``) or made at start (a
random one, printed once and written to the token file when one is named). Logging
in trades it for a session: a random id in an ``HttpOnly``, ``SameSite=Strict``
cookie, valid for ``session_ttl`` seconds of the event loop's time. A request that
changes something must carry the session cookie *and* the ``X-Waltz-Console``
header (a cross-site form cannot set it), and its body says ``"confirm": true``
(the page asks the operator first).
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from waltz_api.errors import ConfigError

SESSION_COOKIE = "waltz_console_session"
CSRF_HEADER = "X-Waltz-Console"
MIN_TOKEN_LENGTH = 16
MAX_SESSIONS = 1000


def new_token() -> str:
    return secrets.token_urlsafe(24)


def load_token(path: str | os.PathLike[str] | None, env_value: str | None) -> tuple[str, bool]:
    """The token and whether it was made now: from ``env_value``, else the file at
    ``path`` when it exists, else a new one (written to ``path``, mode 0600, when given)."""
    if env_value:
        return check_token(env_value.strip(), "WALTZ_CONSOLE_TOKEN"), False
    if path is not None:
        file = Path(path)
        if file.exists():
            try:
                return check_token(file.read_text().strip(), str(file)), False
            except OSError as exc:
                raise ConfigError(
                    f"cannot read the token file {file}: {exc}", "token_file"
                ) from None
        token = new_token()
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(token + "\n")
        except OSError as exc:
            raise ConfigError(f"cannot write the token file {file}: {exc}", "token_file") from None
        return token, True
    return new_token(), True


def check_token(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"the console token from {where} is {len(token)} characters long; use at least "
            f"{MIN_TOKEN_LENGTH} (for example the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe())'`)",
            "token",
        )
    return token


class Sessions:
    """Logged-in sessions, kept in memory (a console restart logs everyone out)."""

    def __init__(
        self, token: str, clock: Callable[[], float], session_ttl: float = 8 * 3600
    ) -> None:
        self._token = token.encode()
        self._clock = clock
        self.session_ttl = session_ttl
        self._sessions: dict[str, float] = {}

    def login(self, token: str) -> str | None:
        """A new session id when ``token`` is the console's token, else None."""
        if not hmac.compare_digest(token.encode(), self._token):
            return None
        now = self._clock()
        for sid in [s for s, exp in self._sessions.items() if exp <= now]:
            del self._sessions[sid]
        if len(self._sessions) >= MAX_SESSIONS:
            oldest = min(self._sessions, key=self._sessions.__getitem__)
            del self._sessions[oldest]
        session = secrets.token_urlsafe(32)
        self._sessions[session] = now + self.session_ttl
        return session

    def valid(self, session: str | None) -> bool:
        if not session:
            return False
        expires = self._sessions.get(session)
        if expires is None:
            return False
        if expires <= self._clock():
            del self._sessions[session]
            return False
        return True

    def logout(self, session: str | None) -> None:
        if session:
            self._sessions.pop(session, None)
