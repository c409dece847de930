"""The wire formats the relay and the unary client share: HTTP/2 frames (``h2``: constants,
building, the one frame scan and header-block trim) and gRPC over HTTP/2 (``grpc``: status
names and mappings, the response headers' status, the 5-byte message framing, timeouts,
compression)."""
