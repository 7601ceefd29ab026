"""On top of the facade: the Batcher and the HTTP server."""
