"""How every process opens Redis: the URL on its command line names host, port and database;
the password comes from $REDIS_PASSWORD, so it never shows in `ps`, a log line or a rendered
file (a password inside a URL still works, for a URL a user passes by environment)."""
from __future__ import annotations

import os
import urllib.parse

PASSWORD_ENV = "REDIS_PASSWORD"


def connect(url: str, blocking: bool = False, **kwargs):
    """A redis.asyncio client (blocking=True: a redis.Redis)."""
    if blocking:
        import redis
    else:
        import redis.asyncio as redis
    return redis.Redis.from_url(url, password=os.environ.get(PASSWORD_ENV) or None, **kwargs)


def split_password(url: str) -> tuple[str, str | None]:
    """(the URL without its password (an ACL user name stays), the password or None)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None and not parts.username:
        return url, None
    host = parts.hostname or ""
    netloc = (f"{parts.username}@" if parts.username else "") + (f"[{host}]" if ":" in host else host)
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), parts.password
