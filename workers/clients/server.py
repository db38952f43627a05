"""Which server a producer talks to when it is not told: `REDIS_URL`, else the embedded server a
running `threadline worker` (or `demo`) started for the data dir. One rule for `Client()` with no URL,
`AsyncClient()` and every CLI command that only talks to a server; none of them ever starts one (a
producer with a server of its own would enqueue where no worker listens). Light: imports no redis
until it must look for an embedded server."""

from __future__ import annotations

from threadline.workers.settings import Settings


class NoServer(ConnectionError):
    """No `REDIS_URL` and no running embedded server for the data dir."""


def server_url(settings: Settings) -> str:
    """`settings.redis_url`, else the URL of the running embedded server of `settings.data_dir`;
    `NoServer` (saying how to get one) when neither is there."""
    if settings.redis_url:
        return settings.redis_url
    from threadline.workers.storage.embedded import join_embedded

    server = join_embedded(settings.data_dir)
    if server is None:
        raise NoServer(f"no server: REDIS_URL is not set and no `threadline worker` (or `demo`) runs for "
                       f"{settings.data_dir}; start one there with `threadline worker`, or set REDIS_URL")
    return server.url


def found_server(prefix: str | None) -> tuple[str, str]:
    """(URL, key prefix) of a client made with no URL: `server_url` of the settings in the
    environment, and `prefix` if given, else `TL_PREFIX`'s."""
    settings = Settings.from_env()
    return server_url(settings), settings.prefix if prefix is None else prefix
