"""Mutual TLS on every internal link: names.py (who may serve and call what), certs.py (a
deployment's CA and role certificates), links.py (this process's certificate in gRPC and
the M2N transport)."""
from tessera.mtls.links import (ENV, SERVER_OPTIONS, AioServerInterceptor, ServerInterceptor, add_port,
                                   aio_channel, channel, identity)

__all__ = ["ENV", "SERVER_OPTIONS", "AioServerInterceptor", "ServerInterceptor", "add_port", "aio_channel",
           "channel", "identity"]
